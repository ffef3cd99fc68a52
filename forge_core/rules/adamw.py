"""AdamW (decoupled weight decay, bias correction), as torch.optim.AdamW computes it.

The reference mirrors torch's single-tensor AdamW op for op (``lerp_`` for the first moment,
``addcmul_`` for the second, ``addcdiv_`` with ``-lr / bias_correction1``), so that with fp32
weights and fp32 states it is torch.optim.AdamW; the epilogue is the same arithmetic on a tile.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule, known_hyperparameters, torch_fused_flag
from .checks import adam_hyperparameters, check_step, filled

DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    full = filled(hp, DEFAULTS)
    lr, beta1, beta2, eps, weight_decay = adam_hyperparameters("adamw", full)
    return lr, beta1, beta2, eps, weight_decay


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One AdamW step in place on fp32 tensors: the spec the fused epilogue is tested against."""
    lr, beta1, beta2, eps, weight_decay = _checked(hp)
    check_step("adamw", step)
    exp_avg, exp_avg_sq = states32["exp_avg"], states32["exp_avg_sq"]
    weight32.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad32, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    weight32.addcdiv_(exp_avg, denom, value=-step_size)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """Host-side float64 scalars: (decay factor, 1-b1, b2, 1-b2, lr/bc1, sqrt(bc2), eps)."""
    lr, beta1, beta2, eps, weight_decay = _checked(hp)
    check_step("adamw", step)
    return (1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2,
            lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), eps)


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for a float64 step tensor on the device (capturable; float64 like the host)."""
    lr, beta1, beta2, eps, weight_decay = _checked(hp)
    return (1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2,
            lr / (1.0 - torch.pow(beta1, step)), torch.sqrt(1.0 - torch.pow(beta2, step)), eps)


@triton.jit
def epilogue(w, g, exp_avg, exp_avg_sq, unused_state, decay, one_minus_beta1, beta2, one_minus_beta2,
             step_size, bias_correction2_sqrt, eps, unused, FAST: tl.constexpr):
    """AdamW on fp32 tiles. The moments are computed exactly as torch does; the update uses the
    fast fp32 sqrt / division (a few ulp), far inside the 1e-6 relative tolerance on the weight,
    and keeps the memory-bound epilogue cheap. With ``FAST`` (the GPU) the per-element division is
    the hardware reciprocal times the numerator (2 instructions, <= 2 ulp; the default fp32
    division adds range checks and scaling: ~7); ``denom >= eps > 0`` keeps it in range."""
    w = w * decay
    exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    if FAST:
        # a per-element division by the scalar compiled to the full division's range scaling
        # (FMUL, FSEL, predicated FMUL, FFMA per element); one reciprocal per program and an FFMA
        # per element instead (<= 1.5 ulp on denom)
        denom = tl.sqrt(exp_avg_sq) * (1.0 / bias_correction2_sqrt) + eps
        w = w - step_size * libdevice.fast_dividef(exp_avg, denom)
    else:
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        w = w - step_size * (exp_avg / denom)
    return w, exp_avg, exp_avg_sq, unused_state


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.AdamW with the same hyper-parameters, for the parameters FORGE does not fuse
    (``capturable``: torch's own flag, step counts on the device so a CUDA graph can replay it)."""
    params = list(params)
    fused = torch_fused_flag(params)
    flags = {"capturable": True} if capturable and fused else {}   # torch allows it on CUDA tensors only
    return torch.optim.AdamW(params, **known_hyperparameters(hp, DEFAULTS), **fused, **flags)


RULE = Rule(
    name="adamw",
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
