"""Adamax (the infinity-norm Adam of Kingma & Ba 2015), as torch.optim.Adamax computes it.

    g <- g + wd * w
    exp_avg <- exp_avg + (1 - beta1) * (g - exp_avg)
    exp_inf <- max(beta2 * exp_inf, |g| + eps)
    w <- w - lr / (1 - beta1^t) * exp_avg / exp_inf

``exp_inf`` is a magnitude, not a square: it is quantized as it is (no sqrt domain), with its int8 /
fp8 codes floored at the smallest positive one (``floored_states``). Why the floor: a code of 0 reads
back as 0, so at the element's next step without a gradient ``exp_inf`` is ``eps`` while its first
moment is not 0, and ``exp_avg / exp_inf`` is huge (a tiny Llama's embedding moved by 27 at lr 1e-3;
a Linear weight whose input columns span decades by 300 lr). The division reads the new ``exp_inf``
(at least eps), never a quantized one.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule
from .checks import adam_hyperparameters, check_step, filled, torch_fallback

DEFAULTS = {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    full = filled(hp, DEFAULTS)
    lr, beta1, beta2, eps, weight_decay = adam_hyperparameters("adamax", full)
    return lr, beta1, beta2, eps, weight_decay


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One Adamax step in place on fp32 tensors, op for op as torch's single-tensor Adamax."""
    lr, beta1, beta2, eps, weight_decay = _checked(hp)
    check_step("adamax", step)
    grad = grad32
    if weight_decay != 0.0:
        grad = grad.add(weight32, alpha=weight_decay)
    exp_avg, exp_inf = states32["exp_avg"], states32["exp_inf"]
    exp_avg.lerp_(grad, 1.0 - beta1)
    torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)
    clr = lr / (1.0 - beta1 ** step)
    weight32.addcdiv_(exp_avg, exp_inf, value=-clr)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(weight_decay, 1 - beta1, beta2, eps, lr / (1 - beta1^step))."""
    lr, beta1, beta2, eps, weight_decay = _checked(hp)
    check_step("adamax", step)
    return (weight_decay, 1.0 - beta1, beta2, eps, lr / (1.0 - beta1 ** step))


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for a float64 step tensor on the device (capturable)."""
    lr, beta1, beta2, eps, weight_decay = _checked(hp)
    return (weight_decay, 1.0 - beta1, beta2, eps, lr / (1.0 - torch.pow(beta1, step)))


@triton.jit
def epilogue(w, g, exp_avg, exp_inf, unused_third, weight_decay, one_minus_beta1, beta2, eps, clr, unused_c5,
             unused_c6, unused_c7, FAST: tl.constexpr):
    """Adamax on fp32 tiles."""
    if weight_decay != 0.0:
        g = g + weight_decay * w
    exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg)
    exp_inf = tl.maximum(exp_inf * beta2, tl.abs(g) + eps)
    if FAST:
        w = w - clr * libdevice.fast_dividef(exp_avg, exp_inf)
    else:
        w = w - clr * (exp_avg / exp_inf)
    return w, exp_avg, exp_inf, unused_third


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.Adamax with the same hyper-parameters, for the parameters FORGE does not fuse."""
    return torch_fallback(torch.optim.Adamax, params, hp, DEFAULTS, capturable)


RULE = Rule(
    name="adamax",
    state_names=("exp_avg", "exp_inf"),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=kernel_scalars_on_device,
    sqrt_domain_states=frozenset(),
    floored_states=frozenset({"exp_inf"}),
    signed_states=frozenset({"exp_avg"}),
)
