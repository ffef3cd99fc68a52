"""The contract every optimizer rule file satisfies.

A rule is one file in ``forge_core/rules/``: its plain-torch reference (the spec) and its
Triton epilogue (what the fused kernel runs on each weight tile after the fp32 gradient tile
is accumulated). Adding a rule = one file + one line in ``forge_core/rules/__init__.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


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
    regime: int = 1
    """Where the rule's step runs (docs/design.md, section 1): 1 = in the fused kernel's epilogue
    (a coordinate-wise state step); 2 = a whole-matrix weight update after the layer's accumulate
    (Muon's Newton-Schulz, LAMB's trust ratio); 3 = deferred: the layer's gradient is formed,
    stepped and freed inside that layer's backward (Adafactor, SM3, Adam-mini, LARS, AdaLomo)."""
    layer_update: Callable[..., None] | None = None
    """A regime-2 rule stepped in plain torch (``forge_core.layer_step``): ``layer_update(x2, dy2,
    weight, states, hp, step, *, grad_accum, first_micro_batch, last_micro_batch)`` with the layer's
    flattened input and output gradient, the weight and its stored states, updated in place. A
    regime-3 rule leaves it None: the layer path forms G and runs ``reference``."""
    state_shapes: Callable[[tuple[int, ...], Mapping[str, Any], str], dict[str, tuple[int, ...]]] | None = None
    """``state_shapes(parameter_shape, hp, name) -> {state name: shape}`` for a rule whose states are
    not parameter-shaped (row / column / block statistics); ``name`` is the parameter's or module's
    qualified name (Adam-mini partitions by it). None: ``state_names``, each of the parameter's shape."""
    state_dtypes: frozenset[str] | None = None
    """The state formats the rule can store (None: every one of forge_core.state.STATE_DTYPES)."""
    hidden_weights_only: bool = False
    """Fuse hidden-layer weights only: the output head (``model.get_output_embeddings()``) stays with
    the fallback optimizer, as torch.optim.Muon's users step it with AdamW."""
    fallback_hyperparameters: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """Our param group's values -> the fallback optimizer's (Muon's ``adamw_*`` keys become AdamW's
    ``lr``, ``betas``, ...). None: the same keys."""
    layer_capturable: bool = False
    """Regimes 2 and 3: the layer update runs device ops only (no host sync; the step may be a 0-d
    device tensor), so ``fuse(..., capturable=True)`` can capture it in a CUDA graph."""
    state_accumulates: Callable[[Mapping[str, Any]], bool] | None = None
    """``state_accumulates(hp)``: True when ``layer_update`` takes the earlier micro-batches of
    ``accumulate_steps`` into its own state (Muon without Nesterov: the momentum buffer), so no fp32
    gradient accumulator is kept. None: never."""

    def shapes_of_states(self, shape: tuple[int, ...], hp: Mapping[str, Any], name: str = "") -> dict[str, tuple[int, ...]]:
        """The states a parameter of ``shape`` called ``name`` holds, and their shapes (``state_shapes``)."""
        if self.state_shapes is None:
            return {state: tuple(shape) for state in self.state_names}
        return {state: tuple(size) for state, size in self.state_shapes(tuple(shape), hp, name).items()}

    def fallback_values(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """A param group's values (not its ``params``) as the fallback optimizer's group takes them
        (``fallback_hyperparameters``; the same keys when None)."""
        values = {key: value for key, value in group.items() if key != "params"}
        return self.fallback_hyperparameters(values) if self.fallback_hyperparameters is not None else values

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
    so torch picks its default (CPU tensors, or a mix)."""
    flat = []
    for item in params:
        flat.extend(item["params"] if isinstance(item, dict) else [item])
    if flat and all(isinstance(p, torch.Tensor) and p.is_cuda and p.is_floating_point() for p in flat):
        return {"fused": True}
    return {}
