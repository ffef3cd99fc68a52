"""The harness's analytic memory model: what one training step needs, per part, before it runs.

One model serves two readers: a cell's ``oom_predicted`` check (``cell.oom_prediction``: skip a cell
that clearly cannot fit the free memory) and the capability arithmetic (``capability.py``: the
largest model each arm trains on a GPU of a given size, paper App. O). Both need the same parts:
the weights, the optimizer states and the gradients alive at the optimizer boundary from the arm's
``Method.bytes_per_param``, and the activations from ``models.activation_bytes_estimate``. Every
part is a low estimate (the activations on purpose), so a prediction over the memory means the
step cannot fit, and a prediction under it means it may.
"""
from __future__ import annotations

from typing import Callable

import torch

from forge_bench import models as models_mod

BytesPerParam = Callable[[int], tuple[float, float]]
"""An arm's (optimizer-state bytes, gradient bytes alive at the optimizer boundary) per parameter,
given the weight dtype's bytes: ``Method.bytes_per_param``."""


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of the weight dtype ``dtype`` ("bfloat16", "float32", "float16")."""
    return torch.empty((), dtype=models_mod.torch_dtype(dtype)).element_size()


def predicted_bytes(model: str, bytes_per_param: BytesPerParam | None, batch: int, seq: int,
                    dtype: str = "bfloat16", activations: str = "hf",
                    checkpointed: bool = False) -> dict[str, int]:
    """Bytes of ``model``'s step at ``batch`` x ``seq`` for an arm with ``bytes_per_param`` (None:
    unknown, states and gradients counted as 0): weights, optimizer_states, gradients, activations
    and their total."""
    weight_bytes = dtype_bytes(dtype)
    n = models_mod.param_count(model)
    states, grads = bytes_per_param(weight_bytes) if bytes_per_param else (0.0, 0.0)
    parts = {
        "weights": n * weight_bytes,
        "optimizer_states": int(n * states),
        "gradients": int(n * grads),
        "activations": models_mod.activation_bytes_estimate(model, batch, seq, weight_bytes, activations,
                                                            checkpointed),
    }
    parts["total"] = sum(parts.values())
    return parts


__all__ = ["BytesPerParam", "dtype_bytes", "predicted_bytes"]
