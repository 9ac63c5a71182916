#!/usr/bin/env bash
# Issue 16: quality and NFE of each training-free accelerator on the embedded default, one distill.evaluate run
# each (500 samples, the metrics protocol): the teacher with DDIM 50 and DPM-Solver 20, the LCM student at 4 steps.
# Latency side by side: bench/accelerate_latency.py. Table and plot: bench/compress_table.py (see docs/make_figures.sh).
#   bash bench/accelerate_quality.sh OUT_DIR [LCM_EXPORT]
set -uo pipefail
OUT=${1:-outputs/accelerate}
LCM=${2:-}
PY=${PYTHON:-python}
mkdir -p "$OUT"
run() {  # label, overrides...: one evaluate run, skipped when its CSV exists (resumable)
  local label=$1; shift
  [ -f "$OUT/$label/quality_cost.csv" ] && return 0
  $PY -m distill.evaluate grids=false model_name="$label" "$@" hydra.run.dir="$OUT/$label" > "$OUT/$label.log" 2>&1
  echo "$label rc=$?" >> "$OUT/summary.txt"
}
[ -f "$OUT/fit/forecaster.json" ] || {
  $PY -m distill.fit_forecaster scheduler=ddim steps=[50] out="$OUT/fit" > "$OUT/fit_ddim.log" 2>&1
  $PY -m distill.fit_forecaster scheduler=dpmsolver steps=[20] out="$OUT/fit" > "$OUT/fit_dpm.log" 2>&1
}
for pair in "ddim 50" "dpmsolver 20"; do
  set -- $pair
  s=$1 n=$2
  base=(scheduler=$s "steps=[$n]")
  run "teacher-$s$n" "${base[@]}"
  for N in 2 3 5; do
    run "teacher-$s$n-deepcache$N" "${base[@]}" accelerate=deepcache accelerate.options.interval=$N
  done
  run "teacher-$s$n-deepcache5nu" "${base[@]}" accelerate=deepcache accelerate.options.interval=5 \
    accelerate.options.schedule=nonuniform
  for N in 2 3 4 5; do
    run "teacher-$s$n-taylor$N" "${base[@]}" accelerate=forecast accelerate.options.interval=$N
  done
  run "teacher-$s$n-fitted2" "${base[@]}" accelerate=forecast_fitted accelerate.options.path="$OUT/fit"
  run "teacher-$s$n-deepcache3+taylor2" "${base[@]}" "accelerators=[deepcache+forecast]"
done
# classifier guidance (the noise-aware digits classifier, scale 3) against and with CFG, on DDIM 50: conditional
# prompts without CFG, with CFG 3, and the harder setting of empty prompts (labels kept) where the guide alone steers
g=(scheduler=ddim "steps=[50]")
run teacher-ddim50-cfg1 "${g[@]}" guidance_scale=1
run teacher-ddim50-cfg1-classifier "${g[@]}" guidance_scale=1 accelerate=classifier
run teacher-ddim50-cfg3-classifier "${g[@]}" guidance_scale=3 accelerate=classifier
run teacher-ddim50-null "${g[@]}" guidance_scale=1 null_prompts=true
run teacher-ddim50-null-classifier "${g[@]}" guidance_scale=1 null_prompts=true accelerate=classifier
run teacher-ddim50-null-clip "${g[@]}" guidance_scale=1 null_prompts=true accelerate=classifier_clip
# (classifier_x0 is not measured here: its default guide is the digits classifier that computes FID and accuracy;
# classifier_clip's guide is the digits CLIP, which computes the CLIP score: that column judges it by itself)
if [ -n "$LCM" ]; then
  run lcm4 pipeline="$LCM" scheduler=lcm "steps=[4]"
  run lcm4-deepcache2 pipeline="$LCM" scheduler=lcm "steps=[4]" accelerate=deepcache accelerate.options.interval=2
  run lcm4-taylor pipeline="$LCM" scheduler=lcm "steps=[4]" accelerate=forecast
fi
