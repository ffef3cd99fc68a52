"""A warp-specialized fused wgrad + optimizer kernel for Hopper, written in Gluon.

Why a second kernel: the Triton kernel (``tile_kernel``) keeps the accumulator in registers through
the epilogue, so its tiles stay small (64x128 bf16, 64x64 int8), and small tiles re-read X and dY
from L2 24-32 B per weight element. Measured on the H100 (docs/design.md) those
re-reads cost 28-63 mJ of a 210-230 mJ gate launch at 512 tokens, and at the 700 W limit joules are
time. Here the roles are split across warps of one persistent program per SM:

* a loader warp streams the dY and X tiles of a ``BM x BN`` weight tile into a ring of shared
  buffers with TMA;
* an MMA warpgroup (two for 256-row tiles) accumulates ``G = dY^T X`` with wgmma and parks the fp32
  tile in shared memory, in two column halves, each as soon as the epilogue has read that half of the
  previous tile (or, with one parked half, the halves take turns in one buffer);
* a second loader warp TMA-loads W and the states in ``RM x CN`` slabs, in the epilogue's order,
  into a ring of its own;
* the epilogue warps (the default partition) read G and each slab from shared memory, run the rule's
  epilogue (the same ``@triton.jit`` function the Triton kernel calls) and store W and the states
  (bf16, or int8 codes and block scales by the Triton kernel's own codec steps; the next slab's int8
  block scales are loaded while this slab is updated).

The MMA warps work on the next tile while the epilogue warps finish the last one, so the GEMM hides
behind the state traffic (512 tokens) or the traffic behind the GEMM (8192), with 128-wide tiles
that re-read X and dY 16 B per element. G still never reaches global memory. Measured on the H100
(results/kernels/h100/ws_s20): faster than the Triton tile at 512 tokens with bf16
states, slower at 2048 tokens and more and with int8 states; ``ws_choice`` picks per weight.

Scope (checked by ``unsupported_reason``, one line naming the problem): a CUDA device of compute
capability 9.x; bf16 X, dY and W; a regime-1 rule with one or two bf16 states, or int8 states (64-column
slabs, their fp32 block scales), not fp8 ones; Dout a multiple of BM and Din of BN; TMA-aligned tensors; no gradient
accumulator and no stochastic rounding (``ws_choice`` does not offer those calls). Gluon kernels do
not run under ``TRITON_INTERPRET``: the numerical tests need the GPU, and ``compile_offline``
(``scripts/offline_sass.py --ws``) compiles it for sm_90 on a machine without one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import triton

from ..rules import get_rule
from ..state import QBLOCK
from .direct_launch import (as_pointers, constexpr_tail, current_device_getter, launch_metadata_or_none,
                            raw_tma_launch)
from .hopper_ws_kernel import GLUON_IMPORT_ERROR, ws_fused_kernel
from .offline_compile import compile_for_gpu

if GLUON_IMPORT_ERROR is None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """One launch configuration of the warp-specialized kernel."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    """Shared-memory ring of dY / X tiles for the main loop."""
    slab_m: int = 128
    """Rows of one epilogue slab (W / state TMA box, G read from shared memory)."""
    slab_n: int = 32
    """Columns of one epilogue slab: at most half the tile (G is parked in two column halves)."""
    state_stages: int = 2
    """Slabs of W and states in flight (TMA prefetch distance + 1)."""
    group: int = 8
    """Row-tiles per group of the tile order (``tile_kernel.grouped_tile``'s); 1 walks whole rows of tiles, so the
    programs running at once read W and the states along whole rows."""
    epilogue_warps: int = 4
    parked_halves: int = 2
    """Column halves of G that shared memory holds at once. 2: the MMA warps park a whole tile and
    go on to the next. 1 halves that memory (what lets 256-row tiles fit): the MMA warps wait for
    the epilogue to read the first half before they park the second."""
    prefetch_scales: bool = True
    """int8 states: load the next slab's block scales while this slab is updated. Without it every
    slab waits a global-memory latency for its scales (the epilogue warps reach it together)."""
    mma_warps: int = 4
    max_registers: int = 168
    mma_registers: int = 208
    loader_registers: int = 24

    def warps(self) -> int:
        """Warps of one program: epilogue, two loader warps, MMA, rounded up to whole warpgroups."""
        return -(-(self.epilogue_warps + 2 + self.mma_warps) // 4) * 4

    def shared_memory_bytes(self, state_bytes: int = 2) -> int:
        """Shared memory of one program: the dY / X ring, the parked fp32 tile, the W / state ring
        (``state_bytes`` per state element: 2 bf16, 1 int8)."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * 2
        accumulator = self.parked_halves * self.block_m * (self.block_n // 2 + 4) * 4   # rows padded by 16 B
        states = self.state_stages * self.slab_m * self.slab_n * (2 + 2 * state_bytes)
        return ring + accumulator + states + 1024          # + the mbarriers and alignment (measured: < 1 KB)


DEFAULT_CONFIG = WsConfig()
_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.int8: "int8"}
SHARED_MEMORY_BYTES = 227 * 1024
REGISTER_FILE = 65536


def config_problem(config: WsConfig, state_bytes: int = 2) -> str | None:
    """Why ``config`` cannot launch with states of ``state_bytes`` per element (None: it can)."""
    if config.block_m % 64 or config.block_n % 16 or config.block_n > 256 or config.block_k % 16:
        return f"tile {config.block_m}x{config.block_n}x{config.block_k} is not a wgmma tile (BM % 64, BN % 16, BK % 16)"
    if config.mma_warps not in (4, 8) or config.block_m % (16 * config.mma_warps):
        return (f"{config.mma_warps} MMA warps cannot split {config.block_m} rows (one or two warpgroups, "
                "16 rows a warp)")
    if config.parked_halves not in (1, 2):
        return f"parked_halves is 1 or 2 (column halves of G in shared memory), got {config.parked_halves}"
    if config.slab_n > config.block_n // 2 or config.block_m % config.slab_m or (config.block_n // 2) % config.slab_n:
        return f"slab {config.slab_m}x{config.slab_n} must tile a column half of the {config.block_m}x{config.block_n} tile"
    if config.slab_n % 8 or 32 % (config.slab_n // 8) or config.stages < 2 or config.state_stages < 2:
        return "slab_n must be 8, 16, 32, 64 or 128 (8 columns a thread), with two stages or more in each ring"
    if config.warps() * 32 * config.max_registers > REGISTER_FILE:
        return (f"config launches {config.warps()} warps at {config.max_registers} registers, over the "
                f"{REGISTER_FILE}-register file of an SM")
    if state_bytes == 1 and config.slab_n != QBLOCK:
        return f"int8 states need {QBLOCK}-column slabs (one block scale per slab row), got {config.slab_n}"
    if config.shared_memory_bytes(state_bytes) > SHARED_MEMORY_BYTES:
        return (f"config needs {config.shared_memory_bytes(state_bytes)} B of shared memory, "
                f"over {SHARED_MEMORY_BYTES}")
    return None


def tile_problem(config: WsConfig, m: int, n: int) -> str | None:
    """Why ``config``'s tiles cannot cover an ``m x n`` weight (None: they can)."""
    if m % config.block_m or n % config.block_n:
        return f"weight {m}x{n} is not a multiple of the {config.block_m}x{config.block_n} tile"
    return None


def unsupported_reason(x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states: list[torch.Tensor],
                       config: WsConfig = DEFAULT_CONFIG, scales: list[torch.Tensor | None] | None = None,
                       layer_sums: int = 0) -> str | None:
    """Why this kernel cannot take the call (None: it can). One line, naming the problem. What it
    refuses runs on the Triton tile kernel, which takes every rule and state format: a rule with no
    state or three, fp8 states, and a regime-2 rule (``layer_sums``: LAMB's per-layer norms)."""
    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon is not importable from this Triton ({triton.__version__}): {GLUON_IMPORT_ERROR}"
    if layer_sums:
        return ("a regime-2 rule (per-layer sums, e.g. LAMB): its accumulate and its second pass run on the "
                "Triton kernel")
    if states and states[0].dtype == torch.uint8:
        return "fp8 states (uint8 codes): the Triton kernel takes them"
    if not 1 <= len(states) <= 2:        # no state (SGD without momentum) or three: the Triton kernel
        return "it takes one or two bf16 states, or one or two int8 states"
    problem = config_problem(config, 1 if states and states[0].dtype == torch.int8 else 2)
    if problem is not None:
        return problem
    if x2.dtype != torch.bfloat16 or dy2.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"inputs {x2.dtype} / {dy2.dtype} and weight {weight.dtype}; it takes bf16 only"
    if not 1 <= len(states) <= 2 or len({s.dtype for s in states}) != 1 or states[0].dtype not in _GL_DTYPES:
        return "it takes one or two bf16 states, or one or two int8 states"
    if states[0].dtype == torch.int8:                   # (their 64-column slabs: config_problem)
        m, n = weight.shape
        if scales is None or len(scales) != len(states) or any(
                t is None or t.dtype != torch.float32 or tuple(t.shape) != (m, n // QBLOCK) or t.stride(1) != 1
                or t.stride() != scales[0].stride() for t in scales):
            return f"int8 states need fp32 block scales of shape ({m}, {n // QBLOCK}), one per state"
    m, n = weight.shape
    problem = tile_problem(config, m, n)
    if problem is not None:
        return problem
    if x2.shape[0] != dy2.shape[0] or x2.shape[1] != n or dy2.shape[1] != m:
        return f"x {tuple(x2.shape)} and dy {tuple(dy2.shape)} do not match the {m}x{n} weight"
    if x2.shape[0] == 0:
        # (a DenseWeight's or a row-gradient embedding's pass: each candidate would fail its
        # descriptor's shape assertion at the first step, with a warning per candidate)
        return "no tokens: its main loop's TMA descriptors need at least one row (the Triton kernel takes it)"
    for name, t in (("x", x2), ("dy", dy2), ("weight", weight), *((f"state{i}", s) for i, s in enumerate(states))):
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return f"{name} is not TMA-compatible (last dim contiguous, 16-byte aligned rows and base)"
    if any(s.stride() != weight.stride() for s in states):
        return "states and weight must share strides"
    if weight.device.type != "cuda" or not torch.cuda.is_available():
        return f"tensors are on {weight.device}; the warp-specialized kernel needs a CUDA device"
    major, _ = torch.cuda.get_device_capability(weight.device)
    if major != 9:
        return f"compute capability {major}.x; the warp-specialized kernel is written for Hopper (9.x) wgmma"
    return None


def _descriptor(t: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GL_DTYPES[t.dtype]))
    return GluonDescriptor.from_tensor(t, block, layout)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The device's SMs: one persistent program each (``grid_size``)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_NO_VALUES = (0.0,) * 8


def _scalar_args(scalars: tuple[float, ...] | torch.Tensor, weight: torch.Tensor | int) -> tuple:
    """The kernel's c0..c7 and SCALARS arguments: the rule's floats (zero-padded to 8) with the weight
    (or its address) as an unread pointer, or zeros with the device buffer holding them (its address
    where the weight is given as one: a direct launch)."""
    if isinstance(scalars, torch.Tensor):
        return (*_NO_VALUES, scalars.data_ptr() if isinstance(weight, int) else scalars)
    return (*scalars, *_NO_VALUES[len(scalars):], weight)


PROGRAM_CAP: int | None = None
"""At most this many persistent programs per launch (None: one per SM). Why: a program holds a whole
SM, so with one per SM an update on the side stream (``forge_core.overlap``) leaves the backward's
next kernels no SM until its last tile; fewer programs leave SMs to them. Read at each plan's first
launch (``direct_launcher`` keeps the grid it saw): clear ``dispatch.PLANS`` after changing it."""


def grid_size(weight: torch.Tensor, config: WsConfig, device_index: int) -> int:
    """One persistent program per SM (at most ``PROGRAM_CAP``), or per tile where there are fewer tiles."""
    tiles = (weight.shape[0] // config.block_m) * (weight.shape[1] // config.block_n)
    programs = sm_count(device_index)
    if PROGRAM_CAP is not None:
        programs = max(1, min(programs, PROGRAM_CAP))
    return min(tiles, programs)


def kernel_call(x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states: list[torch.Tensor],
                scales: list[torch.Tensor | None] | None, epilogue: Any, scalars: tuple[float, ...] | torch.Tensor,
                config: WsConfig, sqrt_domain: tuple[int, int]) -> tuple[tuple, dict]:
    """The kernel's positional arguments and constexprs for one call (``launch``, ``compile_offline``)."""
    m, n = weight.shape
    c = config
    slab = [c.slab_m, c.slab_n]
    int8 = states[0].dtype == torch.int8
    scale0 = scales[0] if int8 else weight
    scale1 = scales[-1] if int8 else weight
    in_memory = isinstance(scalars, torch.Tensor)
    wide = (m - 1) * weight.stride(0) + n >= 2 ** 31 - 1
    args = (_descriptor(x2, [c.block_k, c.block_n]), _descriptor(dy2, [c.block_k, c.block_m]),
            _descriptor(weight, slab), _descriptor(states[0], slab), _descriptor(states[-1], slab),
            weight, states[0], states[-1], scale0, scale1, m, n, x2.shape[0], c.group,
            scale0.stride(0) if int8 else 0, *_scalar_args(scalars, weight))
    kwargs = dict(EPILOGUE=epilogue, NUM_STATES=len(states), STATE_KIND=2 if int8 else 1,
                  S0_SQRT=int(sqrt_domain[0]), S1_SQRT=int(sqrt_domain[-1]), SCALARS_IN_MEMORY=in_memory,
                  BM=c.block_m, BN=c.block_n, BK=c.block_k, STAGES=c.stages, RM=c.slab_m, CN=c.slab_n,
                  STATE_STAGES=c.state_stages, PARKED=c.parked_halves, WIDE_INDEX=wide, MMA_WARPS=c.mma_warps, MMA_REGS=c.mma_registers,
                  LOADER_REGS=c.loader_registers, EPI_WARPS=c.epilogue_warps, num_warps=c.epilogue_warps,
                  PREFETCH_SCALES=c.prefetch_scales and int8,
                  maxnreg=c.max_registers)
    return args, kwargs


def launch(x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states: list[torch.Tensor], epilogue: Any,
           scalars: tuple[float, ...] | torch.Tensor, config: WsConfig = DEFAULT_CONFIG, check: bool = True,
           scales: list[torch.Tensor | None] | None = None, sqrt_domain: tuple[int, int] = (0, 0)) -> Any:
    """One fused step on 2-D bf16 ``x2`` (K, Din), ``dy2`` (K, Dout), ``weight`` (Dout, Din) and its
    ``states`` (bf16, or int8 codes with their fp32 block ``scales``; ``sqrt_domain``: each state's
    ``ParamState.code_domain``, True / 1 for square roots, see state.py), with the rule's ``epilogue`` and its 8
    kernel scalars
    (floats, or a float32 device buffer for a graph-replayed launch). Raises ValueError with the
    reason when the call is outside this kernel's scope (``unsupported_reason``); ``check=False``
    skips that for a caller that checked the same weight and layouts before (a cached plan).
    Returns Triton's compiled kernel (for ``direct_launcher``)."""
    if check:
        reason = unsupported_reason(x2, dy2, weight, states, config, scales)
        if reason is not None:
            raise ValueError(f"hopper_ws: {reason}")
    args, kwargs = kernel_call(x2, dy2, weight, states, scales, epilogue, scalars, config, sqrt_domain)
    device = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return ws_fused_kernel[(grid_size(weight, config, device),)](*args, **kwargs)


_DESCRIPTORS = 5
"""The kernel's first parameters are TMA descriptors: x, dy, W, state 0, state 1."""


def direct_launcher(compiled: Any, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
                    states: list[torch.Tensor], scales: list[torch.Tensor | None] | None, epilogue: Any,
                    scalars: tuple[float, ...] | torch.Tensor, config: WsConfig, sqrt_domain: tuple[int, int]
                    ) -> Callable[[torch.Tensor, torch.Tensor, Any], bool] | None:
    """Launches of ``compiled`` (what the JIT returned for this call) for later calls of the same
    weight, states and activation layout, without the JIT. Why: the JIT binds and specialises ~40
    arguments and builds five descriptor objects per launch (``kernel_call``), which cost an eager
    step more host time than the Triton kernel's direct launch, and would lose the Gluon kernel
    eager choices it wins on the GPU. Here the three descriptors of W and the states are
    encoded once; only x2's and dy2's tensor maps are encoded per launch, with the compiled
    kernel's own descriptor metadata (``direct_launch.raw_tma_launch``).

    The returned callable takes (x2, dy2, scalars) and returns False, launching nothing, when the
    call is not one the compiled kernel was specialised for (another current device, scalars of the
    other kind or alignment, state tensors moved): the caller then launches through the JIT. None
    where this Triton lays out compiled kernels differently (the JIT then always runs)."""
    names = constexpr_tail(ws_fused_kernel)
    raw = raw_tma_launch(compiled, tuple(range(_DESCRIPTORS))) if names is not None else None
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if raw is None or knobs is None or not all(hasattr(compiled, a) for a in ("function", "packed_metadata")):
        return None
    launcher, cooperative, pdl, metas, encode = raw
    args, kwargs = kernel_call(x2, dy2, weight, states, scales, epilogue, scalars, config, sqrt_domain)
    try:
        constexprs = tuple(kwargs[name] for name in names)
        active = triton.runtime.driver.active
        current_stream, current_device = active.get_current_stream, current_device_getter(active.get_current_device)
        device_index = current_device()
    except (KeyError, AttributeError, RuntimeError):
        return None
    in_memory = isinstance(scalars, torch.Tensor)
    aligned = in_memory and scalars.data_ptr() % 16 == 0
    fixed_maps = tuple(item for t, meta in zip((weight, states[0], states[-1]), metas[2:]) for item in encode(t, meta))
    state_pointers = (states[0].data_ptr(), states[-1].data_ptr())
    fixed = as_pointers(args[_DESCRIPTORS:-9])     # W, S0, S1, SCALE0, SCALE1, M, N, K, group, scale row stride
    placeholders = (None,) * _DESCRIPTORS
    grid_x = grid_size(weight, config, device_index)
    grid = (grid_x,)
    function, packed, metadata = compiled.function, compiled.packed_metadata, compiled.launch_metadata
    weight_pointer = weight.data_ptr()

    def launch_direct(x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor) -> bool:
        if isinstance(scalars, torch.Tensor) != in_memory or (in_memory and (scalars.data_ptr() % 16 == 0) != aligned):
            return False
        if current_device() != device_index or (states[0].data_ptr(), states[-1].data_ptr()) != state_pointers:
            return False
        tail = _scalar_args(scalars, weight_pointer)
        stream = current_stream(device_index)
        launcher(grid_x, 1, 1, stream, function, cooperative, pdl, None, None, packed,
                 launch_metadata_or_none(knobs, metadata, grid, stream, *placeholders, *fixed, *tail, *constexprs),
                 knobs.launch_enter_hook, knobs.launch_exit_hook, *encode(x2, metas[0]), *encode(dy2, metas[1]),
                 *fixed_maps, *fixed, *tail, *constexprs)
        return True

    return launch_direct


def compile_offline(m: int, n: int, k: int, config: WsConfig = DEFAULT_CONFIG, epilogue: Any = None,
                    num_states: int = 2, capability: int = 90, int8: bool = False) -> Any:
    """Compile the kernel for ``sm_<capability>`` without a GPU (CPU tensors stand in for the
    arguments; only their dtypes, shapes and strides are read; ``int8``: int8 states, the second in
    the sqrt domain as AdamW's), for register / spill / shared-memory
    checks on a CPU machine (tests, ``scripts/offline_sass.py --ws``). Returns Triton's compiled
    kernel (``.asm["cubin"]``, ``.metadata.shared``)."""
    from triton.experimental.gluon._runtime import GluonASTSource      # only where Gluon imports

    if epilogue is None:
        epilogue = get_rule("adamw").epilogue
    weight = torch.empty((m, n), dtype=torch.bfloat16)
    states = [torch.empty((m, n), dtype=torch.int8 if int8 else torch.bfloat16) for _ in range(num_states)]
    scales = [torch.empty((m, n // QBLOCK), dtype=torch.float32) for _ in range(num_states)] if int8 else None
    x2, dy2 = torch.empty((k, n), dtype=torch.bfloat16), torch.empty((k, m), dtype=torch.bfloat16)
    args, kwargs = kernel_call(x2, dy2, weight, states, scales, epilogue, (0.5,) * 8, config,
                               (False, num_states == 2))
    return compile_for_gpu(ws_fused_kernel, args, kwargs, capability, GluonASTSource)
