"""The arms a sweep compares: one registry entry per method.

Every entry says what it is, which packages it needs, and has an availability check that
returns ``None`` when the arm can run here or a one-line reason when it cannot (that reason
becomes an ``unavailable`` row, never a crash). ``build`` turns a model into an ``Arm``: an
object that runs one full training step (forward, backward, optimizer) on a batch.

Peers (bitsandbytes, torchao, optimi, GaLore, APOLLO, LOMO, FlashOptim) are entries here too;
their adapters live in ``forge_bench/peers.py`` so this file stays a readable registry.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    """What every arm gets: the shared optimizer hyper-parameters of a sweep."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9            # SGD arms
    device: str = "cuda"


class Arm(Protocol):
    """One built method on one model."""
    settings: Mapping[str, Any]  # recorded in the row's method_settings

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One training step on ``batch`` (model inputs incl. labels); returns the loss (detached)."""
        ...

    def memory_breakdown(self) -> Mapping[str, int]:
        """Analytic bytes: {"weights", "optimizer_states", "gradients"} as the arm holds them."""
        ...


@dataclass(frozen=True)
class Method:
    name: str
    family: str                                   # "baseline" | "forge" | "peer"
    description: str
    build: Callable[[nn.Module, TrainConfig], Arm]
    requires: tuple[str, ...] = ()                # importable module names
    needs_cuda: bool = False
    extra_check: Callable[[], str | None] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def unavailable_reason(self, device: str) -> str | None:
        """None when this arm can run on ``device``; otherwise why not, in one line."""
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{self.name}: Python package '{module}' is not installed"
        if self.needs_cuda and (not device.startswith("cuda") or not torch.cuda.is_available()):
            return f"{self.name}: needs a CUDA device (device={device}, cuda available={torch.cuda.is_available()})"
        if self.extra_check is not None:
            return self.extra_check()
        return None


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(sorted(METHODS))}") from None

# --- registry entries below (baselines and FORGE arms: forge_bench harness; peers: forge_bench/peers.py) ---
