#!/usr/bin/env bash
# Send a training run (or a -m sweep) to SLURM through Hydra's submitit launcher.
#   bash launch/slurm.sh +exp=consistency trainer=ddp trainer.devices=8
# Each job runs in its own run directory; sweeps land in multirun/<exp>/<date>/<time>/<job>.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m distill.train -m hydra/launcher=submitit_slurm \
  hydra.launcher.gpus_per_node="${GPUS_PER_NODE:-8}" \
  hydra.launcher.tasks_per_node="${GPUS_PER_NODE:-8}" \
  hydra.launcher.nodes="${NODES:-1}" \
  hydra.launcher.timeout_min="${TIMEOUT_MIN:-1440}" \
  hydra.launcher.partition="${PARTITION:-gpu}" \
  trainer.num_nodes="${NODES:-1}" trainer.devices="${GPUS_PER_NODE:-8}" \
  "$@"
