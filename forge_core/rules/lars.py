"""LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks"): SGD with
momentum whose learning rate is scaled per layer by a trust ratio. Regime 3 (deferred): the trust
ratio reads the norm of the layer's whole gradient.

Per weight W with gradient G::

    trust = trust_coefficient * |W| / (|G| + weight_decay * |W| + eps)   (1 when |W| or |G| is 0)
    v    <- momentum v + lr * trust * (G + weight_decay W)
    W    <- W - v

The paper's rule, applied to every parameter (vectors too; many recipes exclude biases and norms:
give them their own optimizer). Defaults: ``lr=1e-3, momentum=0.9, weight_decay=0.0,
trust_coefficient=1e-3, eps=1e-8``. torch has no LARS: the unfused form is a ``RuleOptimizer`` on
this reference. Where Triton runs, a matrix takes ``matrix_step``: the same arithmetic in two reads
of G (``forge_core.kernels.matrix_steps``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .rule_optimizer import reference_rule
from .scalars import norm

DEFAULTS = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 0.0, "trust_coefficient": 1e-3, "eps": 1e-8}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, momentum, weight_decay, trust, eps = (float(full[key]) for key in DEFAULTS)
    if not lr >= 0.0:
        raise ValueError(f"lars: lr must be >= 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"lars: momentum must lie in [0, 1), got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"lars: weight_decay must be >= 0, got {weight_decay}")
    if not trust > 0.0:
        raise ValueError(f"lars: trust_coefficient must be > 0, got {trust}")
    if not eps >= 0.0:
        raise ValueError(f"lars: eps must be >= 0, got {eps}")
    return lr, momentum, weight_decay, trust, eps


def reference(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One LARS step in place (``weight``: fp32 or bf16; fp32 states); ``grad32`` is consumed (it
    becomes the scaled step)."""
    lr, momentum, weight_decay, trust_coefficient, eps = _checked(hp)
    weight_norm = norm(weight)
    grad_norm = norm(grad32)
    ratio = trust_coefficient * weight_norm / (grad_norm + weight_decay * weight_norm + eps)
    trust = torch.where((weight_norm > 0) & (grad_norm > 0), ratio, torch.ones_like(ratio))
    direction = grad32.add_(weight, alpha=weight_decay) if weight_decay != 0.0 else grad32
    direction.mul_(trust * lr)
    buffer = states32["momentum_buffer"]
    buffer.mul_(momentum).add_(direction)
    weight.sub_(buffer)


def matrix_step(weight: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], hp: Mapping[str, Any],
                step: Any, kernels: Any) -> None:
    """``reference`` for a 2-D weight in two Triton passes: the sums of G^2 and W^2
    (``kernels.square_sums``), then the trust ratio, the momentum and W (``kernels.lars_update``);
    G is only read, the momentum buffer read and rounded in its stored dtype."""
    lr, momentum, weight_decay, trust_coefficient, eps = _checked(hp)
    sums = kernels.square_sums(grad, weight, columns=False)
    kernels.lars_update(weight, grad, states["momentum_buffer"], sums.rows.sum(), sums.weight_squares, lr, momentum,
                        weight_decay, trust_coefficient, eps)


RULE = reference_rule(
    name="lars",
    state_names=("momentum_buffer",),
    defaults=DEFAULTS,
    reference=reference,
    matrix_step=matrix_step,
    layer_capturable=True,
    signed_states=frozenset({"momentum_buffer"}),
)
