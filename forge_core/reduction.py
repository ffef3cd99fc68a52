"""The hook through which ``forge_core.distributed`` takes a fused weight's update across ranks.

``ForgeOptimizer.distributed`` holds a ``DistributedUpdates`` (data parallel) or None. The optimizer
hands it each fused weight's last micro-batch (its earlier ones are in the weight's fp32
accumulator) instead of updating locally, and calls ``before_step`` first in ``step()``; it reduces
the gradient across ranks and updates through ``ForgeOptimizer.apply_gradient``.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

RowBlockUpdate = Callable[[int, int, torch.Tensor, int], None]
"""A row-block update, called as ``fused_weight.RowSliceUpdate`` is: ``(r0, r1, dy_rows, block_index)``."""


class DistributedUpdates(Protocol):
    """``binding`` is the ``fused_weight.FusedWeight`` whose backward delivers (x, dY)."""

    def fused_backward(self, binding: Any, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """The last micro-batch of ``binding``, whole."""

    def row_updates(self, binding: Any, x: torch.Tensor) -> RowBlockUpdate:
        """The last micro-batch of ``binding``, delivered in row blocks (``FusedWeight.begin_row_updates``)."""

    def before_step(self) -> None:
        """First in ``step()``: finish pending reductions, reduce the fallback parameters' gradients."""


__all__ = ["DistributedUpdates", "RowBlockUpdate"]
