"""The passes over a layer's fp32 G of the factored second-moment rules (Adafactor, AdaLomo), in Triton.

Why: stepped in plain torch ops, Adafactor's update of a 2-D weight reads or writes its fp32 G
about ten times (two norms, the layer-sized estimate ``(r / mean(r)) c`` formed, clamped and
inverted, U multiplied into G, its norm, then W), and at Llama-3.1-8B, batch 1, that memory
traffic made the per-layer path slower than torch.optim.Adafactor on bf16 gradients
(results/h200/families_18546e3). Here the same arithmetic reads G three times and writes it never:

* ``square_sums``: every row's and every column's sum of G^2, one read (per-program partial sums,
  added in torch: the result does not depend on the launch's scheduling);
* ``update_square_sum``: the sum of U^2, ``U = G / sqrt(max(a_i c_j, eps^2))``, one read;
* ``apply_update``: ``W <- W + coef U`` (``coef`` a 0-d device tensor: no host sync, so a CUDA
  graph can capture it), one read of G and one of W, W written once in its own dtype.

AdaLomo's ``U = G / sqrt(r_i / mean(r)) / sqrt(c_j)`` takes the two inverse roots as scales
(``scales=True``): its tiny ``eps`` makes the product ``r_i c_j`` underflow where the two roots do not.
Each rule file keeps the step's algebra (``matrix_step``) and its plain-torch ``reference``, which
this path is tested against.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import interpreting, runs_on_device_of

DECORATED_FOR_INTERPRETER = interpreting()
"""Whether these kernels were decorated for the CPU interpreter (``device.runs_on_device_of``)."""

ROWS, COLS = 32, 256
"""A program's tile; ``square_sums`` walks ``COLUMN_SPAN`` columns in tiles of COLS."""
COLUMN_SPAN = 2048


def runs_here(grad: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether these kernels can take ``grad`` (a row-major fp32 matrix on their device) and, when
    given, ``weight`` (a row-major matrix of G's shape: what ``apply_update`` refuses otherwise)."""
    return (grad.dim() == 2 and grad.dtype == torch.float32 and grad.stride(1) == 1
            and runs_on_device_of(grad, DECORATED_FOR_INTERPRETER)
            and (weight is None or _takes_weight(weight, grad)))


def _takes_weight(weight: torch.Tensor, grad: torch.Tensor) -> bool:
    return weight.shape == grad.shape and weight.stride(1) == 1


@triton.jit
def _square_sums_kernel(G, ROW_PARTIAL, COL_PARTIAL, R, C, stride_g,
                        BR: tl.constexpr, BC: tl.constexpr, SPAN: tl.constexpr):
    row_tile = tl.program_id(0)
    span = tl.program_id(1)
    rows = row_tile * BR + tl.arange(0, BR)
    row_mask = rows < R
    rows64 = rows.to(tl.int64)
    row_acc = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, SPAN, BC):
        cols = span * SPAN + c0 + tl.arange(0, BC)
        col_mask = cols < C
        g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0)
        squares = g * g
        row_acc += tl.sum(squares, axis=1)
        tl.store(COL_PARTIAL + row_tile.to(tl.int64) * C + cols, tl.sum(squares, axis=0), mask=col_mask)
    tl.store(ROW_PARTIAL + span.to(tl.int64) * R + rows64, row_acc, mask=row_mask)


@triton.jit
def _scaled_gradient(G, ROW_FACTOR, COL, R, C, stride_g, eps_sq, BR: tl.constexpr, BC: tl.constexpr,
                     SCALES: tl.constexpr):
    """This program's tile of ``U = G / sqrt(max(a_i c_j, eps^2))`` (``SCALES``: ``U = G a_i c_j``,
    the factors already inverse roots), its offsets and mask."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_mask = rows < R
    col_mask = cols < C
    mask = row_mask[:, None] & col_mask[None, :]
    a = tl.load(ROW_FACTOR + rows, mask=row_mask, other=1.0)
    c = tl.load(COL + cols, mask=col_mask, other=1.0)
    g = tl.load(G + rows.to(tl.int64)[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    if SCALES:
        return g * a[:, None] * c[None, :], rows, cols, mask
    estimate = tl.maximum(a[:, None] * c[None, :], eps_sq)
    return g * tl.math.rsqrt(estimate), rows, cols, mask


@triton.jit
def _update_square_sum_kernel(G, ROW_FACTOR, COL, PARTIAL, R, C, stride_g, eps_sq,
                              BR: tl.constexpr, BC: tl.constexpr, SCALES: tl.constexpr):
    u, rows, cols, mask = _scaled_gradient(G, ROW_FACTOR, COL, R, C, stride_g, eps_sq, BR, BC, SCALES)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(PARTIAL + program, tl.sum(tl.sum(u * u, axis=1), axis=0))


@triton.jit
def _apply_update_kernel(W, G, ROW_FACTOR, COL, COEF, R, C, stride_w, stride_g, eps_sq,
                         BR: tl.constexpr, BC: tl.constexpr, SCALES: tl.constexpr):
    u, rows, cols, mask = _scaled_gradient(G, ROW_FACTOR, COL, R, C, stride_g, eps_sq, BR, BC, SCALES)
    offsets = rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    w = tl.load(W + offsets, mask=mask, other=0.0).to(tl.float32)
    coef = tl.load(COEF)
    tl.store(W + offsets, (w + coef * u).to(W.dtype.element_ty), mask=mask)


def square_sums(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(every row's sum of G^2 (R,), every column's (C,)), fp32, from one read of ``grad``."""
    rows, cols = grad.shape
    spans = triton.cdiv(cols, COLUMN_SPAN)
    row_tiles = triton.cdiv(rows, ROWS)
    row_partial = torch.empty((spans, rows), dtype=torch.float32, device=grad.device)
    col_partial = torch.empty((row_tiles, cols), dtype=torch.float32, device=grad.device)
    _square_sums_kernel[(row_tiles, spans)](grad, row_partial, col_partial, rows, cols, grad.stride(0),
                                            BR=ROWS, BC=COLS, SPAN=COLUMN_SPAN)
    return row_partial.sum(dim=0), col_partial.sum(dim=0)


def _grid(grad: torch.Tensor) -> tuple[int, int]:
    return triton.cdiv(grad.shape[0], ROWS), triton.cdiv(grad.shape[1], COLS)


def update_square_sum(grad: torch.Tensor, row_factor: torch.Tensor, col: torch.Tensor, eps_sq: float,
                      scales: bool = False) -> torch.Tensor:
    """The sum of U^2 over the layer (a 0-d fp32 tensor), ``U = G / sqrt(max(a_i c_j, eps_sq))`` with
    ``a = row_factor`` (R,) and ``c = col`` (C,); with ``scales``, ``U = G a_i c_j`` (the factors are
    inverse roots already; ``eps_sq`` unused). G is only read."""
    grid = _grid(grad)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=grad.device)
    _update_square_sum_kernel[grid](grad, row_factor, col, partial, grad.shape[0], grad.shape[1], grad.stride(0),
                                    float(eps_sq), BR=ROWS, BC=COLS, SCALES=bool(scales))
    return partial.sum()


def apply_update(weight: torch.Tensor, grad: torch.Tensor, row_factor: torch.Tensor, col: torch.Tensor,
                 eps_sq: float, coef: torch.Tensor, scales: bool = False) -> None:
    """``weight += coef * U`` in place (computed in fp32, rounded once to the weight's dtype), U as in
    ``update_square_sum``; ``coef``: a 0-d fp32 tensor on the weight's device."""
    if not _takes_weight(weight, grad):
        raise ValueError(f"apply_update: weight {tuple(weight.shape)} (strides {weight.stride()}) must be a "
                         f"row-major matrix of G's shape {tuple(grad.shape)}")
    _apply_update_kernel[_grid(grad)](weight, grad, row_factor, col, coef.reshape(()).to(torch.float32),
                                      grad.shape[0], grad.shape[1], weight.stride(0), grad.stride(0),
                                      float(eps_sq), BR=ROWS, BC=COLS, SCALES=bool(scales))


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
    compiled = [compile_for_gpu(_square_sums_kernel, (grad, torch.empty(2, rows), torch.empty(2, cols), rows, cols,
                                                      grad.stride(0)), dict(tiles, SPAN=COLUMN_SPAN), capability)]
    for scales in (False, True):
        compiled.append(compile_for_gpu(_update_square_sum_kernel, (grad, row_vector, col_vector, torch.empty(2),
                                                                    rows, cols, grad.stride(0), 1e-6),
                                        dict(tiles, SCALES=scales), capability))
        compiled.append(compile_for_gpu(_apply_update_kernel, (weight, grad, row_vector, col_vector, scalar, rows,
                                                               cols, weight.stride(0), grad.stride(0), 1e-6),
                                        dict(tiles, SCALES=scales), capability))
    return compiled


__all__ = ["COLUMN_SPAN", "COLS", "DECORATED_FOR_INTERPRETER", "ROWS", "apply_update", "compile_offline", "runs_here",
           "square_sums", "update_square_sum"]
