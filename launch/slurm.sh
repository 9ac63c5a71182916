#!/usr/bin/env bash
# Send a training run (or a -m sweep) to SLURM through Hydra's submitit launcher (pip install -e '.[slurm]').
#   bash launch/slurm.sh +exp=consistency
#   NODES=2 GPUS_PER_NODE=4 PARTITION=preempt TIMEOUT_MIN=600 bash launch/slurm.sh +exp=consistency seed=1,2
# Each job runs in its own run directory; sweeps land in multirun/<exp>/<date>/<time>/<job>. The launcher config
# (conf/hydra/launcher/slurm.yaml) has SLURM send SIGUSR1 120 s before the time limit: distill saves last.ckpt
# and exits 75, the job requeues itself and, with ckpt_path=last, resumes in the same run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m distill.train -m hydra/launcher=slurm \
  hydra.launcher.gpus_per_node="${GPUS_PER_NODE:-8}" \
  hydra.launcher.tasks_per_node="${GPUS_PER_NODE:-8}" \
  hydra.launcher.nodes="${NODES:-1}" \
  hydra.launcher.timeout_min="${TIMEOUT_MIN:-1440}" \
  hydra.launcher.partition="${PARTITION:-gpu}" \
  trainer=ddp trainer.num_nodes="${NODES:-1}" trainer.devices="${GPUS_PER_NODE:-8}" ckpt_path=last \
  "$@"
