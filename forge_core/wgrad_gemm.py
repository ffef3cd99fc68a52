"""The weight-gradient GEMM ``dY^T X`` of the per-layer paths (``forge_core.layer_step``), on cuBLAS.

Regime-2 and regime-3 rules (Muon, Adafactor, SM3, ...) run their step in plain torch after the
layer's product, so the product itself must be a tensor-core GEMM even when the result is fp32:
an fp32 GEMM on upcast bf16 activations runs without tensor cores (TF32 is off by default),
~15x slower on an H100. On CUDA, bf16 / fp16 operands with an fp32 result go through torch's
``out_dtype`` matmuls (bf16 products, fp32 accumulate and result: cuBLAS ``GemmEx``); elsewhere
(the CPU, or a torch without them) the operands are upcast, which computes the same exact
products of bf16 values.
"""
from __future__ import annotations

import functools

import torch

_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def out_dtype_gemm_available(device: torch.device) -> bool:
    """Whether torch's ``mm`` / ``addmm`` take ``out_dtype=torch.float32`` for bf16 operands on
    ``device`` (CUDA builds of torch >= 2.9). Probed once per device on 2x2 tensors."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        c = torch.zeros((2, 2), dtype=torch.float32, device=device)
        product = torch.mm(a, a, out_dtype=torch.float32)
        summed = torch.addmm(c, a, a, torch.float32, beta=0.5, alpha=0.5)
        return bool(product.dtype == torch.float32 and summed.dtype == torch.float32
                    and float(product[0, 0]) == 2.0 and float(summed[0, 0]) == 1.0)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _mixed(out_dtype: torch.dtype, operand_dtype: torch.dtype, device: torch.device) -> bool:
    return out_dtype == torch.float32 and operand_dtype in _HALF and out_dtype_gemm_available(device)


def weight_gradient(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``G = dY^T X`` as a new fp32 (Dout, Din) tensor from (tokens, Dout) and (tokens, Din)."""
    if dy2.dtype == torch.float32 and x2.dtype == torch.float32:
        return dy2.t() @ x2
    if dy2.dtype == x2.dtype and _mixed(torch.float32, dy2.dtype, dy2.device):
        return torch.mm(dy2.t(), x2, out_dtype=torch.float32)
    return dy2.t().float() @ x2.float()


def accumulate_product(out: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor, *, beta: float,
                       alpha: float) -> torch.Tensor:
    """``out <- beta * out + alpha * dY^T X`` in place (``out``: fp32 or bf16, weight-shaped), one
    GEMM with cuBLAS's beta and alpha where the dtypes allow; returns ``out``."""
    if dy2.dtype == x2.dtype == out.dtype:
        return out.addmm_(dy2.t(), x2, beta=beta, alpha=alpha)
    if dy2.dtype == x2.dtype and _mixed(out.dtype, dy2.dtype, out.device):
        return torch.addmm(out, dy2.t(), x2, torch.float32, beta=beta, alpha=alpha, out=out)
    if out.dtype == torch.float32:
        return out.addmm_(dy2.t().float(), x2.float(), beta=beta, alpha=alpha)
    # a bf16 state from fp32 activations: the product in fp32, rounded once into the state
    return out.copy_(out.float().addmm_(dy2.t().float(), x2.float(), beta=beta, alpha=alpha))


def product_plus(base: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor, *, beta: float,
                 alpha: float) -> torch.Tensor:
    """A new tensor ``beta * base + alpha * dY^T X`` in ``base``'s dtype (``base`` is not written)."""
    return accumulate_product(base.clone(), dy2, x2, beta=beta, alpha=alpha)


__all__ = ["accumulate_product", "out_dtype_gemm_available", "product_plus", "weight_gradient"]
