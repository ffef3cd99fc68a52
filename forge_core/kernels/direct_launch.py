"""Launching a compiled Triton kernel without its JIT's per-call work.

Why: Triton's JIT binds and specialises every argument, hashes the key and reads its knobs on each
call, about 100 us a launch on the H100 hosts, and an eager Llama step makes a few hundred fused
launches. Once a plan's first launch returned its compiled kernel, the later launches of the same
layout can call the compiled launcher directly (``launch.direct_launcher`` for the Triton tile
kernel, ``hopper_ws.direct_launcher`` for the Gluon kernel). These helpers read what that needs
from the compiled kernel, and return None wherever this Triton lays it out differently (the JIT
path then runs, as it would have).
"""
from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import triton

from .device import interpreting


def direct_launch_enabled() -> bool:
    """``FORGE_DIRECT_LAUNCH=0`` keeps every launch on Triton's JIT path (to A/B the host cost)."""
    return os.environ.get("FORGE_DIRECT_LAUNCH", "1") != "0"


def constexpr_tail(kernel: Any) -> tuple[str, ...] | None:
    """``kernel``'s constexpr parameter names when they all follow its runtime parameters (the layout
    the direct launchers rely on), else None."""
    params = getattr(kernel, "params", None)
    if params and all(hasattr(p, "is_constexpr") and hasattr(p, "name") for p in params):
        flagged = [(p.name, bool(p.is_constexpr)) for p in params]
    else:       # the interpreter's wrapper has no params: read the annotations (strings here)
        signature = inspect.signature(kernel.fn)
        flagged = [(name, str(p.annotation).endswith("constexpr")) for name, p in signature.parameters.items()]
    flags = [flag for _, flag in flagged]
    first = flags.index(True) if True in flags else len(flags)
    if not all(flags[first:]):
        return None
    return tuple(name for name, _ in flagged[first:])


def as_pointers(values: tuple) -> tuple:
    """``values`` with every tensor replaced by its device address. Why: Triton's C launcher resolves a
    tensor argument by calling its ``data_ptr`` and then asking the driver about the address
    (``cuPointerGetAttribute``), per pointer and launch, a dozen driver calls for the fused kernel;
    an int it takes as it is. Only for tensors whose storage a launcher's later calls keep (a plan
    keys on the weight's address and the states' identity)."""
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)


def current_device_getter(driver_getter: Callable[[], int]) -> Callable[[], int]:
    """The driver's current-device getter, or torch's C function behind it where that is
    ``torch.cuda.current_device`` (whose Python lazy-init check ran at the first launch, long before a
    direct launcher exists)."""
    fast = getattr(torch._C, "_cuda_getDevice", None)
    return fast if fast is not None and driver_getter is torch.cuda.current_device else driver_getter


def launch_metadata_or_none(knobs: Any, metadata: Callable[..., Any], grid: tuple, stream: int, *args: Any) -> Any:
    """What the launcher passes to Triton's launch hooks: computed only when a hook is set (a profiler);
    the C launcher reads it for nothing else."""
    if not _hooked(knobs.launch_enter_hook) and not _hooked(knobs.launch_exit_hook):
        return None
    return metadata(grid, stream, *args)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook knob holds a hook: not None (Triton 3.6) nor an empty chain (later)."""
    return hook is not None and bool(getattr(hook, "calls", True))


@dataclass(frozen=True)
class CompiledLaunch:
    """What launching a compiled kernel without the JIT needs, read once from it (``launch_parts``)."""
    run: Any
    function: Any
    packed: Any
    metadata: Callable[..., Any]
    constexprs: tuple
    knobs: Any
    current_stream: Callable[[int], Any]
    current_device: Callable[[], int]
    device_index: int


def launch_parts(kernel: Any, compiled: Any, constexprs: Mapping[str, Any]) -> CompiledLaunch | None:
    """The pieces of a direct launch of ``compiled`` (``kernel`` compiled with ``constexprs``), or None
    where this Triton lays out its kernels or compiled handles otherwise (the JIT then runs)."""
    names = constexpr_tail(kernel)
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    driver = getattr(getattr(triton, "runtime", None), "driver", None)
    needed = ("run", "function", "packed_metadata", "launch_metadata")
    if names is None or knobs is None or driver is None or not all(hasattr(compiled, a) for a in needed):
        return None
    try:
        values = tuple(constexprs[name] for name in names)
        current_stream = driver.active.get_current_stream
        current_device = current_device_getter(driver.active.get_current_device)
        device_index = current_device()
    except (KeyError, AttributeError, RuntimeError):
        return None
    return CompiledLaunch(compiled.run, compiled.function, compiled.packed_metadata, compiled.launch_metadata,
                          values, knobs, current_stream, current_device, device_index)


def compiled_launcher(kernel: Any, compiled: Any, grid: tuple[int, ...],
                      constexprs: Mapping[str, Any]) -> Callable[[tuple], bool] | None:
    """A launch of ``compiled`` on ``grid`` that takes the runtime arguments only, in order, and skips
    the JIT's binding, specialising and hashing; it returns False, launching nothing, when another
    device is current than at the first launch. Sound only for arguments that specialise as the
    compiled launch's did (the caller keys its launchers on that: ``LaunchCache``)."""
    parts = launch_parts(kernel, compiled, constexprs)
    if parts is None:
        return None
    grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]

    def launch(args: tuple) -> bool:
        if parts.current_device() != parts.device_index:
            return False
        stream = parts.current_stream(parts.device_index)
        knobs = parts.knobs
        parts.run(grid_x, grid_y, grid_z, stream, parts.function, parts.packed,
                  launch_metadata_or_none(knobs, parts.metadata, grid, stream, *args, *parts.constexprs),
                  knobs.launch_enter_hook, knobs.launch_exit_hook, *args, *parts.constexprs)
        return True

    return launch


def specialisation(value: Any) -> Any:
    """What Triton's JIT specialises a runtime argument on, as a hashable key: a tensor's dtype,
    device and 16-byte alignment, an int's value (its width and divisibility follow from it), a
    float's type only (floats are never specialised)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.data_ptr() % 16 == 0)
    if isinstance(value, float):
        return float
    return value


class LaunchCache:
    """Launches of one kernel that go through Triton's JIT once per specialisation (grid, argument
    specialisation, constexprs) and directly after that. Why: the factored rules launch three
    kernels per weight per step, and through the JIT each costs about 100 us of host time on an
    eager step that is host-bound (``forge_core.kernels.factored``)."""

    def __init__(self, kernel: Any, counts: dict[str, int] | None = None, unspecialised: tuple[str, ...] = ()) -> None:
        self.kernel = kernel
        self.launchers: dict[tuple, Callable[[tuple], bool] | None] = {}
        self.counts = counts if counts is not None else {"direct": 0, "jit": 0}
        """Launches by path (``direct`` / ``jit``); a shared dict when given (``launch.LAUNCH_PATHS``)."""
        self.unspecialised = frozenset(kernel.arg_names.index(name) for name in unspecialised)
        """Positions of the integer arguments the kernel does not specialise on (its
        ``do_not_specialize``, a seed): keyed by type, so a new value launches directly."""

    def __call__(self, grid: tuple[int, ...], args: tuple, **constexprs: Any) -> None:
        key = (tuple(grid), tuple(type(a) if i in self.unspecialised else specialisation(a) for i, a in enumerate(args)),
               tuple(sorted(constexprs.items())))
        launcher = self.launchers.get(key)
        if launcher is not None and launcher(args):
            self.counts["direct"] += 1
            return
        self.counts["jit"] += 1
        compiled = self.kernel[grid](*args, **constexprs)
        if key not in self.launchers and compiled is not None and not interpreting() and direct_launch_enabled():
            self.launchers[key] = compiled_launcher(self.kernel, compiled, grid, constexprs)


TRITON_36_BASE_ARGS = "iiiKKppOOOOOO"      # grid xyz, stream, function, cooperative, pdl, 2 scratches, 4 objects


def raw_tma_launch(compiled: Any, descriptor_indices: tuple[int, ...] = (2, 3)) -> tuple | None:
    """What a TMA plan's launch needs to skip Triton's descriptor handling, or None when ``compiled``
    is not laid out as in Triton 3.6 with descriptors at exactly ``descriptor_indices`` of its
    parameters (x2's and dy2's for the Triton kernel; the Gluon kernel's five: ``hopper_ws``); the
    ``launch.direct_launcher`` path with TensorDescriptor objects, or the JIT, then runs.

    Why: Triton 3.6 turns each TensorDescriptor into the launcher's (tensor map, shape, strides)
    arguments in Python, walking every one of the kernel's ~70 parameters per launch, after
    ``TensorDescriptor`` itself validated shape, strides and block in Python: about 20 us a launch
    on the H100 hosts, 226 launches per eager Llama-8B step. Here the
    tensor maps come from the same encoder with the compiled kernel's own descriptor metadata
    (swizzle, element type, block); the checks ``tma_inputs`` made when the plan was built hold
    for every launch of it (the plan signature holds shapes, strides and alignment).

    Returns (launcher, cooperative, pdl, one meta per descriptor in parameter order, encode)."""
    nvidia_driver = sys.modules.get("triton.backends.nvidia.driver")
    run = getattr(compiled, "run", None)
    inner = getattr(run, "launch", None)
    code, closure = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
    if nvidia_driver is None or code is None or not closure or \
            getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) != TRITON_36_BASE_ARGS:
        return None
    try:
        cells = {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure)}
        launcher, indices, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        scratch = (run.global_scratch_size, run.profile_scratch_size)
        cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        device_types = nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST
    except (KeyError, AttributeError, ValueError):
        return None
    if sorted(indices) != sorted(descriptor_indices) or len(metas) != len(descriptor_indices) or any(scratch) \
            or not callable(launcher):
        return None
    prepared = []
    for meta in metas:
        if not isinstance(meta, Mapping) or meta.get("fp4_padded") or meta.get("is_im2col"):
            return None
        try:
            prepared.append((meta["swizzle"], meta["elem_size"], device_types[meta["elem_type"]],
                             list(meta["block_size"])))
        except (KeyError, IndexError, TypeError):
            return None

    def encode(t: torch.Tensor, meta: tuple) -> tuple:
        swizzle, elem_size, elem_type, block = meta
        shape, strides = list(t.shape), list(t.stride())
        return (fill(t.data_ptr(), swizzle, elem_size, elem_type, block, shape, strides, 0), *shape, *strides)

    return launcher, cooperative, pdl, tuple(prepared), encode
