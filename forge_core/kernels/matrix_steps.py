"""The Triton passes of every regime-3 rule's ``matrix_step``: the namespace the layer path hands a
rule (``layer_step.MATRIX_KERNELS``). The factored rules' three (``factored``) and one update pass
each for SM3, Adam-mini and LARS.

Why: stepped in plain torch ops, these rules read and write the layer's fp32 G and their
layer-sized states eight to twelve times a step (SM3's estimate, its maxima and its inverse root
into G; Adam-mini's lerp, block norms and addcdiv; LARS's norms, scaled direction and momentum),
and at Llama-3.1-8B they ran 150-210 ms a CUDA-graph step above the no-optimizer step where the
factored rules' kernels run 70 (results/h100/families_6a571c5). Here each rule reads G at most
twice and never writes it:

* SM3: ``sm3_update``, one pass: ``nu = min(r_i, c_j) + G^2``, the update ``G / sqrt(nu + eps)``
  (through the momentum), W, and per-tile maxima of nu that two ``amax``es turn into the new
  accumulators (the old ones are read by every tile of their row or column, so none is
  overwritten in the pass);
* Adam-mini: ``square_sums`` (row sums of G^2 only) for the block means, then
  ``block_adam_update``: the first moment, the decay and W from the block's second moment;
* LARS: ``square_sums`` (the sums of G^2 and W^2), then ``lars_update``: the trust ratio computed in
  the kernel from the two sums, the momentum and W.

A layer-sized state (a momentum, Adam-mini's first moment) is read and written in its stored dtype,
fp32 or bf16, and rounded once (``Rule.matrix_step``'s states); the weight too. The scalars that
depend on the step come as floats, or as 0-d device tensors in a capturable step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import store_tile
from .device import interpreting
from .direct_launch import LaunchCache
from .factored import (COLS, COLUMN_SPAN, GRADIENT_DTYPES, ROWS, Factors, SquareSums, StepScalars, apply_update,
                       ceil_div, runs_here, square_sums, update_square_sum)
from .launch import LAUNCH_PATHS

DECORATED_FOR_INTERPRETER = interpreting()
"""Whether these kernels were decorated for the CPU interpreter (``device.runs_on_device_of``)."""


@triton.jit
def _tile(R, C, BR: tl.constexpr, BC: tl.constexpr):
    """This program's rows, columns and mask of a (R, C) matrix in (BR, BC) tiles."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    return rows, cols, (rows < R)[:, None] & (cols < C)[None, :]


@triton.jit
def _sm3_update_kernel(W, G, ROW_ACC, COL_ACC, MOMENTUM, ROW_PARTIAL, COL_PARTIAL, R, C, stride_w, stride_g,
                       stride_m, lr, momentum, eps, BR: tl.constexpr, BC: tl.constexpr,
                       WITH_MOMENTUM: tl.constexpr, HW_MATH: tl.constexpr):
    rows, cols, mask = _tile(R, C, BR, BC)
    rows64 = rows.to(tl.int64)
    r = tl.load(ROW_ACC + rows, mask=rows < R, other=0.0).to(tl.float32)
    c = tl.load(COL_ACC + cols, mask=cols < C, other=0.0).to(tl.float32)
    g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    nu = tl.where(mask, tl.minimum(r[:, None], c[None, :]) + g * g, 0.0)      # >= 0: 0 is neutral for max
    tl.store(ROW_PARTIAL + tl.program_id(1).to(tl.int64) * R + rows, tl.max(nu, axis=1), mask=rows < R)
    tl.store(COL_PARTIAL + tl.program_id(0).to(tl.int64) * C + cols, tl.max(nu, axis=0), mask=cols < C)
    update = g * tl.math.rsqrt(nu + eps)
    if WITH_MOMENTUM:
        m_offsets = rows64[:, None] * stride_m + cols[None, :]
        buffer = tl.load(MOMENTUM + m_offsets, mask=mask, other=0.0).to(tl.float32)
        update = buffer * momentum + update * (1.0 - momentum)
        store_tile(MOMENTUM + m_offsets, update, mask, False, HW_MATH)
    w_offsets = rows64[:, None] * stride_w + cols[None, :]
    w = tl.load(W + w_offsets, mask=mask, other=0.0).to(tl.float32)
    store_tile(W + w_offsets, w - lr * update, mask, False, HW_MATH)


@triton.jit
def _scalar(value, IN_MEMORY: tl.constexpr):
    if IN_MEMORY:
        return tl.load(value).to(tl.float32)
    else:
        return value


@triton.jit
def _block_adam_update_kernel(W, G, EXP_AVG, EXP_AVG_SQ, BIAS2_SQRT, NEG_BIAS1_OVER_LR, R, C, stride_w, stride_g,
                              stride_m, rows_per_block, beta1, decay, eps, BR: tl.constexpr, BC: tl.constexpr,
                              STEP_IN_MEMORY: tl.constexpr, STEP_W: tl.constexpr, HW_MATH: tl.constexpr):
    rows, cols, mask = _tile(R, C, BR, BC)
    rows64 = rows.to(tl.int64)
    g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m_offsets = rows64[:, None] * stride_m + cols[None, :]
    m = tl.load(EXP_AVG + m_offsets, mask=mask, other=0.0).to(tl.float32)
    m = m + (1.0 - beta1) * (g - m)                      # torch's lerp with a weight below 0.5
    store_tile(EXP_AVG + m_offsets, m, mask, False, HW_MATH)
    if STEP_W:
        v = tl.load(EXP_AVG_SQ + rows // rows_per_block, mask=rows < R, other=1.0).to(tl.float32)
        bias2_sqrt = _scalar(BIAS2_SQRT, STEP_IN_MEMORY)
        neg_bias1_over_lr = _scalar(NEG_BIAS1_OVER_LR, STEP_IN_MEMORY)
        denominator = (tl.sqrt(v) / bias2_sqrt + eps) * neg_bias1_over_lr
        w_offsets = rows64[:, None] * stride_w + cols[None, :]
        w = tl.load(W + w_offsets, mask=mask, other=0.0).to(tl.float32)
        store_tile(W + w_offsets, w * decay + m / denominator[:, None], mask, False, HW_MATH)


@triton.jit
def _lars_update_kernel(W, G, MOMENTUM, G_SQUARES, W_SQUARES, R, C, stride_w, stride_g, stride_m, lr, momentum,
                        weight_decay, trust_coefficient, eps, BR: tl.constexpr, BC: tl.constexpr,
                        HW_MATH: tl.constexpr):
    weight_norm = tl.sqrt(tl.load(W_SQUARES))
    grad_norm = tl.sqrt(tl.load(G_SQUARES))
    ratio = trust_coefficient * weight_norm / (grad_norm + weight_decay * weight_norm + eps)
    trust = tl.where((weight_norm > 0) & (grad_norm > 0), ratio, 1.0)
    rows, cols, mask = _tile(R, C, BR, BC)
    rows64 = rows.to(tl.int64)
    w_offsets = rows64[:, None] * stride_w + cols[None, :]
    w = tl.load(W + w_offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    direction = (g + weight_decay * w) * (trust * lr)
    m_offsets = rows64[:, None] * stride_m + cols[None, :]
    buffer = tl.load(MOMENTUM + m_offsets, mask=mask, other=0.0).to(tl.float32) * momentum + direction
    store_tile(MOMENTUM + m_offsets, buffer, mask, False, HW_MATH)
    store_tile(W + w_offsets, w - buffer, mask, False, HW_MATH)


_launch_sm3_update = LaunchCache(_sm3_update_kernel, LAUNCH_PATHS)
_launch_block_adam_update = LaunchCache(_block_adam_update_kernel, LAUNCH_PATHS)
_launch_lars_update = LaunchCache(_lars_update_kernel, LAUNCH_PATHS)


def _grid(grad: torch.Tensor) -> tuple[int, int]:
    return ceil_div(grad.shape[0], ROWS), ceil_div(grad.shape[1], COLS)


def _check_matrix(tensor: torch.Tensor, grad: torch.Tensor, what: str, where: str) -> None:
    """A layer-sized operand must be a row-major matrix of G's shape (the kernels index it so)."""
    if tensor.shape != grad.shape or tensor.stride(1) != 1:
        raise ValueError(f"{where}: {what} {tuple(tensor.shape)} (strides {tensor.stride()}) must be a row-major "
                         f"matrix of G's shape {tuple(grad.shape)}")


def _check_vector(tensor: torch.Tensor, size: int, what: str, where: str) -> None:
    if tensor.numel() != size or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"{where}: {what} must be a contiguous fp32 tensor of {size} elements, got shape "
                         f"{tuple(tensor.shape)} {tensor.dtype}")


def sm3_update(weight: torch.Tensor, grad: torch.Tensor, row_accumulator: torch.Tensor,
               col_accumulator: torch.Tensor, lr: float, eps: float, momentum: float = 0.0,
               momentum_buffer: torch.Tensor | None = None) -> None:
    """One SM3-II step of a matrix in place (``forge_core.rules.sm3``): W, the momentum buffer (with
    ``momentum > 0``) and the row (R) and column (C) accumulators, fp32, which become the maxima of
    this step's nu. G is only read."""
    where = "sm3_update"
    rows, cols = grad.shape
    _check_matrix(weight, grad, "weight", where)
    _check_vector(row_accumulator, rows, "the row accumulator", where)
    _check_vector(col_accumulator, cols, "the column accumulator", where)
    with_momentum = momentum > 0.0
    if with_momentum:
        if momentum_buffer is None:
            raise ValueError(f"{where}: momentum > 0 needs the momentum buffer")
        _check_matrix(momentum_buffer, grad, "the momentum buffer", where)
    buffer = momentum_buffer if with_momentum else weight
    grid = _grid(grad)
    row_partial = torch.empty((grid[1], rows), dtype=torch.float32, device=grad.device)
    col_partial = torch.empty((grid[0], cols), dtype=torch.float32, device=grad.device)
    _launch_sm3_update(grid, (weight, grad, row_accumulator, col_accumulator, buffer, row_partial, col_partial,
                              rows, cols, weight.stride(0), grad.stride(0), buffer.stride(0), float(lr),
                              float(momentum), float(eps)),
                       BR=ROWS, BC=COLS, WITH_MOMENTUM=with_momentum, HW_MATH=not DECORATED_FOR_INTERPRETER)
    torch.amax(row_partial, dim=0, out=row_accumulator.view(rows))
    torch.amax(col_partial, dim=0, out=col_accumulator.view(cols))


def block_adam_update(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      beta1: float, decay: float, eps: float, bias2_sqrt: float | torch.Tensor,
                      neg_bias1_over_lr: float | torch.Tensor | None) -> None:
    """Adam-mini's update of a matrix in place (``forge_core.rules.adam_mini``), its blocks runs of
    ``R / blocks`` rows, from the blocks' second moments ``exp_avg_sq`` (already this step's, fp32)::

        m <- m.lerp(G, 1 - beta1);   W <- W decay + m / ((sqrt(v_b) / bias2_sqrt + eps) neg_bias1_over_lr)

    ``neg_bias1_over_lr`` None (lr = 0): the first moment only. The two step scalars are floats or
    0-d fp32 device tensors (then both)."""
    where = "block_adam_update"
    rows, cols = grad.shape
    _check_matrix(weight, grad, "weight", where)
    _check_matrix(exp_avg, grad, "the first moment", where)
    blocks = exp_avg_sq.numel()
    if blocks < 1 or rows % blocks:
        raise ValueError(f"{where}: {blocks} second-moment blocks do not divide the {rows} rows")
    _check_vector(exp_avg_sq, blocks, "the second moment", where)
    in_memory = isinstance(bias2_sqrt, torch.Tensor)
    step_w = neg_bias1_over_lr is not None
    if step_w and in_memory != isinstance(neg_bias1_over_lr, torch.Tensor):
        raise ValueError(f"{where}: the two step scalars must both be floats or both be tensors")

    def scalar(value: float | torch.Tensor | None) -> float | torch.Tensor:
        if value is None:
            return 1.0
        return value.reshape(()).to(torch.float32) if isinstance(value, torch.Tensor) else float(value)

    _launch_block_adam_update(_grid(grad), (weight, grad, exp_avg, exp_avg_sq, scalar(bias2_sqrt),
                                            scalar(neg_bias1_over_lr), rows, cols, weight.stride(0), grad.stride(0),
                                            exp_avg.stride(0), rows // blocks, float(beta1), float(decay),
                                            float(eps)),
                              BR=ROWS, BC=COLS, STEP_IN_MEMORY=in_memory and step_w, STEP_W=step_w,
                              HW_MATH=not DECORATED_FOR_INTERPRETER)


def lars_update(weight: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor,
                grad_squares: torch.Tensor, weight_squares: torch.Tensor, lr: float, momentum: float,
                weight_decay: float, trust_coefficient: float, eps: float) -> None:
    """One LARS step of a matrix in place (``forge_core.rules.lars``) from the 0-d fp32 sums of G^2
    and of W^2 (W before this step): the trust ratio is formed in the kernel (no host sync)."""
    where = "lars_update"
    rows, cols = grad.shape
    _check_matrix(weight, grad, "weight", where)
    _check_matrix(momentum_buffer, grad, "the momentum buffer", where)
    _launch_lars_update(_grid(grad), (weight, grad, momentum_buffer, grad_squares.reshape(()),
                                      weight_squares.reshape(()), rows, cols, weight.stride(0), grad.stride(0),
                                      momentum_buffer.stride(0), float(lr), float(momentum), float(weight_decay),
                                      float(trust_coefficient), float(eps)),
                        BR=ROWS, BC=COLS, HW_MATH=not DECORATED_FOR_INTERPRETER)


def compile_offline(rows: int, cols: int, weight_dtype: torch.dtype = torch.bfloat16, capability: int = 90) -> list:
    """The three update kernels compiled for ``sm_<capability>`` without a GPU, as a launch on a
    ``rows x cols`` G with a ``weight_dtype`` weight and states would bind them (``offline_compile``)."""
    from .offline_compile import compile_for_gpu

    if DECORATED_FOR_INTERPRETER:
        raise RuntimeError("matrix_steps.compile_offline: the kernels were decorated for the interpreter; "
                           "unset TRITON_INTERPRET")
    grad = torch.empty(rows, cols)
    weight, state = torch.empty(rows, cols, dtype=weight_dtype), torch.empty(rows, cols, dtype=weight_dtype)
    scalar, tiles = torch.empty(()), dict(BR=ROWS, BC=COLS, HW_MATH=True)
    return [
        compile_for_gpu(_sm3_update_kernel, (weight, grad, torch.empty(rows), torch.empty(cols), state,
                                             torch.empty(2, rows), torch.empty(2, cols), rows, cols, weight.stride(0),
                                             grad.stride(0), state.stride(0), 0.1, 0.9, 1e-30),
                        dict(tiles, WITH_MOMENTUM=True), capability),
        compile_for_gpu(_block_adam_update_kernel, (weight, grad, state, torch.empty(rows), scalar, scalar, rows,
                                                    cols, weight.stride(0), grad.stride(0), state.stride(0), 1, 0.9,
                                                    0.99, 1e-8),
                        dict(tiles, STEP_IN_MEMORY=True, STEP_W=True), capability),
        compile_for_gpu(_lars_update_kernel, (weight, grad, state, scalar, scalar, rows, cols, weight.stride(0),
                                              grad.stride(0), state.stride(0), 1e-3, 0.9, 1e-4, 1e-3, 1e-8),
                        tiles, capability),
    ]


__all__ = ["COLS", "COLUMN_SPAN", "DECORATED_FOR_INTERPRETER", "Factors", "GRADIENT_DTYPES", "ROWS", "SquareSums",
           "StepScalars", "apply_update", "block_adam_update", "compile_offline", "lars_update", "runs_here",
           "sm3_update", "square_sums", "update_square_sum"]
