"""The passes over a layer's fp32 G of the factored second-moment rules (Adafactor, AdaLomo), in Triton.

Why: stepped in plain torch ops, Adafactor's update of a 2-D weight reads or writes its fp32 G
about ten times (two norms, the layer-sized estimate ``(r / mean(r)) c`` formed, clamped and
inverted, U multiplied into G, its norm, then W), and at Llama-3.1-8B, batch 1, that memory
traffic made the per-layer path slower than torch.optim.Adafactor on bf16 gradients
(results/h200/families_18546e3). Here the same arithmetic reads G three times and writes it never:

* ``square_sums``: every row's and every column's sum of G^2 (scaled: the rules want means), and
  the sum of W^2 for ``rms(W)``, one read of G and W (per-program partial sums, added in torch: the
  result does not depend on the launch's scheduling);
* ``update_square_sum``: the sum of U^2, U formed from G and the statistics (``Factors``), one read;
* ``apply_update``: ``W <- W decay + coef U``, one read of G and W, W written once in its own dtype.
  ``coef`` and ``decay`` are the family's scalar algebra (``StepScalars``), computed in the kernel
  from the two sums: no host sync (a CUDA graph can capture it) and no torch op per scalar.

Why so few torch ops: an eager step at batch 1 is host-bound, and each torch op or Triton launch per
weight costs the whole step its host time 225 times at Llama-3.1-8B (results/h200/families_da69182:
~30 ops a weight made the fused Adafactor step 0.82x torch's). The kernels launch through
``direct_launch.LaunchCache``: Triton's JIT once per shape, its compiled launcher after that.

Each rule file keeps the step's algebra (``matrix_step``) and its plain-torch ``reference``, which
this path is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .codec import store_tile
from .device import interpreting, runs_on_device_of
from .direct_launch import LaunchCache
from .launch import LAUNCH_PATHS

DECORATED_FOR_INTERPRETER = interpreting()
"""Whether these kernels were decorated for the CPU interpreter (``device.runs_on_device_of``)."""

ROWS, COLS = 32, 256
"""A program's tile; ``square_sums`` walks ``COLUMN_SPAN`` columns in tiles of COLS."""
COLUMN_SPAN = 2048


@dataclass(frozen=True)
class Factors:
    """How U is formed from G: ``a_i = r_i / max(mean, mean_floor)``, ``U = G / sqrt(max(a_i c_j,
    eps_sq))`` (Adafactor), or with ``scales``, ``U = G / sqrt(r_i / mean) / sqrt(c_j)`` (AdaLomo, whose
    tiny eps would make the product ``r_i c_j`` underflow where the two roots do not).
    ``row``: (R,) fp32, ``col``: (C,) fp32, ``row_mean``: a 0-d fp32 tensor on their device."""
    row: torch.Tensor
    row_mean: torch.Tensor
    col: torch.Tensor
    mean_floor: float = 0.0
    eps_sq: float = 0.0
    scales: bool = False


@dataclass(frozen=True)
class StepScalars:
    """The factored family's update of W from U, with n = R C::

        alpha = max(eps2, sqrt(sum W^2 / n)) rho
        coef  = -sign alpha / max(1, sqrt(sum U^2 / n) / d)
        decay = 1 - (alpha if decay_by_alpha else 1) decay_rate
        W    <- W decay + coef U

    ``rho``: a float, or a 0-d tensor on W's device (a capturable step's)."""
    rho: float | torch.Tensor
    eps2: float
    d: float
    sign: float = 1.0
    decay_rate: float = 0.0
    decay_by_alpha: bool = False


@dataclass(frozen=True)
class SquareSums:
    """``square_sums``' results: (R,) and (C,) fp32 vectors (``cols`` None when not asked for), and the
    0-d sum of W^2 (None without W)."""
    rows: torch.Tensor
    cols: torch.Tensor | None
    weight_squares: torch.Tensor | None


GRADIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What G may be stored in: the layer path forms it in fp32; a fallback parameter's (the embedding's)
is read in its own dtype, every op in fp32."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in plain Python (``triton.cdiv`` is a JIT function: about 4 us a host call)."""
    return -(-a // b)


def runs_here(grad: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether these kernels can take ``grad`` (a row-major matrix of ``GRADIENT_DTYPES`` on their
    device) and, when given, ``weight`` (a row-major matrix of G's shape: what ``apply_update``
    refuses otherwise)."""
    return (grad.dim() == 2 and grad.dtype in GRADIENT_DTYPES and grad.stride(1) == 1
            and runs_on_device_of(grad, DECORATED_FOR_INTERPRETER)
            and (weight is None or _takes_weight(weight, grad)))


def _takes_weight(weight: torch.Tensor, grad: torch.Tensor) -> bool:
    return weight.shape == grad.shape and weight.stride(1) == 1


@triton.jit
def _square_sums_kernel(G, W, ROW_PARTIAL, COL_PARTIAL, W_PARTIAL, R, C, stride_g, stride_w, row_scale, col_scale,
                        BR: tl.constexpr, BC: tl.constexpr, SPAN: tl.constexpr, WITH_W: tl.constexpr,
                        WITH_COLS: tl.constexpr):
    row_tile = tl.program_id(0)
    span = tl.program_id(1)
    rows = row_tile * BR + tl.arange(0, BR)
    row_mask = rows < R
    rows64 = rows.to(tl.int64)
    row_acc = tl.zeros([BR], dtype=tl.float32)
    w_acc = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, SPAN, BC):
        cols = span * SPAN + c0 + tl.arange(0, BC)
        col_mask = cols < C
        mask = row_mask[:, None] & col_mask[None, :]
        g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        squares = g * g
        row_acc += tl.sum(squares, axis=1)
        if WITH_COLS:
            tl.store(COL_PARTIAL + row_tile.to(tl.int64) * C + cols, tl.sum(squares, axis=0) * col_scale,
                     mask=col_mask)
        if WITH_W:
            w = tl.load(W + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w_acc += tl.sum(w * w, axis=1)
    tl.store(ROW_PARTIAL + span.to(tl.int64) * R + rows64, row_acc * row_scale, mask=row_mask)
    if WITH_W:
        tl.store(W_PARTIAL + span.to(tl.int64) * tl.num_programs(0) + row_tile, tl.sum(w_acc, axis=0))


@triton.jit
def _scaled_gradient(G, ROW, ROW_MEAN, COL, R, C, stride_g, mean_floor, eps_sq, BR: tl.constexpr,
                     BC: tl.constexpr, SCALES: tl.constexpr):
    """This program's tile of U (``Factors``), its offsets and mask."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_mask = rows < R
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    mean = tl.maximum(tl.load(ROW_MEAN), mean_floor)
    r = tl.load(ROW + rows, mask=row_mask, other=1.0)
    c = tl.load(COL + cols, mask=col_mask, other=1.0)
    g = tl.load(G + rows.to(tl.int64)[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if SCALES:
        return g * tl.math.rsqrt(r / mean)[:, None] * tl.math.rsqrt(c)[None, :], rows, cols, mask
    estimate = tl.maximum((r / mean)[:, None] * c[None, :], eps_sq)
    return g * tl.math.rsqrt(estimate), rows, cols, mask


@triton.jit
def _update_square_sum_kernel(G, ROW, ROW_MEAN, COL, PARTIAL, R, C, stride_g, mean_floor, eps_sq,
                              BR: tl.constexpr, BC: tl.constexpr, SCALES: tl.constexpr):
    u, rows, cols, mask = _scaled_gradient(G, ROW, ROW_MEAN, COL, R, C, stride_g, mean_floor, eps_sq, BR, BC, SCALES)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(PARTIAL + program, tl.sum(tl.sum(u * u, axis=1), axis=0))


@triton.jit
def _apply_update_kernel(W, G, ROW, ROW_MEAN, COL, U_SQUARES, W_SQUARES, RHO, R, C, stride_w, stride_g, mean_floor,
                         eps_sq, inv_n, eps2, inv_d, sign, decay_rate, BR: tl.constexpr, BC: tl.constexpr,
                         SCALES: tl.constexpr, RHO_IN_MEMORY: tl.constexpr, DECAY_BY_ALPHA: tl.constexpr,
                         HW_MATH: tl.constexpr):
    if RHO_IN_MEMORY:
        rho = tl.load(RHO).to(tl.float32)
    else:
        rho = RHO
    alpha = tl.maximum(tl.sqrt(tl.load(W_SQUARES) * inv_n), eps2) * rho
    coef = -sign * alpha / tl.maximum(tl.sqrt(tl.load(U_SQUARES) * inv_n) * inv_d, 1.0)
    if DECAY_BY_ALPHA:
        decay = 1.0 - alpha * decay_rate
    else:
        decay = 1.0 - decay_rate
    u, rows, cols, mask = _scaled_gradient(G, ROW, ROW_MEAN, COL, R, C, stride_g, mean_floor, eps_sq, BR, BC, SCALES)
    offsets = rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    w = tl.load(W + offsets, mask=mask, other=0.0).to(tl.float32)
    store_tile(W + offsets, w * decay + coef * u, mask, False, HW_MATH)     # bf16: round to nearest even


_launch_square_sums = LaunchCache(_square_sums_kernel, LAUNCH_PATHS)
_launch_update_square_sum = LaunchCache(_update_square_sum_kernel, LAUNCH_PATHS)
_launch_apply_update = LaunchCache(_apply_update_kernel, LAUNCH_PATHS)


def square_sums(grad: torch.Tensor, weight: torch.Tensor | None = None, row_scale: float = 1.0,
                col_scale: float = 1.0, columns: bool = True) -> SquareSums:
    """Every row's sum of G^2 times ``row_scale`` (R,), with ``columns`` every column's times
    ``col_scale`` (C,), fp32, and with ``weight`` (G's shape) the sum of W^2 (0-d fp32): one read of
    ``grad`` and ``weight``."""
    rows, cols = grad.shape
    spans = ceil_div(cols, COLUMN_SPAN)
    row_tiles = ceil_div(rows, ROWS)
    if weight is not None and not _takes_weight(weight, grad):
        raise ValueError(_weight_error(weight, grad, "square_sums"))
    row_partial = torch.empty((spans, rows), dtype=torch.float32, device=grad.device)
    col_partial = torch.empty((row_tiles, cols) if columns else (1,), dtype=torch.float32, device=grad.device)
    w_partial = torch.empty((spans, row_tiles) if weight is not None else (1,), dtype=torch.float32,
                            device=grad.device)
    _launch_square_sums((row_tiles, spans), (grad, grad if weight is None else weight, row_partial, col_partial,
                                             w_partial, rows, cols, grad.stride(0),
                                             grad.stride(0) if weight is None else weight.stride(0),
                                             float(row_scale), float(col_scale)),
                        BR=ROWS, BC=COLS, SPAN=COLUMN_SPAN, WITH_W=weight is not None, WITH_COLS=bool(columns))
    return SquareSums(row_partial.sum(dim=0), col_partial.sum(dim=0) if columns else None,
                      w_partial.sum() if weight is not None else None)


def _grid(grad: torch.Tensor) -> tuple[int, int]:
    return ceil_div(grad.shape[0], ROWS), ceil_div(grad.shape[1], COLS)


def _factor_args(factors: Factors) -> tuple:
    return (factors.row.reshape(-1), factors.row_mean.reshape(()), factors.col.reshape(-1))


def update_square_sum(grad: torch.Tensor, factors: Factors) -> torch.Tensor:
    """The sum of U^2 over the layer (a 0-d fp32 tensor), U as ``factors`` forms it. G is only read."""
    grid = _grid(grad)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=grad.device)
    _launch_update_square_sum(grid, (grad, *_factor_args(factors), partial, grad.shape[0], grad.shape[1],
                                     grad.stride(0), float(factors.mean_floor), float(factors.eps_sq)),
                              BR=ROWS, BC=COLS, SCALES=bool(factors.scales))
    return partial.sum()


def apply_update(weight: torch.Tensor, grad: torch.Tensor, factors: Factors, update_squares: torch.Tensor,
                 weight_squares: torch.Tensor, scalars: StepScalars) -> None:
    """``W <- W decay + coef U`` in place (``StepScalars``; computed in fp32, rounded once to the
    weight's dtype), U as ``factors`` forms it, from the 0-d sums of U^2 and of W^2 (W before
    this step)."""
    if not _takes_weight(weight, grad):
        raise ValueError(_weight_error(weight, grad, "apply_update"))
    rho = scalars.rho
    in_memory = isinstance(rho, torch.Tensor)
    rho_arg = rho.reshape(()) if in_memory else float(rho)
    _launch_apply_update(_grid(grad), (weight, grad, *_factor_args(factors), update_squares.reshape(()),
                                       weight_squares.reshape(()), rho_arg, grad.shape[0], grad.shape[1],
                                       weight.stride(0), grad.stride(0), float(factors.mean_floor),
                                       float(factors.eps_sq), 1.0 / max(grad.numel(), 1), float(scalars.eps2),
                                       1.0 / float(scalars.d), float(scalars.sign), float(scalars.decay_rate)),
                         BR=ROWS, BC=COLS, SCALES=bool(factors.scales), RHO_IN_MEMORY=in_memory,
                         DECAY_BY_ALPHA=bool(scalars.decay_by_alpha), HW_MATH=not DECORATED_FOR_INTERPRETER)


def _weight_error(weight: torch.Tensor, grad: torch.Tensor, where: str) -> str:
    return (f"{where}: weight {tuple(weight.shape)} (strides {weight.stride()}) must be a row-major matrix of "
            f"G's shape {tuple(grad.shape)}")


def compile_offline(rows: int, cols: int, weight_dtype: torch.dtype = torch.bfloat16, capability: int = 90) -> list:
    """The three kernels (both forms of the update) compiled for ``sm_<capability>`` without a GPU,
    as a launch on a ``rows x cols`` G would bind them (CPU tensors stand in; ``offline_compile``).
    Needs kernels decorated without ``TRITON_INTERPRET``."""
    from .offline_compile import compile_for_gpu

    if DECORATED_FOR_INTERPRETER:
        raise RuntimeError("factored.compile_offline: the kernels were decorated for the interpreter; "
                           "unset TRITON_INTERPRET")
    grad, weight = torch.empty(rows, cols), torch.empty(rows, cols, dtype=weight_dtype)
    row_vector, col_vector, scalar = torch.empty(rows), torch.empty(cols), torch.empty(())
    tiles = dict(BR=ROWS, BC=COLS)
    compiled = [compile_for_gpu(_square_sums_kernel, (grad, weight, torch.empty(2, rows), torch.empty(2, cols),
                                                      torch.empty(2, 2), rows, cols, grad.stride(0), weight.stride(0),
                                                      0.5, 0.5), dict(tiles, SPAN=COLUMN_SPAN, WITH_W=True,
                                                                             WITH_COLS=True),
                                capability)]
    factors = (row_vector, scalar, col_vector)
    for scales in (False, True):
        compiled.append(compile_for_gpu(_update_square_sum_kernel, (grad, *factors, torch.empty(2), rows, cols,
                                                                    grad.stride(0), 1e-3, 1e-6),
                                        dict(tiles, SCALES=scales), capability))
        rho = scalar if scales else 1e-2
        compiled.append(compile_for_gpu(_apply_update_kernel, (weight, grad, *factors, scalar, scalar, rho, rows, cols,
                                                               weight.stride(0), grad.stride(0), 1e-3, 1e-6,
                                                               1.0 / (rows * cols), 1e-3, 1.0, 1.0, 1e-3),
                                        dict(tiles, SCALES=scales, RHO_IN_MEMORY=scales, DECAY_BY_ALPHA=scales,
                                             HW_MATH=True),
                                        capability))
    return compiled


__all__ = ["COLUMN_SPAN", "COLS", "DECORATED_FOR_INTERPRETER", "Factors", "GRADIENT_DTYPES", "ROWS", "SquareSums", "StepScalars",
           "apply_update", "ceil_div", "compile_offline", "runs_here", "square_sums", "update_square_sum"]
