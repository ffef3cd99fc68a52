"""The physical floor of a FORGE step: the arithmetic, from terms measured in the same process.

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
``gpu_measure.floor_terms`` measures the terms in a no_optimizer cell; the report
(``report/tables.py``) and the kernel benchmark use this arithmetic. No torch import: the report
does not load it.
"""
from __future__ import annotations

from typing import Mapping

QBLOCK = 64
STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}


def state_traffic_bytes(shapes: list[tuple[int, int]], weight_bytes: float, state_dtype: str,
                        n_states: int = 2) -> float:
    """Bytes the fused update must read and write for these weights (W and its moments)."""
    if state_dtype not in STATE_BYTES:
        raise ValueError(f"state_dtype {state_dtype!r} is not one of {sorted(STATE_BYTES)}")
    per_state = 2 * STATE_BYTES[state_dtype] + (2 * 4.0 / QBLOCK if state_dtype == "int8" else 0.0)
    per_element = 2 * weight_bytes + n_states * per_state
    return float(sum(dout * din for dout, din in shapes)) * per_element


def floor_ms(no_optimizer_step_ms: float, terms: Mapping, state_dtype: str) -> float:
    """The floor of a FORGE step with ``state_dtype`` states, from a no_optimizer step time and
    ``gpu_measure.floor_terms`` measured in the same run."""
    wgrad = float(terms["wgrad_ms"])
    traffic = float(terms["traffic_ms"][state_dtype])
    return no_optimizer_step_ms - wgrad + max(wgrad, traffic)


def copy_dynamic_j_per_byte(copy_j_per_byte: float, copy_w: float, idle_w: float) -> float:
    """The copy's joules above idle power, per byte, from its own window. Not through
    ``copy_bytes_per_s``: the energy window's copy, replayed in a CUDA graph, runs at ~2.4 TB/s on
    the H100 (copy W / copy J per byte) against do_bench's 3.0, so do_bench's rate is not the rate
    its joules are spent at."""
    return copy_j_per_byte * (1.0 - idle_w / copy_w)


def power_floor_ms(no_optimizer_step_ms: float, no_optimizer_power_w: float | None, terms: Mapping,
                   state_dtype: str) -> float | None:
    """The floor at the board's power limit (module docstring): the larger of ``floor_ms`` and the
    time the step's dynamic energy needs at (limit - idle) watts; None where the run measured no
    energy (a board without the counter, or rows without energy terms)."""
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
