#!/usr/bin/env bash
# On the GPU machine (repo root; `.whl` and an old tree at tmp/ab_old carried): the kernel sweep of
# the old tree and of this one, interleaved old / new / old (first case) so drift shows, each record with
# the SM clock. Output: $OUT/{old1,new,old2}/*.jsonl and $OUT/ab.log.
#   scripts/kernel_ab.sh "q:512:bf16 q:512:int8 gate:512:int8"
set -u
cases=$1
source scripts/device_setup.sh "$(cat tmp/ab_commit 2>/dev/null || echo unknown)" >/dev/null || exit 1
clock() { nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader; }
for arm in old1 new old2; do
  tree=.; [ "${arm#old}" != "$arm" ] && tree=tmp/ab_old
  echo "$arm start $(clock)" | tee -a "$OUT/ab.log"
  these=$cases; [ "$arm" = old2 ] && these=${cases%% *}       # the drift check: the first case only
  python3 "$tree/scripts/gpu_kernel_check.py" --out "$OUT/$arm" --skip-correctness --sweep $these \
    > "$OUT/$arm.log" 2>&1 || echo "$arm failed rc=$?" | tee -a "$OUT/ab.log"
  echo "$arm end $(clock)" | tee -a "$OUT/ab.log"
done
