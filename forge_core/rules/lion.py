"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    w <- w * (1 - lr * wd)
    w <- w - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g

torch has no Lion, so ``Lion`` below (a torch.optim.Optimizer built on ``reference``) is both the
fallback optimizer and the thing the fused step is compared with.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from .base import Rule, known_hyperparameters
from .checks import betas_pair

DEFAULTS = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, (beta1, beta2), weight_decay = float(full["lr"]), betas_pair("lion", full["betas"]), float(full["weight_decay"])
    if not lr >= 0.0:
        raise ValueError(f"lion: lr must be >= 0, got {lr}")
    if not (0.0 <= beta1 <= 1.0 and 0.0 <= beta2 <= 1.0):
        raise ValueError(f"lion: betas must lie in [0, 1], got {(beta1, beta2)}")
    if not weight_decay >= 0.0:
        raise ValueError(f"lion: weight_decay must be >= 0, got {weight_decay}")
    return lr, beta1, beta2, weight_decay


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: int) -> None:
    """One Lion step in place on fp32 tensors (``step`` is unused: Lion has no bias correction)."""
    lr, beta1, beta2, weight_decay = _checked(hp)
    exp_avg = states32["exp_avg"]
    weight32.mul_(1.0 - lr * weight_decay)
    direction = exp_avg.mul(beta1).add_(grad32, alpha=1.0 - beta1).sign_()
    weight32.add_(direction, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad32, alpha=1.0 - beta2)


def kernel_scalars(hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """(decay factor, lr, beta1, 1-beta1, beta2, 1-beta2)."""
    lr, beta1, beta2, weight_decay = _checked(hp)
    return (1.0 - lr * weight_decay, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2)


def kernel_scalars_on_device(hp: Mapping[str, Any], step: torch.Tensor) -> tuple[Any, ...]:
    """``kernel_scalars`` for the capturable path: Lion's do not depend on the step."""
    return kernel_scalars(hp, 1)


@triton.jit
def epilogue(w, g, exp_avg, unused_state, unused_third, decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2,
             unused_c6, unused_c7, FAST: tl.constexpr):
    """Lion on fp32 tiles; sign(0) = 0 as torch.sign."""
    w = w * decay
    blend = exp_avg * beta1 + one_minus_beta1 * g
    direction = tl.where(blend > 0.0, 1.0, tl.where(blend < 0.0, -1.0, 0.0))
    w = w - lr * direction
    exp_avg = exp_avg * beta2 + one_minus_beta2 * g
    return w, exp_avg, unused_state, unused_third


class Lion(torch.optim.Optimizer):
    """A plain torch Lion built on ``reference`` (params of any dtype; math in fp32)."""

    def __init__(self, params, lr: float = DEFAULTS["lr"], betas: tuple[float, float] = DEFAULTS["betas"],
                 weight_decay: float = DEFAULTS["weight_decay"]) -> None:
        _checked({"lr": lr, "betas": betas, "weight_decay": weight_decay})
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

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
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[param]
                if "exp_avg" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                weight32 = param.detach().float()
                exp_avg32 = state["exp_avg"].float()
                reference(weight32, param.grad.float(), {"exp_avg": exp_avg32}, group, state["step"])
                if weight32.data_ptr() != param.data_ptr():
                    param.copy_(weight32)
                if exp_avg32.data_ptr() != state["exp_avg"].data_ptr():
                    state["exp_avg"].copy_(exp_avg32)
        return loss


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """``Lion`` with the same hyper-parameters, for the parameters FORGE does not fuse (``capturable``
    needs nothing: its math never reads the step, so a graph can replay it once its state exists)."""
    return Lion(params, **known_hyperparameters(hp, DEFAULTS))


RULE = Rule(
    name="lion",
    state_names=("exp_avg",),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    epilogue=epilogue,
    kernel_scalars=kernel_scalars,
    kernel_scalars_on_device=kernel_scalars_on_device,
    sqrt_domain_states=frozenset(),
    signed_states=frozenset({"exp_avg"}),
)
