"""Do the fused update's tile-shaped state accesses cost more DRAM joules per byte than a stream?

Why: at 512 tokens every FORGE step runs at the board's 700 W limit, so its time is its energy, and
on the H100 the bf16 step sits 6-10% above its power floor, whose state traffic is priced at the
joules per byte of a contiguous copy. The fused kernels read and write W and the moments in 2-D
slabs (e.g. 64x64 bf16: 64 rows of 128 B, 8 KB apart), which open more DRAM pages per byte than a
stream does. If that costs joules, the optimizer's private states could be stored tile-major.

The same elementwise read-modify-write of three bf16 (R, C) arrays (an AdamW-like pass: W, m, v,
705 MB at the gate shape) in programs of 4096 elements shaped SRxSC, row-major over the tiles;
1x4096 is a stream of whole rows. Arms interleaved over rounds, each a CUDA graph of ``--calls``
passes, timed with CUDA events and NVML's energy counter. One JSON line per arm and round:

    python3 scripts/dram_locality_bench.py --out $OUT/locality.jsonl [--rounds 4] [--shape 14336x4096]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_bench.kernel_bench import measure_graph  # noqa: E402
from forge_bench.telemetry import open_energy_counter  # noqa: E402

SLABS = ((64, 64), (32, 128), (16, 256), (8, 512), (4, 1024), (1, 4096))


@triton.jit
def _slab_update(W, M, V, R, C, SR: tl.constexpr, SC: tl.constexpr):
    tiles_per_row = C // SC
    pid = tl.program_id(0)
    rows = (pid // tiles_per_row) * SR + tl.arange(0, SR)
    cols = (pid % tiles_per_row) * SC + tl.arange(0, SC)
    offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
    w = tl.load(W + offsets).to(tl.float32)
    m = tl.load(M + offsets).to(tl.float32)
    v = tl.load(V + offsets).to(tl.float32)
    m = 0.9 * m + 0.1 * w
    v = 0.99 * v + 0.01 * w * w
    w = w - 1e-4 * m / (tl.sqrt(v) + 1e-8)
    tl.store(W + offsets, w.to(tl.bfloat16))
    tl.store(M + offsets, m.to(tl.bfloat16))
    tl.store(V + offsets, v.to(tl.bfloat16))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="14336x4096", help="RxC of each bf16 array (C a multiple of 4096)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=8, help="passes per graph replay")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("dram_locality_bench: needs a CUDA GPU")
    rows, cols = (int(v) for v in args.shape.lower().split("x"))
    if cols % 4096 or rows % 64:
        raise SystemExit(f"dram_locality_bench: --shape {args.shape}: C must be a multiple of 4096 and R of 64")
    arrays = [(torch.rand(rows, cols, device="cuda") * 1e-2).to(torch.bfloat16) for _ in range(3)]
    arrays[2].abs_()
    counter, why = open_energy_counter()
    if counter is None:
        print(why, file=sys.stderr)
    traffic = 2 * 3 * rows * cols * 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict]] = {}
    with args.out.open("a") as sink:
        for round_ in range(args.rounds):
            for sr, sc in SLABS:
                def call(_, sr=sr, sc=sc):
                    _slab_update[(rows // sr * (cols // sc),)](*arrays, rows, cols, SR=sr, SC=sc, num_warps=4)
                result = measure_graph(call, list(range(args.calls)), counter)
                record = dict(slab=f"{sr}x{sc}", round=round_, shape=args.shape, traffic_bytes=traffic,
                              ms=result["ms"], j=result.get("j"), w=result.get("w"),
                              gbps=traffic / result["ms"] / 1e6, device=torch.cuda.get_device_name(0))
                sink.write(json.dumps(record) + "\n")
                records.setdefault(record["slab"], []).append(record)
    print(f"{'slab':>8} {'ms':>8} {'GB/s':>8} {'mJ':>8} {'pJ/B':>7}")
    for slab, recs in records.items():
        ms = statistics.median(r["ms"] for r in recs)
        joules = [r["j"] for r in recs if r["j"] is not None]
        j = statistics.median(joules) if joules else float("nan")
        print(f"{slab:>8} {ms:8.3f} {traffic / ms / 1e6:8.0f} {j * 1e3:8.1f} {j / traffic * 1e12:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
