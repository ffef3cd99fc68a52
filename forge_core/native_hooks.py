"""The eager fused Linear's backward hook in C++ (``forge_core/native/update_hook.cpp``).

Why: an eager step at batch 1 is bound by the host. With a Python hook every fused layer's backward
enters the interpreter, runs the optimizer's bookkeeping and checks its recorded update's key before one
graph launch (``forge_core.update_graphs``). The C++ hook checks the key itself and launches the
recorded graph from the autograd thread, without the GIL; whatever it cannot replay (no recording yet,
another placement, a capture around the backward, the step's scalars not yet checked) it hands to the
Python update, so the results are the Python path's, bit for bit.

Under ``torch.compile`` the backward calls the operator ``forge::update_weight_`` instead of a hook; the
extension registers that operator's kernel for CUDA tensors (``serve_traced_updates``), which replays the
same recordings where the compiled graph hands the operator its owner's own tensors and runs the operator's
Python body otherwise.

The extension is built by torch's C++ extension loader at its first use and cached (``make install``
and the GPU machine's setup build it ahead). Where it cannot be built or loaded (no compiler, no
ninja) FORGE says so in one warning and keeps the Python hook. ``FORGE_NATIVE_HOOKS=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import torch

NATIVE_HOOKS = os.environ.get("FORGE_NATIVE_HOOKS", "1") != "0"
"""Whether eager fused updates may run through the C++ hook; read once at import (a test may set it)."""
ON_CPU_TOO = False
"""Whether weights on the CPU get the C++ hook too (nothing to replay there: tests set it)."""
SOURCE = Path(__file__).parent / "native" / "update_hook.cpp"
EXTENSION_NAME = "forge_update_hook"

_extension: Optional[ModuleType] = None
_problem: Optional[str] = None
_traced_kernels: dict[str, Any] = {}
"""The registrations of the ``forge::update_weight_`` kernel, by dispatch key (each lives as long as it is held)."""


def load() -> Optional[ModuleType]:
    """The extension, built on first use (torch's cache keeps it for later processes); None, with
    ``problem()`` saying why and one warning, where it cannot be built or loaded."""
    global _extension, _problem
    if _extension is not None or _problem is not None:
        return _extension
    if not NATIVE_HOOKS:
        _problem = "FORGE_NATIVE_HOOKS=0"
        return None
    try:
        from torch.utils import cpp_extension
        with _ninja_on_path():
            _extension = cpp_extension.load(name=EXTENSION_NAME, sources=[str(SOURCE)], extra_cflags=["-O2"],
                                            verbose=False)
    except Exception as error:  # no compiler, no ninja, headers that do not match: the Python hook stays
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        _problem = f"the C++ update hook could not be built or loaded ({type(error).__name__}: {first_line})"
        warnings.warn(f"FORGE: {_problem}; eager fused updates use the Python hook", RuntimeWarning, stacklevel=2)
    return _extension


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's loader runs ``ninja`` from PATH; the ``ninja`` package FORGE depends on installs it beside the
    interpreter, which a venv's python run by its path does not put on PATH."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:         # the loader then says ninja is missing, and load() warns with that
            pass
    try:
        yield
    finally:
        os.environ["PATH"] = path


def status() -> Optional[str]:
    """"loaded", or why the C++ hook is not in use; None where nothing asked for it yet (no CUDA weights fused)."""
    return "loaded" if _extension is not None else _problem


def problem() -> Optional[str]:
    """Why the C++ hook is not in use (after ``load``), or None."""
    return _problem


def wanted(devices: set[torch.device]) -> bool:
    """Whether weights on ``devices`` get the C++ hook: CUDA weights (their recorded updates replay), and
    CPU ones where ``ON_CPU_TOO`` (tests)."""
    if not NATIVE_HOOKS or not devices:
        return False
    return all(device.type == "cuda" or (ON_CPU_TOO and device.type == "cpu") for device in devices)


def new_gate() -> Any:
    """The switch an optimizer opens once its step's device scalars are current (``Slot``s read it)."""
    extension = load()
    return None if extension is None else extension.Gate()


def new_slot(gate: Any, weight: torch.Tensor, update: Callable[[torch.Tensor, torch.Tensor], None]) -> Any:
    """One fused weight's native side: its recorded updates (``add``/``remove``/``clear``), its backward
    count since the last step (``count``) and the Python ``update(first, second)`` everything else runs."""
    extension = load()
    if extension is None:
        raise RuntimeError(f"FORGE's C++ update hook is not available: {_problem}")
    return extension.Slot(gate, weight, update)


def name_slot(key: int, slot: Any) -> None:
    """Let the compiled backward's ``forge::update_weight_`` calls for the weight ``key`` names
    (``forge_core.traced.trace_key``) replay ``slot``'s recordings (held weakly)."""
    _extension.name_slot(key, slot)


def serve_traced_updates(devices: set[torch.device], body: Callable[..., None]) -> None:
    """Register the C++ kernel of ``forge::update_weight_`` for the device types of ``devices`` (CUDA; the CPU
    where ``ON_CPU_TOO``), once per process: it replays a named slot's recording (``name_slot``) and calls
    ``body``, the operator's Python body, for everything else."""
    for device_type in sorted({device.type for device in devices}):
        if device_type == "cuda" or (ON_CPU_TOO and device_type == "cpu"):
            key = device_type.upper()
            if key not in _traced_kernels:
                _traced_kernels[key] = _extension.register_traced_kernel(key, body)


def hooked_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], slot: Any,
                   transposed: bool) -> Optional[torch.Tensor]:
    """``forge_core.linear.hooked_linear`` after its global checks, in C++: the GEMM on a detached alias of
    the weight, and the C++ hook on its node, which replays or runs ``slot``'s update with (x, dY)
    (``transposed``: (dY, x)) once the node has computed dX. None where that path does not apply."""
    return _extension.hooked_forward(x, weight, bias, slot, transposed)


def native_replays() -> int:
    """Updates the C++ hook replayed since the last ``reset_native_replays`` (0 when it is not loaded)."""
    return _extension.replays() if _extension is not None else 0


def native_replay_seconds() -> float:
    """Host seconds those replays took, each from its key's match to the graph launch's return (0.0 when the
    hook is not loaded): what a profile reports per replay, where no Python runs to be timed."""
    return _extension.replay_seconds() if _extension is not None else 0.0


def reset_native_replays() -> None:
    """Zero ``native_replays`` and ``native_replay_seconds``."""
    if _extension is not None:
        _extension.reset_replays()


__all__ = ["NATIVE_HOOKS", "ON_CPU_TOO", "load", "status", "problem", "wanted", "new_gate", "new_slot", "name_slot", "serve_traced_updates", "hooked_forward",
           "native_replays", "native_replay_seconds", "reset_native_replays"]
