#!/usr/bin/env bash
# LCM variants over several seeds (500 steps each, the student's 1/2/4-step rows at the end), then the
# mean +- sd over seeds per variant (bench/seeds_table.py). About 6 min a run on 2 idle CPU cores.
#   bash bench/lcm_seeds.sh                      # MoE vs dense (default loss), and the loss A/B on the dense copy, seeds 0 1 2
#   SEEDS="0 1" bash bench/lcm_seeds.sh "copy|student=copy" "lora|student=lora method.ema_decay=0"
# Each argument is "label|hydra overrides"; runs already finished are skipped, so the script resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/lcm_seeds}
if [ $# -eq 0 ]; then
  set -- "copy|student=copy" \
         "moe_token|student=moe_token" \
         "moe_timestep|student=moe_timestep" \
         "copy_ict|student=copy method.huber_c=null" \
         "copy_elementwise|student=copy method.loss_type=pseudo_huber_elementwise method.huber_c=0.001"
fi
for seed in ${SEEDS:-0 1 2}; do
  for variant in "$@"; do
    label=${variant%%|*}; overrides=${variant#*|}
    run=$OUT/$label-s$seed
    [ -f "$run/quality_cost.csv" ] && continue
    # shellcheck disable=SC2086
    $PY -m distill.train +exp=consistency $overrides seed=$seed trainer.max_steps=500 \
      method.lr_scheduler.total_steps=500 callbacks.quality_cost.every_n_steps=500 \
      callbacks.quality_cost.teacher=null logger=csv sample_grid_seeds=0 export=false hydra.run.dir=$run
  done
done
args=()
for variant in "$@"; do label=${variant%%|*}; args+=("$label=$OUT/$label-s*/quality_cost.csv"); done
$PY bench/seeds_table.py "${args[@]}" --out "$OUT/seeds.csv"
