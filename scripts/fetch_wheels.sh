#!/usr/bin/env bash
# Download, for the GPU machine's Python (CPython 3.12, manylinux x86_64, no internet there),
# every peer package (forge_bench/peers.py) and each dependency that machine lacks, plus pydantic (the
# harness needs it), into the git-ignored folder .whl/ . Then check every wheel's
# Requires-Dist against what the GPU image already has, print the total size against the
# 64 MiB carry limit, and print the install line a GPU command must start with.
#
# Never fetched: torch, triton, nvidia-* (the GPU keeps its own CUDA 13 build).
#
# Usage: bash scripts/fetch_wheels.sh [--slim-bitsandbytes]
#   --slim-bitsandbytes  repack the bitsandbytes wheel with only its CPU and CUDA 13.x
#                        libraries (43 MB -> about 5 MB); use it when the carry is over 64 MiB.
# Environment: PYTHON (default python3) runs pip; WHEEL_DIR (default .whl).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
WHEEL_DIR="${WHEEL_DIR:-.whl}"
SLIM_BNB=0
for arg in "$@"; do
  case "$arg" in
    --slim-bitsandbytes) SLIM_BNB=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "fetch_wheels.sh: unknown argument '$arg' (known: --slim-bitsandbytes)" >&2; exit 2 ;;
  esac
done

# Pinned, each checked against torch 2.11 / triton 3.6 / transformers 5.17 (docs/peers.md says how).
PEERS=(
  "bitsandbytes==0.50.2"     # manylinux_2_24 wheel, ships libbitsandbytes_cuda130.so (torch cu130)
  "torchao==0.18.0"          # abi3 wheel; its C++ extensions are built for torch >= 2.11
  "torch-optimi==0.3.3"
  "galore-torch==1.0"
  "apollo-torch==1.0.3"
  "lomo-optim==0.1.1"
  "flashoptim==0.1.4"
)
# The harness's needs that the GPU image lacks: pydantic and its own requirements.
# typing-extensions is on the GPU, but pydantic 2.14 needs >= 4.16, so a known one travels too.
HARNESS=(
  "pydantic==2.14.3"
  "pydantic-core==2.50.4"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"
)

# Python packages the GPU image already holds (its installed-package list),
# normalised (lower case, '_' and '.' as '-').
GPU_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

LIMIT_BYTES=$((64 * 1024 * 1024))
PLATFORM_FLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$WHEEL_DIR"
if ! git check-ignore -q "$WHEEL_DIR/x.whl"; then
  echo "fetch_wheels.sh: $WHEEL_DIR is not git-ignored; add '/$WHEEL_DIR/' to .gitignore first" >&2
  exit 1
fi

# A slimmed bitsandbytes wheel keeps the original's name: fetch it afresh.
rm -f "$WHEEL_DIR"/bitsandbytes-*.whl
for spec in "${PEERS[@]}" "${HARNESS[@]}"; do
  name="${spec%%==*}"
  case "$name" in torch|triton|nvidia-*)
    echo "fetch_wheels.sh: refusing to fetch $name (the GPU keeps its own)" >&2; exit 1 ;;
  esac
  echo "== $spec"
  if ! out=$("$PYTHON" -m pip download -q "${PLATFORM_FLAGS[@]}" -d "$WHEEL_DIR" "$spec" 2>&1); then
    echo "$out" >&2
    echo "fetch_wheels.sh: pip could not download $spec for CPython 3.12 manylinux x86_64" >&2
    exit 1
  fi
done

# Keep one wheel per project (two versions of one name stop the whole install on the GPU).
"$PYTHON" - "$WHEEL_DIR" "${PEERS[@]}" "${HARNESS[@]}" <<'PY'
import re, sys
from pathlib import Path

wheel_dir, specs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
wanted = {norm(s.split("==")[0]): s.split("==")[1] for s in specs}
for whl in sorted(wheel_dir.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if norm(name) not in wanted:
        print(f"removing {whl.name}: not in the pinned list")
        whl.unlink()
    elif version != wanted[norm(name)]:
        print(f"removing {whl.name}: pinned {wanted[norm(name)]}")
        whl.unlink()
PY

if [[ "$SLIM_BNB" == 1 ]]; then
  "$PYTHON" - "$WHEEL_DIR" <<'PY'
# Drop the bitsandbytes native libraries the GPU cannot use (CUDA 11/12, ROCm, XPU), and their
# RECORD lines, so the wheel stays installable. The GPU's torch is cu130: keep cuda13x and cpu.
import re, sys, zipfile
from pathlib import Path

for whl in Path(sys.argv[1]).glob("bitsandbytes-*.whl"):
    keep = lambda n: not re.search(r"libbitsandbytes_(cuda1[0-2]\d|rocm\d+|xpu\d*)\.so$", n)
    tmp = whl.with_suffix(".slim")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if not keep(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [l for l in data.decode().splitlines() if keep(l.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)
    tmp.replace(whl)
    print(f"slimmed {whl.name}: {whl.stat().st_size / 2**20:.1f} MiB")
PY
fi

# Every requirement of every wheel must be on the GPU already or travel in $WHEEL_DIR.
"$PYTHON" - "$WHEEL_DIR" "$GPU_HAS" <<'PY'
import re, sys, zipfile
from pathlib import Path

norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
wheel_dir, gpu_has = Path(sys.argv[1]), {norm(n) for n in sys.argv[2].split()}
carried = {norm(w.name.split("-")[0]) for w in wheel_dir.glob("*.whl")}
missing = []
for whl in sorted(wheel_dir.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:") or "extra ==" in line:
                continue
            req = norm(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
            if req not in gpu_has and req not in carried:
                missing.append(f"{whl.name} needs {req}")
if missing:
    print("MISSING on the GPU and not fetched:\n  " + "\n  ".join(missing))
    sys.exit(1)
print("requirements: every Requires-Dist is on the GPU image or in", wheel_dir)
PY

echo
printf '%10s  %s\n' BYTES WHEEL
total=0
for whl in "$WHEEL_DIR"/*.whl; do
  size=$(stat -c %s "$whl"); total=$((total + size))
  printf '%10d  %s\n' "$size" "$(basename "$whl")"
done
tree_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
awk -v w="$total" -v t="$tree_bytes" 'BEGIN { printf "total wheels: %.1f MiB; tracked tree: %.1f MiB; carry limit: 64 MiB per GPU command\n", w / 1048576, t / 1048576 }'
if (( total + tree_bytes > LIMIT_BYTES )); then
  echo "WARNING: wheels + tree exceed the 64 MiB carry limit: rerun with --slim-bitsandbytes," \
       "or carry the bitsandbytes wheel in a second GPU command (docs/peers.md)" >&2
fi
echo
echo "GPU command prefix (carry: .whl):"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEEL_DIR/*.whl && export PYTHONPATH=/tmp/site:\${PYTHONPATH:-} || exit;"
