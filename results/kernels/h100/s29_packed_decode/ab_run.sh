# session 29, call 4: GPU tests of the packed int8 decode, then the int8 Gluon candidates, old tree / new tree interleaved
set -u
source scripts/ws_probe_lib.sh
ws_probe_start "$(cat tmp/ab_commit)" results/h100/run61/tune_cache.json || exit 1
I0=$(config CANDIDATES 4); I1=$(config CANDIDATES 6)
timeout 240 python3 -m pytest -q -rs -n 8 -p no:cacheprovider --durations=10 \
  tests/test_kernels.py::test_the_packed_int8_decode_gives_every_code_exactly tests/test_hopper_ws.py > "$OUT/pytest_gpu.log" 2>&1
progress pytest $?; tail -n 15 "$OUT/pytest_gpu.log"
root=$PWD
for arm in old1 new1 old2 new2 old3 new3; do
  tree=$root; [ "${arm#old}" != "$arm" ] && tree=$root/tmp/ab_old
  [ $SECONDS -gt 470 ] && break
  (cd "$tree" && PYTHONPATH="$tree:/tmp/site" python3 scripts/ws_bench.py --out "$OUT/$arm" --state int8 --rounds 2 \
     --configs "[$I0,$I1]" time gate:512 down:512 q:512 k:512 > "$OUT/$arm.log" 2>&1)
  progress "$arm $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader)" $?
done
