"""Adagrad, as torch.optim.Adagrad computes it (lr_decay, initial_accumulator_value, eps).

    g <- g + wd * w
    sum <- sum + g^2                         (starts at initial_accumulator_value)
    w <- w - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)

The state is named ``sum`` as torch names it; it is a second moment (stored in the sqrt domain when
quantized). Not capturable: torch.optim.Adagrad, which steps the parameters FORGE does not fuse,
reads its step count on the host and has no capturable mode.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule, known_hyperparameters
from .checks import check_step

DEFAULTS = {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, lr_decay, weight_decay = float(full["lr"]), float(full["lr_decay"]), float(full["weight_decay"])
    initial, eps = float(full["initial_accumulator_value"]), float(full["eps"])
    for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                        ("initial_accumulator_value", initial), ("eps", eps)):
        if not value >= 0.0:
            raise ValueError(f"adagrad: {name} must be >= 0, got {value}")
    return lr, lr_decay, weight_decay, initial, eps


def initial_state(name: str, hp: Mapping[str, Any]) -> float:
    """``sum`` starts at ``initial_accumulator_value``."""
    return _checked(hp)[3]


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One Adagrad step in place on fp32 tensors, op for op as torch's single-tensor Adagrad."""
    lr, lr_decay, weight_decay, _, eps = _checked(hp)
    check_step("adagrad", step)
    grad = grad32
    if weight_decay != 0.0:
        grad = grad.add(weight32, alpha=weight_decay)
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum = states32["sum"]
    state_sum.addcmul_(grad, grad, value=1)
    std = state_sum.sqrt().add_(eps)
    weight32.addcdiv_(grad, std, value=-clr)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(lr / (1 + (step - 1) * lr_decay), weight_decay, eps)."""
    lr, lr_decay, weight_decay, _, eps = _checked(hp)
    check_step("adagrad", step)
    return (lr / (1 + (step - 1) * lr_decay), weight_decay, eps)


@triton.jit
def epilogue(w, g, state_sum, unused_state, unused_third, clr, weight_decay, eps, unused_c3, unused_c4, unused_c5,
             unused_c6, unused_c7, FAST: tl.constexpr):
    """Adagrad on fp32 tiles."""
    if weight_decay != 0.0:
        g = g + weight_decay * w
    state_sum = state_sum + g * g
    std = tl.sqrt(state_sum) + eps
    if FAST:
        w = w - clr * libdevice.fast_dividef(g, std)
    else:
        w = w - clr * (g / std)
    return w, state_sum, unused_state, unused_third


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.Adagrad with the same hyper-parameters, for the parameters FORGE does not fuse."""
    return torch.optim.Adagrad(list(params), **known_hyperparameters(hp, DEFAULTS))


RULE = Rule(
    name="adagrad",
    state_names=("sum",),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=None,
    sqrt_domain_states=frozenset({"sum"}),
    signed_states=frozenset(),
    initial_state=initial_state,
    refusals={"capturable": "torch.optim.Adagrad, which steps the parameters FORGE does not fuse, reads its step "
                            "count on the host and has no capturable mode"},
)
