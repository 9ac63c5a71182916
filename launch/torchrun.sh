#!/usr/bin/env bash
# One node, N processes: Lightning picks up torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT;
# --standalone picks a free port itself). The run directory is stable and ckpt_path=last, so running the same
# command again resumes. A SIGTERM to torchrun (Kubernetes' eviction) reaches every worker: distill saves
# last.ckpt at the next step boundary and the workers exit 75 (torchrun itself then exits non-zero).
#   NPROC=8 bash launch/torchrun.sh +exp=consistency
#   NPROC=2 RUN_DIR=outputs/cpu bash launch/torchrun.sh +exp=debug trainer=cpu_ddp   # CPU processes (gloo)
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-8}
exec torchrun --standalone --nproc_per_node="$NPROC" -m distill.train \
  trainer=ddp trainer.devices="$NPROC" hydra.run.dir="${RUN_DIR:-outputs/torchrun}" ckpt_path=last "$@"
