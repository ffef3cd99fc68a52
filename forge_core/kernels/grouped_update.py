"""``grouped_wgrad_update``: one launch steps every expert of a 3-D expert weight.

Why: a mixture-of-experts layer's weight ``(E, Dout, Din)`` is ``E`` Linear weights, each with its
own routed tokens. Stepped one expert at a time (``dispatch.fused_wgrad_update`` on the expert's
rows), a Qwen3-MoE layer of 128 experts makes 256 launches per step, each paying the Python of
``fused_wgrad_update`` and a launch on the host; at Qwen3-30B-A3B on an H100 (eager, 8 layers) that
host time made FORGE's step 4.4x fused AdamW's (``results/h100/zoo_57e7f83``). Here a program's
second grid index is its expert: it reads that expert's token range from ``ENDS`` (the forward's
cumulative, padded group ends, on the device), accumulates ``G = dY^T X`` over it for one tile of the
expert's rows and runs the rule's epilogue there (``tile_kernel.update_columns``, the same code as
the tile kernel's). An expert no token reached has an empty range: G is zero and the epilogue takes
the zero-gradient step that torch's AdamW takes on such rows (the paper's Remark 1), in the same
launch. No host sync, one launch per weight and backward.

The accumulator is formed per epilogue column slab (``SPLIT`` of them, each re-reading the expert's
``dY`` tile): an expert holds few tokens (64 per expert at 512 tokens x top-8 over 128 experts), so
the second read costs little and the slab needs no register split. The tile is fixed (no tuning):
token counts change every step. This kernel has its own fingerprint; the tile kernel's (and the
shipped tune caches keyed to it) do not change with it.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from ..rules import get_rule
from ..state import QBLOCK, ParamState
from .device import interpreting
from .direct_launch import LaunchCache
from .launch import (LAUNCH_PATHS, NUM_SCALARS, compile_options, kernel_meta, kernel_scalars, kernel_states,
                     state_pointers, wide_index)
from .tile_config import INTERPRETER_CONFIG, TileConfig, check_config, default_config
from .tile_kernel import grouped_tile, update_columns

SEED_MASK = 0x7FFFFFFF


@triton.jit(do_not_specialize=["seed"])
def _grouped_wgrad_update_kernel(
        X, DY, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, GRAD_ACCUM, ENDS,
        rows_per_group, N,
        stride_xk, stride_xn, stride_dyk, stride_dym,
        stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
        c0, c1, c2, c3, c4, c5, c6, c7, seed, seed_stride,
        EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
        S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr,
        HAS_GRAD_ACCUM: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr, IEEE_PRODUCTS: tl.constexpr,
        UPCAST_DOT: tl.constexpr, EVEN_MN: tl.constexpr, WIDE_INDEX: tl.constexpr, HW_MATH: tl.constexpr,
        SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
        QB: tl.constexpr):
    group = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), rows_per_group, N, BM, BN, GROUP)
    k_end = tl.load(ENDS + group)
    k_start = tl.where(group > 0, tl.load(ENDS + tl.maximum(group - 1, 0)), 0)
    tokens = k_end - k_start

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    row_mask = offs_m < rows_per_group
    if WIDE_INDEX:
        rows = group.to(tl.int64) * rows_per_group + offs_m
    else:
        rows = group * rows_per_group + offs_m
    # each group's own stochastic-rounding stream, as when each is stepped by a launch of its own
    group_seed = ((seed + group.to(tl.int64) * seed_stride) & 0x7FFFFFFF).to(tl.int32)
    token_rows = (k_start + offs_k).to(tl.int64)

    CN: tl.constexpr = BN // SPLIT
    for slab in tl.static_range(SPLIT):
        col0 = pid_n * BN + slab * CN
        offs_n = col0 + tl.arange(0, CN)
        col_mask = offs_n < N
        dy_ptrs = DY + token_rows[None, :] * stride_dyk + offs_m[:, None] * stride_dym      # (BM, BK)
        x_ptrs = X + token_rows[:, None] * stride_xk + offs_n[None, :] * stride_xn          # (BK, CN)
        acc = tl.zeros((BM, CN), dtype=tl.float32)
        for k_chunk in range(0, tl.cdiv(tokens, BK)):
            k_left = tokens - k_chunk * BK
            dy_tile = tl.load(dy_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            x_tile = tl.load(x_ptrs, mask=(offs_k[:, None] < k_left) & col_mask[None, :], other=0.0)
            if UPCAST_DOT:             # the interpreter's bf16 dot: see tile_kernel (exact in fp32)
                dy_tile = dy_tile.to(tl.float32)
                x_tile = x_tile.to(tl.float32)
            if IEEE_PRODUCTS:
                acc = tl.dot(dy_tile, x_tile, acc, input_precision="ieee")
            else:
                acc = tl.dot(dy_tile, x_tile, acc)
            dy_ptrs += BK * stride_dyk
            x_ptrs += BK * stride_xk
        update_columns(acc, col0, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, W, GRAD_ACCUM,
                       rows_per_group, N, stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm,
                       stride_gn, c0, c1, c2, c3, c4, c5, c6, c7, group_seed, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                       False, EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT, S1_SQRT, S2_SQRT, 0, HAS_GRAD_ACCUM,
                       STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH, BM, CN, QB)


grouped_wgrad_update_kernel = _grouped_wgrad_update_kernel
"""The kernel (its own name keeps the underscore: profiles name kernels by it)."""

_launch = LaunchCache(_grouped_wgrad_update_kernel, LAUNCH_PATHS, unspecialised=("seed",))


def grouped_config(weight: torch.Tensor) -> TileConfig:
    """The fixed tile: the untuned default on a GPU (``tile_config.default_config``), the
    interpreter's small tile on the CPU."""
    return INTERPRETER_CONFIG if interpreting() else default_config(0, 0, 0, weight.element_size())


def grouped_wgrad_update(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                         ends: torch.Tensor, rows_per_group: int, hp: Mapping[str, Any], step: int, *,
                         grad_accum: torch.Tensor | None = None, stochastic_rounding: bool = False, seed: int = 0,
                         seed_stride: int = 0, config: TileConfig | None = None) -> None:
    """One optimizer step of every row group of ``weight`` (``E * rows_per_group``, Din), group ``e``
    from tokens ``[ends[e-1], ends[e])`` of ``x`` (T, Din) and ``dy`` (T, rows_per_group) (``ends``:
    E int32 cumulative ends on the weight's device). ``grad_accum``: the whole weight's accumulator,
    added per row. ``seed`` + ``e * seed_stride`` seeds group ``e``'s stochastic rounding."""
    if x.dim() != 2 or dy.dim() != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"grouped_wgrad_update takes x (T, Din) and dy (T, Dout) with one T, got "
                         f"{tuple(x.shape)} and {tuple(dy.shape)}")
    groups = ends.numel()
    if weight.dim() != 2 or weight.shape[0] != groups * rows_per_group or weight.shape[1] != x.shape[1] \
            or dy.shape[1] != rows_per_group:
        raise ValueError(f"grouped_wgrad_update: weight {tuple(weight.shape)} is not {groups} groups of "
                         f"{rows_per_group} rows by x's {x.shape[1]} columns (dy {tuple(dy.shape)})")
    if ends.dtype != torch.int32 or ends.device != weight.device:
        raise ValueError(f"ends must be int32 on {weight.device}, got {ends.dtype} on {ends.device}")
    if x.dtype != dy.dtype:
        raise ValueError(f"x and dy must share a dtype, got {x.dtype} and {dy.dtype}")
    rule = state.rule
    if rule.layer_sums:
        raise ValueError(f"rule {rule.name!r} reads norms of the whole weight: its groups cannot be stepped apart")
    grid, args, constexprs = launch_arguments(x, dy, weight, state, ends, rows_per_group, kernel_scalars(rule, hp, step),
                                              grad_accum, bool(stochastic_rounding), seed, seed_stride, config)
    _launch(grid, args, **constexprs)


def launch_arguments(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState, ends: torch.Tensor,
                     rows_per_group: int, scalars: tuple[float, ...], grad_accum: torch.Tensor | None,
                     stochastic_rounding: bool, seed: int, seed_stride: int,
                     config: TileConfig | None) -> tuple[tuple[int, int], tuple, dict[str, Any]]:
    """(grid, runtime arguments, compile-time arguments) of one launch (``grouped_wgrad_update``'s,
    or ``compile_offline``'s on CPU tensors that stand in for the GPU's)."""
    states, scales = kernel_states(state)
    config = config or grouped_config(weight)
    check_config(config, state.state_dtype)
    stochastic = stochastic_rounding and weight.dtype == torch.bfloat16
    ieee = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    meta = kernel_meta(state, x.dtype, grad_accum=grad_accum is not None, stochastic=stochastic, ieee=ieee,
                       scalars_in_memory=False)
    meta.pop("NUM_SUMS")
    meta.pop("SCALARS_IN_MEMORY")
    # IEEE fp32 products where the tile kernel takes them (fp32 inputs without TF32, the interpreter's
    # upcast bf16), the dot's default elsewhere; a bool, as every constexpr of a direct launch is
    meta["IEEE_PRODUCTS"] = bool(meta.pop("IEEE_DOT") or meta["UPCAST_DOT"])
    s0, s1, s2, scale0, scale1, scale2 = state_pointers(weight, states, scales)
    accum = grad_accum if grad_accum is not None else weight
    n = weight.shape[1]
    grid = (triton.cdiv(rows_per_group, config.block_m) * triton.cdiv(n, config.block_n), ends.numel())
    args = (x, dy, weight, s0, s1, s2, scale0, scale1, scale2, accum, ends, rows_per_group, n,
            x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), weight.stride(0), weight.stride(1),
            s0.stride(0), s0.stride(1), scale0.stride(0), accum.stride(0), accum.stride(1),
            *scalars, int(seed) & SEED_MASK, int(seed_stride) & SEED_MASK)
    constexprs = dict(EVEN_MN=rows_per_group % config.block_m == 0 and n % config.block_n == 0,
                      WIDE_INDEX=wide_index(weight, s0, accum), HW_MATH=not interpreting(), SPLIT=config.split_n,
                      BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP=config.group, QB=QBLOCK,
                      num_warps=config.num_warps, num_stages=config.num_stages, **compile_options(), **meta)
    if not interpreting() and config.max_registers is not None:
        constexprs["maxnreg"] = config.max_registers
    return grid, args, constexprs


def compile_offline(groups: int, rows_per_group: int, cols: int, tokens: int, state_dtype: str,
                    capability: int = 90) -> Any:
    """The kernel compiled for ``sm_<capability>`` without a GPU, as an AdamW launch on bf16 inputs
    and weight would bind it, at the GPU's fixed tile (``offline_compile``). Needs a process without
    ``TRITON_INTERPRET``."""
    from .offline_compile import compile_for_gpu

    if interpreting():
        raise RuntimeError("grouped_update.compile_offline compiles for a GPU: unset TRITON_INTERPRET")
    weight = torch.empty((groups * rows_per_group, cols), dtype=torch.bfloat16)
    state = ParamState(weight, get_rule("adamw"), state_dtype)
    x = torch.empty((tokens, cols), dtype=torch.bfloat16)
    dy = torch.empty((tokens, rows_per_group), dtype=torch.bfloat16)
    ends = torch.empty(groups, dtype=torch.int32)
    _, args, constexprs = launch_arguments(x, dy, weight, state, ends, rows_per_group, (0.5,) * NUM_SCALARS, None,
                                           True, 1, 3, None)
    return compile_for_gpu(_grouped_wgrad_update_kernel, args, constexprs, capability)


__all__ = ["compile_offline", "grouped_config", "grouped_wgrad_update", "grouped_wgrad_update_kernel", "launch_arguments"]
