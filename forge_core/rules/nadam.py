"""NAdam (Dozat 2016, Nesterov momentum in Adam), as torch.optim.NAdam computes it.

    g <- g + wd * w                (or, decoupled_weight_decay: w <- w * (1 - lr * wd))
    mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay));   mu_product_t = mu_1 * ... * mu_t
    exp_avg <- exp_avg + (1 - beta1) * (g - exp_avg);  exp_avg_sq <- beta2 * exp_avg_sq + (1 - beta2) g^2
    denom = sqrt(exp_avg_sq / (1 - beta2^t)) + eps
    w <- w - lr (1 - mu_t) / (1 - mu_product_t) * g / denom
           - lr mu_{t+1} / (1 - mu_product_t * mu_{t+1}) * exp_avg / denom

``mu_product`` is a function of the step and (beta1, momentum_decay): torch keeps it per parameter as
an fp32 running product; ``mu_product`` here is that running product in fp32, memoized per
(beta1, momentum_decay), so equal steps give torch's value bit for bit. The capturable path reads it
from a device table of the products (``device_mu_products``) indexed by the device step. It is
derived, not saved: a state dict holds the step, as for every rule. (A beta1 changed mid-training
restarts the product under the new beta1, where torch would continue the old one.)

The kernel computes ``g / denom`` as ``g * sqrt(bc2) / (sqrt(v) + eps * sqrt(bc2))`` (the same value
up to rounding), which fits the update in eight scalars.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule
from .checks import adam_hyperparameters, check_step, filled, torch_fallback

DEFAULTS = {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "momentum_decay": 4e-3,
            "decoupled_weight_decay": False}
MAX_TABLE_STEPS = 1 << 21
"""The capturable path's device table of mu_product ends where the fp32 product stops changing (about
150 / -log2(beta1) steps, at the bottom of the subnormals: 1000 for beta1 = 0.9); at most this many
steps (16 MiB of float64)."""


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, float, bool]:
    full = filled(hp, DEFAULTS)
    lr, beta1, beta2, eps, weight_decay = adam_hyperparameters("nadam", full)
    momentum_decay = float(full["momentum_decay"])
    if not momentum_decay >= 0.0:
        raise ValueError(f"nadam: momentum_decay must be >= 0, got {momentum_decay}")
    return lr, beta1, beta2, eps, weight_decay, momentum_decay, bool(full["decoupled_weight_decay"])


def mu(beta1: float, momentum_decay: float, step: float) -> float:
    """The momentum coefficient mu_step, as torch computes it (float64)."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


_PRODUCTS: dict[tuple[float, float], list[np.float32]] = {}


def mu_product(beta1: float, momentum_decay: float, step: int) -> float:
    """mu_1 * ... * mu_step as torch's fp32 running product (``mu_product *= mu`` on an fp32 tensor:
    each mu rounded to fp32, each product rounded to fp32), memoized per (beta1, momentum_decay)."""
    products = _PRODUCTS.setdefault((beta1, momentum_decay), [np.float32(1.0)])
    while len(products) <= step:
        products.append(np.float32(products[-1] * np.float32(mu(beta1, momentum_decay, len(products)))))
    return float(products[step])


_DEVICE_TABLES: dict[tuple[float, float, str], torch.Tensor] = {}


def device_mu_products(beta1: float, momentum_decay: float, device: torch.device) -> torch.Tensor:
    """float64 tensor on ``device``: entry t is ``mu_product(t)``, up to the first step where the fp32
    product stops changing (0, or a subnormal that mu rounds back to itself: mu_t never decreases with
    t, so it never changes again; the last entry serves every later step). Made outside graph captures
    (the first eager step) and kept, so a captured step only indexes it."""
    key = (beta1, momentum_decay, str(device))
    table = _DEVICE_TABLES.get(key)
    if table is not None:
        return table
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("nadam: the capturable step's mu_product table is made by the first eager step; "
                           "run one step before capturing (or after changing betas / momentum_decay)")
    step = 1
    while mu_product(beta1, momentum_decay, step) != mu_product(beta1, momentum_decay, step - 1):
        step += 1
        if step > MAX_TABLE_STEPS:
            raise ValueError(f"nadam: capturable=True with beta1={beta1}: mu_product stays non-zero past "
                             f"{MAX_TABLE_STEPS} steps; use a smaller beta1 or capturable=False")
    products = _PRODUCTS[(beta1, momentum_decay)][:step + 1]
    table = torch.tensor([float(p) for p in products], dtype=torch.float64, device=device)
    _DEVICE_TABLES[key] = table
    return table


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One NAdam step in place on fp32 tensors, op for op as torch's single-tensor NAdam."""
    lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled = _checked(hp)
    check_step("nadam", step)
    exp_avg, exp_avg_sq = states32["exp_avg"], states32["exp_avg_sq"]
    bias_correction2 = 1.0 - beta2 ** step
    grad = grad32
    if weight_decay != 0.0:
        if decoupled:
            weight32.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(weight32, alpha=weight_decay)
    mu_now, mu_next = mu(beta1, momentum_decay, step), mu(beta1, momentum_decay, step + 1)
    product = mu_product(beta1, momentum_decay, step)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = exp_avg_sq.div(bias_correction2).sqrt().add_(eps)
    weight32.addcdiv_(grad, denom, value=(-lr * (1.0 - mu_now) / (1.0 - product)))
    weight32.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1.0 - product * mu_next))


def _scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
             mu_now: Any, mu_next: Any, product: Any, bias_correction2_sqrt: Any) -> tuple[Any, ...]:
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    coupled = 0.0 if decoupled else weight_decay
    grad_coefficient = -lr * (1.0 - mu_now) / (1.0 - product) * bias_correction2_sqrt
    avg_coefficient = (-lr * mu_next) / (1.0 - product * mu_next) * bias_correction2_sqrt
    return (decay, coupled, 1.0 - beta1, beta2, 1.0 - beta2, eps * bias_correction2_sqrt, grad_coefficient,
            avg_coefficient)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(decay factor, coupled weight decay, 1 - beta1, beta2, 1 - beta2, eps * sqrt(bc2), the gradient's
    and the first moment's coefficients times sqrt(bc2))."""
    lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled = _checked(hp)
    check_step("nadam", step)
    return _scalars(lr, beta1, beta2, eps, weight_decay, decoupled, mu(beta1, momentum_decay, step),
                    mu(beta1, momentum_decay, step + 1), mu_product(beta1, momentum_decay, step),
                    math.sqrt(1.0 - beta2 ** step))


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for a float64 step tensor on the device (capturable): mu_product from the
    device table (``device_mu_products``), the rest by torch ops on the step."""
    lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled = _checked(hp)
    table = device_mu_products(beta1, momentum_decay, step.device)
    # gather, not ``table[index]``: indexing with a 0-d tensor reads the index on the host (an
    # item(), which a CUDA graph capture refuses)
    product = table.gather(0, step.clamp(max=table.numel() - 1).long().reshape(1)).reshape(())
    mu_now = beta1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1.0) * momentum_decay))
    return _scalars(lr, beta1, beta2, eps, weight_decay, decoupled, mu_now, mu_next, product,
                    torch.sqrt(1.0 - torch.pow(beta2, step)))


@triton.jit
def epilogue(w, g, exp_avg, exp_avg_sq, unused_third, decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2,
             eps_scaled, grad_coefficient, avg_coefficient, FAST: tl.constexpr):
    """NAdam on fp32 tiles."""
    if weight_decay != 0.0:
        g = g + weight_decay * w
    w = w * decay
    exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt(exp_avg_sq) + eps_scaled
    if FAST:
        w = w + libdevice.fast_dividef(grad_coefficient * g + avg_coefficient * exp_avg, denom)
    else:
        w = w + (grad_coefficient * g + avg_coefficient * exp_avg) / denom
    return w, exp_avg, exp_avg_sq, unused_third


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.NAdam with the same hyper-parameters, for the parameters FORGE does not fuse."""
    return torch_fallback(torch.optim.NAdam, params, hp, DEFAULTS, capturable)


RULE = Rule(
    name="nadam",
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
