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
    """``fallback_optimizer(params_or_groups, **hp)``: the torch optimizer that steps the parameters
    FORGE does not fuse (biases, norms, embeddings, tied weights) with the same hyper-parameters."""
    epilogue: Any = None
    """The ``@triton.jit`` epilogue function (see forge_core/kernels for its calling convention)."""
    sqrt_domain_states: frozenset[str] = field(default_factory=frozenset)
    """States stored as sqrt(value) when quantized to int8 (second moments), see forge_core/state.py."""
    signed_states: frozenset[str] = field(default_factory=frozenset)
    """States that can be negative (first moments); the others are non-negative."""
