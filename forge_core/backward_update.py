"""What the optimizers that update fused weights inside the backward share: ``ForgeOptimizer``
(``forge_core.fuse``) and ``FsdpForgeOptimizer`` (``forge_core.distributed.fuse_fsdp``).

Both decide at construction which parameters they fuse, so their one param group is fixed then
(``add_param_group`` afterwards is refused), and both launch the update through the backend's
function: the Triton kernel, or the plain-torch reference.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from . import kernels
from .rules.base import Rule


class BackwardUpdateOptimizer(torch.optim.Optimizer):
    """The rule, state format and backend of an optimizer whose fused updates run in the backward."""

    ADD_PARAM_GROUP_REFUSAL = "this optimizer decides its fused parameters when it is built; add_param_group is not supported"

    def __init__(self, params: list[nn.Parameter], *, rule: Rule, hyperparameters: Mapping[str, Any],
                 state_dtype: str, stochastic_rounding: bool, accumulate_steps: int, backend: str) -> None:
        self._constructing = True
        super().__init__([{"params": params}], dict(hyperparameters))
        self._constructing = False
        self.rule = rule
        self.state_dtype = state_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.accumulate_steps = int(accumulate_steps)
        self.backend = backend
        self._update_function: Callable[..., None] = (
            kernels.fused_wgrad_update if backend == "triton" else kernels.reference_wgrad_update)

    def packed_param_groups(self, index_of: Mapping[int, int]) -> list[dict[str, Any]]:
        """The param groups as torch's ``state_dict`` lays them out: their values, and each parameter
        as its index (``index_of``: ``id(parameter)`` -> index)."""
        return [{**{key: value for key, value in group.items() if key != "params"},
                 "params": [index_of[id(p)] for p in group["params"]]} for group in self.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructing", True):      # torch.optim.Optimizer.__init__ adds the group
            super().add_param_group(param_group)
            return
        raise NotImplementedError(self.ADD_PARAM_GROUP_REFUSAL)


__all__ = ["BackwardUpdateOptimizer"]
