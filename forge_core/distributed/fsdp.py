"""FORGE under FSDP2 (``torch.distributed.fsdp.fully_shard``): update each gradient shard as it arrives.

FSDP2 reduce-scatters each parameter group's gradient during the backward and hands every rank
the (averaged) shard of each weight that matches its shard of the weight. That shard's gradient is
complete, so the fused kernel's zero-token path (the shard gradient as its accumulator input, as
``forge_core.dense`` steps a dense weight) applies the rule to the rank's shard of the weight and
of its states right there, and the gradient shard is dropped (``param.grad = None``): the sharded
gradient pool that a plain FSDP2 step keeps until ``optimizer.step()`` never builds up.

The hook point: FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after it sets
the shard's ``.grad`` (``foreach_reduce``, torch 2.5 and later), on its reduce-scatter stream, before
it records the event that the backward's end waits on; so the update is ordered after the
reduction and before anything that reads the weights again. Biases, norms and any parameter the
kernel does not take (not 2-D, not fp32 / bf16) are stepped in ``step()`` by the rule's torch
optimizer, which works on DTensors.

``state_dict()``: torch's layout, each shard's states as DTensors with the parameter's mesh and
placements (int8 block scales sharded by rows like the weight), so ``torch.distributed.checkpoint``
saves and loads them (and reshards them to another world size).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..dense import no_tokens
from ..dtensors import contiguous_strides, dtensor_module, is_dtensor, local_shard
from ..backward_update import BackwardUpdateOptimizer
from ..rules.base import Rule
from ..state import ParamState, restore_entry, saved_entry


class ShardedWeight:
    """One FSDP2-sharded 2-D weight the kernel steps: its local shard's state and step count."""

    def __init__(self, name: str, parameter: nn.Parameter, index: int, rule: Rule, state_dtype: str) -> None:
        self.name = name
        self.parameter = parameter
        self.index = index
        self.group_index = 0
        self.state = ParamState(local_shard(parameter), rule, state_dtype)
        self.steps_done = 0
        self.micro_batches = 0

    def __repr__(self) -> str:
        return f"ShardedWeight({self.name!r}, shard={self.state.shape}, steps={self.steps_done})"


def kernel_steppable(parameter: nn.Parameter, rule: Rule) -> bool:
    """Whether FSDP2's shard of ``parameter`` can be stepped by the kernel as it arrives."""
    if not is_dtensor(parameter) or parameter.dim() != 2 or rule.epilogue is None:
        return False
    if any(placement.is_shard() and placement.dim != 0 for placement in parameter.placements):
        return False                    # int8 block scales run along rows: rows must be what is sharded
    local = local_shard(parameter)
    return parameter.dtype in (torch.float32, torch.bfloat16) and local.is_contiguous()


class FsdpForgeOptimizer(BackwardUpdateOptimizer):
    """A torch optimizer over an FSDP2 model whose 2-D weight shards are updated in the backward
    (see the module docstring); built by ``forge_core.distributed.fuse_fsdp``."""

    ADD_PARAM_GROUP_REFUSAL = "the FSDP optimizer decides its shards at fuse_fsdp() time; add_param_group is not supported"

    def __init__(self, model: nn.Module, *, rule: Rule, hyperparameters: Mapping[str, Any], state_dtype: str,
                 stochastic_rounding: bool, accumulate_steps: int, backend: str) -> None:
        names = {id(p): name for name, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, rule=rule, hyperparameters=hyperparameters, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, accumulate_steps=accumulate_steps, backend=backend)
        self.sharded: list[ShardedWeight] = []
        self._by_parameter: dict[int, ShardedWeight] = {}
        self._hooks = []
        torch_params = []
        for index, parameter in enumerate(params):
            if kernel_steppable(parameter, rule):
                shard = ShardedWeight(names.get(id(parameter), f"parameter {index}"), parameter, index, rule,
                                      state_dtype)
                self.sharded.append(shard)
                self._by_parameter[id(parameter)] = shard
                self._hooks.append(parameter.register_post_accumulate_grad_hook(self._on_gradient_shard))
            else:
                torch_params.append(parameter)
        self._torch_params = torch_params
        self._fallback = rule.fallback_optimizer([{"params": list(torch_params)}], **hyperparameters)
        self._steps_taken = 0
        self.shard_updates = 0
        """Shard updates applied in backward hooks (tests read it)."""

    # -- the update as each shard arrives --------------------------------------------------------

    def _on_gradient_shard(self, parameter: nn.Parameter) -> None:
        """FSDP2 set ``parameter``'s gradient shard: on the last micro-batch, step the shard and drop it."""
        shard = self._by_parameter[id(parameter)]
        shard.micro_batches += 1
        if shard.micro_batches < self.accumulate_steps:
            return                                  # FSDP2 adds the next micro-batch's shard to it
        self._update_shard(shard)

    def _update_shard(self, shard: ShardedWeight) -> None:
        parameter = shard.parameter
        gradient = local_shard(parameter.grad)
        weight = local_shard(parameter)
        if weight.numel():
            if not gradient.is_contiguous():
                gradient = gradient.contiguous()
            step = shard.steps_done + 1
            group = self.param_groups[shard.group_index]
            hp = {key: (group[key].item() if isinstance(group[key], torch.Tensor) else group[key])
                  for key in self.rule.defaults}
            with torch.no_grad():
                self._update_function(*no_tokens(weight, weight.shape[0]), weight, shard.state, hp, step, grad_accum=gradient,
                             stochastic_rounding=self.stochastic_rounding,
                             seed=(shard.index * 1_000_003 + step) & 0x7FFFFFFF)
        parameter.grad = None
        shard.micro_batches = self.accumulate_steps
        self.shard_updates += 1

    # -- torch.optim.Optimizer interface ---------------------------------------------------------

    def sharded_parameters(self) -> list[nn.Parameter]:
        """The weights whose shards are stepped in the backward (they keep no ``.grad``)."""
        return [shard.parameter for shard in self.sharded]

    def fallback_parameters(self) -> list[nn.Parameter]:
        """The parameters ``step()`` updates with the rule's torch optimizer."""
        return list(self._torch_params)

    @property
    def fallback_optimizer(self) -> torch.optim.Optimizer:
        return self._fallback

    @property
    def steps_taken(self) -> int:
        return self._steps_taken

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Step the fallback parameters; a shard whose micro-batches stopped short of
        ``accumulate_steps`` is stepped from what FSDP2 accumulated; advance the step counts."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for shard in self.sharded:
            if 0 < shard.micro_batches < self.accumulate_steps and shard.parameter.grad is not None:
                self._update_shard(shard)
        for ours, theirs in zip(self.param_groups, self._fallback.param_groups):
            theirs.update({key: value for key, value in ours.items() if key != "params"})
        self._fallback.step()
        for shard in self.sharded:
            if shard.micro_batches == self.accumulate_steps:
                shard.steps_done += 1
            shard.micro_batches = 0
        self._steps_taken += 1
        return loss

    def initialize_state(self) -> None:
        """Create the fallback optimizer's states (torch makes them at its first step) without moving
        a weight, so that ``state_dict()`` has every tensor for ``torch.distributed.checkpoint.load``
        to fill in place: call it on a fresh optimizer before loading. The sharded weights' states
        exist from the start."""
        if self._fallback.state:
            return
        saved_lrs = [group["lr"] for group in self._fallback.param_groups]
        for parameter in self._torch_params:
            parameter.grad = torch.zeros_like(parameter)
        for group in self._fallback.param_groups:
            group["lr"] = 0.0
        self._fallback.step()
        for group, lr in zip(self._fallback.param_groups, saved_lrs):
            group["lr"] = lr
        for parameter in self._torch_params:
            parameter.grad = None

    def _parameter_order(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's layout; a sharded weight's entry: ``step`` and its states as DTensors laid out as the
        weight (``name``, and ``name + "_scale"`` for int8), so DCP can save and reshard them."""
        index_of = {id(p): i for i, p in enumerate(self._parameter_order())}
        state: dict[int, dict[str, Any]] = {}
        for shard in self.sharded:
            state[index_of[id(shard.parameter)]] = {key: value if key == "step" else _as_dtensor(value, shard.parameter)
                                                    for key, value in saved_entry(shard).items()}
        for parameter, parameter_state in self._fallback.state.items():
            state[index_of[id(parameter)]] = dict(parameter_state)
        groups = self.packed_param_groups(index_of)
        forge = {"rule": self.rule.name, "state_dtype": self.state_dtype, "steps_taken": self._steps_taken,
                 "sharded": sorted(index_of[id(s.parameter)] for s in self.sharded)}
        return {"state": state, "param_groups": groups, "forge": forge}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restore ``state_dict()``'s layout (DTensor or local states) into the same model and settings."""
        forge = state_dict.get("forge")
        if not isinstance(forge, Mapping) or "sharded" not in forge:
            raise ValueError("not an FSDP ForgeOptimizer state dict (no 'forge' entry with 'sharded')")
        if forge.get("rule") != self.rule.name or forge.get("state_dtype") != self.state_dtype:
            raise ValueError(f"state dict is for rule={forge.get('rule')!r} state_dtype={forge.get('state_dtype')!r}, "
                             f"this optimizer is rule={self.rule.name!r} state_dtype={self.state_dtype!r}")
        order = self._parameter_order()
        index_of = {id(p): i for i, p in enumerate(order)}
        if list(forge["sharded"]) != sorted(index_of[id(s.parameter)] for s in self.sharded):
            raise ValueError("the state dict stepped a different set of sharded weights than this optimizer")
        saved_state = state_dict["state"]
        for shard in self.sharded:
            entry = saved_state[index_of[id(shard.parameter)]]
            restore_entry(shard, {key: local_shard(value) for key, value in entry.items()})
            shard.micro_batches = 0
        for saved, ours in zip(state_dict["param_groups"], self.param_groups):
            ours.update({key: copy.deepcopy(value) for key, value in saved.items() if key != "params"})
        fallback_index = {id(p): i for i, p in enumerate(self._torch_params)}
        fallback_state = {fallback_index[id(order[int(i)])]: value for i, value in saved_state.items()
                          if id(order[int(i)]) in fallback_index}
        fallback_groups = []
        for group in self._fallback.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed.update({key: value for key, value in self.param_groups[0].items() if key != "params"})
            packed["params"] = [fallback_index[id(p)] for p in group["params"]]
            fallback_groups.append(packed)
        self._fallback.load_state_dict({"state": fallback_state, "param_groups": fallback_groups})
        self._steps_taken = int(forge.get("steps_taken", 0))

    def __repr__(self) -> str:
        return (f"FsdpForgeOptimizer(rule={self.rule.name}, state_dtype={self.state_dtype}, backend={self.backend}, "
                f"sharded={len(self.sharded)}, fallback={len(self._torch_params)})")


def _as_dtensor(local: torch.Tensor, parameter: nn.Parameter) -> torch.Tensor:
    """A state shard as a DTensor laid out as ``parameter`` (rows sharded alike; an int8 scale has one
    column per 64-element block)."""
    module = dtensor_module()
    rows = parameter.shape[0]
    shape = (rows, *local.shape[1:]) if local.shape[1:] != parameter.shape[1:] else tuple(parameter.shape)
    return module.DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                                     shape=shape, stride=contiguous_strides(shape))


__all__ = ["FsdpForgeOptimizer", "ShardedWeight", "kernel_steppable"]
