"""What one GaLore projection refresh costs on Llama-3.1-8B: a full ``torch.linalg.svd`` (what
galore-torch runs on step 0 and every ``update_proj_gap`` steps) vs ``torch.svd_lowrank`` (the
``galore_adamw_rsvd`` arm), per projected weight shape, on fp32 Gaussian matrices of that shape.

    python scripts/galore_svd_cost.py OUT.json [--budget-s 240]

Each shape is timed once (CUDA synchronised wall clock) after a small warm-up SVD; shapes run from
the smallest up and stop when the budget is spent (the rest are reported as not measured).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

# (name, rows, cols, matrices per model) for the 32 layers of Llama-3.1-8B
SHAPES = (("k_proj/v_proj", 1024, 4096, 64), ("q_proj/o_proj", 4096, 4096, 64),
          ("gate_proj/up_proj", 14336, 4096, 64), ("down_proj", 4096, 14336, 32))
RANK = 128


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.linalg.svd(torch.randn(256, 256, device="cuda"), full_matrices=False)   # library load
    torch.svd_lowrank(torch.randn(256, 256, device="cuda"), q=16, niter=2)
    began = time.perf_counter()
    rows = []
    for name, m, n, count in SHAPES:
        matrix = torch.randn(m, n, device="cuda")
        low = _seconds(lambda: torch.svd_lowrank(matrix, q=RANK + 10, niter=2))
        full = None
        if time.perf_counter() - began < args.budget_s:
            full = _seconds(lambda: torch.linalg.svd(matrix, full_matrices=False))
        rows.append({"shape": name, "rows": m, "cols": n, "per_model": count, "full_svd_s": full,
                     "svd_lowrank_s": low})
        print(rows[-1], flush=True)
    measured = [r for r in rows if r["full_svd_s"] is not None]
    measured_part = sum(r["full_svd_s"] * r["per_model"] for r in measured)
    summary = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rank": RANK, "shapes": rows,
        "full_svd_per_refresh_s": measured_part if len(measured) == len(rows) else None,
        "full_svd_measured_part_s": measured_part,
        "svd_lowrank_per_refresh_s": sum(r["svd_lowrank_s"] * r["per_model"] for r in rows),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "shapes"}), flush=True)
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
