#!/usr/bin/env bash
# Latency per image of denoising over 2 processes against one process on the same 2 cores (bench/parallel_latency.py):
# the digits UNet teacher, DDIM 25, CFG 3, batch 1 and 8; one process at 1 thread (also the reference sample), one at
# 2 threads, CFG parallel and AsyncDiff (warm-up 3; stride 1: 2 components, stride 2: 1 component and the
# extra process) on 2 processes at 1 thread each. Run on an otherwise idle machine.
# Writes docs/parallel_latency.jsonl (one JSON line a setting).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/parallel_latency.jsonl}
ROUNDS=${ROUNDS:-7}
: > "$OUT"
for BATCH in ${BATCHES:-1 8}; do
  common=(--steps 25 --guidance 3 --batch "$BATCH" --rounds "$ROUNDS")
  OMP_NUM_THREADS=1 $PY bench/parallel_latency.py --threads 1 "${common[@]}" | tail -1 >> "$OUT"
  OMP_NUM_THREADS=2 $PY bench/parallel_latency.py --threads 2 "${common[@]}" | tail -1 >> "$OUT"
  for PARALLEL in "cfg" "asyncdiff --stride 1" "asyncdiff --stride 2"; do
    # shellcheck disable=SC2086  # the setting's words
    OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node=2 bench/parallel_latency.py \
      --parallel $PARALLEL --threads 1 "${common[@]}" 2>/dev/null | grep '^{' >> "$OUT"
  done
done
cat "$OUT"
