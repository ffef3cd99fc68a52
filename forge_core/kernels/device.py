"""Where the Triton kernels run: a CUDA device, or the CPU under the Triton interpreter.

Why a module of its own: every kernel module asks these questions, and none of them needs Triton
to answer (``forge_core.kernels`` stays importable, and cheap, for a torch-only arm).
"""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on_device_of(tensor: torch.Tensor, decorated_for_interpreter: bool) -> bool:
    """Whether kernels decorated while ``TRITON_INTERPRET`` was ``decorated_for_interpreter`` can run
    on ``tensor``'s device: interpreted kernels on the CPU only, compiled ones on CUDA only (triton.jit
    reads the variable when it decorates, so each kernel module records it at import)."""
    if decorated_for_interpreter:
        return tensor.device.type == "cpu"
    return tensor.is_cuda


def triton_available() -> bool:
    """Whether the fused kernel can run here: a CUDA device, or the Triton interpreter."""
    return torch.cuda.is_available() or interpreting()
