"""The fused GPT-2 ``Conv1D``: transformers' linear layer whose weight is stored ``(Din, Dout)``.

transformers' ``Conv1D`` (GPT-2, GPT-J's ancestors, ...) computes ``y = x W + b`` with ``W`` of
shape ``(Din, Dout)``. Its weight gradient is ``G = X^T dY``, of the weight's own shape: the fused
kernel's ``dY^T X`` with ``x`` and ``dY`` swapped (``FusedLinearFunction(..., transposed=True)``).
The kernel's rows are then the input features and its token-axis reduction is unchanged, so the
update, the optimizer state (int8 blocks run along ``Dout``) and the tile tuning are those of a
plain ``(Din, Dout)`` matrix; nothing is transposed or copied.

As with ``ForgeLinear``, ``forge_core.fuse`` changes the class of the existing module in place
(to a subclass of transformers' ``Conv1D`` made once per base class), keeping its Parameters,
hooks and name; ``forge_core.unfuse`` changes it back. transformers stays an optional
dependency: without it there is no ``Conv1D`` to fuse.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from .linear import FusedLinearFunction, WeightUpdater, hooked_linear, native_forward, traced_linear
from .module_copies import plain_module_reduction
from .traced import count_forward, traced


def conv1d_class() -> Optional[type]:
    """transformers' ``Conv1D`` class when transformers is importable, else None (no hard dependency)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers absent or broken: there is no Conv1D to fuse
        return None
    return Conv1D


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D`` (a subclass may compute something else)."""
    base = conv1d_class()
    return base is not None and type(module) is base


def _fused_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (Conv1D's name)
    """``x W + b``; through the fused Function when the module has an updater and grad is on."""
    output = native_forward(self, input, transposed=True)
    if output is not None:
        return output
    updater = getattr(self, "forge_updater", None)
    count_forward(self)
    weight = self.weight
    if updater is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return torch.nn.functional.linear(input, weight.t(), self.bias)
    if traced(updater):
        return traced_linear(input, weight, self.bias, updater, transposed=True)
    output = hooked_linear(input, weight, self.bias, updater, transposed=True)
    return output if output is not None else FusedLinearFunction.apply(input, weight, self.bias, updater, True)


def _fused_repr(self: nn.Module) -> str:
    return f"ForgeConv1D(nf={self.nf}, nx={self.nx}, forge_fused=True)"


def _plain_reduction(self: nn.Module, protocol: int) -> tuple:
    """A deep copy or pickle is transformers' ``Conv1D`` with the same weights (``forge_core.module_copies``)."""
    return plain_module_reduction(self, type(self).__mro__[1], protocol)


@functools.lru_cache(maxsize=None)
def forge_conv1d_class(base: type) -> type:
    """The fused subclass of ``base`` (transformers' ``Conv1D``), made once."""
    return type("ForgeConv1D", (base,), {
        "__doc__": "A transformers Conv1D whose (Din, Dout) weight is updated inside its own backward "
                   "(see forge_core.conv1d).",
        "__module__": __name__,
        "forward": _fused_forward,
        "__repr__": _fused_repr,
        "__reduce_ex__": _plain_reduction,
        "forge_fused_conv1d": True,
    })


def is_forge_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Conv1D that ``fuse`` turned into a ``ForgeConv1D``."""
    return bool(getattr(type(module), "forge_fused_conv1d", False))


def install_forge_conv1d(module: nn.Module, updater: WeightUpdater) -> None:
    """Turn ``module`` (exactly transformers' ``Conv1D``) into a ForgeConv1D in place."""
    if not is_conv1d(module):
        raise TypeError(f"only transformers Conv1D modules can be fused as Conv1D, got {type(module).__name__}")
    module.__class__ = forge_conv1d_class(type(module))
    module.forge_updater = updater
    module.forge_forward_calls = 0
    module.forge_counting_forwards = False


def remove_forge_conv1d(module: nn.Module) -> None:
    """Turn a ForgeConv1D back into transformers' ``Conv1D`` (same object, same Parameters)."""
    if not is_forge_conv1d(module):
        raise TypeError(f"not a ForgeConv1D: {type(module).__name__}")
    for attribute in ("forge_updater", "forge_forward_calls", "forge_counting_forwards"):
        module.__dict__.pop(attribute, None)
    module.__class__ = type(module).__mro__[1]


__all__ = ["conv1d_class", "is_conv1d", "forge_conv1d_class", "is_forge_conv1d", "install_forge_conv1d",
           "remove_forge_conv1d"]
