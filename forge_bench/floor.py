"""The physical floor of a FORGE step, measured in the same process as the cells it judges.

    floor = no_optimizer step - cuBLAS wgrad time + max(cuBLAS wgrad time, state bytes / copy bandwidth)

The no_optimizer step already contains a cuBLAS ``dY^T X`` per Linear (autograd computes the
weight gradient even with no optimizer), which FORGE replaces by one kernel that does the same
GEMM and streams W and its optimizer state once. That kernel can be no faster than the larger
of its GEMM and its state traffic, so the step can be no faster than the floor above.

State bytes (per fused weight element, read + written): W (2 x weight bytes) and each moment
(2 x state bytes), plus for int8 the fp32 scale of each 64-element block (2 x 4/64 per state).
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

import torch
from torch import nn

QBLOCK = 64
STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}


def fused_linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(Dout, Din) of every nn.Linear whose weight is trainable and appears once in the model.

    Tied or shared weights are stepped by the fallback optimizer, not the fused kernel, so they
    belong to neither the wgrad term nor the state traffic."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    shapes = []
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad and uses[id(module.weight)] == 1:
            shapes.append((module.out_features, module.in_features))
    return shapes


def state_traffic_bytes(shapes: list[tuple[int, int]], weight_bytes: float, state_dtype: str,
                        n_states: int = 2) -> float:
    """Bytes the fused update must read and write for these weights (W and its moments)."""
    if state_dtype not in STATE_BYTES:
        raise ValueError(f"state_dtype {state_dtype!r} is not one of {sorted(STATE_BYTES)}")
    per_state = 2 * STATE_BYTES[state_dtype] + (2 * 4.0 / QBLOCK if state_dtype == "int8" else 0.0)
    per_element = 2 * weight_bytes + n_states * per_state
    return float(sum(dout * din for dout, din in shapes)) * per_element


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, bytes read + written per second (median of do_bench)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def measure_wgrad_ms(shapes: list[tuple[int, int]], tokens: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[float, dict[str, float]]:
    """Sum over ``shapes`` of the cuBLAS time of ``dY^T X`` at ``tokens`` rows (each unique shape
    timed once, median of do_bench, random data), and the per-shape times."""
    from triton.testing import do_bench

    per_shape: dict[str, float] = {}
    total = 0.0
    for (dout, din), count in Counter(shapes).items():
        dy = torch.randn(tokens, dout, dtype=dtype, device=device)
        x = torch.randn(tokens, din, dtype=dtype, device=device)
        ms = do_bench(lambda: dy.t() @ x, warmup=10, rep=50, return_mode="median")
        per_shape[f"{dout}x{din}"] = ms
        total += ms * count
        del dy, x
    return total, per_shape


def floor_terms(model: nn.Module, tokens: int, dtype: torch.dtype, device: torch.device,
                state_dtypes: tuple[str, ...] = ("fp32", "bf16", "int8")) -> dict:
    """What the floor formula needs, measured now on ``device``: the wgrad time, the copy
    bandwidth and the state bytes per state dtype. JSON-ready."""
    shapes = fused_linear_shapes(model)
    weight_bytes = torch.finfo(dtype).bits / 8
    wgrad_ms, per_shape = measure_wgrad_ms(shapes, tokens, dtype, device)
    bandwidth = measure_copy_bandwidth(device)
    traffic = {sd: state_traffic_bytes(shapes, weight_bytes, sd) for sd in state_dtypes}
    return {
        "tokens": tokens,
        "n_fused_weights": len(shapes),
        "fused_params": int(sum(a * b for a, b in shapes)),
        "wgrad_ms": wgrad_ms,
        "wgrad_ms_per_shape": per_shape,
        "copy_bytes_per_s": bandwidth,
        "state_bytes": traffic,
        "traffic_ms": {sd: b / bandwidth * 1e3 for sd, b in traffic.items()},
    }


def floor_ms(no_optimizer_step_ms: float, terms: Mapping, state_dtype: str) -> float:
    """The floor of a FORGE step with ``state_dtype`` states, from a no_optimizer step time and
    ``floor_terms`` measured in the same run."""
    wgrad = float(terms["wgrad_ms"])
    traffic = float(terms["traffic_ms"][state_dtype])
    return no_optimizer_step_ms - wgrad + max(wgrad, traffic)
