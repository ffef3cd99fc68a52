#!/usr/bin/env bash
# 256x128 tiles on two MMA warpgroups for int8 states: the config the Gluon kernel lacks where the int8
# step loses to bf16 (4096 tokens: the gate/up and down updates stay on the Triton tile, whose int8
# epilogue costs ~4% over its bf16 one, and every 128x128 Gluon candidate is 8-39% slower there;
# results/h100/run50/tune_cache.json). ws_choice.BF16_ONLY's configs spill with int8 states (232 B and
# 72 B of stack, Triton 3.6, sm_90); 16x64 epilogue slabs leave no spill (scripts/offline_sass.py
# --ws). Checked against the Triton kernel, then timed against it and main's int8 candidates at 4096,
# 2048 and 512 tokens. Run on the H100 from the repo root, .whl carried:
#   bash scripts/ws_int8_wide_probe.sh <git-commit> <tune-cache.json>   # ~6 minutes; output under $OUT
set -u
source scripts/ws_probe_lib.sh
ws_probe_start "${1:-unknown}" "${2:-results/kernels/h100/kernel_bench_dc52e16/tune_cache.json}" || exit 1
I0=$(config CANDIDATES 4)                                           # int8: eight epilogue warps, six 32-deep slots
C2=$(config CANDIDATES 5)                                           # 32x64 slabs, seven 32-deep slots
# Run in session 25 (results/kernels/h100/ws_s25/wide, 12bb03e) with two more configs on 32x32 slabs,
# which the launch refused (int8 keeps one block scale per 64 columns of a row; config_problem now says
# so before a compile). The 16x64 config was 1.4-3x slower than the Triton tile: not adopted.
W2=$(config BF16_ONLY 1 '{"slab_m":16,"state_stages":4}')           # 256x128, 16x64 slabs four deep
mkdir -p "$OUT/check"
python3 scripts/ws_bench.py --out "$OUT/check" --state int8 --configs "[$W2]" check q:520 k:1000 > "$OUT/check/check.log" 2>&1
progress check $?
python3 scripts/ws_bench.py --out "$OUT/t4096" --state int8 --rounds 3 --configs "[$I0,$C2,$W2]" time gate:4096 down:4096 q:4096 > "$OUT/t4096.log" 2>&1
progress t4096 $?
python3 scripts/ws_bench.py --out "$OUT/t2048" --state int8 --rounds 2 --configs "[$I0,$C2,$W2]" time gate:2048 down:2048 > "$OUT/t2048.log" 2>&1
progress t2048 $?
python3 scripts/ws_bench.py --out "$OUT/t512" --state int8 --rounds 2 --configs "[$I0,$W2]" time gate:512 q:512 > "$OUT/t512.log" 2>&1
progress t512 $?
