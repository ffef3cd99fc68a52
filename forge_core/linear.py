"""The fused Linear: forward ``y = x W^T (+ b)``, backward ``dX = dY W`` then the fused update.

``ForgeLinear`` is a subclass of ``nn.Linear`` that ``forge_core.fuse`` installs by changing the
class of an existing module in place (``module.__class__ = ForgeLinear``). The module object, its
Parameters, its hooks and its name in the model are all kept, and ``forge_core.unfuse`` turns it
back into a plain ``nn.Linear`` the same way.

Why a custom autograd Function:

* The weight gradient ``G = dY^T X`` is never formed. The backward hands ``x`` and ``dY`` to an
  *updater* (the optimizer's per-weight binding, see ``forge_core.manager``) which runs the fused
  wgrad + optimizer kernel, and returns ``None`` for the weight, so ``W.grad`` is never created.
* ``dX = dY @ W`` is computed from the pre-update ``W`` *before* the updater runs.
* The weight keeps ``requires_grad=True``, so the output requires grad and this backward runs even
  when ``x`` does not (the first layer of a model).

``transposed=True`` serves a weight stored ``(Din, Dout)`` (transformers' GPT-2 ``Conv1D``,
``y = x W + b``; ``forge_core.conv1d``): its gradient ``X^T dY`` is the kernel's ``dY^T X`` with x
and dY swapped, so the updater is called with ``(dY, x)`` and the same kernel updates the
``(Din, Dout)`` weight row by row, tile by tile, with no transposed copy of anything.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .overlap import run_beside, wants_overlap


class WeightUpdater(Protocol):
    """What the backward calls once per use of the layer: apply (or accumulate) the update.

    An updater with a true ``overlap_updates`` attribute is run on a side CUDA stream, overlapping
    the rest of the backward (``forge_core.overlap``)."""

    def __call__(self, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        ...


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear in on ``device_type``, or None when it is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # device types autocast does not know
        return None
    return None


class FusedLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` (``x W + b`` when ``transposed``) whose backward returns dX and db, and
    updates W in place (no dW)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                updater: WeightUpdater, transposed: bool = False) -> torch.Tensor:
        compute_dtype = autocast_dtype(x.device.type)
        if compute_dtype is not None and x.is_floating_point():
            # Do what autocast does to F.linear, and save the cast x (half the bytes of fp32).
            x = x.to(compute_dtype)
            weight_for_forward = weight.to(compute_dtype)
            bias_for_forward = bias.to(compute_dtype) if bias is not None else None
            with torch.autocast(x.device.type, enabled=False):
                output = F.linear(x, weight_for_forward.t() if transposed else weight_for_forward, bias_for_forward)
        else:
            output = F.linear(x, weight.t() if transposed else weight, bias)
        # Only x is saved for the update; W is the Parameter itself (saving it costs nothing and
        # lets autograd check that nobody modified it between forward and backward).
        ctx.save_for_backward(x, weight)
        ctx.updater = updater
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.input_dtype = x.dtype
        ctx.transposed = transposed
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        needs_x_grad, _, needs_bias_grad = ctx.needs_input_grad[:3]

        # The dtype checks below skip a no-op ``.to`` each (a dispatcher call): an eager backward is
        # bound by the host, and this runs once per fused layer.
        dtype = grad_output.dtype
        grad_x = None
        if needs_x_grad:
            # dX from the PRE-update weight: this must happen before the updater touches W.
            matrix = weight if weight.dtype == dtype else weight.to(dtype)
            grad_x = torch.matmul(grad_output, matrix.t() if ctx.transposed else matrix)
            if dtype != ctx.input_dtype:
                grad_x = grad_x.to(ctx.input_dtype)

        grad_bias = None
        if ctx.has_bias and needs_bias_grad:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0).to(ctx.bias_dtype)

        x_for_update = x if x.dtype == dtype else x.to(dtype)
        # A (Din, Dout) weight's gradient X^T dY is the kernel's dY^T X with the operands swapped.
        first, second = (grad_output, x_for_update) if ctx.transposed else (x_for_update, grad_output)
        updater = ctx.updater
        if torch.is_grad_enabled():          # backward(create_graph=True): the update is not differentiable
            with torch.no_grad():
                _update(updater, first, second)
        else:                                # autograd runs a plain backward with grad mode off already
            _update(updater, first, second)
        # None for the weight: autograd then never creates (or accumulates into) W.grad.
        return grad_x, None, grad_bias, None, None


def _update(updater: WeightUpdater, x: torch.Tensor, grad_output: torch.Tensor) -> None:
    if wants_overlap(updater, grad_output):
        # The update streams W and the moments once; the rest of the backward need not wait.
        run_beside(lambda: updater(x, grad_output), grad_output.device, (x, grad_output))
    else:
        updater(x, grad_output)


class ForgeLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is updated inside its own backward.

    Never constructed directly: ``forge_core.fuse`` sets ``module.__class__ = ForgeLinear`` on an
    existing ``nn.Linear`` and attaches ``module.forge_updater``. Outside autograd (``no_grad``,
    inference) and without an updater it behaves exactly like ``nn.Linear``.
    """

    forge_updater: Optional[WeightUpdater]
    forge_forward_calls: int
    """Forward calls counted while the fuse-time probe runs (see ``forge_core.manager``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        updater = getattr(self, "forge_updater", None)
        if getattr(self, "forge_counting_forwards", False):
            self.forge_forward_calls += 1
        weight = self.weight             # one nn.Module.__getattr__ (a Parameter is not in __dict__)
        if updater is None or not torch.is_grad_enabled() or not weight.requires_grad:
            return F.linear(input, weight, self.bias)
        return FusedLinearFunction.apply(input, weight, self.bias, updater)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", forge_fused=True"


def install_forge_linear(module: nn.Linear, updater: WeightUpdater) -> None:
    """Turn ``module`` (exactly an ``nn.Linear``) into a ForgeLinear in place."""
    if type(module) is not nn.Linear:
        raise TypeError(f"only plain nn.Linear modules can be fused, got {type(module).__name__}")
    module.__class__ = ForgeLinear
    module.forge_updater = updater
    module.forge_forward_calls = 0
    module.forge_counting_forwards = False


def remove_forge_linear(module: nn.Module) -> None:
    """Turn a ForgeLinear back into a plain ``nn.Linear`` (same object, same Parameters)."""
    if not isinstance(module, ForgeLinear):
        raise TypeError(f"not a ForgeLinear: {type(module).__name__}")
    for attribute in ("forge_updater", "forge_forward_calls", "forge_counting_forwards"):
        module.__dict__.pop(attribute, None)
    module.__class__ = nn.Linear
