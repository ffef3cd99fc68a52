"""What a deep copy or a pickle of a fused module is: the plain module, as ``forge_core.unfuse`` would leave it.

A fused module (``ForgeLinear``, ``ForgeConv1D``, a fused experts module, ``ForgeEmbedding``) holds its
binding to the ``ForgeOptimizer`` that updates its weight inside backward, and through it the optimizer's
states, kernels and locks: none of that can be copied or pickled (``copy.deepcopy(model)`` raised on a
lock, ``torch.save(model)`` on a Triton function). A copy of a fused model is what EMA weights, evaluation
copies and whole-model checkpoints need: the modules and their weights as they are now. So a copy (and a
pickle, and what loads from one) is the plain model: ``nn.Linear``, transformers' ``Conv1D``, the experts
module's own class, ``nn.Embedding``, with the same weights, buffers and hooks and none of the ``forge_*``
attributes. It is not updated by the original's optimizer, and its forward is the plain module's (the
same values: a fused forward computes what its plain module does). To train a copy, fuse it
(``forge_core.fuse(copy, ...)``, a new ``ForgeOptimizer``) or give it a torch optimizer; to resume from a
pickled model, fuse the loaded model and load the saved ``ForgeOptimizer.state_dict()`` into the new one.
A weight's ``forge_core.clipping.FUSED_MARK`` is a ``FusedMark``, which pickles to a plain string that
the clipping guard ignores (a deep copy of a Parameter keeps no attribute at all).
"""
from __future__ import annotations

import copyreg
from typing import Any

from torch import nn

FORGE_ATTRIBUTE_PREFIX = "forge_"
"""The prefix of every attribute ``fuse`` sets on a module it fuses (its binding, the probe's counters)."""


def plain_module_reduction(module: nn.Module, plain_class: type, protocol: int) -> tuple[Any, ...]:
    """``module.__reduce_ex__(protocol)`` as if ``module`` were a ``plain_class`` without its ``forge_*``
    attributes: what ``copy.deepcopy``, ``copy.copy`` and ``pickle`` then rebuild (module docstring). The
    rebuild is the standard library's (``copyreg._reconstructor``, what pickle protocols 0 and 1 use, then
    ``nn.Module.__setstate__``): a pickled model loads without forge_core."""
    state = {key: value for key, value in module.__dict__.items() if not key.startswith(FORGE_ATTRIBUTE_PREFIX)}
    return (copyreg._reconstructor, (plain_class, object, None), state)


class FusedMark(str):
    """The value of ``forge_core.clipping.FUSED_MARK`` on a weight: what the weight is, for the clipping
    guard's message. A pickled weight (``torch.save`` of the model) loads it back as a plain ``str``, which
    the guard does not read as a mark: the loaded model is a plain one (module docstring)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))


__all__ = ["FORGE_ATTRIBUTE_PREFIX", "FusedMark", "plain_module_reduction"]
