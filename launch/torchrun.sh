#!/usr/bin/env bash
# One node, N processes: Lightning picks up torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR).
# The run directory is stable and ckpt_path=last, so running the same command again resumes.
#   NPROC=8 bash launch/torchrun.sh +exp=consistency
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-8}
exec torchrun --standalone --nproc_per_node="$NPROC" -m distill.train \
  trainer=ddp trainer.devices="$NPROC" hydra.run.dir="${RUN_DIR:-outputs/torchrun}" ckpt_path=last "$@"
