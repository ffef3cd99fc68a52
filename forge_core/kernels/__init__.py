"""Kernels: the fused weight-gradient + optimizer step, and its plain-torch reference.

``fused_wgrad_update(x, dy, weight, state, hp, step, *, grad_accum=None,
stochastic_rounding=False, seed=0)`` updates ``weight`` and ``state`` in place with one optimizer
step on G = dY^T X without ever writing G to memory; ``reference_wgrad_update`` has the same
signature and materializes G (see docs/CONTRACTS.md). The modules ``row_gradient`` and ``row_update`` step an
embedding from the rows its batch touched (``forge_core.embedding``).
"""
from __future__ import annotations

from .reference import reference_wgrad_update

try:
    from .fused import NUM_SCALARS, fused_wgrad_update, triton_available
except ImportError:  # pragma: no cover - the fused kernel is added in the next step
    fused_wgrad_update = reference_wgrad_update
    from ..rules.base import KERNEL_SCALARS as NUM_SCALARS

    def triton_available() -> bool:
        return False

__all__ = ["NUM_SCALARS", "fused_wgrad_update", "reference_wgrad_update", "triton_available"]
