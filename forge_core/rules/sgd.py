"""SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, as torch.optim.SGD.

torch starts the momentum buffer as a copy of the first gradient (no dampening on step 1); here
"first" means ``step == 1``, so the caller's step count stands in for torch's "buffer is None".
Without momentum (``momentum == 0``, torch's default) a weight holds no state at all, as torch's
SGD holds none: ``state_names_for`` gives no states, and the kernel loads and stores none.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from .base import Rule, known_hyperparameters, torch_fused_flag

DEFAULTS = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, bool]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, momentum = float(full["lr"]), float(full["momentum"])
    dampening, weight_decay, nesterov = float(full["dampening"]), float(full["weight_decay"]), bool(full["nesterov"])
    if not lr >= 0.0:
        raise ValueError(f"sgd: lr must be >= 0, got {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"sgd: momentum must be >= 0, got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"sgd: weight_decay must be >= 0, got {weight_decay}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("sgd: nesterov needs momentum > 0 and dampening == 0")
    return lr, momentum, dampening, weight_decay, nesterov


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One SGD step in place on fp32 tensors, op for op as torch.optim.SGD (single-tensor)."""
    lr, momentum, dampening, weight_decay, nesterov = _checked(hp)
    if int(step) < 1:
        raise ValueError(f"sgd: step is 1-based, got {step}")
    grad = grad32
    if weight_decay != 0.0:
        grad = grad.add(weight32, alpha=weight_decay)
    if momentum != 0.0:
        buf = states32["momentum_buffer"]
        if step == 1:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1.0 - dampening)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    weight32.add_(grad, alpha=-lr)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(lr, weight_decay, momentum, 1 - dampening, is_first_step, nesterov) as floats."""
    lr, momentum, dampening, weight_decay, nesterov = _checked(hp)
    if int(step) < 1:
        raise ValueError(f"sgd: step is 1-based, got {step}")
    return (lr, weight_decay, momentum, 1.0 - dampening, 1.0 if step == 1 else 0.0, 1.0 if nesterov else 0.0)


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for a float64 step tensor on the device (capturable)."""
    lr, momentum, dampening, weight_decay, nesterov = _checked(hp)
    return (lr, weight_decay, momentum, 1.0 - dampening, (step == 1).to(torch.float64), 1.0 if nesterov else 0.0)


@triton.jit
def epilogue(w, g, momentum_buffer, unused_state, unused_third, lr, weight_decay, momentum, one_minus_dampening,
             is_first_step, nesterov, unused_c6, unused_c7, FAST: tl.constexpr):
    """SGD on fp32 tiles; the flags are runtime floats so a new step never recompiles."""
    if weight_decay != 0.0:
        g = g + weight_decay * w
    if momentum != 0.0:
        if is_first_step != 0.0:
            momentum_buffer = g
        else:
            momentum_buffer = momentum_buffer * momentum + one_minus_dampening * g
        if nesterov != 0.0:
            g = g + momentum * momentum_buffer
        else:
            g = momentum_buffer
    w = w - lr * g
    return w, momentum_buffer, unused_state, unused_third


def state_names_for(hp: Mapping[str, Any]) -> tuple[str, ...]:
    """The momentum buffer with momentum, nothing without."""
    return ("momentum_buffer",) if float(hp.get("momentum", DEFAULTS["momentum"])) != 0.0 else ()


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.SGD with the same hyper-parameters, for the parameters FORGE does not fuse
    (``capturable`` needs nothing: SGD keeps no step count, and a graph can replay it once its
    momentum buffers exist)."""
    params = list(params)
    return torch.optim.SGD(params, **known_hyperparameters(hp, DEFAULTS), **torch_fused_flag(params))


RULE = Rule(
    name="sgd",
    state_names=("momentum_buffer",),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=kernel_scalars_on_device,
    sqrt_domain_states=frozenset(),
    signed_states=frozenset({"momentum_buffer"}),
    state_names_for=state_names_for,
)
