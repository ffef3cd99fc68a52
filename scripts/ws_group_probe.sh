#!/usr/bin/env bash
# The deeper-ring Gluon candidates in the grouped tile order (group=8) against the same in row order
# (group=1) and the Triton tile, at 2048 and 4096 tokens. Why: with group=1 the ~132 programs running
# at once sit along one row of tiles, so every row of tiles reads all of X again; for down (X is
# T x 14336) at 4096 tokens that is 117 MB a row, 3.8 GB for the 32 rows, more than L2 keeps (the
# seven-slot config ran down 46% slower than the Triton tile there and gate, whose X is 33 MB, 1%;
# results/kernels/h100/ws_s25/wide). Eight row-tiles per group read X a quarter as often.
# Run on the H100 from the repo root, .whl carried:
#   bash scripts/ws_group_probe.sh <git-commit> <tune-cache.json>   # ~2 minutes; output under $OUT
set -u
source scripts/ws_probe_lib.sh
ws_probe_start "${1:-unknown}" "${2:-results/h100/run50/tune_cache.json}" || exit 1
C2=$(config CANDIDATES 5); C2G=$(config CANDIDATES 7); I1=$(config CANDIDATES 6)
B1=$(config BF16_ONLY 1); B1G=$(config BF16_ONLY 2)
python3 scripts/ws_bench.py --out "$OUT/check" --configs "[$C2G,$B1G]" check q:520 k:1000 > "$OUT/check.log" 2>&1
progress check $?
python3 scripts/ws_bench.py --out "$OUT/int8" --state int8 --rounds 3 --configs "[$C2,$C2G,$I1]" time down:4096 gate:4096 q:4096 down:2048 > "$OUT/int8.log" 2>&1
progress int8 $?
python3 scripts/ws_bench.py --out "$OUT/bf16" --rounds 3 --configs "[$B1,$B1G,$C2,$C2G]" time down:4096 gate:4096 down:2048 > "$OUT/bf16.log" 2>&1
progress bf16 $?
