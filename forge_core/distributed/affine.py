"""Data parallel for an affine rule: reduce the momentum state, not the gradient.

SGD's momentum step ``B <- mu B + c (mean_r G_r + wd W)`` (``c = 1 - dampening``; ``B <- g`` on the
first step) is affine in the gradients, so the ranks can each write a share of the new ``B`` and
sum the shares: rank 0 writes ``mu B + c wd W + (c / N) G_0``, every other rank ``(c / N) G_r``, and
one all-reduce of ``B`` in place leaves every rank the new momentum. The share is the fused
kernel's epilogue with per-rank scalars (``PARTIAL_MOMENTUM``): G stays in registers, and no
gradient bucket exists at all. The weight step ``W <- W - lr B`` follows the reduction.

What it cannot take, and ``fuse_data_parallel`` sends to the gradient bucket instead (or refuses
with ``reduce="state"``): int8 states (an all-reduce adds values, not block-quantized codes),
Nesterov (its step reads the gradient apart from ``B``), stochastic rounding (the weight step is a
torch op), rules other than SGD with momentum.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import triton
import triton.language as tl

from .. import kernels
from ..fused_weight import FusedWeight
from ..optimizer import ForgeOptimizer
from ..rules.base import Rule
from ..state import ParamState

PARTIAL_DEFAULTS = {"seed_scale": 0.0, "grad_scale": 1.0, "decay_scale": 0.0}
"""The share's three scalars: ``B_share = seed_scale * B + grad_scale * G + decay_scale * W``."""


def partial_reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
                      hp: Mapping[str, Any], step: int) -> None:
    """The spec of the share: the momentum buffer becomes this rank's share of the new momentum;
    the weight is left as it is."""
    buffer = states32["momentum_buffer"]
    share = grad32 * float(hp["grad_scale"]) + weight32 * float(hp["decay_scale"])
    if float(hp["seed_scale"]) != 0.0:
        share = share + buffer * float(hp["seed_scale"])
    buffer.copy_(share)


def partial_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(seed_scale, grad_scale, decay_scale) for the epilogue."""
    return (float(hp["seed_scale"]), float(hp["grad_scale"]), float(hp["decay_scale"]))


@triton.jit
def partial_epilogue(w, g, momentum_buffer, unused_state, unused_state2, seed_scale, grad_scale, decay_scale,
                     unused_c3, unused_c4, unused_c5, unused_c6, unused_c7, FAST: tl.constexpr):
    """This rank's share of the new momentum on an fp32 tile; the weight tile is stored unchanged."""
    share = grad_scale * g + decay_scale * w
    if seed_scale != 0.0:
        share = share + seed_scale * momentum_buffer
    return w, share, unused_state, unused_state2


def _no_fallback(params: Any, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """The share is not an optimizer: nothing steps with it outside the kernel."""
    raise TypeError("the partial-momentum rule has no torch optimizer; it only writes a momentum share")


PARTIAL_MOMENTUM = Rule(
    name="sgd_momentum_share",
    state_names=("momentum_buffer",),
    defaults=PARTIAL_DEFAULTS,
    reference=partial_reference,
    fallback_optimizer=_no_fallback,
    epilogue=partial_epilogue,
    kernel_scalars=partial_scalars,
    signed_states=frozenset({"momentum_buffer"}),
)


def state_reduction_problem(rule_name: str, hyperparameters: Mapping[str, Any], state_dtype: str,
                            stochastic_rounding: bool) -> str | None:
    """Why the momentum cannot be reduced in place for these settings (one line), or None."""
    if rule_name != "sgd":
        return f"rule {rule_name!r} is not affine in the gradient (only SGD's momentum is)"
    if float(hyperparameters.get("momentum", 0.0)) == 0.0:
        return "SGD without momentum keeps no state to reduce"
    if bool(hyperparameters.get("nesterov", False)):
        return "Nesterov's step reads the gradient apart from the momentum"
    if state_dtype == "int8":
        return "an all-reduce adds values, not int8 block-quantized codes"
    if stochastic_rounding:
        return "the weight step after the reduction rounds to nearest (no stochastic rounding)"
    return None


class MomentumReduction:
    """The state path for one optimizer: per fused weight, the share kernel, then an in-place
    all-reduce of its momentum buffer, then the weight step once the reduction is done."""

    def __init__(self, optimizer: ForgeOptimizer, rank: int, world_size: int) -> None:
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = world_size
        self._share_states: dict[int, ParamState] = {}
        self._launch: Callable[..., None] = (kernels.fused_wgrad_update if optimizer.backend == "triton"
                                             else kernels.reference_wgrad_update)

    def share_state(self, binding: FusedWeight) -> ParamState:
        """The binding's momentum buffer under the share rule (a view, kept: the kernel caches its
        launch plan per ParamState)."""
        state = self._share_states.get(binding.index)
        if state is None:
            state = binding.state.rows(0, binding.state.shape[0])
            state.rule = PARTIAL_MOMENTUM
            self._share_states[binding.index] = state
        return state

    def write_share(self, binding: FusedWeight, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """Write this rank's share of ``binding``'s new momentum (its accumulator's micro-batches
        included) into the buffer, which it returns for the all-reduce."""
        group = self.optimizer.param_groups[binding.group_index]
        momentum = float(group["momentum"])
        first = binding.steps_done == 0
        coefficient = 1.0 if first or momentum == 0.0 else 1.0 - float(group["dampening"])
        on_rank0 = self.rank == 0
        scalars = {"seed_scale": momentum if (on_rank0 and not first) else 0.0,
                   "grad_scale": coefficient / self.world_size,
                   "decay_scale": coefficient * float(group["weight_decay"]) if on_rank0 else 0.0}
        with torch.no_grad():
            self._launch(x, grad_output, binding.matrix, self.share_state(binding), scalars,
                         binding.steps_done + 1, grad_accum=binding.grad_accum)
            if binding.grad_accum is not None:
                binding.grad_accum.zero_()
        return binding.state.values["momentum_buffer"]

    def step_weight(self, binding: FusedWeight) -> None:
        """``W <- W - lr B`` with the reduced momentum ``B``, as torch's SGD steps a parameter."""
        lr = float(self.optimizer.param_groups[binding.group_index]["lr"])
        with torch.no_grad():
            binding.matrix.add_(binding.state.values["momentum_buffer"], alpha=-lr)


__all__ = ["PARTIAL_MOMENTUM", "MomentumReduction", "state_reduction_problem"]
