"""Which backend runs the fused updates, and what a capturable optimizer needs of it.

``resolve_backend`` turns ``fuse(..., backend=)`` into "triton" or "reference" for the devices the
fused weights are on; ``check_capturable`` refuses, in one line, a ``capturable=True`` optimizer
that a replayed CUDA graph could not run correctly. Both are ``ForgeOptimizer``'s (and ``fuse``'s)
checks, kept here beside nothing else they depend on.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from . import kernels
from .kernels.device import interpreting
from .layer_step import takes_layer_path
from .rules.base import Rule

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


def check_capturable(rule: Rule, backend: str, accumulate_steps: int, stochastic_rounding: bool,
                     bindings: Sequence[Any]) -> None:
    """A clear error for a capturable optimizer that could not be replayed correctly."""
    if takes_layer_path(rule):              # plain torch ops, on any backend (forge_core.layer_step)
        if not rule.layer_capturable:
            raise ValueError(f"capturable=True: rule {rule.name!r} syncs with the host in its layer step")
    elif backend != "triton":
        raise ValueError(f"capturable=True needs the Triton backend (a CUDA device, or TRITON_INTERPRET=1); "
                         f"this optimizer resolved to backend={backend!r}")
    elif rule.kernel_scalars_on_device is None:
        raise ValueError(f"capturable=True: rule {rule.name!r} has no kernel_scalars_on_device")
    if accumulate_steps != 1:
        raise ValueError("capturable=True does not support accumulate_steps > 1 (the host decides per backward "
                         "whether to accumulate or update, which a replayed graph cannot)")
    if stochastic_rounding:
        raise ValueError("capturable=True does not support stochastic_rounding (it needs a new seed every step)")
    devices = {binding.weight.device for binding in bindings}
    if len(devices) > 1:
        raise ValueError(f"capturable=True needs every fused weight on one device, got {sorted(map(str, devices))}")


__all__ = ["BACKENDS", "check_capturable", "resolve_backend"]
