#!/usr/bin/env bash
# Quality with the training-speed settings against the default: LCM on the digits (the bench/lcm_seeds.sh protocol,
# 500 steps) with the 4-step FID every 100 steps, so that the step where the quality bar is met shows too.
#   bash bench/quality_fast.sh               # seeds 0 1 2, interleaved: fast then default per seed
#   SEEDS=0 bash bench/quality_fast.sh
# Finished runs are skipped, so the script resumes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/quality_fast}
mkdir -p "$OUT"
for seed in ${SEEDS:-0 1 2}; do
  for variant in "fast|method.latent_cache=true method.frozen_dtype=bf16" "default|"; do
    label=${variant%%|*}; overrides=${variant#*|}
    run=$OUT/$label-s$seed
    [ -f "$run/quality_cost.csv" ] && continue
    # shellcheck disable=SC2086
    $PY -m distill.train +exp=consistency student=copy $overrides seed=$seed trainer.max_steps=500 \
      method.lr_scheduler.total_steps=500 callbacks.quality_cost.every_n_steps=100 \
      callbacks.quality_cost.teacher=null logger=csv sample_grid_seeds=0 export=false hydra.run.dir=$run \
      method.latent_cache_dir=$OUT/latent_cache > "$OUT/$label-s$seed.log" 2>&1 || exit $?
  done
done
