#!/usr/bin/env bash
# Rebuild every figure of the README (about 20 minutes on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
run=outputs/consistency_demo
$PY -m distill.train +exp=consistency hydra.run.dir=$run logger=csv
cp $run/plots/pareto_step_0001000.png docs/consistency_pareto.png
cp $run/samples/student-lcm-1_step_0001000.png docs/consistency_lcm1.png
cp $run/samples/student-lcm-4_step_0001000.png docs/consistency_lcm4.png
cp $run/samples/teacher-ddim-4.png docs/teacher_ddim4.png
$PY -m distill.sample pipeline=distill/assets/digits/teacher out=docs/teacher_grid.png num_seeds=8
cp $run/quality_cost.csv docs/consistency_quality_cost.csv
$PY -m distill.evaluate schedulers=[ddim,dpmsolver,euler] steps=[1,2,4,8,25,50] num_per_class=50 hydra.run.dir=outputs/evaluate_teacher
cp outputs/evaluate_teacher/quality_cost.csv docs/teacher_quality_cost.csv
cp outputs/evaluate_teacher/pareto.png docs/teacher_pareto.png
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
