#!/usr/bin/env bash
# Rebuild every figure of README.md and docs/*.md (it runs every training below, one after another).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
run=outputs/consistency_demo
$PY -m distill.train +exp=consistency hydra.run.dir=$run logger=csv
cp $run/plots/pareto_step_0001000.png docs/consistency_pareto.png
cp $run/samples/student-lcm-1_step_0001000.png docs/consistency_lcm1.png
cp $run/samples/student-lcm-4_step_0001000.png docs/consistency_lcm4.png
cp $run/samples/teacher-ddim-4.png docs/teacher_ddim4.png
$PY -m distill.sample pipeline=distill/worlds/digits/weights/teacher out=docs/teacher_grid.png num_seeds=8
cp $run/quality_cost.csv docs/consistency_quality_cost.csv
$PY -m distill.evaluate schedulers=[ddim,dpmsolver,euler] steps=[1,2,4,8,25,50] num_per_class=50 hydra.run.dir=outputs/evaluate_teacher
cp outputs/evaluate_teacher/quality_cost.csv docs/teacher_quality_cost.csv
cp outputs/evaluate_teacher/pareto.png docs/teacher_pareto.png
# the metric sensitivity suite (docs/evaluation.md, "Does the metric see the defect?"), about a minute
$PY -m distill.evaluate sanity=true eval.extra_features=[pixels,clip] hydra.run.dir=outputs/sanity
cp outputs/sanity/sanity.png docs/metric_sanity.png
cp outputs/sanity/sanity.csv docs/metric_sanity.csv
$PY -m distill.train +exp=progressive hydra.run.dir=outputs/progressive_demo logger=csv
cp outputs/progressive_demo/plots/pareto_step_0001200.png docs/progressive_pareto.png
cp outputs/progressive_demo/quality_cost.csv docs/progressive_quality_cost.csv
$PY -m distill.train +exp=progressive_w hydra.run.dir=outputs/progressive_w_demo logger=csv
cp outputs/progressive_w_demo/plots/pareto_step_0001500.png docs/progressive_w_pareto.png
cp outputs/progressive_w_demo/quality_cost.csv docs/progressive_w_quality_cost.csv
for s in copy moe_timestep moe_token; do
  $PY -m distill.train +exp=consistency student=$s trainer.max_steps=500 method.lr_scheduler.total_steps=500 \
    callbacks.quality_cost.every_n_steps=500 callbacks.quality_cost.teacher=null logger=csv sample_grid_seeds=0 \
    hydra.run.dir=outputs/moe_compare/$s
  cp outputs/moe_compare/$s/quality_cost.csv docs/moe_compare_$s.csv
done
# compression (issue 15): before recovery, recovered by feature distillation, and pruned + LCM
$PY bench/compress_untrained.py --out outputs/compress_untrained pruned30=pruned:0.3 pruned50=pruned:0.5 \
  pruned70=pruned:0.7 lowrank50=lowrank:0.5 lowrank25=lowrank:0.25
for d in pruned30 pruned50 pruned70 lowrank50 lowrank25; do
  $PY -m distill.evaluate pipeline=outputs/compress_untrained/$d schedulers=[ddim] steps=[25] guidance_scale=3.0 \
    num_per_class=50 grids=false cost_repeats=1 hydra.run.dir=outputs/compress_untrained/$d/eval
done
$PY -m distill.train +exp=compress callbacks.quality_cost.teacher=null logger=csv hydra.run.dir=outputs/compress/pruned50
$PY -m distill.train +exp=compress method.match_mid_block=false callbacks.quality_cost.teacher=null logger=csv \
  hydra.run.dir=outputs/compress/pruned50_bksdm
for v in "pruned30|student.ratio=0.3" "pruned70|student.ratio=0.7" "lowrank50|student=lowrank student.budget=0.5" \
  "lowrank25|student=lowrank student.budget=0.25"; do
  # shellcheck disable=SC2086
  $PY -m distill.train +exp=compress ${v#*|} trainer.max_steps=1000 callbacks.quality_cost.teacher=null logger=csv \
    hydra.run.dir=outputs/compress/${v%%|*}
done
lcm=(trainer.max_steps=500 method.lr_scheduler.total_steps=500 callbacks.quality_cost.every_n_steps=500
  callbacks.quality_cost.teacher=null logger=csv sample_grid_seeds=0)
$PY -m distill.train +exp=consistency student=pruned student.ratio=0.5 student.time_cond_proj_dim=256 "${lcm[@]}" \
  hydra.run.dir=outputs/compress/pruned50_lcm
$PY -m distill.train +exp=consistency student=pretrained student.path=outputs/compress/pruned50_bksdm/export \
  student.time_cond_proj_dim=256 "${lcm[@]}" hydra.run.dir=outputs/compress/recovered50_lcm
$PY -m distill.evaluate steps=[4,8,25] schedulers=[ddim,dpmsolver] num_per_class=50 grids=false cost_repeats=1 \
  hydra.run.dir=outputs/compress/teacher
u=outputs/compress_untrained; c=outputs/compress
$PY bench/compress_table.py "teacher=$c/teacher/quality_cost.csv" \
  "pruned30 untrained=$u/pruned30/eval/quality_cost.csv" "pruned50 untrained=$u/pruned50/eval/quality_cost.csv" \
  "pruned70 untrained=$u/pruned70/eval/quality_cost.csv" "lowrank50 untrained=$u/lowrank50/eval/quality_cost.csv" \
  "lowrank25 untrained=$u/lowrank25/eval/quality_cost.csv" "pruned30 1k=$c/pruned30/quality_cost.csv:student" \
  "pruned50 2k=$c/pruned50/quality_cost.csv:student" "pruned50 2k BK-SDM blocks=$c/pruned50_bksdm/quality_cost.csv:student" \
  "pruned70 1k=$c/pruned70/quality_cost.csv:student" "lowrank50 1k=$c/lowrank50/quality_cost.csv:student" \
  "lowrank25 1k=$c/lowrank25/quality_cost.csv:student" "pruned50+LCM 500=$c/pruned50_lcm/quality_cost.csv:student" \
  "recovered pruned50+LCM 500=$c/recovered50_lcm/quality_cost.csv:student" \
  --out docs/compress_quality_cost.csv --plot docs/compress_pareto.png

# training-free accelerators (issue 16): each accelerator on the teacher (DDIM 50, DPM-Solver 20) and the LCM student
a=outputs/accelerate
PYTHON=$PY bash bench/accelerate_quality.sh $a outputs/consistency_demo/export
specs=()
for d in teacher-ddim50 teacher-ddim50-deepcache2 teacher-ddim50-deepcache3 teacher-ddim50-deepcache5 \
  teacher-ddim50-deepcache5nu teacher-ddim50-taylor2 teacher-ddim50-taylor3 teacher-ddim50-taylor4 teacher-ddim50-taylor5 \
  teacher-ddim50-fitted2 teacher-ddim50-deepcache3+taylor2 teacher-dpmsolver20 teacher-dpmsolver20-deepcache2 \
  teacher-dpmsolver20-deepcache3 teacher-dpmsolver20-deepcache5 teacher-dpmsolver20-deepcache5nu \
  teacher-dpmsolver20-taylor2 teacher-dpmsolver20-taylor3 teacher-dpmsolver20-taylor4 teacher-dpmsolver20-taylor5 \
  teacher-dpmsolver20-fitted2 teacher-dpmsolver20-deepcache3+taylor2 teacher-ddim50-cfg1 teacher-ddim50-cfg1-classifier \
  teacher-ddim50-cfg3-classifier teacher-ddim50-null teacher-ddim50-null-classifier teacher-ddim50-null-clip lcm4 \
  lcm4-deepcache2 lcm4-taylor; do
  specs+=("$d=$a/$d/quality_cost.csv")
done
$PY bench/compress_table.py "${specs[@]}" --out docs/accelerate_quality_cost.csv --plot docs/accelerate_pareto.png \
  --title "training-free accelerators: FID vs GFLOPs per image" --groups "teacher DDIM 50=teacher-ddim50" \
  "teacher DPM-Solver 20=teacher-dpmsolver20" "teacher DDIM 50 no CFG=teacher-ddim50-cfg1" \
  "teacher DDIM 50 empty prompt=teacher-ddim50-null" "LCM 4 steps=lcm4"
$PY bench/accelerate_latency.py --threads 2 --lcm outputs/consistency_demo/export --out docs/accelerate_latency.json
# the notebooks' pictures (docs/notebooks.md): each notebook with its default settings, its figure cell
$PY notebooks/run.py notebooks/*.ipynb --figure-dir docs/notebooks
