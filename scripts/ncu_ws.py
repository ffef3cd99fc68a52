"""One Llama-8B-shape AdamW update (bf16 or int8 states) by the warp-specialized Gluon kernel or by
the Triton kernel, launched a few times, for Nsight Compute:

    ncu --set full --clock-control none -k regex:_ws_fused --launch-skip 2 --launch-count 1 \
        python3 scripts/ncu_ws.py gate 512 ws '{"slab_m": 32, "slab_n": 64, "state_stages": 4}' [int8]
    ncu ... -k regex:_fused_wgrad ... python3 scripts/ncu_ws.py gate 512 triton '{}' [int8]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from forge_core.kernels import hopper_ws  # noqa: E402
from ws_bench import _inputs, _triton_call, _ws_call  # noqa: E402
from forge_bench.kernel_bench import LLAMA_8B_SHAPES  # noqa: E402


def main() -> int:
    name, tokens, arm = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = hopper_ws.WsConfig(**json.loads(sys.argv[4])) if len(sys.argv) > 4 else hopper_ws.DEFAULT_CONFIG
    state_dtype = sys.argv[5] if len(sys.argv) > 5 else "bf16"
    dout, din = LLAMA_8B_SHAPES[name]
    inputs = _inputs(dout, din, tokens, torch.device("cuda"), state_dtype=state_dtype)
    for _ in range(5):
        _ws_call(inputs, config) if arm == "ws" else _triton_call(inputs)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
