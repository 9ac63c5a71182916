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
$PY - "$OUT" <<'TABLE'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| batch | setting | processes x threads | ms per image (median) | min | vs 1 process x 2 threads | latent deviation |")
print("|---|---|---|---|---|---|---|")
for row in rows:
    base = next(r for r in rows if r["batch"] == row["batch"] and r["parallel"] == "none" and r["threads"] == 2)
    name = row["parallel"] + (f" (stride {row['stride']}, warm-up {row['warmup_steps']})" if row["stride"] else "")
    dev = "" if row["latent_deviation"] is None else f"{row['latent_deviation']:.2g}"
    print(f"| {row['batch']} | {name} | {row['processes']} x {row['threads']} | {row['ms_per_image']:.1f} | "
          f"{row['ms_per_image_min']:.1f} | {base['ms_per_image'] / row['ms_per_image']:.2f}x | {dev} |")
TABLE
