#!/usr/bin/env bash
# The README's measured sweep: 6 LCM settings on the embedded digits (solver skip num_ddim_timesteps x the
# student's sampling steps), 300 training steps each, every run judged at its own step count (FID, latency),
# then one report across the runs (table, Pareto plot, HTML dashboard). About 6 min a run on 2 idle CPU cores.
#   bash bench/sweep_lcm.sh                # writes outputs/sweep_lcm/ and its report in docs/sweep_lcm/
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/sweep_lcm}
$PY -m distill.train -m +exp=consistency objectives=[fid,latency_s] \
  method.num_ddim_timesteps=25,50,100 scheduler.num_inference_steps=2,4 \
  trainer.max_steps=300 method.lr_scheduler.total_steps=300 callbacks.quality_cost.every_n_steps=0 \
  callbacks.quality_cost.teacher=null logger=csv export=false hydra.sweep.dir=$OUT
$PY -m distill.report "$OUT" --out "${REPORT:-docs/sweep_lcm}"
