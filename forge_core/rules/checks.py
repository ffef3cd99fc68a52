"""Hyper-parameter checks and torch fallbacks shared by the rule files: the Adam family validates its
``lr, betas, eps, weight_decay`` with torch.optim's bounds and messages, and every rule counts steps from 1."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .base import capturable_flag, known_hyperparameters


def filled(hp: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``hp`` with every missing hyper-parameter at its default (only the rule's own keys)."""
    return {key: hp.get(key, default) for key, default in defaults.items()}


def betas_pair(rule_name: str, value: Any, name: str = "betas") -> tuple[float, float]:
    """``value`` as ``(beta1, beta2)``: a one-line ValueError naming the rule and the value for anything but
    two numbers (``betas=(0.9,)`` raised a bare IndexError inside torch's optimizer)."""
    try:
        pair = tuple(value)
        if len(pair) != 2:
            raise ValueError
        return float(pair[0]), float(pair[1])
    except (TypeError, ValueError):
        raise ValueError(f"{rule_name}: {name} must be a pair of numbers (beta1, beta2), got {value!r}") from None


def adam_hyperparameters(rule_name: str, full: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    """``lr, beta1, beta2, eps, weight_decay`` from a filled param group, each checked as torch.optim's
    Adam family checks it (a one-line ValueError naming the rule and the value)."""
    lr, (beta1, beta2), eps = float(full["lr"]), betas_pair(rule_name, full["betas"]), float(full["eps"])
    weight_decay = float(full["weight_decay"])
    if not lr >= 0.0:
        raise ValueError(f"{rule_name}: lr must be >= 0, got {lr}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{rule_name}: betas must lie in [0, 1), got {(beta1, beta2)}")
    if not eps >= 0.0:
        raise ValueError(f"{rule_name}: eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{rule_name}: weight_decay must be >= 0, got {weight_decay}")
    return lr, beta1, beta2, eps, weight_decay


def check_step(rule_name: str, step: int) -> None:
    """Steps count from 1, as torch's optimizers count them (bias corrections divide by 1 - beta^step)."""
    if int(step) < 1:
        raise ValueError(f"{rule_name}: step is 1-based, got {step}")


def torch_fallback(optimizer_class: type[torch.optim.Optimizer], params: Any, hp: Mapping[str, Any],
                   defaults: Mapping[str, Any], capturable: bool) -> torch.optim.Optimizer:
    """torch's ``optimizer_class`` over ``params`` with the rule's hyper-parameters from ``hp`` (a param
    group's other keys left out), capturable where asked and every parameter is on CUDA."""
    params = list(params)
    return optimizer_class(params, **known_hyperparameters(hp, defaults), **capturable_flag(params, capturable))


__all__ = ["adam_hyperparameters", "betas_pair", "check_step", "filled", "torch_fallback"]
