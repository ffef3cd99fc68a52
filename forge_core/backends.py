"""Which backend runs the fused updates, and what a capturable optimizer needs of it.

``resolve_backend`` turns ``fuse(..., backend=)`` into "triton" or "reference" for the devices the
fused weights are on; ``check_capturable`` refuses, in one line, a ``capturable=True`` optimizer
that a replayed CUDA graph could not run correctly. Both are ``ForgeOptimizer``'s (and ``fuse``'s)
checks, kept here beside nothing else they depend on.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

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


def capturable_problem(rule: Rule, backend: str, accumulate_steps: int, stochastic_rounding: bool,
                       bindings: Sequence[Any]) -> Optional[str]:
    """Why an optimizer's updates could not be replayed from a CUDA graph (the step count and kernel
    scalars read from device tensors), in one line; None when they can."""
    if takes_layer_path(rule):              # plain torch ops, on any backend (forge_core.layer_step)
        if not rule.layer_capturable:
            return f"rule {rule.name!r} syncs with the host in its layer step"
    elif backend != "triton":
        return (f"reading scalars on the device needs the Triton backend (a CUDA device, or TRITON_INTERPRET=1); this "
                f"optimizer resolved to backend={backend!r}")
    elif rule.kernel_scalars_on_device is None:
        return f"rule {rule.name!r} has no kernel_scalars_on_device"
    if accumulate_steps != 1:
        return ("accumulate_steps > 1 is not supported (the host decides per backward whether to accumulate or "
                "update, which a replayed graph cannot)")
    if stochastic_rounding:
        return "stochastic_rounding is not supported (it needs a new seed every step)"
    unreplayable = [binding.name for binding in bindings if not getattr(binding, "replayable", True)]
    if unreplayable:
        return f"{unreplayable[0]!r} reads its token counts on the host (fused experts)"
    devices = {binding.weight.device for binding in bindings}
    if len(devices) > 1:
        return f"the fused weights must share one device, got {sorted(map(str, devices))}"
    return None


def check_capturable(rule: Rule, backend: str, accumulate_steps: int, stochastic_rounding: bool,
                     bindings: Sequence[Any]) -> None:
    """A clear error for a capturable optimizer that could not be replayed correctly."""
    problem = capturable_problem(rule, backend, accumulate_steps, stochastic_rounding, bindings)
    if problem is not None:
        raise ValueError(f"capturable=True: {problem}")


__all__ = ["BACKENDS", "capturable_problem", "check_capturable", "resolve_backend"]
