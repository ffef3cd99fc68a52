"""The optimizer states of every fused weight of an optimizer in one buffer per device and storage dtype.

Why: a compiled forward hands each fused layer's update operator every tensor the update writes
(``forge_core.traced``), and each of them is an input of the compiled graphs: Dynamo guards it, AOTAutograd
carries it from the forward to the backward and Inductor checks its size and strides, at every call. Llama-3.2-1B
has 224 moments; with each weight's states views of one buffer per dtype, the operators are handed the
buffers instead (one for fp32 or bf16 states, two for int8 / fp8: codes and scales), and a compiled graph takes
one or two inputs where it took two a weight. Each operator declares the buffers it is handed mutated, which
they are, in the part its weight owns; the compiler keeps the operators in order and runs them on the
buffers themselves (Inductor's code, read on the CPU, hands each operator the buffer: no copy of it).

The views are what the kernels and ``state_dict`` see: contiguous, each starting on ``ALIGN`` bytes (TMA
descriptors need 16). ``torch.save`` of a whole ``state_dict`` writes each buffer once; a view saved on its
own carries its buffer with it, as any view in torch does.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

ALIGN = 512
"""Bytes each view starts on, from its buffer's start."""

Request = tuple[tuple[int, ...], torch.dtype, torch.device]
"""One tensor a state will hold: its shape, storage dtype and device."""


def _aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up to whole ``ALIGN``-byte steps, in elements of ``dtype``."""
    step = max(1, ALIGN // torch.empty((), dtype=dtype).element_size())
    return int(math.ceil(numel / step) * step)


class StateArena:
    """Buffers planned from ``requests`` and handed out in views, in any order within a dtype
    (``allocate``); a request beyond the plan is an error, not a new allocation."""

    def __init__(self, requests: Iterable[Request]) -> None:
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for shape, dtype, device in requests:
            key = (torch.device(device), dtype)
            sizes[key] = sizes.get(key, 0) + _aligned_numel(math.prod(shape), dtype)
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {
            key: torch.zeros(size, dtype=key[1], device=key[0]) for key, size in sizes.items() if size}
        self._next = {key: 0 for key in self.buffers}

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed view of ``shape`` in the buffer of ``device`` and ``dtype`` (``ParamState``'s ``allocate``)."""
        key = (torch.device(device), dtype)
        numel = math.prod(shape)
        start = self._next.get(key)
        buffer = self.buffers.get(key)
        if buffer is None or start is None or start + numel > buffer.numel():
            raise RuntimeError(f"the state arena was not planned for another {tuple(shape)} {dtype} tensor on {device}")
        self._next[key] = start + _aligned_numel(numel, dtype)
        return buffer[start:start + numel].view(shape)

    def holding(self, tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The buffers that hold any of ``tensors``, in the arena's order."""
        buffers = tuple(self.buffers.values())
        held = {inside(tensor, buffers) for tensor in tensors}
        return tuple(buffer for index, buffer in enumerate(buffers) if index in held)


def inside(tensor: torch.Tensor, buffers: Iterable[torch.Tensor]) -> Optional[int]:
    """The index of the buffer of ``buffers`` whose storage ``tensor`` views, or None."""
    storage = tensor.untyped_storage().data_ptr()
    return next((i for i, buffer in enumerate(buffers) if buffer.untyped_storage().data_ptr() == storage), None)


def view_in(tensor: torch.Tensor, own: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The view of ``other`` (a copy of the buffer ``own``) where ``tensor`` lies in ``own``."""
    return other.as_strided(tensor.size(), tensor.stride(),
                            tensor.storage_offset() - own.storage_offset() + other.storage_offset())


__all__ = ["ALIGN", "Request", "StateArena", "inside", "view_in"]
