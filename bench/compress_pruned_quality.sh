#!/usr/bin/env bash
# The pruned rows of docs/compression.md's table with today's student=pruned (per_block=true: a uniform width
# multiplier, FLOPs counted with attention at 16 text tokens): untrained, recovered by +exp=compress (output +
# feature distillation, mid block matched; BK-SDM's blocks for 50%), and LCM on the pruned copy and on the recovered
# export. The commands are docs/make_figures.sh's compression block, restricted to the pruned rows; the teacher's
# row is from the same evaluation protocol (DDIM / DPM-Solver 25 / 8 / 4, CFG 3, 500 samples).
# Usage: bash bench/compress_pruned_quality.sh [OUT=outputs/compress_pruned]   (PY=python to override)
set -euo pipefail
PY=${PY:-.venv/bin/python}
O=${1:-outputs/compress_pruned}
u=$O/untrained
# step FILE COMMAND...: run COMMAND unless FILE (what it writes last) exists
step() { [ -f "$1" ] && { echo "have $1"; return 0; }; shift; "$@"; }
[ -d "$u/pruned70" ] || $PY bench/compress_untrained.py --out "$u" pruned30=pruned:0.3 pruned50=pruned:0.5 pruned70=pruned:0.7
for d in pruned30 pruned50 pruned70; do
  step "$u/$d/eval/quality_cost.csv" $PY -m distill.evaluate pipeline=$u/$d schedulers=[ddim] steps=[25] guidance_scale=3.0 \
    num_per_class=50 grids=false cost_repeats=1 hydra.run.dir=$u/$d/eval
done
common=(callbacks.quality_cost.teacher=null logger=csv)
recover() {  # recover NAME OVERRIDES...: +exp=compress into $O/NAME unless its export exists
  local name=$1; shift
  step "$O/$name/export/model_index.json" $PY -m distill.train +exp=compress "$@" "${common[@]}" hydra.run.dir=$O/$name
}
recover pruned30 student.ratio=0.3 trainer.max_steps=1000
recover pruned50 student.ratio=0.5
recover pruned70 student.ratio=0.7 trainer.max_steps=1000
lcm=(trainer.max_steps=500 method.lr_scheduler.total_steps=500 callbacks.quality_cost.every_n_steps=500
  "${common[@]}" sample_grid_seeds=0)
step "$O/pruned50_lcm/export/model_index.json" $PY -m distill.train +exp=consistency student=pruned student.ratio=0.5 \
  student.time_cond_proj_dim=256 "${lcm[@]}" hydra.run.dir=$O/pruned50_lcm
step "$O/recovered50_lcm/export/model_index.json" $PY -m distill.train +exp=consistency student=pretrained \
  student.path=$O/pruned50/export student.time_cond_proj_dim=256 "${lcm[@]}" hydra.run.dir=$O/recovered50_lcm
recover pruned50_bksdm student.ratio=0.5 method.match_mid_block=false  # last: the longest (2,000 steps)
$PY bench/compress_table.py "pruned30 untrained=$u/pruned30/eval/quality_cost.csv" \
  "pruned50 untrained=$u/pruned50/eval/quality_cost.csv" "pruned70 untrained=$u/pruned70/eval/quality_cost.csv" \
  "pruned30 1k=$O/pruned30/quality_cost.csv:student" "pruned50 2k=$O/pruned50/quality_cost.csv:student" \
  "pruned50 2k BK-SDM blocks=$O/pruned50_bksdm/quality_cost.csv:student" \
  "pruned70 1k=$O/pruned70/quality_cost.csv:student" "pruned50+LCM 500=$O/pruned50_lcm/quality_cost.csv:student" \
  "recovered pruned50+LCM 500=$O/recovered50_lcm/quality_cost.csv:student" \
  --out docs/compress_pruned_quality_cost.csv
