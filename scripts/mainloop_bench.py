"""Time the fused kernel's main loop alone (G = dY^T X in registers, no epilogue), with the
pointer loads the kernel uses (cp.async pipeline) and with TMA tensor descriptors, per tile shape:
to see whether the main loop at BT 512 is bound by its L2 re-reads (time falls with 1/BM + 1/BN)
or by how its loads are issued (TMA faster at the same tile), before changing the kernel.

    python3 scripts/mainloop_bench.py --out $OUT gate:512 gate:4096 q:512

Each program stores one float (its tile's sum) so the compiler keeps the loop. Records (one JSON
line per tile, loader and shape) go to OUT/mainloop.jsonl: ms (median of triton.testing.do_bench),
TFLOP/s and the L2 -> SM bytes the tile re-reads, per second. ``--energy``: also joules per launch,
board power and SM clock over ~0.5 s of graph replays (``forge_bench.kernel_bench.measure_graph``),
to split the fused kernel's joules into main loop and epilogue (``kernel_variants.py --energy``
gives the whole kernel and its epilogue alone).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from forge_core.kernels.fused import grouped_tile  # noqa: E402
from gpu_kernel_check import SWEEP_SHAPES  # noqa: E402

# (BM, BN, BK, warps, stages): the tuner's BT-512 tiles and the large ones of BT >= 2048
TILES = ((64, 64, 32, 4, 6), (64, 128, 32, 8, 4), (64, 128, 64, 8, 4), (128, 128, 32, 8, 6),
         (128, 128, 64, 8, 4), (128, 256, 64, 8, 3))


@triton.jit
def _mainloop_kernel(X, DY, x_desc, dy_desc, OUT, M, N, K, TMA: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BM, BN, GROUP)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        for k in range(0, K, BK):
            dy_tile = dy_desc.load([k, pid_m * BM])          # (BK, BM)
            x_tile = x_desc.load([k, pid_n * BN])            # (BK, BN)
            acc = tl.dot(dy_tile.T, x_tile, acc)
    else:
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        dy_ptrs = DY + offs_k[None, :] * M + offs_m[:, None]
        x_ptrs = X + offs_k[:, None] * N + offs_n[None, :]
        for _ in range(0, tl.cdiv(K, BK)):
            acc = tl.dot(tl.load(dy_ptrs), tl.load(x_ptrs), acc)
            dy_ptrs += BK * M
            x_ptrs += BK * N
    tl.store(OUT + pid, tl.sum(acc))


def run(dout: int, din: int, tokens: int, tile: tuple[int, ...], tma: bool, counter=None) -> dict:
    bm, bn, bk, warps, stages = tile
    x = torch.randn(tokens, din, device="cuda").bfloat16()
    dy = torch.randn(tokens, dout, device="cuda").bfloat16()
    grid = (triton.cdiv(dout, bm) * triton.cdiv(din, bn),)
    out = torch.empty(grid[0], device="cuda")
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bk, bn])
    dy_desc = TensorDescriptor(dy, list(dy.shape), list(dy.stride()), [bk, bm])

    def launch() -> None:
        _mainloop_kernel[grid](x, dy, x_desc, dy_desc, out, dout, din, tokens, TMA=tma, BM=bm, BN=bn, BK=bk,
                               GROUP=8, num_warps=warps, num_stages=stages)

    launch()
    expected = (dy.float().T @ x.float()).reshape(triton.cdiv(dout, bm), bm, triton.cdiv(din, bn), bn)
    # loose: only to catch a wrong loop, the sums are over 4096-32768 fp32 products
    reference_sums = expected.sum(dim=(1, 3))
    ms = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
    flops = 2.0 * dout * din * tokens
    l2_bytes = tokens * 2.0 * (dout * din / bm + dout * din / bn)
    energy = {}
    if counter is not None:
        from forge_bench.kernel_bench import measure_graph
        measured = measure_graph(lambda _: launch(), [None], counter)     # keeps its time if NVML fails
        energy = {{"ms": "graph_ms", "j": "j_per_call"}.get(k, k): v for k, v in measured.items()}
    return dict(kind="mainloop", dout=dout, din=din, tokens=tokens, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages,
                tma=tma, ms=ms, tflops=flops / ms / 1e9, l2_tb_per_s=l2_bytes / ms / 1e9,
                sums_close=bool(torch.allclose(out.sort().values, reference_sums.flatten().sort().values,
                                               rtol=1e-2, atol=1.0)), **energy)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--energy", action="store_true", help="also joules per launch (NVML energy counter)")
    parser.add_argument("cases", nargs="+", metavar="SHAPE:BT")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counter = None
    if args.energy:
        from forge_bench.telemetry import open_energy_counter
        counter, why_not = open_energy_counter(torch.cuda.current_device())
        if counter is None:
            raise SystemExit(f"mainloop_bench: --energy: {why_not}")
    with open(out / "mainloop.jsonl", "a") as handle:
        for case in args.cases:
            name, tokens = case.split(":")
            dout, din = SWEEP_SHAPES[name]
            for tile in TILES:
                for tma in (False, True):
                    try:
                        record = run(dout, din, int(tokens), tile, tma, counter)
                    except Exception as error:  # noqa: BLE001 - a tile that cannot compile: say so, go on
                        record = dict(kind="mainloop", shape=case, tile=list(tile), tma=tma,
                                      error=f"{type(error).__name__}: {str(error)[:300]}")
                    print(json.dumps(record), flush=True)
                    handle.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
