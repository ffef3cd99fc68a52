"""Triton kernels for the lean activations (``forge_core.lean``): RMSNorm and SwiGLU.

transformers' RMSNorm is about ten elementwise kernels forward and more backward, most of them on
an fp32 copy of the input; SwiGLU is three forward-and-backward pairs. Here each is one kernel
per direction. The plain-torch functions in ``forge_core.lean`` are the spec these kernels are
tested against; they round where transformers rounds (the normalized input to the input dtype
before the weight multiplies it, ``dy * w`` and ``silu(gate)`` to the activation dtype), so the
results agree with transformers' to the order of fp32 summation.

A recomputation (``rstd`` given to ``rms_norm_forward``, or ``swiglu_forward`` again) runs the
same kernel on the same inputs, so it is bit-identical to the forward it replaces.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .device import interpreting, runs_on_device_of


# triton.jit reads TRITON_INTERPRET when it decorates: what counts is the value at import
_DECORATED_FOR_INTERPRETER = interpreting()


def usable_for(tensor: torch.Tensor) -> bool:
    """Whether these kernels can run on ``tensor``'s device (CUDA, or the CPU when the kernels
    were decorated for the interpreter)."""
    return runs_on_device_of(tensor, _DECORATED_FOR_INTERPRETER)


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps,
                             HAS_RSTD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RSTD:
        rstd = tl.load(rstd_ptr + row)
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
    normalized = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normalized).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                              rows_per_program, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = program * rows_per_program
    for i in range(0, rows_per_program):
        row = (first + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            dw += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
            # transformers rounds dy * w to the input dtype before the fp32 part of the chain rule
            g = (dy * w).to(x_ptr.dtype.element_ty).to(tl.float32)
            mean_dot = tl.sum(g * x_hat, axis=0) / n_cols
            dx = (g - x_hat * mean_dot) * rstd
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + program * n_cols + cols, dw, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _block(n_cols: int) -> int:
    return triton.next_power_of_2(n_cols)


def _warps(block: int) -> int:
    return 1 if _DECORATED_FOR_INTERPRETER else min(16, max(4, block // 512))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     rstd: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``weight * (x * rstd).to(x.dtype)``, rstd fp32 with shape ``x.shape[:-1] + (1,)``); with
    ``rstd`` given, the output only (a recomputation)."""
    rows = _rows(x)
    n_rows, n_cols = rows.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    has_rstd = rstd is not None
    rstd_rows = rstd.reshape(n_rows).contiguous() if has_rstd else torch.empty(n_rows, dtype=torch.float32,
                                                                                  device=x.device)
    block = _block(n_cols)
    _rms_norm_forward_kernel[(n_rows,)](rows, weight.contiguous(), y, rstd_rows, n_cols, float(eps),
                                        HAS_RSTD=has_rstd, BLOCK=block, num_warps=_warps(block))
    return y.view(*x.shape[:-1], n_cols), rstd_rows.view(*x.shape[:-1], 1)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in fp32)."""
    rows, grads = _rows(x), _rows(grad_output)
    n_rows, n_cols = rows.shape
    programs = max(1, min(n_rows, 256))
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(rows)
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    block = _block(n_cols)
    _rms_norm_backward_kernel[(programs,)](rows, weight.contiguous(), rstd.reshape(n_rows).contiguous(), grads,
                                           dx, dw_partial, n_rows, n_cols, rows_per_program, BLOCK=block,
                                           num_warps=_warps(block))
    return dx.view(x.shape), dw_partial.sum(0)


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(gate_ptr, up_ptr, grad_ptr, grad_gate_ptr, grad_up_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = 1.0 / (1.0 + tl.exp(-gate))
    silu = (gate * sigmoid).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(grad_up_ptr + offsets, (grad * silu).to(grad_up_ptr.dtype.element_ty), mask=mask)
    grad_silu = (grad * up).to(gate_ptr.dtype.element_ty).to(tl.float32)
    grad_gate = grad_silu * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)


def _elementwise_block() -> int:
    return 256 if _DECORATED_FOR_INTERPRETER else 1024


def _same_shape_check(*tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"swiglu: gate, up (and grad) need one shape and dtype, got "
                         f"{[(tuple(t.shape), t.dtype) for t in tensors]}")


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (silu rounded to the activation dtype first, as torch does)."""
    _same_shape_check(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    block = _elementwise_block()
    _swiglu_forward_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor,
                    grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``silu(gate) * up``."""
    _same_shape_check(gate, up, grad_output)
    gate, up, grad_output = gate.contiguous(), up.contiguous(), grad_output.contiguous()
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    block = _elementwise_block()
    _swiglu_backward_kernel[(triton.cdiv(n, block),)](gate, up, grad_output, grad_gate, grad_up, n, BLOCK=block)
    return grad_gate, grad_up
