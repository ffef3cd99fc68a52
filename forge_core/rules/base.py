"""The contract every optimizer rule file satisfies.

A rule is one file in ``forge_core/rules/``: its plain-torch reference (the spec) and its
Triton epilogue (what the fused kernel runs on each weight tile after the fp32 gradient tile
is accumulated). Adding a rule = one file + one line in ``forge_core/rules/__init__.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..dtensors import is_dtensor


@dataclass(frozen=True)
class Rule:
    name: str
    """Registry key, e.g. "adamw"."""
    state_names: tuple[str, ...]
    """Per-weight state tensors, in the order the epilogue takes them, e.g. ("exp_avg", "exp_avg_sq")."""
    defaults: Mapping[str, Any]
    """Hyper-parameters and their defaults, ``lr`` included (what a param_group holds)."""
    reference: Callable[..., None]
    """``reference(weight32, grad32, states32: dict[str, Tensor], hp: Mapping, step: int) -> None``:
    updates fp32 weight and fp32 states in place. This is the spec the kernel is tested against."""
    fallback_optimizer: Callable[..., torch.optim.Optimizer]
    """``fallback_optimizer(params_or_groups, capturable=False, **hp)``: the torch optimizer that steps
    the parameters FORGE does not fuse (biases, norms, embeddings, tied weights) with the same
    hyper-parameters; ``capturable=True`` makes it safe to replay in a CUDA graph."""
    epilogue: Any = None
    """The ``@triton.jit`` epilogue function (see forge_core/kernels for its calling convention):
    ``epilogue(w, g, s0, s1, c0, c1, c2, c3, c4, c5, c6, c7, FAST) -> (w, s0, s1)`` on fp32 tiles, where
    ``s0``/``s1`` are the states in ``state_names`` order (``s1`` is a zero dummy for a one-state
    rule and is not stored), ``c0..c7`` are the floats returned by ``kernel_scalars`` and ``FAST``
    (a ``tl.constexpr``) is true on the GPU, where hardware approximations (``libdevice``) may
    replace IEEE operations; the CPU interpreter has no ``libdevice`` and passes false."""
    kernel_scalars: Callable[[Mapping[str, Any], int], tuple[float, ...]] | None = None
    """``kernel_scalars(hp, step) -> tuple`` of at most 8 floats the epilogue reads (lr, decay
    factors, bias corrections...), computed on the host in float64 so that a new step or a new
    ``lr`` is a new runtime argument, never a recompilation."""
    kernel_scalars_on_device: Callable[[Mapping[str, Any], torch.Tensor], tuple[Any, ...]] | None = None
    """``kernel_scalars_on_device(hp, step) -> tuple`` of the same values as ``kernel_scalars`` for a
    float64 ``step`` tensor (0-d, on the weights' device), each a Python float or a 0-d tensor computed
    with torch ops on that device: no host sync, so the step count can live on the GPU and a CUDA
    graph can replay the computation (``fuse(..., capturable=True)``). None: the rule is not capturable."""
    sqrt_domain_states: frozenset[str] = field(default_factory=frozenset)
    """States stored as sqrt(value) when quantized to int8 (second moments), see forge_core/state.py."""
    signed_states: frozenset[str] = field(default_factory=frozenset)
    """States that can be negative (first moments); the others are non-negative."""

    def resolve_hp(self, hp: Mapping[str, Any]) -> dict[str, Any]:
        """This rule's hyper-parameters from ``hp`` (a param_group holds more keys, e.g. ``params``),
        with defaults filled in for any that are missing."""
        return {key: hp.get(key, default) for key, default in self.defaults.items()}


KERNEL_SCALARS = 8
"""How many floats a rule may hand the fused kernel (``kernel_scalars`` / ``kernel_scalars_on_device``)."""


def check_scalar_count(rule_name: str, count: int) -> None:
    """A clear error for a rule that returns more kernel scalars than the kernel takes."""
    if count > KERNEL_SCALARS:
        raise ValueError(f"rule {rule_name!r} returned {count} kernel scalars; at most {KERNEL_SCALARS}")


def known_hyperparameters(hp: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``hp`` a rule knows: a param_group also carries keys of its own
    (``params``, a scheduler's ``initial_lr``) that the fallback torch optimizer must not get."""
    return {key: hp[key] for key in defaults if key in hp}


def torch_fused_flag(params: Any) -> dict[str, bool]:
    """``{"fused": True}`` when every parameter is a floating CUDA tensor (torch's fused AdamW / SGD
    take one kernel launch per few tensors instead of foreach's per-op launches: on a host-bound
    Llama-8B step the fallback embedding update alone cost ~8 ms of foreach kernels), else ``{}``
    so torch picks its default (CPU tensors, or a mix); ``{"foreach": False}`` for a mix of DTensors
    (tensor-parallel shards) and plain tensors, which torch's multi-tensor kernels refuse."""
    flat = []
    for item in params:
        flat.extend(item["params"] if isinstance(item, dict) else [item])
    sharded = [is_dtensor(p) for p in flat]
    if any(sharded) and not all(sharded):
        return {"foreach": False}    # a multi-tensor kernel refuses a list mixing DTensors and tensors
    if flat and all(isinstance(p, torch.Tensor) and p.is_cuda and p.is_floating_point() for p in flat):
        return {"fused": True}
    return {}
