#!/usr/bin/env bash
# Deeper operand rings for the bf16 Gluon candidates, and a 16-deep ring for the int8 one: the
# measurement session 24 prepared and could not run (no device time left); run in session 25
# (results/kernels/h100/ws_s25/probe: C2, B1 and I1 became ws_choice candidates). Why: ncu_stalls.py on
# session 23's Nsight profile of the 128x128 bf16 candidate (results/kernels/h100/ws_s23/call6) has
# its MMA warps waiting on the operand ring 64% of their time and the epilogue waiting for G 34% of
# its; the int8 candidate gained 2.5-6% (512 tokens) and 12-18% (1024) from six 32-deep slots instead
# of two 64-deep ones (ws_s23 call 7). With one wgmma in flight the MMA warps hold two slots, so three
# 64-deep slots keep one 32 KB load in flight and six 32-deep slots four 16 KB loads, in the same
# shared memory. Every config below compiles for sm_90 with Triton 3.6 without spills
# (scripts/offline_sass.py --ws). Run on the H100 from the repo root, .whl carried:
#   bash scripts/ws_ring_probe.sh <git-commit> [tune-cache.json]   # ~5 minutes; everything lands under $OUT
set -u
source scripts/ws_probe_lib.sh
ws_probe_start "${1:-unknown}" "${2:-results/h100/run48/tune_cache.json}" || exit 1
C0=$(config CANDIDATES 1)                                        # 128x128, three 64-deep operand slots
C1=$(config CANDIDATES 1 '{"block_k":32,"stages":6}')
C2=$(config CANDIDATES 1 '{"block_k":32,"stages":7,"state_stages":3}')
C3=$(config CANDIDATES 1 '{"block_k":16,"stages":12}')
B0=$(config BF16_ONLY 0)                                         # 256x128, two 64-deep operand slots
B1=$(config BF16_ONLY 0 '{"block_k":32,"stages":5,"slab_m":32}')
I0=$(config CANDIDATES 4)                                        # int8: six 32-deep operand slots
I1=$(config CANDIDATES 4 '{"block_k":16,"stages":12}')
mkdir -p "$OUT/check"
for variant in "$C1" "$C2" "$C3" "$B1"; do
  python3 scripts/ws_bench.py --out "$OUT/check" --configs "[$variant]" check q:520 k:1000 >> "$OUT/check/check.log" 2>&1
  progress check $?
done
python3 scripts/ws_bench.py --out "$OUT/check" --state int8 --configs "[$I1]" check q:520 k:1000 >> "$OUT/check/check.log" 2>&1
progress check_int8 $?
python3 scripts/ws_bench.py --out "$OUT/b512" --rounds 3 --configs "[$C0,$C1,$C2,$C3,$B0,$B1]" time gate:512 down:512 q:512 k:512 > "$OUT/b512.log" 2>&1
progress b512 $?
python3 scripts/ws_bench.py --out "$OUT/b1024" --rounds 2 --configs "[$C0,$C1,$C2,$B0,$B1]" time gate:1024 q:1024 > "$OUT/b1024.log" 2>&1
progress b1024 $?
python3 scripts/ws_bench.py --out "$OUT/i512" --state int8 --rounds 3 --configs "[$I0,$I1]" time gate:512 down:512 q:512 > "$OUT/i512.log" 2>&1
progress i512 $?
