"""The physical floor of a FORGE step, measured in the same process as the cells it judges.

    floor = no_optimizer step - cuBLAS wgrad time + max(cuBLAS wgrad time, state bytes / copy bandwidth)

The no_optimizer step already contains a cuBLAS ``dY^T X`` per Linear (autograd computes the
weight gradient even with no optimizer), which FORGE replaces by one kernel that does the same
GEMM and streams W and its optimizer state once. That kernel can be no faster than the larger
of its GEMM and its state traffic, so the step can be no faster than the floor above.

State bytes (per fused weight element, read + written): W (2 x weight bytes) and each moment
(2 x state bytes), plus for int8 the fp32 scale of each 64-element block (2 x 4/64 per state).

The formula assumes the board can stream the state bytes at the copy rate while the rest of the
step runs at full clock. On an H100 the Llama-8B step already draws the board's power limit
(700 W) without an optimizer, so every extra joule costs time. ``power_floor_ms`` is that floor's
energy counterpart (an estimate, not a bound: it holds the idle board's power fixed, where the
static power moves with clock and temperature):

    power floor = (no_optimizer's dynamic energy + the state traffic's dynamic energy
                   - the gradient write's) / (power limit - idle power)

where a byte's dynamic energy is the copy's joules per byte times (1 - idle power / copy power).
``floor_terms`` measures the copy's joules per byte and power, the idle power right after it
(clocks still up) and the limit when NVML has an energy counter.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

if TYPE_CHECKING:
    from .telemetry import EnergyCounter

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


def copy_energy(device: torch.device, counter: "EnergyCounter", nbytes: int = 1 << 30) -> dict[str, float]:
    """Joules per byte read + written by a device-to-device copy over ~0.5 s of graph replays, and
    the idle board's power measured just before (clocks still up from the copy bandwidth run)."""
    import time

    from .kernel_bench import measure_graph     # here: kernel_bench imports this module

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    started_j, started_s = counter.read_j(), time.perf_counter()
    time.sleep(0.5)
    idle_w = (counter.read_j() - started_j) / (time.perf_counter() - started_s)
    copied = measure_graph(lambda _: dst.copy_(src), [None], counter)
    del src, dst
    return {"copy_j_per_byte": copied["j"] / (2 * nbytes), "copy_w": copied["w"],
            "copy_sm_mhz": copied["sm_mhz"], "idle_w": idle_w,
            "copy_graph_bytes_per_s": 2 * nbytes / (copied["ms"] * 1e-3)}


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
        **energy_terms(device),
        "grad_bytes": float(sum(dout * din for dout, din in shapes)) * weight_bytes,
        "tokens": tokens,
        "n_fused_weights": len(shapes),
        "fused_params": int(sum(a * b for a, b in shapes)),
        "wgrad_ms": wgrad_ms,
        "wgrad_ms_per_shape": per_shape,
        "copy_bytes_per_s": bandwidth,
        "state_bytes": traffic,
        "traffic_ms": {sd: b / bandwidth * 1e3 for sd, b in traffic.items()},
    }


def energy_terms(device: torch.device) -> dict:
    """The power floor's terms (copy joules per byte, idle power, power limit), or the reason they
    are missing: the time floor never depends on them."""
    from .telemetry import open_energy_counter

    counter, why_not = open_energy_counter(device.index if device.index is not None else torch.cuda.current_device())
    if counter is None:
        return {"energy_reason": why_not}
    try:
        terms = copy_energy(device, counter)
        terms["power_limit_w"] = counter.power_limit_w()
    except Exception as exc:       # a counter that stops answering: keep the time floor's terms
        return {"energy_reason": f"copy energy not measured: {type(exc).__name__}: {exc}"[:300]}
    finally:
        counter.close()
    return terms


def floor_ms(no_optimizer_step_ms: float, terms: Mapping, state_dtype: str) -> float:
    """The floor of a FORGE step with ``state_dtype`` states, from a no_optimizer step time and
    ``floor_terms`` measured in the same run."""
    wgrad = float(terms["wgrad_ms"])
    traffic = float(terms["traffic_ms"][state_dtype])
    return no_optimizer_step_ms - wgrad + max(wgrad, traffic)


def copy_dynamic_j_per_byte(copy_j_per_byte: float, copy_w: float, idle_w: float) -> float:
    """The copy's joules above idle power, per byte, from its own window. Not through
    ``copy_bytes_per_s``: the energy window's copy, replayed in a CUDA graph, ran at ~2.4 TB/s on
    the H100 (copy W / copy J per byte) against do_bench's 3.0, so do_bench's rate is not the rate
    its joules were spent at. Why the graph's copy is slower was not measured."""
    return copy_j_per_byte * (1.0 - idle_w / copy_w)


def power_floor_ms(no_optimizer_step_ms: float, no_optimizer_power_w: float | None, terms: Mapping,
                   state_dtype: str) -> float | None:
    """The floor at the board's power limit (module docstring): the larger of ``floor_ms`` and the
    time the step's dynamic energy needs at (limit - idle) watts; None where the run measured no
    energy (an older run, a board without the counter)."""
    needed = ("copy_j_per_byte", "copy_w", "idle_w", "power_limit_w", "grad_bytes")
    if no_optimizer_power_w is None or any(terms.get(k) is None for k in needed):
        return None
    idle_w, limit_w, copy_w = float(terms["idle_w"]), float(terms["power_limit_w"]), float(terms["copy_w"])
    if limit_w <= idle_w or copy_w <= idle_w:
        return None
    dynamic_j_per_byte = copy_dynamic_j_per_byte(float(terms["copy_j_per_byte"]), copy_w, idle_w)
    extra_bytes = float(terms["state_bytes"][state_dtype]) - float(terms["grad_bytes"])
    no_optimizer_dynamic_j = (float(no_optimizer_power_w) - idle_w) * no_optimizer_step_ms * 1e-3
    energy_ms = (no_optimizer_dynamic_j + extra_bytes * dynamic_j_per_byte) / (limit_w - idle_w) * 1e3
    return max(floor_ms(no_optimizer_step_ms, terms, state_dtype), energy_ms)
