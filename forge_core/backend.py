"""Which backend steps fused weights: the Triton kernels, or the plain-torch reference.

``forge_core.fuse`` and ``forge_core.distributed.fuse_fsdp`` ask once, for the devices of the weights
they fuse; the optimizer then launches one or the other (``forge_core.kernels``).
"""
from __future__ import annotations

from typing import Iterable

import torch

from . import kernels
from .kernels.device import interpreting

BACKENDS = ("auto", "triton", "reference")


def resolve_backend(backend: str, devices: Iterable[torch.device]) -> str:
    """"triton" or "reference" for fused weights on ``devices`` (see ``forge_core.fuse``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    devices = set(devices)
    needs_interpreter = any(device.type != "cuda" for device in devices)
    interpreter_on = interpreting()
    if backend == "reference":
        return "reference"
    if backend == "auto":
        if not kernels.triton_available():
            return "reference"
        return "triton" if (interpreter_on or not needs_interpreter) else "reference"
    if needs_interpreter and not interpreter_on or not kernels.triton_available():
        where = sorted({str(device) for device in devices}) or ["no fused weights"]
        raise ValueError(f"backend='triton' cannot run on {where}: the kernel needs a CUDA device, or "
                         "TRITON_INTERPRET=1 set before forge_core is imported; or use backend='reference'")
    return "triton"


__all__ = ["BACKENDS", "resolve_backend"]
