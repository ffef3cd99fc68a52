"""The weight-gradient GEMM ``dY^T X`` of the per-layer paths (``forge_core.layer_step``), on cuBLAS.

Regime-2 and regime-3 rules (Muon, Adafactor, SM3, ...) run their step in plain torch after the
layer's product, so the product itself must be a tensor-core GEMM even when the result is fp32:
an fp32 GEMM on upcast bf16 activations runs without tensor cores (TF32 is off by default),
~15x slower on an H100. On CUDA, bf16 / fp16 operands with an fp32 result go through torch's
``out_dtype`` matmuls (bf16 products, fp32 accumulate and result: cuBLAS ``GemmEx``); a torch
without them gets the half-precision GEMM's result (fp32 accumulate, rounded once to bf16, which
is the weight gradient autograd gives a bf16 model) added in fp32. On the CPU the operands are
upcast, which computes the same exact products of bf16 values as the ``out_dtype`` GEMM.
"""
from __future__ import annotations

import functools

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def out_dtype_gemm_available(device: torch.device) -> bool:
    """Whether torch's ``mm`` / ``addmm`` take ``out_dtype=torch.float32`` for bf16 operands on
    ``device`` (CUDA builds of a recent torch). Probed once per device on 2x2 tensors, in place as
    ``accumulate_product`` calls it, before any CUDA graph capture (the first eager step)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        c = torch.full((2, 2), 4.0, dtype=torch.float32, device=device)
        product = torch.mm(a, a, torch.float32)
        torch.addmm(c, a, a, torch.float32, beta=0.5, alpha=0.5, out=c)       # in place, as accumulate_product
        return bool(product.dtype == torch.float32 and float(product[0, 0]) == 2.0 and float(c[0, 0]) == 3.0)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _mixed(out_dtype: torch.dtype, operand_dtype: torch.dtype, device: torch.device) -> bool:
    return out_dtype == torch.float32 and operand_dtype in _HALF and out_dtype_gemm_available(device)


def _half_on_cuda(dy2: torch.Tensor, x2: torch.Tensor) -> bool:
    return dy2.is_cuda and dy2.dtype == x2.dtype and dy2.dtype in _HALF


def weight_gradient(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``G = dY^T X`` as a new fp32 (Dout, Din) tensor from (tokens, Dout) and (tokens, Din)."""
    if dy2.dtype == torch.float32 and x2.dtype == torch.float32:
        return dy2.t() @ x2
    if dy2.dtype == x2.dtype and _mixed(torch.float32, dy2.dtype, dy2.device):
        return torch.mm(dy2.t(), x2, torch.float32)
    if _half_on_cuda(dy2, x2):
        return (dy2.t() @ x2).float()
    return dy2.t().float() @ x2.float()


def accumulate_product(out: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor, *, beta: float,
                       alpha: float) -> torch.Tensor:
    """``out <- beta * out + alpha * dY^T X`` in place (``out``: fp32 or bf16, weight-shaped), one
    GEMM with cuBLAS's beta and alpha where the dtypes allow; returns ``out``."""
    if dy2.dtype == x2.dtype == out.dtype:
        return out.addmm_(dy2.t(), x2, beta=beta, alpha=alpha)
    if dy2.dtype == x2.dtype and _mixed(out.dtype, dy2.dtype, out.device):
        return torch.addmm(out, dy2.t(), x2, torch.float32, beta=beta, alpha=alpha, out=out)
    if out.dtype == torch.float32 and _half_on_cuda(dy2, x2):
        return (out if beta == 1.0 else out.mul_(beta)).add_(dy2.t() @ x2, alpha=alpha)
    if out.dtype == torch.float32:
        return out.addmm_(dy2.t().float(), x2.float(), beta=beta, alpha=alpha)
    # a bf16 state from fp32 activations: the product in fp32, rounded once into the state
    return out.copy_(out.float().addmm_(dy2.t().float(), x2.float(), beta=beta, alpha=alpha))


def product_plus(base: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor, *, beta: float,
                 alpha: float) -> torch.Tensor:
    """A new tensor ``beta * base + alpha * dY^T X`` in ``base``'s dtype (``base`` is not written)."""
    return accumulate_product(base.clone(), dy2, x2, beta=beta, alpha=alpha)


__all__ = ["accumulate_product", "out_dtype_gemm_available", "product_plus", "weight_gradient"]
