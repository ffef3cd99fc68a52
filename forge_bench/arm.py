"""What every arm shares: the sweep's hyper-parameters, the ``Arm`` interface, and byte counting.

The registry (``methods.py``), the baseline and FORGE arms (``torch_arms.py``) and the peer
adapters (``peers.py``) all import this module and nothing of each other's, so the arms form a
tree under the registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol

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
    capturable: bool = False         # the step will be captured in a CUDA graph (optimizers keep steps on the GPU)
    world_size: int = 1              # ranks of a distributed arm (forge_bench/dist_cell.py)
    bucket_cap_mb: float = 25.0      # data parallel: the gradient bucket (DDP's default)


class Arm(Protocol):
    """One built method on one model."""
    settings: Mapping[str, Any]  # recorded in the row's method_settings

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One training step on ``batch`` (model inputs incl. labels); returns the loss (detached)."""
        ...

    def memory_breakdown(self) -> Mapping[str, int]:
        """Analytic bytes: {"weights", "optimizer_states", "gradients"} as the arm holds them."""
        ...


class ArmUnavailable(RuntimeError):
    """Raised by a ``build`` that cannot run on the given model (a fact about the model, which the
    device-only availability check cannot see): the cell records an ``unavailable`` row with this
    one-line message instead of crashing."""


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each once (tied weights appear once in ``parameters()``)."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as listed (no de-duplication of shared storage)."""
    return int(sum(t.numel() * t.element_size() for t in tensors))
