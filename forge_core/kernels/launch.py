"""Launching the Triton tile kernel (``tile_kernel``): a launch plan per weight and activation
layout, the kernel's arguments and compile options, the rule's scalars as it takes them, and the
direct launch that skips Triton's JIT from a plan's second launch (``direct_launch``).

Why plans: everything a launch needs but the activations, the step's scalars and the seed is built
once per weight and layout and reused every step; on a host-bound eager Llama-8B step the per-layer
Python of each fused launch counts (``dispatch`` keeps one plan per weight).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..native_hooks import native_replays, reset_native_replays
from ..rules.base import KERNEL_SCALARS, MAX_STATES, Rule, check_scalar_count
from ..state import QBLOCK, ParamState
from .device import interpreting
from .direct_launch import (as_pointers, compiled_launcher, direct_launch_enabled, launch_metadata_or_none, launch_parts,
                            raw_tma_launch)
from .tile_config import TileConfig
from .tile_kernel import fused_wgrad_update_kernel

STATE_KIND = {"fp32": 0, "bf16": 1, "int8": 2, "fp8": 3}
"""The kernels' ``STATE_KIND`` constexpr per state format."""
NUM_SCALARS = KERNEL_SCALARS


def tma_inputs(x2: torch.Tensor, dy2: torch.Tensor) -> bool:
    """Whether the main loop can load these (tokens, features) inputs through TMA descriptors:
    16-bit floats (fp32 inputs keep the pointer path and its IEEE products), unit feature stride,
    16-byte-aligned base and row stride (the hardware's rules), at least one token, and a Hopper or
    newer GPU (or the interpreter, so the CPU tests run this path)."""
    if x2.dtype not in (torch.bfloat16, torch.float16) or x2.shape[0] == 0:
        return False
    for t in (x2, dy2):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    if interpreting():
        return True
    return x2.is_cuda and torch.cuda.get_device_capability(x2.device)[0] >= 9


@dataclasses.dataclass
class LaunchPlan:
    """Everything a launch needs but the activations, the step's scalars and the seed: built once per
    weight and activation layout, then reused every step (the per-step host path is a signature
    compare and one Triton call; on a host-bound Llama-8B step each fused layer's Python counts)."""
    config: TileConfig
    grid: tuple[int]
    fixed_args: tuple            # weight, states, scales, sizes and strides after x2, dy2, then the third
                                 # state, its scales and the per-layer sums (not the accumulator: it is
                                 # passed per launch, see run_plan)
    kwargs: Mapping[str, Any]    # tile sizes, warps, stages, layout and rule meta-parameters
    direct: Callable[[tuple], bool] | None = None
    """Launches the kernel this plan compiled without Triton's per-call binding (``direct_launcher``);
    set after the plan's first launch, for plans that are cached (their arguments keep the
    specialisation the kernel was compiled for)."""
    direct_builds_descriptors: bool = False
    """``direct`` encodes the TMA descriptors of x2 and dy2 itself (``raw_tma_launch``): ``run_plan``
    then passes no TensorDescriptor objects."""
    fixed_pointers: tuple = ()
    """``fixed_args`` with each tensor as its device address (``direct_launch.as_pointers``), set with
    ``direct``: what the direct launches pass."""

    @property
    def tma(self) -> bool:
        """Whether the main loop loads through TMA descriptors (built per launch by ``run_plan``)."""
        return self.kwargs["TMA"]


def state_pointers(weight: torch.Tensor, states: list[torch.Tensor],
                   scales: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """(S0, S1, S2, SCALE0, SCALE1, SCALE2) as the kernels take them: the weight stands in for a state
    or scale the rule or format lacks (never read: NUM_STATES / STATE_KIND rule it out)."""
    slots = [states[i] if len(states) > i else weight for i in range(MAX_STATES)]
    scale_slots = [scales[i] if len(scales) > i and scales[i] is not None else weight for i in range(MAX_STATES)]
    return (*slots, *scale_slots)


def wide_index(*matrices: torch.Tensor) -> bool:
    """Whether a kernel's weight-shaped offsets need 64 bits: some 2-D operand's last element lies at
    or past 2^31 - 1 elements from its base (Llama's 128256 x 4096 embedding does not; larger ones may)."""
    return max((t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1)
               for t in matrices if t.dim() == 2) >= 2 ** 31 - 1


def compile_options() -> dict[str, Any]:
    """The compile options every launch of the update kernels asks for on the GPU: FMA contraction,
    which the int8 codes' FFMA relies on (``codec.int8_codes``) and Triton 3.10 stops defaulting to."""
    return {} if interpreting() else {"enable_fp_fusion": True}


def scalar_arguments(scalars: tuple[float, ...] | torch.Tensor,
                     placeholder: torch.Tensor | int) -> tuple[tuple[float, ...], torch.Tensor | int]:
    """(c0..c7, SCALARS) as a launch passes them: the floats and any pointer, or (capturable mode) zeros
    and the device buffer the kernel reads them from (``rule_scalars``)."""
    if isinstance(scalars, torch.Tensor):
        return _NO_SCALARS, scalars
    return scalars, placeholder


def make_plan(config: TileConfig, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
              states: list[torch.Tensor], scales: list[torch.Tensor | None], grad_accum: torch.Tensor | None,
              meta: Mapping[str, Any], sums: torch.Tensor | None = None) -> LaunchPlan:
    """The plan of ``config`` for these tensors (``meta``: ``kernel_meta``'s); ``grad_accum`` only
    lends its layout (its strides), the tensor itself is passed per launch. ``sums``: a regime-2
    rule's per-layer sums (``ParamState.layer_sums``), which the kernel adds to."""
    m, n = weight.shape
    k = x2.shape[0]
    s0, s1, s2, scale0, scale1, scale2 = state_pointers(weight, states, scales)
    accum = grad_accum if grad_accum is not None else weight
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    tma = config.tma and tma_inputs(x2, dy2)
    layout = dict(EVEN_MN=m % config.block_m == 0 and n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
                  WIDE_INDEX=wide_index(weight, s0, accum), PREFETCH=config.prefetch, SPLIT=config.split_n,
                  HW_MATH=not interpreting(), TMA=tma)
    options = compile_options()
    if not interpreting() and config.max_registers is not None:
        options["maxnreg"] = config.max_registers
    # The accumulator is not kept in the plan: a dense .grad (DenseWeight) is a new tensor every step,
    # and a cached plan holding the old one would keep a weight-sized tensor alive.
    fixed = (weight, s0, s1, scale0, scale1, m, n, k)
    strides = (weight.stride(0), weight.stride(1), s0.stride(0), s0.stride(1), scale0.stride(0),
               accum.stride(0), accum.stride(1))
    third = (s2, scale2, sums if sums is not None else weight)
    kwargs = dict(BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP=config.group, QB=QBLOCK,
                  num_warps=config.num_warps, num_stages=config.num_stages, **options, **layout, **meta)
    return LaunchPlan(config, grid, fixed + strides + third, kwargs)


_NO_SCALARS = (0.0,) * NUM_SCALARS


LAUNCH_PATHS = {"direct": 0, "jit": 0, "graph": 0, "recorded": 0}
"""Fused-kernel launches by path since the last ``reset_launch_paths`` (the factored rules' passes,
``kernels.factored``, count here too): ``direct`` (a kept plan's or ``LaunchCache``'s launcher, ~20 us
of host time) or ``jit`` (through Triton's JIT: ~100-240 us; a first launch, or a direct launcher
that declined), and ``graph``: an eager update replayed from its recorded CUDA graph (``forge_core.update_graphs``:
a graph launch; the C++ hook's replays, ``forge_core.native_hooks``, are added by ``launch_paths``). Of the
``graph`` ones, ``recorded`` were recorded at that call (a capture: far more host time than a replay, paid
again at every step where an input's address keeps moving). Why: an eager step is host-bound at batch 1, and a
layer whose launches stay on the JIT, or whose update is recorded again at every step, costs it ~0.2 ms or more
a step; the harness records the counts per timed step."""


def reset_launch_paths() -> None:
    """Zero ``LAUNCH_PATHS`` (the harness, at the timed window's start)."""
    for path in LAUNCH_PATHS:
        LAUNCH_PATHS[path] = 0
    reset_native_replays()


def launch_paths() -> dict[str, int]:
    """A copy of ``LAUNCH_PATHS``, with the C++ hook's replays in ``graph`` and, on their own, in ``native``."""
    paths = dict(LAUNCH_PATHS)
    paths["native"] = native_replays()
    paths["graph"] += paths["native"]
    return paths


def launch_path_counts() -> dict[str, int]:
    """``LAUNCH_PATHS`` itself, for a caller that counts launches of its own (``forge_core.update_graphs``)."""
    return LAUNCH_PATHS


def run_plan(plan: LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor,
             seed: int, grad_accum: torch.Tensor | None = None):
    """One launch. ``scalars``: the rule's floats as launch arguments, or a device buffer holding them
    (the plan was then built with ``SCALARS_IN_MEMORY``). ``grad_accum``: the accumulator, of the
    layout the plan was built with (or None, as the plan was)."""
    if plan.direct is not None:
        # a launcher that encodes the descriptors itself reads the tensors; the others take addresses
        head = (x2, dy2, None, None) if plan.direct_builds_descriptors else \
            (x2.data_ptr(), dy2.data_ptr(), *_tma_descriptors(plan, x2, dy2))
        if plan.direct((*head, *direct_kernel_args(plan, x2, dy2, scalars, seed, grad_accum))):
            LAUNCH_PATHS["direct"] += 1
            return None
    LAUNCH_PATHS["jit"] += 1
    tail = kernel_args(plan, x2, dy2, scalars, seed, grad_accum)
    return fused_wgrad_update_kernel[plan.grid](x2, dy2, *_tma_descriptors(plan, x2, dy2), *tail, **plan.kwargs)


def kernel_args(plan: LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor,
                seed: int, grad_accum: torch.Tensor | None = None) -> tuple:
    """The kernel's runtime arguments after X, DY and their two descriptors (see ``run_plan``)."""
    weight = plan.fixed_args[0]
    values, buffer = scalar_arguments(scalars, weight)
    return _ordered_arguments(plan.fixed_args, grad_accum if grad_accum is not None else weight, x2, dy2, values,
                              seed, buffer)


def direct_kernel_args(plan: LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor,
                       scalars: tuple[float, ...] | torch.Tensor, seed: int,
                       grad_accum: torch.Tensor | None = None) -> tuple:
    """``kernel_args`` as a direct launch passes them: every tensor as its address (``fixed_pointers``)."""
    weight = plan.fixed_pointers[0]
    values, buffer = scalar_arguments(scalars, weight)
    return _ordered_arguments(plan.fixed_pointers, grad_accum.data_ptr() if grad_accum is not None else weight, x2,
                              dy2, values, seed, buffer.data_ptr() if isinstance(buffer, torch.Tensor) else buffer)


def _ordered_arguments(fixed: tuple, accum: Any, x2: torch.Tensor, dy2: torch.Tensor, values: tuple[float, ...],
                       seed: int, buffer: Any) -> tuple:
    """The kernel's runtime arguments after X, DY and their descriptors, in its parameter order: the plan's
    weight, states and scales (``fixed``: tensors or their addresses), the accumulator, sizes, the
    activations' strides, the other strides, the scalars, the seed, the scalars' buffer, the third state."""
    return (*fixed[:5], accum, *fixed[5:8], x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
            *fixed[8:15], *values, seed, buffer, *fixed[15:])


def _tma_descriptors(plan: LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor) -> tuple[Any, Any]:
    """The main loop's TMA descriptors of x2 and dy2, or (None, None) for a pointer plan. A descriptor
    holds the base address: a new one per launch (a graph captures it)."""
    if not plan.tma:
        return None, None
    config = plan.config
    return (TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [config.block_k, config.block_n]),
            TensorDescriptor(dy2, list(dy2.shape), list(dy2.stride()), [config.block_k, config.block_m]))


def direct_launcher(compiled: Any, plan: LaunchPlan) -> Callable[[tuple], bool] | None:
    """A launch of ``compiled`` (what ``plan``'s first launch through the JIT returned) that skips the
    JIT's per-call work: binding ~40 arguments, specialising each, hashing the key, reading its knobs
    (about 100 us a launch on the H100 hosts; a 1B eager step makes 113). Only sound when the later
    arguments specialise as the first did, which the plan signature guarantees for everything but
    the seed (not specialised) and the scalar values (floats, never specialised). The launcher
    returns False, launching nothing, when another device is current than at the first launch (the
    JIT path then runs, as it would have: the compiled handle is loaded for that device).

    None where this Triton lays out its compiled kernels differently (the JIT path then stays). For a
    TMA plan whose compiled kernel ``raw_tma_launch`` understands, the launch encodes the descriptors
    itself and ``plan.direct_builds_descriptors`` is set, so ``run_plan`` builds none for it."""
    parts = launch_parts(fused_wgrad_update_kernel, compiled, plan.kwargs)
    if parts is None:
        return None
    plan.fixed_pointers = as_pointers(plan.fixed_args)
    grid = plan.grid
    raw = raw_tma_launch(compiled) if plan.tma else None
    if raw is None:
        return compiled_launcher(fused_wgrad_update_kernel, compiled, grid, plan.kwargs)
    launcher, cooperative, pdl, (x_meta, dy_meta), encode = raw
    plan.direct_builds_descriptors = True
    grid_x, constexprs, knobs = grid[0], parts.constexprs, parts.knobs

    def launch_encoding_descriptors(args: tuple) -> bool:
        if parts.current_device() != parts.device_index:
            return False
        stream = parts.current_stream(parts.device_index)
        x2, dy2 = args[0], args[1]
        launcher(grid_x, 1, 1, stream, parts.function, cooperative, pdl, None, None, parts.packed,
                 launch_metadata_or_none(knobs, parts.metadata, grid, stream, *args, *constexprs),
                 knobs.launch_enter_hook, knobs.launch_exit_hook, x2.data_ptr(), dy2.data_ptr(),
                 *encode(x2, x_meta), *encode(dy2, dy_meta), *args[4:], *constexprs)
        return True

    return launch_encoding_descriptors


def go_direct(plan: LaunchPlan, compiled: Any) -> None:
    """After ``plan``'s launch through the JIT returned ``compiled``: its direct launcher, for the
    launches that follow (unless launches stay on the JIT: the interpreter, ``FORGE_DIRECT_LAUNCH=0``)."""
    if compiled is not None and not interpreting() and direct_launch_enabled():
        plan.direct = direct_launcher(compiled, plan)


def launch_tile(config: TileConfig, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
                states: list[torch.Tensor], scales: list[torch.Tensor | None], grad_accum: torch.Tensor | None,
                scalars: tuple[float, ...] | torch.Tensor, seed: int, meta: Mapping[str, Any],
                sums: torch.Tensor | None = None):
    """Launch the kernel with ``config``; returns Triton's compiled-kernel handle (resource report)."""
    return run_plan(make_plan(config, x2, dy2, weight, states, scales, grad_accum, meta, sums), x2, dy2, scalars,
                    seed, grad_accum)


def kernel_meta(state: ParamState, input_dtype: torch.dtype, *, grad_accum: bool, stochastic: bool, ieee: bool,
                scalars_in_memory: bool) -> dict[str, Any]:
    """The rule's and the states' compile-time parameters of a launch (its plan adds the tile's)."""
    names = state.state_names
    sqrt = [state.code_domain(names[i]) if len(names) > i else 0 for i in range(MAX_STATES)]     # codec.py's DOMAIN
    return dict(
        EPILOGUE=state.epilogue, NUM_STATES=len(names), STATE_KIND=STATE_KIND[state.state_dtype],
        S0_SQRT=sqrt[0], S1_SQRT=sqrt[1], S2_SQRT=sqrt[2], NUM_SUMS=state.rule.layer_sums,
        HAS_GRAD_ACCUM=grad_accum, STOCHASTIC_ROUNDING=stochastic, IEEE_DOT=ieee,
        UPCAST_DOT=interpreting() and input_dtype == torch.bfloat16, SCALARS_IN_MEMORY=scalars_in_memory)


def _check_device_scalars(buffer: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32 or buffer.dim() != 1 \
            or buffer.numel() < NUM_SCALARS or not buffer.is_contiguous():
        raise ValueError(f"device_scalars must be a contiguous 1-D float32 tensor of at least {NUM_SCALARS} "
                         f"elements, got {getattr(buffer, 'dtype', type(buffer))} of shape "
                         f"{tuple(getattr(buffer, 'shape', ()))}")
    if buffer.device != weight.device:
        raise ValueError(f"device_scalars is on {buffer.device}, the weight on {weight.device}")


def kernel_states(state: ParamState) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The state tensors and int8 / fp8 scales a launch takes, in the epilogue's order (fp8 codes as
    uint8: the kernels decode and encode them with integer and conversion instructions of their own),
    once the rule is known to have a Triton epilogue the kernels can run."""
    rule = state.rule
    if state.epilogue is None or rule.kernel_scalars is None:
        raise ValueError(f"rule {rule.name!r} has no Triton epilogue; use reference_wgrad_update")
    if len(state.state_names) > MAX_STATES:
        raise ValueError(f"rule {rule.name!r} has {len(state.state_names)} states; the kernel takes at most {MAX_STATES}")
    if rule.layer_sums not in (0, 2):
        raise ValueError(f"rule {rule.name!r} asks for {rule.layer_sums} per-layer sums; the kernel takes 0 or 2")
    states = [state.values[name] for name in state.state_names]
    if state.state_dtype == "fp8":
        states = [s.view(torch.uint8) for s in states]
    scales = [state.scales[name] for name in state.state_names]
    if any(s.stride() != states[0].stride() for s in states):
        raise ValueError("all state tensors of one weight must share strides")
    return states, scales


def launch_scalars(caller: str, rule: Rule, hp: Mapping[str, Any], step: int, device_scalars: torch.Tensor | None,
                   weight: torch.Tensor, stochastic_rounding: bool) -> tuple[float, ...] | torch.Tensor:
    """What a launch passes for the rule's scalars: the checked ``device_scalars`` buffer (capturable
    mode, read by ``rule_scalars`` in the kernel), else the floats of ``kernel_scalars``."""
    if device_scalars is None:
        return kernel_scalars(rule, hp, step)
    _check_device_scalars(device_scalars, weight)
    if stochastic_rounding and weight.dtype == torch.bfloat16:
        raise ValueError(f"{caller}: stochastic rounding draws a new seed every step, which a "
                         "replayed launch cannot; use device_scalars=None with stochastic_rounding")
    return device_scalars


_SCALARS: dict[tuple, tuple[float, ...]] = {}


def kernel_scalars(rule, hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
    """The rule's kernel scalars, computed (and validated) once per step and hyper-parameters: every
    fused layer of a model asks for the same ones in one backward."""
    try:
        key = (rule.name, int(step), tuple(hp.items()))
        hash(key)
    except TypeError:                            # an unhashable hyper-parameter value: no memo
        key = None
    if key is not None and key in _SCALARS:
        return _SCALARS[key]
    scalars = tuple(float(c) for c in rule.kernel_scalars(hp, int(step)))
    check_scalar_count(rule.name, len(scalars))
    scalars = scalars + (0.0,) * (NUM_SCALARS - len(scalars))
    if key is not None:
        if len(_SCALARS) >= 64:
            _SCALARS.clear()
        _SCALARS[key] = scalars
    return scalars
