"""Scalar arithmetic of the per-layer rules that works on Python floats and on 0-d tensors alike.

A rule's reference gets the step as an ``int`` in an eager step and as a 0-d device tensor when
the optimizer is capturable (the count lives on the GPU so a replayed CUDA graph reads the
current one). Norms are 0-d tensors in both cases: reading them on the host would sync with the
device once per layer, and a CUDA graph cannot capture a sync. These helpers keep one reference
for both.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Union

import torch

Scalar = Union[float, torch.Tensor]


def at_most(value: Scalar, bound: float) -> Scalar:
    """``min(value, bound)`` for a float or a tensor."""
    return torch.clamp(value, max=bound) if isinstance(value, torch.Tensor) else min(value, bound)


def at_least(value: Scalar, bound: float) -> Scalar:
    """``max(value, bound)`` for a float or a tensor."""
    return torch.clamp(value, min=bound) if isinstance(value, torch.Tensor) else max(value, bound)


def square_root(value: Scalar) -> Scalar:
    """``sqrt`` of a float or a tensor."""
    return torch.sqrt(value) if isinstance(value, torch.Tensor) else math.sqrt(value)


def step_value(step: Any) -> Scalar:
    """The step as a float, or as the 0-d tensor it is (float64 kept)."""
    if isinstance(step, torch.Tensor):
        return step if step.is_floating_point() else step.double()
    value = float(step)
    if value < 1.0:
        raise ValueError(f"the step is 1-based, got {step}")
    return value


def like(value: Scalar, tensor: torch.Tensor) -> Scalar:
    """``value`` ready to scale ``tensor`` in place: a tensor in ``tensor``'s dtype, or the float."""
    return value.to(tensor.dtype) if isinstance(value, torch.Tensor) else value


def norm(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``tensor`` as a 0-d fp32 tensor, accumulated in fp32 for a bf16 tensor too
    (no fp32 copy of it, no host sync)."""
    return torch.linalg.vector_norm(tensor, dtype=torch.float32)


def rms(tensor: torch.Tensor) -> torch.Tensor:
    """The root mean square of ``tensor`` as a 0-d fp32 tensor (as ``norm``)."""
    return norm(tensor) / math.sqrt(max(tensor.numel(), 1))


ROW_BLOCK_BYTES = 256 * 2 ** 20
"""The most bytes of an fp32 layer-sized temporary a per-layer rule holds at once (``row_blocks``)."""


def row_blocks(matrix: torch.Tensor) -> Iterator[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of ``matrix`` whose fp32 temporaries stay under ``ROW_BLOCK_BYTES``.

    Why: a rule whose update needs an elementwise temporary of the layer's shape (Adafactor's
    factored second moment, SM3's estimate) computes it block by block into G, so the layer step
    holds G and one block, not G twice: at Llama-3.1-8B's LM head a second fp32 layer is 2.1 GB. A
    hidden layer of an 8B model is one block; the head is eight. The arithmetic per element is the
    same whatever the blocks."""
    rows, cols = matrix.shape
    step = max(1, ROW_BLOCK_BYTES // (4 * max(cols, 1)))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


__all__ = ["ROW_BLOCK_BYTES", "Scalar", "at_least", "at_most", "like", "norm", "rms", "row_blocks", "square_root",
           "step_value"]
