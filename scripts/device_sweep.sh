#!/usr/bin/env bash
# On the GPU machine (repo root, `.whl` carried): optionally the GPU test files, then a sweep that
# starts no new cell after the command's time box, resuming into OUT_DIR if it already holds rows.
# The result folder comes back as $OUT/<name>.tgz (extract it in the checkout before the next command).
#   scripts/device_sweep.sh COMMIT SUITE OUT_DIR ONLY BOX_S [TESTS...]
# BOX_S: seconds this command may take in all; a cell takes up to ~100 s on Llama-8B, so the sweep
# stops starting cells 110 s before the box ends. ONLY may hold several --only selections separated
# by ';': they run one after the other (the cells that matter most first; within one selection the
# suite's order decides), all into OUT_DIR under one run id. GPUS=0,1,2,3 in the environment runs the
# cells side by side on those GPUs (`sweep --gpus`), one cell per GPU at a time; INTERLEAVE=1 keeps each
# model's cells resident together with their timed repeats taking turns (`sweep --interleave`). The tests run on a fixed tile
# (FORGE_AUTOTUNE=0, set here for them alone); a FORGE_* variable in the caller's environment reaches the cells,
# and each row records it (extra.forge_env). Each lane's timed windows run on two CPUs of its own (`sweep --cpus-per-cell`, D114).
set -u
commit=$1 suite=$2 out_dir=$3 only=$4 box=$5; shift 5
source scripts/device_setup.sh "$commit" >/dev/null || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
if [ $# -gt 0 ]; then
  # -v: each result is logged as it comes, so a run cut by the timeout still names its failures
  FORGE_AUTOTUNE=0 timeout $((box / 3)) python3 -m pytest -v -rfEs --tb=line -n 8 -p no:cacheprovider "$@" \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?"; grep -E "(FAILED|ERROR) tests/" "$OUT/pytest_gpu.log" | head -n 30
  grep -E "^SKIPPED|^=+ .*(passed|failed)" "$OUT/pytest_gpu.log" | tail -n 25
fi
IFS=';' read -ra selections <<< "$only"
for selection in "${selections[@]}"; do
  resume=""; [ -f "$out_dir/manifest.json" ] && resume="--resume"
  left=$((box - SECONDS - 110)); [ $left -le 0 ] && break
  timeout $((box - SECONDS - 15)) python3 -m forge_bench.cli sweep "$suite" --out "$out_dir" --only "$selection" \
    $resume --stop-after $left ${GPUS:+--gpus "$GPUS"} ${INTERLEAVE:+--interleave} >> "$OUT/sweep.log" 2>&1
  echo "sweep '$selection' rc=$?"
done
grep -hE "^  [A-Za-z0-9_.-]+/" "$OUT/sweep.log" | tail -n 60
tar -czf "$OUT/$(basename "$out_dir").tgz" "$out_dir"
