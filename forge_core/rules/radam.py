"""RAdam (Liu et al. 2020, rectified Adam), as torch.optim.RAdam computes it.

    g <- g + wd * w                (or, decoupled_weight_decay: w <- w * (1 - lr * wd))
    exp_avg, exp_avg_sq as Adam's;  rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
    rho_t > 5:  w <- w - lr / (1 - beta1^t) * rect_t * sqrt(1 - beta2^t) * exp_avg / (sqrt(exp_avg_sq) + eps)
    otherwise:  w <- w - lr / (1 - beta1^t) * exp_avg
    rect_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))

The branch depends on the step only, so it is a kernel scalar (0 or 1, with the step's coefficient):
one compiled kernel takes both. For small t, rho_t is about t - 1 whatever beta2 is: the first five or
six steps take the unrectified branch.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule
from .checks import adam_hyperparameters, check_step, filled, torch_fallback

DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "decoupled_weight_decay": False}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, bool]:
    full = filled(hp, DEFAULTS)
    lr, beta1, beta2, eps, weight_decay = adam_hyperparameters("radam", full)
    return lr, beta1, beta2, eps, weight_decay, bool(full["decoupled_weight_decay"])


def rho(beta2: float, step: float) -> tuple[float, float]:
    """(rho_inf, rho_t), as torch computes them."""
    rho_inf = 2 / (1 - beta2) - 1
    return rho_inf, rho_inf - 2 * step * (beta2 ** step) / (1 - beta2 ** step)


def rectified(beta2: float, step: int) -> bool:
    """Whether step ``step`` takes the rectified (adaptive) branch: rho_t > 5."""
    return rho(beta2, step)[1] > 5.0


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One RAdam step in place on fp32 tensors, op for op as torch's single-tensor RAdam."""
    lr, beta1, beta2, eps, weight_decay, decoupled = _checked(hp)
    check_step("radam", step)
    grad = grad32
    if weight_decay != 0.0:
        if decoupled:
            weight32.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(weight32, alpha=weight_decay)
    exp_avg, exp_avg_sq = states32["exp_avg"], states32["exp_avg_sq"]
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    corrected = exp_avg / bias_correction1
    rho_inf, rho_t = rho(beta2, step)
    if rho_t > 5.0:
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        adaptive_lr = (bias_correction2 ** 0.5) / exp_avg_sq.sqrt().add_(eps)
        weight32.add_(corrected * lr * adaptive_lr * rect, alpha=-1.0)
    else:
        weight32.add_(corrected * lr, alpha=-1.0)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(decay factor, coupled weight decay, 1 - beta1, beta2, 1 - beta2, the step's coefficient of the
    first moment, 1.0 for the rectified branch else 0.0, eps)."""
    lr, beta1, beta2, eps, weight_decay, decoupled = _checked(hp)
    check_step("radam", step)
    rho_inf, rho_t = rho(beta2, step)
    coefficient = lr / (1 - beta1 ** step)
    adaptive = rho_t > 5.0
    if adaptive:
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        coefficient *= rect * math.sqrt(1 - beta2 ** step)
    return (1.0 - lr * weight_decay if decoupled else 1.0, 0.0 if decoupled else weight_decay, 1.0 - beta1, beta2,
            1.0 - beta2, coefficient, 1.0 if adaptive else 0.0, eps)


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for a float64 step tensor on the device (capturable; the branch by ``torch.where``)."""
    lr, beta1, beta2, eps, weight_decay, decoupled = _checked(hp)
    bias_correction2 = 1 - torch.pow(beta2, step)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * torch.pow(beta2, step) / bias_correction2
    adaptive = rho_t > 5.0
    rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)).clamp_min(0.0).sqrt()
    coefficient = lr / (1 - torch.pow(beta1, step))
    coefficient = torch.where(adaptive, coefficient * rect * torch.sqrt(bias_correction2), coefficient)
    return (1.0 - lr * weight_decay if decoupled else 1.0, 0.0 if decoupled else weight_decay, 1.0 - beta1, beta2,
            1.0 - beta2, coefficient, adaptive.to(torch.float64), eps)


@triton.jit
def epilogue(w, g, exp_avg, exp_avg_sq, unused_third, decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2,
             coefficient, adaptive, eps, FAST: tl.constexpr):
    """RAdam on fp32 tiles; the branch is a runtime scalar, so a new step never recompiles."""
    if weight_decay != 0.0:
        g = g + weight_decay * w
    w = w * decay
    exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    if adaptive != 0.0:
        if FAST:
            w = w - coefficient * libdevice.fast_dividef(exp_avg, tl.sqrt(exp_avg_sq) + eps)
        else:
            w = w - coefficient * (exp_avg / (tl.sqrt(exp_avg_sq) + eps))
    else:
        w = w - coefficient * exp_avg
    return w, exp_avg, exp_avg_sq, unused_third


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.RAdam with the same hyper-parameters, for the parameters FORGE does not fuse."""
    return torch_fallback(torch.optim.RAdam, params, hp, DEFAULTS, capturable)


RULE = Rule(
    name="radam",
    state_names=("exp_avg", "exp_avg_sq"),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=kernel_scalars_on_device,
    sqrt_domain_states=frozenset({"exp_avg_sq"}),
    signed_states=frozenset({"exp_avg"}),
)
