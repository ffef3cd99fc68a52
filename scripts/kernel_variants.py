"""Check and time hand-picked tile configurations of the fused kernel on the GPU (the sweep of
``gpu_kernel_check.py --sweep`` on an explicit list): for trying occupancy / register-cap ideas
before they enter ``SHORTLIST``. Records go to OUT/check.jsonl like the sweep's.

    python3 scripts/kernel_variants.py --out $OUT q:512:int8 gate:512:int8 q:512:bf16

``--config SPEC`` (repeatable): explicit tile configs instead of the built-in variants (``parse_config``).

``--winners``: only the tuner's BT-512 winners (BK 32 for int8 states, 64 for bf16), the short
old-vs-new kernel A/B: run it from the old tree and from the new, alternating, in one boot.
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


def variants() -> list[TileConfig]:
    """The current BT-512 winner and occupancy variants around it (programs per SM in comments)."""
    return [
        TileConfig(64, 128, 64, 8, 8, 4, prefetch=True, split_n=2, max_registers=128),   # 2 (the winner)
        TileConfig(64, 128, 64, 8, 8, 3, prefetch=True, split_n=2, max_registers=128),   # 2, less shared
        TileConfig(64, 128, 64, 16, 8, 4, prefetch=True, split_n=2, max_registers=128),  # 2, group 16
        TileConfig(64, 128, 32, 8, 8, 4, prefetch=True, split_n=2, max_registers=128),   # 2, BK 32
        TileConfig(64, 64, 64, 8, 4, 3, prefetch=True, max_registers=128),               # 4 (48 KB shared)
        TileConfig(64, 64, 64, 8, 4, 2, prefetch=True, max_registers=128),               # 4 (32 KB)
        TileConfig(64, 64, 64, 8, 4, 4, prefetch=True, max_registers=168),               # 3 (64 KB)
        TileConfig(128, 64, 64, 8, 8, 3, prefetch=True, max_registers=128),              # 2, tall tile
        TileConfig(64, 128, 64, 8, 4, 3, prefetch=True, split_n=2),                      # 4 warps, wide
    ]


def winner(state_dtype: str) -> TileConfig:
    """The tile the A/B of ``--winners`` pins: the tuner's BT-512 choice up to 6e2de5c
    (results/kernels/h100/variants_aacade5). Since 6e2de5c the tuner may pick 64x64x32 on 4 warps,
    6 stages, instead (time it with ``--config 64x64x32/w4/s6/r128``)."""
    return TileConfig(64, 128, 32 if state_dtype == "int8" else 64, 8, 8, 4, prefetch=True, split_n=2,
                      max_registers=128)


def parse_config(spec: str) -> TileConfig:
    """``BMxBNxBK/wWARPS/sSTAGES[/spSPLIT][/gGROUP][/rMAXREG][/nopf][/ptr]``, e.g. ``64x128x32/w8/s5/sp2/r128``
    (group 8, prefetch on, TMA main loop, no register cap unless given; ``ptr``: pointer loads in
    the main loop): one tile configuration from the command line."""
    head, *options = spec.split("/")
    try:
        block_m, block_n, block_k = (int(x) for x in head.split("x"))
        fields = dict(group=8, num_warps=None, num_stages=None, prefetch=True, split_n=1, max_registers=None,
                      tma=True)
        for option in options:
            if option == "nopf":
                fields["prefetch"] = False
            elif option == "ptr":
                fields["tma"] = False
            elif option.startswith("sp"):
                fields["split_n"] = int(option[2:])
            else:
                key = {"w": "num_warps", "s": "num_stages", "g": "group", "r": "max_registers"}[option[0]]
                fields[key] = int(option[1:])
    except (ValueError, KeyError, IndexError):      # IndexError: an empty field, as in '64x64x32//w4'
        raise SystemExit(f"kernel_variants: cannot read tile config {spec!r} (e.g. 64x128x32/w8/s5/sp2/r128)") from None
    if fields["num_warps"] is None or fields["num_stages"] is None:
        raise SystemExit(f"kernel_variants: tile config {spec!r} needs /wWARPS and /sSTAGES")
    return TileConfig(block_m, block_n, block_k, fields["group"], fields["num_warps"], fields["num_stages"],
                      prefetch=fields["prefetch"], split_n=fields["split_n"], max_registers=fields["max_registers"],
                      tma=fields["tma"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--winners", action="store_true", help="only the pinned BT-512 tile per state dtype (winner())")
    parser.add_argument("--config", action="append", type=parse_config, metavar="SPEC", dest="configs",
                        help="an explicit tile config instead of the built-in variants (repeat it), e.g. 64x128x32/w8/s5/sp2/r128")
    parser.add_argument("--energy", action="store_true",
                        help="also joules per call, board power and SM clock per config (NVML energy counter)")
    parser.add_argument("cases", nargs="+", metavar="SHAPE:BT:STATES")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from forge_bench.floor import measure_copy_bandwidth
    check.BANDWIDTH.append(measure_copy_bandwidth(torch.device("cuda")))
    check.emit(out, dict(kind="copy_bandwidth", gbps=check.BANDWIDTH[0] / 1e9))
    if args.energy:
        from forge_bench.floor import copy_energy
        from forge_bench.telemetry import open_energy_counter
        counter, why_not = open_energy_counter(torch.cuda.current_device())
        if counter is None:
            raise SystemExit(f"kernel_variants: --energy: {why_not}")
        check.ENERGY.append(counter)
        check.emit(out, dict(kind="copy_energy", **copy_energy(torch.device("cuda"), counter)))
    for case in args.cases:
        name, tokens, state_dtype = case.split(":")
        dout, din = check.SWEEP_SHAPES[name]
        configs = [winner(state_dtype)] if args.winners else (args.configs or variants())
        check.guarded(out, check.sweep_configs, dout, din, int(tokens), state_dtype, configs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
