"""Muon's orthogonalization: the quintic Newton-Schulz iteration in bf16, as torch.optim.Muon runs it.

``zeropower_via_newton_schulz`` performs torch's op sequence (cast to bf16, transpose a tall matrix,
divide by the Frobenius norm clamped at ``eps``, then ``steps`` iterations of
``X <- a X + (b A + c A A) X`` with ``A = X X^T``), so that the fused Muon step and
torch.optim.Muon differ only where their inputs do. One difference on purpose: the bf16 input is
always a copy. torch's ``grad.bfloat16()`` is the tensor itself when it is already bf16, so for
bf16 parameters without Nesterov torch's in-place division rescales the momentum buffer; here the
momentum buffer is never written by the iteration.

``adjusted_lr`` is torch's per-shape learning-rate factor.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def zeropower_via_newton_schulz(update: torch.Tensor, coefficients: Sequence[float], steps: int,
                                eps: float) -> torch.Tensor:
    """A new bf16 tensor of ``update``'s shape: ``steps`` quintic Newton-Schulz iterations towards
    the orthogonal factor of ``update`` (2-D)."""
    if update.dim() != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(update.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {tuple(coefficients)}")
    if not 0 <= int(steps) < 100:
        raise ValueError(f"ns_steps must lie in [0, 100), got {steps}")
    a, b, c = (float(value) for value in coefficients)
    tall = update.shape[0] > update.shape[1]
    matrix = update.to(torch.bfloat16, copy=True)
    if tall:
        matrix = matrix.T
    matrix.div_(matrix.norm().clamp(min=eps))
    for _ in range(int(steps)):
        gram = matrix @ matrix.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        matrix = torch.addmm(matrix, polynomial, matrix, beta=a)
    return matrix.T if tall else matrix


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """torch.optim.Muon's learning rate for a (rows, cols) weight: ``lr * sqrt(max(1, rows / cols))``
    ("original", the default), ``lr * 0.2 * sqrt(max(rows, cols))`` ("match_rms_adamw")."""
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


__all__ = ["ADJUST_LR_FNS", "adjusted_lr", "zeropower_via_newton_schulz"]
