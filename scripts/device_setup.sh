# Source this on the GPU machine (repo root, `.whl` carried): installs the carried wheels
# (pydantic, the peer packages) into /tmp/site without touching torch/triton, and sets the
# environment forge-bench needs when the tree travels without .git.
#   source scripts/device_setup.sh <git-commit>
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_setup: wheel install failed" >&2; return 1; }
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FORGE_BENCH_GIT_COMMIT="${1:-unknown}"
fb() { python3 -m forge_bench.cli "$@"; }
# The C++ update hook (forge_core.native_hooks), built once before any cell needs it.
python3 -c "import forge_core.native_hooks as n; n.load() or print('device_setup: no C++ update hook:', n.problem())"
