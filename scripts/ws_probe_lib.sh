# Shared by the scripts/ws_*_probe.sh device calls (source it from the repo root on the GPU machine):
#   ws_probe_start COMMIT TUNE_CACHE   # carried wheels, GPU line in $OUT/gpu.txt, the Triton tiles from
#                                      # TUNE_CACHE (a copy: the probe adds its choices to it), the clock
#   progress NAME RC                   # "NAME rc=RC t=<s since start>" to stdout and $OUT/progress.txt
#   config LIST INDEX [FIELDS_JSON]    # ws_choice.LIST[INDEX] as WsConfig JSON, FIELDS_JSON's fields changed
ws_probe_start() {
  source scripts/device_setup.sh "${1:-unknown}" || return 1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw,power.limit --format=csv > "$OUT/gpu.txt"
  cp "$2" /tmp/ws_probe_tune_cache.json
  export FORGE_TUNE_CACHE=/tmp/ws_probe_tune_cache.json
  WS_PROBE_T0=$(date +%s)
}
progress() { echo "$1 rc=$2 t=$(( $(date +%s) - WS_PROBE_T0 ))s" | tee -a "$OUT/progress.txt"; }
config() {
  python3 -c 'import dataclasses, json, sys
from forge_core.kernels import ws_choice
base = getattr(ws_choice, sys.argv[1])[int(sys.argv[2])]
print(json.dumps(dataclasses.asdict(dataclasses.replace(base, **json.loads(sys.argv[3] or "{}")))))' "$1" "$2" "${3-}"
}
