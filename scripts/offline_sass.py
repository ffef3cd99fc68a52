"""Compile the fused kernel for sm_90 on a machine without a GPU and count its epilogue's instructions.

Why: at the H100's 700 W cap every instruction of the epilogue costs step time, and device time is
scarce; this counts them per weight element on the CPU machine (the local Triton's ptxas and
nvdisasm), so an instruction diet can be predicted before a GPU run measures it.

Use the device's Triton: `make offline-triton` puts triton==3.6.0 (the H100 machine's) in
`.offline-triton/`, and `PYTHONPATH=.offline-triton python scripts/offline_sass.py ...` compiles with it.
The versions disagree where it matters: the int8 64x64x32/w4/s6/r128 tile is spill-free at 128
registers with 3.6, as on the H100, and spills 32 B with 3.9. The first line printed names the Triton
that compiled the kernel. Compare trees with the same one.

    python scripts/offline_sass.py --shape 14336x4096 --tokens 512 --state int8 \
        --tile 64x64x32 --warps 4 --stages 6 --maxnreg 128 --prefetch --tma [--sass-out FILE]

The epilogue is everything after the last warpgroup MMA wait up to EXIT; its opcodes are counted and
divided by the weight elements one thread updates (BM * BN / threads).
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import torch


def _compile(args: argparse.Namespace):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from forge_core.kernels import launch
    from forge_core.kernels.offline_compile import compile_for_gpu
    from forge_core.kernels.tile_config import TileConfig
    from forge_core.kernels.tile_kernel import fused_wgrad_update_kernel
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    m, n = (int(v) for v in args.shape.lower().split("x"))
    bm, bn, bk = (int(v) for v in args.tile.lower().split("x"))
    rule = get_rule(args.rule)
    weight = torch.empty((m, n), dtype=torch.bfloat16)
    state = ParamState(weight[:1, :1], rule, args.state)        # only dtypes / kinds are read below
    storage = torch.uint8 if args.state == "fp8" else None       # fp8 codes reach the kernels as uint8
    states = [torch.empty((m, n), dtype=storage or state.values[name].dtype) for name in state.state_names]
    scales = [torch.empty((m, (n + 63) // 64), dtype=torch.float32) if args.state in ("int8", "fp8") else None
              for _ in state.state_names]
    x2 = torch.empty((args.tokens, n), dtype=torch.bfloat16)
    dy2 = torch.empty((args.tokens, m), dtype=torch.bfloat16)
    config = TileConfig(bm, bn, bk, args.group, args.warps, args.stages, prefetch=args.prefetch,
                        split_n=args.split, max_registers=args.maxnreg, tma=args.tma)
    meta = launch.kernel_meta(state, x2.dtype, grad_accum=False, stochastic=False, ieee=False,
                              scalars_in_memory=args.scalars_in_memory)
    sums = torch.empty(2, dtype=torch.float32) if rule.layer_sums else None
    plan = launch.make_plan(config, x2, dy2, weight, states, scales, None, meta, sums)
    kwargs = dict(plan.kwargs, TMA=args.tma)        # the plan says no TMA: its tensors are not on a GPU
    descriptors = ((TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [bk, bn]),
                    TensorDescriptor(dy2, list(dy2.shape), list(dy2.stride()), [bk, bm])) if args.tma else (None, None))
    scalars = (torch.empty(launch.NUM_SCALARS, dtype=torch.float32) if args.scalars_in_memory
               else (0.5,) * launch.NUM_SCALARS)
    call = (x2, dy2, *descriptors, *launch.kernel_args(plan, x2, dy2, scalars, 1))

    overrides = {} if args.fp_fusion is None else {"enable_fp_fusion": args.fp_fusion}
    compiled = compile_for_gpu(fused_wgrad_update_kernel, call, kwargs, 90, **overrides)
    threads = 32 * args.warps
    return compiled, bm * bn // threads


def _nvidia_tool(name: str, cubin: bytes, *flags: str) -> str:
    import triton
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([str(tool), *flags, handle.name], check=True, capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, spill stores in bytes) of the kernel, as cuobjdump reports them."""
    usage = _nvidia_tool("cuobjdump", cubin, "--dump-resource-usage")
    registers = re.search(r"REG:(\d+)", usage)
    spills = re.search(r"STACK:(\d+)", usage)
    return int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else -1


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def epilogue_opcodes(sass: str) -> collections.Counter:
    """Opcodes (base name, before the first dot) after the last WGMMA wait / HGMMA up to the last EXIT."""
    ops = [match.group(2) for match in map(_INSTRUCTION.search, sass.splitlines()) if match]
    last_mma = max((i for i, op in enumerate(ops) if op.startswith(("HGMMA", "WARPGROUP.DEPBAR", "WARPSYNC"))
                    or op == "HMMA" or op.startswith("HMMA.")), default=-1)
    tail = [op.split(".")[0] for op in ops[last_mma + 1:]]
    return collections.Counter(op for op in tail if op not in ("NOP", "BRA"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="14336x4096", help="weight (Dout)x(Din)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--state", choices=("fp32", "bf16", "int8", "fp8"), default="int8")
    parser.add_argument("--rule", default="adamw")
    parser.add_argument("--tile", default="64x64x32", help="BMxBNxBK")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--maxnreg", type=int, default=None)
    parser.add_argument("--prefetch", action="store_true")
    parser.add_argument("--tma", action="store_true")
    parser.add_argument("--scalars-in-memory", action="store_true", help="the capturable (graph) launch")
    parser.add_argument("--fp-fusion", type=lambda v: v.lower() in ("1", "true", "yes"), default=None,
                        help="force Triton's enable_fp_fusion option (default: Triton's default)")
    parser.add_argument("--sass-out", type=pathlib.Path, default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ws", metavar="CONFIGS_JSON", default=None,
                        help="compile the warp-specialized Gluon kernel (forge_core/kernels/hopper_ws.py) instead, "
                             "for each WsConfig field dict of this JSON list; print one JSON line per config "
                             "(registers, stack bytes, shared bytes) and exit")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("offline_sass: unset TRITON_INTERPRET (under the interpreter there is no compiled kernel)")
    if args.ws is not None:
        return _ws_resources(args)
    compiled, per_thread = _compile(args)
    sass = _nvidia_tool("nvdisasm", compiled.asm["cubin"], "-c")
    registers, stack = resource_usage(compiled.asm["cubin"])
    if args.sass_out:
        args.sass_out.write_text(sass)
        args.sass_out.with_suffix(".ttgir").write_text(compiled.asm["ttgir"])
    counts = epilogue_opcodes(sass)
    total = sum(counts.values())
    import triton
    print(f"compiled by Triton {triton.__version__} ({pathlib.Path(triton.__file__).parent})")
    print(f"registers {registers}, stack {stack} B, epilogue {total} instructions per thread, "
          f"{total / per_thread:.1f} per weight element ({per_thread} elements per thread)")
    for op, count in counts.most_common(args.top):
        print(f"  {op:10s} {count:6d}  {count / per_thread:6.2f}")
    return 0


def _ws_resources(args: argparse.Namespace) -> int:
    """Registers, spills and shared memory of the Gluon kernel per config (``--state`` bf16 or int8, ``--rule``);
    with ``--sass-out DIR/NAME.sass``, each config's SASS as ``NAME.<index>.sass``."""
    import dataclasses
    import json

    from forge_core.kernels import hopper_ws
    from forge_core.rules import get_rule

    m, n = (int(v) for v in args.shape.lower().split("x"))
    rule = get_rule(args.rule)
    for index, fields in enumerate(json.loads(args.ws)):
        config = hopper_ws.WsConfig(**fields)
        compiled = hopper_ws.compile_offline(m, n, args.tokens, config, rule.epilogue, len(rule.state_names),
                                             int8=args.state == "int8")
        registers, stack = resource_usage(compiled.asm["cubin"])
        if args.sass_out:
            path = args.sass_out.with_name(f"{args.sass_out.stem}.{index}{args.sass_out.suffix}")
            path.write_text(_nvidia_tool("nvdisasm", compiled.asm["cubin"], "-c"))
        print(json.dumps(dict(config=dataclasses.asdict(config), rule=rule.name, state=args.state,
                              registers=registers, stack=stack,
                              shared=compiled.metadata.shared,
                              estimate=config.shared_memory_bytes(1 if args.state == "int8" else 2))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
