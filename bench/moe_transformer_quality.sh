#!/usr/bin/env bash
# Token-routed MoE student (4 experts, top-1) against the dense copy student of the digits flow DiT: latent consistency
# distillation, same seed and steps (300), guidance 3; FID of 500 samples in three feature spaces at 1, 2, 4 steps, each
# MoE row's difference from the copy at equal steps with the paired bootstrap uncertainty (same prompts and seeds).
# About 18 min a run on 2 busy CPU cores. Runs already finished are skipped.
#   bash bench/moe_transformer_quality.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/moe_transformer}
STEPS=${STEPS:-300}
for student in copy moe_token; do
  [ -f "$OUT/$student/quality_cost.csv" ] && continue
  $PY -m distill.train +exp=consistency_flow teacher=digits_flow student=$student seed=0 \
    method.guidance_scale_min=3.0 method.guidance_scale_max=3.0 method.latent_cache=true trainer.max_steps=$STEPS \
    method.lr_scheduler.total_steps=$STEPS callbacks.quality_cost.every_n_steps=$STEPS callbacks.quality_cost.teacher=null \
    'eval.extra_features=[pixels,clip]' logger=csv sample_grid_seeds=0 export=false hydra.run.dir=$OUT/$student
done
for steps in 1 2 4; do
  $PY bench/students_table.py "copy=$OUT/copy/quality_cost.csv:student" "moe_token=$OUT/moe_token/quality_cost.csv:student" \
    --reference copy@$steps --out "$OUT/vs_copy_at_$steps.csv"
done
