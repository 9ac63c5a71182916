#!/usr/bin/env bash
# Denoising over processes (distill.inference.parallel; docs/parallel.md): one node, NPROC processes, each loading the
# pipeline; NCCL with CUDA (a GPU a process, by LOCAL_RANK), else gloo on CPU. Rank 0 writes the results.
#   bash launch/parallel.sh sample parallel=cfg pipeline=<dir> out=grid.png                 # 2 processes
#   NPROC=2 bash launch/parallel.sh evaluate parallel=asyncdiff parallel.warmup_steps=3 steps=[25]
#   PYTHON=.venv/bin/python THREADS=1 bash launch/parallel.sh sample parallel=cfg ...   # torchrun of that interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
COMMAND=${1:?usage: launch/parallel.sh sample|evaluate overrides...}
shift
export OMP_NUM_THREADS=${THREADS:-${OMP_NUM_THREADS:-1}}
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m "distill.$COMMAND" "$@"
