"""DTensor parameters as the library sees them: whether a tensor is one, and its local shard.

Tensor parallelism (``torch.distributed.tensor.parallel``) and FSDP2 (``fully_shard``) turn
parameters into DTensors. The fused kernel runs on the rank's local shard (a plain tensor whose
storage the DTensor owns), so the library needs only these two questions answered.

Why through ``sys.modules``: importing ``torch.distributed.tensor`` costs ~1.4 s, and a DTensor can
exist only once its module was imported by whoever made it; a process that never made one never
pays for the import.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Optional

import torch

DTENSOR_MODULE = "torch.distributed.tensor"


def dtensor_module() -> Optional[ModuleType]:
    """``torch.distributed.tensor`` when something imported it, else None (then no DTensor exists)."""
    return sys.modules.get(DTENSOR_MODULE)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a Parameter holding one included)."""
    module = dtensor_module()
    return module is not None and isinstance(tensor, module.DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the very tensor its storage lives in: an in-place update of
    it updates the DTensor), or ``tensor`` itself when it is a plain tensor."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():          # to_local outside autograd returns the local tensor itself
        return tensor.to_local()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (a DTensor built from a shard is told its global layout)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


__all__ = ["dtensor_module", "is_dtensor", "local_shard", "contiguous_strides", "DTENSOR_MODULE"]
