"""Time the tuner's BT-512 winners (64x128, 8 warps, two slabs, prefetch, 128 registers; BK 32 for
int8 states, 64 for bf16) from one source tree, with gpu_kernel_check's correctness check: the short
old-vs-new kernel A/B when there is no time for the full sweep (`scripts/kernel_ab.sh`).

    python3 TREE/scripts/kernel_winners_ab.py --out DIR q:512:int8 q:512:bf16
(run it once from the old tree, once from the new, alternating, in one boot)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpu_kernel_check as check  # noqa: E402
from forge_core.kernels.fused import TileConfig  # noqa: E402


def winner(state_dtype: str) -> TileConfig:
    return TileConfig(64, 128, 32 if state_dtype == "int8" else 64, 8, 8, 4, prefetch=True, split_n=2,
                      max_registers=128)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", metavar="SHAPE:BT:STATES")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from forge_bench.floor import measure_copy_bandwidth
    check.BANDWIDTH.append(measure_copy_bandwidth(torch.device("cuda")))
    for case in args.cases:
        name, tokens, state_dtype = case.split(":")
        dout, din = check.SWEEP_SHAPES[name]
        check.guarded(out, check.sweep_configs, dout, din, int(tokens), state_dtype, [winner(state_dtype)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
