"""The gradient-clipping guard: ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` refuse, in one line,
a weight whose gradient FORGE never forms.

Why: both functions skip a parameter whose ``.grad`` is None, so given a fused model's parameters they
would clip the fallback's gradients alone and leave every fused weight out silently. ``fuse`` marks each
such weight (``FUSED_MARK``, ``mark_gradientless_weights``) and wraps the two functions once per process
(``install_clipping_guard``); ``unfuse`` removes the marks.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.utils.clip_grad as torch_clip_grad

from .experts import EXPERT_PARAMETERS
from .module_copies import FusedMark

if TYPE_CHECKING:
    from .optimizer import ForgeOptimizer


FUSED_MARK = "forge_gradient_never_exists"
"""The attribute ``fuse`` sets on each weight whose gradient FORGE never forms (a fused Linear's, a
row-gradient embedding's), holding what it is; ``unfuse`` removes it. The clipping guard reads it."""

CLIPPING_FUNCTIONS = {
    "clip_grad_norm_": "global-norm clipping needs every gradient before any weight moves",
    "clip_grad_value_": "FORGE cannot clip a gradient it never forms",
}
"""The ``torch.nn.utils`` functions the guard wraps, with why a weight without a gradient breaks them
(both skip a parameter whose ``.grad`` is None, so they would leave the fused weights out silently)."""


def _clipping_guard(original: Callable[..., Any], function_name: str) -> Callable[..., Any]:
    """``original`` behind a check that none of its parameters carries ``FUSED_MARK``: one attribute
    read per parameter, then the untouched original (it runs every step of a training loop)."""

    @functools.wraps(original)
    def guarded(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for parameter in parameters:
            what = getattr(parameter, FUSED_MARK, None)
            if isinstance(what, FusedMark):          # (a pickled copy's weight loads a plain str: no mark)
                if function_name == "clip_grad_norm_" and _clips_nothing(args, kwargs):
                    # max_norm=inf measures a norm and clips nothing: HF's Trainer does it every step for
                    # its grad_norm log, max_grad_norm=0 or not. Allowed; the norm leaves out every
                    # fused weight, which the warning says (once per place it is called from).
                    warnings.warn(f"torch.nn.utils.clip_grad_norm_ with max_norm=inf (a norm, no clipping) was "
                                  f"given {what}: the norm it returns covers only the gradients that exist",
                                  stacklevel=2)
                    break
                raise ValueError(
                    f"torch.nn.utils.{function_name} was given {what}: it would be left out silently, and "
                    f"{CLIPPING_FUNCTIONS[function_name]}; train without clipping (HF Trainer: max_grad_norm=0), "
                    "clip only parameters that get a .grad, or call forge_core.unfuse(model) first")
        return original(parameters, *args, **kwargs)

    guarded.forge_clipping_guard_of = original      # type: ignore[attr-defined]
    return guarded


def _clips_nothing(args: tuple, kwargs: dict) -> bool:
    """Whether a ``clip_grad_norm_`` call's ``max_norm`` is infinite (it then only measures the norm)."""
    max_norm = args[0] if args else kwargs.get("max_norm")
    try:
        return max_norm is not None and math.isinf(float(max_norm))
    except (TypeError, ValueError):
        return False


def install_clipping_guard() -> None:
    """Wrap ``CLIPPING_FUNCTIONS`` in ``torch.nn.utils`` and ``torch.nn.utils.clip_grad`` (once: a
    wrapped function is left as it is). Why at ``fuse``: a user's ``clip_grad_norm_(model.parameters())``
    after ``fuse`` would clip the fallback gradients alone; code that imported the function by name
    before ``fuse`` keeps the unguarded one."""
    for function_name in CLIPPING_FUNCTIONS:
        wrapped: dict[int, Callable[..., Any]] = {}
        for namespace in (torch_clip_grad, torch.nn.utils):
            current = getattr(namespace, function_name, None)
            if current is None or hasattr(current, "forge_clipping_guard_of"):
                continue
            if id(current) not in wrapped:
                wrapped[id(current)] = _clipping_guard(current, function_name)
            setattr(namespace, function_name, wrapped[id(current)])


def mark_gradientless_weights(optimizer: "ForgeOptimizer") -> None:
    """Set ``FUSED_MARK`` on the weights that will never get a ``.grad``: the fused ones and the
    row-gradient embeddings'."""
    for name, weight in zip(optimizer.fused_module_names(), optimizer.fused_parameters()):
        label = name if name.rpartition(".")[2] in EXPERT_PARAMETERS else f"{name}.weight"   # experts name the Parameter
        setattr(weight, FUSED_MARK, FusedMark(f"{label}, a fused weight (forge_core.fuse updates it inside backward; "
                                              "its gradient never exists)"))
    for dense in optimizer.dense_weights():
        if dense.records_rows:
            setattr(dense.weight, FUSED_MARK, FusedMark(
                f"{dense.name}, an embedding weight whose gradient forge_core.fuse keeps as rows (it never gets a "
                ".grad; fuse(..., embedding_rows=False) gives it one)"))


__all__ = ["FUSED_MARK", "CLIPPING_FUNCTIONS", "install_clipping_guard", "mark_gradientless_weights"]
