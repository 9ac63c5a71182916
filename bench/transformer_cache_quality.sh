#!/usr/bin/env bash
# Issue 34: quality and NFE of the transformer caches (First-Block Cache, TeaCache) and the Taylor forecast on the
# embedded flow teacher (flow Euler 28 steps, guidance 3.0) and on its 4-step consistency student, one
# distill.evaluate run each (500 samples, FID in the three feature spaces); TeaCache's rescaling is fitted first
# on each model's own trajectories (other seeds than the evaluation's). Paired differences: bench/students_table.py.
# Latency side by side: bench/pipeline_latency.py.
#   bash bench/transformer_cache_quality.sh OUT_DIR [CONSISTENCY_EXPORT]
set -uo pipefail
OUT=${1:-outputs/transformer_cache}
STUDENT=${2:-}
PY=${PYTHON:-python}
TEACHER=distill/worlds/digits/weights/flow_teacher
mkdir -p "$OUT"
run() {  # label, overrides...: one evaluate run, skipped when its CSV exists (resumable)
  local label=$1; shift
  [ -f "$OUT/$label/quality_cost.csv" ] && return 0
  $PY -m distill.evaluate grids=false model_name="$label" "eval.extra_features=[pixels,clip]" cost_repeats=1 "$@" \
    hydra.run.dir="$OUT/$label" > "$OUT/$label.log" 2>&1
  echo "$label rc=$?" >> "$OUT/summary.txt"
}
fit() {  # pipeline, steps, folder: TeaCache's polynomial for that pipeline and step count
  [ -f "$3/teacache.json" ] || $PY -m distill.fit_forecaster accelerate=teacache pipeline="$1" \
    "steps=[$2]" out="$3" "${@:4}" > "$3.log" 2>&1
}
t=(pipeline=$TEACHER "schedulers=[flow_euler]" "steps=[28]" guidance_scale=3.0)
mkdir -p "$OUT/fit_teacher"
fit $TEACHER 28 "$OUT/fit_teacher" scheduler=flow_euler guidance_scale=3.0
run teacher28 "${t[@]}"
for thr in 0.08 0.1 0.12 0.15; do
  run "teacher28-fbcache$thr" "${t[@]}" accelerate=fbcache accelerate.options.threshold=$thr
done
for thr in 0.05 0.1 0.25 0.5; do
  run "teacher28-teacache$thr" "${t[@]}" accelerate=teacache accelerate.options.threshold=$thr \
    accelerate.options.path="$OUT/fit_teacher"
done
for thr in 0.1 0.2; do  # TeaCache without rescaling: the raw change of the modulated input accumulated
  run "teacher28-teacache-raw$thr" "${t[@]}" accelerate=teacache accelerate.options.threshold=$thr \
    accelerate.options.rescale=false
done
run teacher28-taylor2 "${t[@]}" accelerate=forecast
for n in 2 3; do  # TaylorSeer per block: every block's attention and MLP forecast, order 1 (the preset: N=3)
  run "teacher28-taylorseer$n" "${t[@]}" accelerate=taylorseer accelerate.options.interval=$n
done
if [ -n "$STUDENT" ]; then
  s=(pipeline="$STUDENT" "schedulers=[flow_lcm]" "steps=[4]")
  mkdir -p "$OUT/fit_student"
  fit "$STUDENT" 4 "$OUT/fit_student" scheduler=flow_lcm
  run student4 "${s[@]}"
  run student4-fbcache0.08 "${s[@]}" accelerate=fbcache
  run student4-teacache0.25 "${s[@]}" accelerate=teacache accelerate.options.path="$OUT/fit_student"
  run student4-taylor2 "${s[@]}" accelerate=forecast
  run student4-taylorseer3 "${s[@]}" accelerate=taylorseer
fi
