"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2), regime 2.

    m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2
    m_hat = m / (1 - beta1^t);  v_hat = v / (1 - beta2^t)             (Adam's bias correction)
    r = m_hat / (sqrt(v_hat) + eps) + wd * w
    ratio = ||w|| / ||r||  (1 where either norm is 0; at most 1 with trust_clip)
    w <- w - lr * ratio * r

The norms are per tensor (a layer's weight). This is the paper's algorithm with phi the identity and
the bias correction that the common PyTorch implementations apply by default: timm's ``Lamb``
(``bias_correction=True, grad_averaging=True``) and NVIDIA apex's ``FusedLAMB`` (``bias_correction=True``),
with their defaults that change the algorithm off: no global gradient-norm clipping (timm
``max_grad_norm=None``, apex ``max_grad_norm=0``), and the trust ratio applied to every tensor, also
those without weight decay (timm ``always_adapt=True``, apex ``use_nvlamb=True``). ``trust_clip``
clamps the ratio at 1 as timm's does. torch has no LAMB: ``Lamb`` below (a torch.optim.Optimizer on
``reference``) is the fallback optimizer and what the fused step is compared with.

Fused (regime 2): the fused kernel's epilogue updates m and v and returns the terms w^2 and r^2,
which the kernel sums over the layer (``ParamState.layer_sums``); the second pass (``apply``) reads
the two sums, recomputes r from the stored moments and writes w. G is never formed. r is computed
as ``k m / (sqrt(v) + eps sqrt(bc2)) + wd w`` with ``k = sqrt(bc2) / bc1`` (the same value up to
rounding). The fp32 sums come from atomics in program order, which varies between GPU runs: the
ratio can differ by an ulp from run to run there (the CPU interpreter runs programs in order).
The second pass reads the moments as stored: with fp32 states that is the reference; with bf16, int8
or fp8 states W moves by r of the rounded moments (the norms are those of the unrounded ones), where
a regime-1 rule's update uses the moments before their rounding.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule, known_hyperparameters
from .checks import adam_hyperparameters, check_step, filled

DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01, "trust_clip": False}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, bool]:
    full = filled(hp, DEFAULTS)
    lr, beta1, beta2, eps, weight_decay = adam_hyperparameters("lamb", full)
    return lr, beta1, beta2, eps, weight_decay, bool(full["trust_clip"])


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor, trust_clip: bool) -> torch.Tensor:
    """||w|| / ||r||, 1 where either norm is 0, clamped at 1 with ``trust_clip``."""
    ratio = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm,
                        torch.ones_like(weight_norm))
    return ratio.clamp(max=1.0) if trust_clip else ratio


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One LAMB step in place on fp32 tensors (the module docstring's algorithm)."""
    lr, beta1, beta2, eps, weight_decay, trust_clip = _checked(hp)
    check_step("lamb", step)
    exp_avg, exp_avg_sq = states32["exp_avg"], states32["exp_avg_sq"]
    exp_avg.lerp_(grad32, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    update = (exp_avg / (1.0 - beta1 ** step)).div_(denom)
    if weight_decay != 0.0:
        update.add_(weight32, alpha=weight_decay)
    ratio = trust_ratio(weight32.norm(), update.norm(), trust_clip)
    weight32.sub_(update * (lr * ratio))


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(1 - beta1, beta2, 1 - beta2, sqrt(bc2) / bc1, eps * sqrt(bc2), weight_decay, lr, 1.0 with trust_clip)."""
    lr, beta1, beta2, eps, weight_decay, trust_clip = _checked(hp)
    check_step("lamb", step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    return (1.0 - beta1, beta2, 1.0 - beta2, bias_correction2_sqrt / (1.0 - beta1 ** step), eps * bias_correction2_sqrt,
            weight_decay, lr, 1.0 if trust_clip else 0.0)


@triton.jit
def _update_direction(w, exp_avg, exp_avg_sq, moment_scale, eps_scaled, weight_decay, FAST: tl.constexpr):
    """r = k m / (sqrt(v) + eps sqrt(bc2)) + wd w on fp32 tiles."""
    denom = tl.sqrt(exp_avg_sq) + eps_scaled
    if FAST:
        return moment_scale * libdevice.fast_dividef(exp_avg, denom) + weight_decay * w
    else:
        return moment_scale * (exp_avg / denom) + weight_decay * w


@triton.jit
def epilogue(w, g, exp_avg, exp_avg_sq, unused_third, one_minus_beta1, beta2, one_minus_beta2, moment_scale,
             eps_scaled, weight_decay, lr, trust_clip, FAST: tl.constexpr):
    """The accumulate: new moments, and the terms of ||w||^2 and ||r||^2; w is returned as it came."""
    exp_avg = exp_avg + one_minus_beta1 * (g - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    r = _update_direction(w, exp_avg, exp_avg_sq, moment_scale, eps_scaled, weight_decay, FAST)
    return w, exp_avg, exp_avg_sq, unused_third, w * w, r * r


@triton.jit
def apply(w, exp_avg, exp_avg_sq, unused_third, weight_sq_sum, update_sq_sum, one_minus_beta1, beta2,
          one_minus_beta2, moment_scale, eps_scaled, weight_decay, lr, trust_clip, FAST: tl.constexpr):
    """The second pass: w from the stored moments and the layer's two sums (the trust ratio)."""
    weight_norm = tl.sqrt(weight_sq_sum)
    update_norm = tl.sqrt(update_sq_sum)
    ratio = tl.where((weight_norm > 0.0) & (update_norm > 0.0), weight_norm / update_norm, 1.0)
    if trust_clip != 0.0:
        ratio = tl.minimum(ratio, 1.0)
    r = _update_direction(w, exp_avg, exp_avg_sq, moment_scale, eps_scaled, weight_decay, FAST)
    return w - (lr * ratio) * r


class Lamb(torch.optim.Optimizer):
    """A plain torch LAMB built on ``reference`` (params of any dtype; math in fp32; one trust ratio per
    parameter tensor)."""

    def __init__(self, params, lr: float = DEFAULTS["lr"], betas: tuple[float, float] = DEFAULTS["betas"],
                 eps: float = DEFAULTS["eps"], weight_decay: float = DEFAULTS["weight_decay"],
                 trust_clip: bool = DEFAULTS["trust_clip"]) -> None:
        hp = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "trust_clip": trust_clip}
        _checked(hp)
        super().__init__(params, hp)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[param]
                if "exp_avg" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                weight32 = param.detach().float()
                moments = {name: state[name].float() for name in ("exp_avg", "exp_avg_sq")}
                reference(weight32, param.grad.float(), moments, group, state["step"])
                if weight32.data_ptr() != param.data_ptr():
                    param.copy_(weight32)
                for name, value in moments.items():
                    if value.data_ptr() != state[name].data_ptr():
                        state[name].copy_(value)
        return loss


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """``Lamb`` with the same hyper-parameters, for the parameters FORGE does not fuse."""
    return Lamb(params, **known_hyperparameters(hp, DEFAULTS))


RULE = Rule(
    name="lamb",
    state_names=("exp_avg", "exp_avg_sq"),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=None,
    sqrt_domain_states=frozenset({"exp_avg_sq"}),
    signed_states=frozenset({"exp_avg"}),
    layer_sums=2,
    regime=2,
    apply=apply,
    refusals={"capturable": "its fallback Lamb (for the parameters FORGE does not fuse) counts steps on the host"},
)
