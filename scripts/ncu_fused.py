"""One Llama-8B-shape fused update, launched a few times with a pinned tile config, for Nsight Compute:

    ncu --set full -k regex:_fused_wgrad --launch-skip 3 --launch-count 1 \
        python3 scripts/ncu_fused.py q 512 int8 [64x64x32/w4/s6/r128]

The tile is the pinned BT-512 tile (``kernel_variants.winner``) unless a config spec
(``kernel_variants.parse_config``) is given.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from forge_core.kernels import fused_wgrad_update  # noqa: E402
from forge_core.rules import get_rule  # noqa: E402
from forge_core.state import ParamState  # noqa: E402
from gpu_kernel_check import SWEEP_SHAPES  # noqa: E402
from kernel_variants import parse_config, winner  # noqa: E402

HP = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def main() -> int:
    name, tokens, state_dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dout, din = SWEEP_SHAPES[name]
    config = parse_config(sys.argv[4]) if len(sys.argv) > 4 else winner(state_dtype)
    w = (torch.randn(dout, din, device="cuda") * 0.02).bfloat16()
    state = ParamState(w, get_rule("adamw"), state_dtype)
    state.store("exp_avg", torch.randn(dout, din, device="cuda") * 1e-4)
    state.store("exp_avg_sq", torch.rand(dout, din, device="cuda") * 1e-6)
    x = torch.randn(tokens, din, device="cuda").bfloat16()
    dy = (torch.randn(tokens, dout, device="cuda") * 0.01).bfloat16()
    for step in range(1, 6):
        fused_wgrad_update(x, dy, w, state, HP, step, config=config)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
