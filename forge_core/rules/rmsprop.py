"""RMSprop, as torch.optim.RMSprop computes it (momentum and centered options, coupled weight decay).

    g <- g + wd * w
    square_avg <- alpha * square_avg + (1 - alpha) * g^2
    grad_avg   <- grad_avg + (1 - alpha) * (g - grad_avg)                   (centered)
    avg <- sqrt(square_avg - grad_avg^2) + eps   (centered)   or   sqrt(square_avg) + eps
    buf <- momentum * buf + g / avg;  w <- w - lr * buf                     (momentum > 0)
    w <- w - lr * g / avg                                                   (otherwise)

A weight holds ``square_avg``, plus ``momentum_buffer`` with momentum and ``grad_avg`` when centered
(``state_names_for``, as torch allocates them), so the kernel runs one of four epilogues, one per
state set, with one to three state slots. The centered variance is clamped at zero before its square
root: torch would return NaN where rounding makes it negative, which with quantized states (the two
moments rounded apart) happens where the variance is tiny next to the mean's square.

Centered RMSprop takes fp32 and bf16 states only (``format_refusal``): its variance ``square_avg -
grad_avg^2`` is the difference of two moments stored apart, and int8 / fp8 codes keep neither to better
than their block's step (int8) or 1/16 (fp8), so a variance small next to ``grad_avg^2`` reads back as 0 and
the step is ``g / eps``. ``tests/test_differential.py`` saw steps up to 10^6 (int8) and 2100 (fp8) times
torch's largest; flooring the variance at its exact lower bound ``alpha (1 - alpha) (g - grad_avg_old)^2``
left 350 (int8), 8900 (int8, momentum) and 135 (fp8, momentum): a gradient near its stored mean makes that
bound 0 too.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .base import Rule
from .checks import torch_fallback

DEFAULTS = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False}
STATE_NAMES = ("square_avg", "momentum_buffer", "grad_avg")


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, bool]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, alpha, eps = float(full["lr"]), float(full["alpha"]), float(full["eps"])
    weight_decay, momentum, centered = float(full["weight_decay"]), float(full["momentum"]), bool(full["centered"])
    if not lr >= 0.0:
        raise ValueError(f"rmsprop: lr must be >= 0, got {lr}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"rmsprop: alpha must lie in [0, 1], got {alpha}")
    if not eps >= 0.0:
        raise ValueError(f"rmsprop: eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"rmsprop: weight_decay must be >= 0, got {weight_decay}")
    if not momentum >= 0.0:
        raise ValueError(f"rmsprop: momentum must be >= 0, got {momentum}")
    return lr, alpha, eps, weight_decay, momentum, centered


def state_names_for(hp: Mapping[str, Any]) -> tuple[str, ...]:
    """``square_avg``, ``momentum_buffer`` with momentum, ``grad_avg`` when centered."""
    _, _, _, _, momentum, centered = _checked(hp)
    return tuple(name for name, held in zip(STATE_NAMES, (True, momentum > 0.0, centered)) if held)


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One RMSprop step in place on fp32 tensors, op for op as torch's single-tensor RMSprop (``step``
    is unused: RMSprop has no bias correction)."""
    lr, alpha, eps, weight_decay, momentum, centered = _checked(hp)
    grad = grad32
    if weight_decay != 0.0:
        grad = grad.add(weight32, alpha=weight_decay)
    square_avg = states32["square_avg"]
    square_avg.mul_(alpha).addcmul_(grad, grad, value=1.0 - alpha)
    if centered:
        grad_avg = states32["grad_avg"]
        grad_avg.lerp_(grad, 1.0 - alpha)
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1.0).clamp_min_(0.0).sqrt_()
    else:
        avg = square_avg.sqrt()
    avg.add_(eps)
    if momentum > 0.0:
        buf = states32["momentum_buffer"]
        buf.mul_(momentum).addcdiv_(grad, avg)
        weight32.add_(buf, alpha=-lr)
    else:
        weight32.addcdiv_(grad, avg, value=-lr)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(lr, alpha, 1 - alpha, eps, weight_decay, momentum)."""
    lr, alpha, eps, weight_decay, momentum, _ = _checked(hp)
    return (lr, alpha, 1.0 - alpha, eps, weight_decay, momentum)


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for the capturable path: RMSprop's do not depend on the step."""
    return kernel_scalars(hp, 1)


@triton.jit
def _rmsprop(w, g, square_avg, momentum_buffer, grad_avg, lr, alpha, one_minus_alpha, eps, weight_decay, momentum,
             MOMENTUM: tl.constexpr, CENTERED: tl.constexpr, FAST: tl.constexpr):
    """RMSprop on fp32 tiles; ``MOMENTUM`` / ``CENTERED`` say which states the weight holds."""
    if weight_decay != 0.0:
        g = g + weight_decay * w
    square_avg = square_avg * alpha + one_minus_alpha * g * g
    if CENTERED:
        grad_avg = grad_avg + one_minus_alpha * (g - grad_avg)
        avg = tl.sqrt(tl.maximum(square_avg - grad_avg * grad_avg, 0.0)) + eps
    else:
        avg = tl.sqrt(square_avg) + eps
    if FAST:
        scaled = libdevice.fast_dividef(g, avg)
    else:
        scaled = g / avg
    if MOMENTUM:
        momentum_buffer = momentum_buffer * momentum + scaled
        w = w - lr * momentum_buffer
    else:
        w = w - lr * scaled
    return w, square_avg, momentum_buffer, grad_avg


@triton.jit
def epilogue(w, g, square_avg, momentum_buffer, grad_avg, lr, alpha, one_minus_alpha, eps, weight_decay, momentum,
             unused_c6, unused_c7, FAST: tl.constexpr):
    """Momentum and centered: three states."""
    return _rmsprop(w, g, square_avg, momentum_buffer, grad_avg, lr, alpha, one_minus_alpha, eps, weight_decay,
                    momentum, True, True, FAST)


@triton.jit
def epilogue_plain(w, g, square_avg, unused_state, unused_third, lr, alpha, one_minus_alpha, eps, weight_decay,
                   momentum, unused_c6, unused_c7, FAST: tl.constexpr):
    """Neither momentum nor centered: ``square_avg`` alone."""
    return _rmsprop(w, g, square_avg, unused_state, unused_third, lr, alpha, one_minus_alpha, eps, weight_decay,
                    momentum, False, False, FAST)


@triton.jit
def epilogue_momentum(w, g, square_avg, momentum_buffer, unused_third, lr, alpha, one_minus_alpha, eps,
                      weight_decay, momentum, unused_c6, unused_c7, FAST: tl.constexpr):
    """Momentum, not centered: ``square_avg``, ``momentum_buffer``."""
    return _rmsprop(w, g, square_avg, momentum_buffer, unused_third, lr, alpha, one_minus_alpha, eps, weight_decay,
                    momentum, True, False, FAST)


@triton.jit
def epilogue_centered(w, g, square_avg, grad_avg, unused_third, lr, alpha, one_minus_alpha, eps, weight_decay,
                      momentum, unused_c6, unused_c7, FAST: tl.constexpr):
    """Centered, no momentum: ``square_avg``, ``grad_avg`` (the second slot)."""
    w, square_avg, unused_third, grad_avg = _rmsprop(w, g, square_avg, unused_third, grad_avg, lr, alpha,
                                                     one_minus_alpha, eps, weight_decay, momentum, False, True, FAST)
    return w, square_avg, grad_avg, unused_third


def format_refusal(hp: Mapping[str, Any], state_dtype: str) -> str | None:
    """Centered RMSprop with int8 / fp8 states (module docstring), or None."""
    if bool(hp["centered"]) and state_dtype in ("int8", "fp8"):
        return (f"rule 'rmsprop': centered=True cannot keep {state_dtype} states: its variance square_avg - grad_avg^2, "
                f"a difference of two moments rounded apart, reads back as 0 where it is small and the step becomes "
                "g / eps; use fp32 or bf16 states, or centered=False")
    return None


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.RMSprop with the same hyper-parameters, for the parameters FORGE does not fuse."""
    return torch_fallback(torch.optim.RMSprop, params, hp, DEFAULTS, capturable)


RULE = Rule(
    name="rmsprop",
    state_names=STATE_NAMES,
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=kernel_scalars_on_device,
    sqrt_domain_states=frozenset({"square_avg"}),
    signed_states=frozenset({"momentum_buffer", "grad_avg"}),
    nonzero_code_states=frozenset({"momentum_buffer"}),
    state_names_for=state_names_for,
    format_refusal=format_refusal,
    epilogues={("square_avg",): epilogue_plain, ("square_avg", "momentum_buffer"): epilogue_momentum,
               ("square_avg", "grad_avg"): epilogue_centered},
)
