#!/usr/bin/env bash
# Latency of the digits flow teacher, its distilled students and the transformer caches, every variant of one table
# in one process, interleaved (bench/pipeline_latency.py), 2 threads, batch 1 and 16, median of 3 rounds.
# Inputs: the exports of the commands in docs/families.md (consistency: outputs/consistency_flow_trailing, progressive:
# a progressive_flow run's rounds; latency does not depend on the weights, so a short run of the same command serves)
# and outputs/transformer_cache/fit_teacher (bench/transformer_cache_quality.sh). Writes docs/flow_students_latency.json
# and docs/transformer_cache_latency.json.
set -euo pipefail
PY=${PY:-.venv/bin/python}
T=${TEACHER:-distill/worlds/digits/weights/flow_teacher}
C=${CONSISTENCY:-outputs/consistency_flow_trailing/export}
P=${PROGRESSIVE:-outputs/progressive_flow_latency/rounds}
FIT=${FIT:-outputs/transformer_cache/fit_teacher}
ROUNDS=${ROUNDS:-3}
G="guidance_scale=3.0"
$PY bench/pipeline_latency.py --threads 2 --batch-sizes 1 16 --rounds "$ROUNDS" --reference teacher@28 \
    --out docs/flow_students_latency.json \
    "teacher@1=$T:steps=1,$G" "teacher@2=$T:steps=2,$G" "teacher@4=$T:steps=4,$G" "teacher@28=$T:steps=28,$G" \
    "consistency@1=$C:steps=1" "consistency@2=$C:steps=2" "consistency@4=$C:steps=4" \
    "progressive@1=$P/001-steps:steps=1" "progressive@2=$P/002-steps:steps=2" "progressive@4=$P/004-steps:steps=4" \
    "progressive@8=$P/008-steps:steps=8"
$PY bench/pipeline_latency.py --threads 2 --batch-sizes 1 16 --rounds "$ROUNDS" --reference plain \
    --out docs/transformer_cache_latency.json \
    "plain=$T:steps=28,$G" \
    "fbcache0.12=$T:steps=28,$G,accelerate=fbcache,accelerate.threshold=0.12" \
    "teacache0.05=$T:steps=28,$G,accelerate=teacache,accelerate.threshold=0.05,accelerate.path=$FIT" \
    "forecast2=$T:steps=28,$G,accelerate=forecast" \
    "taylorseer2=$T:steps=28,$G,accelerate=taylorseer,accelerate.interval=2" \
    "taylorseer3=$T:steps=28,$G,accelerate=taylorseer"
