"""Two torch entry points that would break a fused model silently or late, refused in one line instead.

* ``torch.optim.Optimizer.load_state_dict`` given a ``ForgeOptimizer`` state dict. The dict ends with a
  guard group (``optimizer.GUARD_GROUP_KEY``) that makes any other optimizer class refuse it, so none
  trains on int8 codes and block scales taken for its moments; but torch's refusal names only its own
  check ("loaded state dict has a different number of parameter groups"), which sends a user resuming
  the ``--unfused`` twin (torch's AdamW) from a FORGE checkpoint looking for a mismatch in their param
  groups. ``install_load_guard`` (run when forge_core is imported: the unfused run never calls ``fuse``)
  raises what the dict is and what loads it. A script that never imports forge_core keeps torch's message.
* ``nn.Module._apply`` (``model.to(...)``, ``.double()``, ``.half()``, ``.cuda()``, ...) on a model with
  fused modules, where it would give a fused weight a dtype the fused update does not take (fp32 and bf16
  only) or another device than its optimizer state's: the model then failed at its first backward, with
  the kernel's "weight dtype must be bf16 or fp32". ``install_conversion_guard`` (run by ``fuse``) checks
  what the conversion would give every fused weight before anything is converted (the conversion applied
  to an empty tensor of the weight's dtype and device) and refuses it, the model left as it was. Between
  fp32 and bf16, and to the same device, a fused model converts as any other.

Each wrap is installed once; every call it does not refuse is torch's own, unchanged.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from .backward_update import BackwardUpdateOptimizer
from .conv1d import is_forge_conv1d
from .embedding import ForgeEmbedding
from .experts import EXPERT_PARAMETERS, is_forge_experts
from .linear import ForgeLinear
from .optimizer import GUARD_GROUP_KEY

FUSED_DTYPES = (torch.float32, torch.bfloat16)
"""The weight dtypes the fused update takes."""


def foreign_state_dict_problem(optimizer: torch.optim.Optimizer, state_dict: Any) -> Optional[str]:
    """Why ``optimizer`` cannot load ``state_dict`` because it is a ``ForgeOptimizer``'s (one line), or None."""
    if isinstance(optimizer, BackwardUpdateOptimizer) or not isinstance(state_dict, Mapping):
        return None
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not groups or not isinstance(groups[-1], Mapping) \
            or GUARD_GROUP_KEY not in groups[-1]:
        return None
    forge = state_dict.get("forge") if isinstance(state_dict.get("forge"), Mapping) else {}
    name = type(optimizer).__name__
    return (f"{name}.load_state_dict was given a ForgeOptimizer state dict (rule {forge.get('rule')!r}, "
            f"{forge.get('state_dtype')} states; its fused weights' moments are FORGE kernel states, not {name}'s): "
            "load it into the optimizer forge_core.fuse(model, ...) returns, or start the unfused run's optimizer "
            "from scratch (load only the model's state dict)")


def install_load_guard() -> None:
    """Wrap ``torch.optim.Optimizer.load_state_dict`` to raise ``foreign_state_dict_problem`` before torch's
    own checks; ``.forge_load_guard_of`` is torch's method."""
    current: Callable[..., Any] = torch.optim.Optimizer.load_state_dict
    if hasattr(current, "forge_load_guard_of"):
        return

    @functools.wraps(current)
    def guarded(self: torch.optim.Optimizer, state_dict: Any) -> None:
        problem = foreign_state_dict_problem(self, state_dict)
        if problem is not None:
            raise ValueError(problem)
        return current(self, state_dict)

    guarded.forge_load_guard_of = current      # type: ignore[attr-defined]
    torch.optim.Optimizer.load_state_dict = guarded      # type: ignore[method-assign]


def _fused_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(qualified name, weight) of every weight of ``model`` a fused module updates (or records rows of)."""
    for name, module in model.named_modules():
        if isinstance(module, (ForgeLinear, ForgeEmbedding)) or is_forge_conv1d(module):
            yield f"{name}.weight" if name else "weight", module.weight
        elif is_forge_experts(module):
            for attribute in EXPERT_PARAMETERS:
                yield f"{name}.{attribute}" if name else attribute, getattr(module, attribute)


def conversion_problem(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> Optional[str]:
    """Why ``model._apply(fn)`` would break a fused weight of ``model`` (one line), or None: ``fn`` is tried on
    an empty tensor of each fused weight's dtype and device (what ``Module.to`` and its kin convert with)."""
    for name, weight in _fused_weights(model):
        probe = fn(torch.empty(0, dtype=weight.dtype, device=weight.device))
        if not isinstance(probe, torch.Tensor):
            continue
        if probe.dtype not in FUSED_DTYPES:
            return (f"converting a fused model to {probe.dtype}: the fused update takes fp32 or bf16 weights, and "
                    f"{name!r} would become {probe.dtype}; convert the model before forge_core.fuse (or "
                    "forge_core.unfuse it first)")
        if probe.device != weight.device:
            return (f"moving a fused model to {probe.device}: {name!r}'s optimizer state stays on {weight.device}; "
                    "move the model before forge_core.fuse (or forge_core.unfuse it first)")
    return None


_CONVERTING = threading.local()
"""Set while a checked ``_apply`` runs: its recursion into the children is not checked again."""


def install_conversion_guard() -> None:
    """Wrap ``nn.Module._apply`` to raise ``conversion_problem`` before anything is converted;
    ``.forge_conversion_guard_of`` is torch's method."""
    current: Callable[..., Any] = nn.Module._apply
    if hasattr(current, "forge_conversion_guard_of"):
        return

    @functools.wraps(current)
    def guarded(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if getattr(_CONVERTING, "active", False):
            return current(self, fn, *args, **kwargs)
        problem = conversion_problem(self, fn)
        if problem is not None:
            raise ValueError(problem)
        _CONVERTING.active = True
        try:
            return current(self, fn, *args, **kwargs)
        finally:
            _CONVERTING.active = False

    guarded.forge_conversion_guard_of = current      # type: ignore[attr-defined]
    nn.Module._apply = guarded      # type: ignore[method-assign]


__all__ = ["FUSED_DTYPES", "conversion_problem", "foreign_state_dict_problem", "install_conversion_guard",
           "install_load_guard"]
