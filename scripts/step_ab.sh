#!/usr/bin/env bash
# On the GPU machine (repo root; `.whl` and an old tree at tmp/ab_old carried): the same suite cells
# run by the old tree and by this one, alternating old / new per selection, each into its own
# results folder (results/h100/<name>_old, <name>_new; one cell id per selection), returned as
# $OUT/<name>.tgz.
#   scripts/step_ab.sh SUITE NAME OLD_COMMIT NEW_COMMIT "sel1;sel2"
set -u
suite=$1 name=$2 old_commit=$3 new_commit=$4 only=$5
source scripts/device_setup.sh "$new_commit" >/dev/null || exit 1
root=$PWD
arm() {   # arm TAG TREE COMMIT SELECTION; runs from TREE: `python -m` puts the cwd first on sys.path
  local dir="$root/results/h100/${name}_$1" resume=""
  [ -f "$dir/manifest.json" ] && resume="--resume"
  (cd "$root/$2" && PYTHONPATH="$root/$2:/tmp/site" FORGE_BENCH_GIT_COMMIT=$3 python3 -m forge_bench.cli sweep \
    "$root/$suite" --out "$dir" --only "$4" $resume >> "$OUT/step_ab.log" 2>&1)
  echo "$1 $4 rc=$? $(nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader)"
  (cd "$root/$2" && python3 -c "import forge_core, sys; print('  imported', forge_core.__file__)")
}
IFS=';' read -ra selections <<< "$only"
for selection in "${selections[@]}"; do
  arm old tmp/ab_old "$old_commit" "$selection"
  arm new . "$new_commit" "$selection"
  # after every pair: a command that runs out of its time box still returns the pairs it finished
  tar -czf "$OUT/$name.tgz" results/h100/${name}_old results/h100/${name}_new
done
grep -hE "^  [A-Za-z0-9_.-]+/" "$OUT/step_ab.log" | tail -n 20
