"""One optimizer step over every row of a weight whose gradient is a few rows: a vocabulary
embedding's (``forge_core.embedding``), given as a slot table into the summed gradient rows.

Why: a batch of T tokens touches at most T of an embedding's rows (Llama-3.1-8B: 512 of 128256),
yet every row must be stepped (weight decay and the moments' decay move untouched rows too, as
under torch). Reading a dense gradient costs 2 bytes per element of a bf16 weight that are almost
all zero; two passes (every row with no gradient on the GEMM kernel, then the gathered touched rows
with theirs, then a scatter) cost a second launch, the gather and scatter of W and the states, and
run the int8 pass on the GEMM kernel's tiles at low occupancy. Here each
program owns a ``BM x CN`` block of the weight, loads the ``BM`` slots of its rows
(``slots[r]``: -1 for no gradient, else the index of row r's gradient in ``row_grads``), reads
those gradient rows (masked loads: rows without one issue no traffic) and runs the rule through
the fused kernel's own device helpers (``tile_kernel.update_columns``: the same loads, epilogue, state
codecs, stores and stochastic-rounding stream, which is keyed by the element's position in the
weight and the seed). So each element sees the dense step's arithmetic: the fused kernel with zero
tokens on a dense gradient holding ``row_grads[slots[r]]`` in row r and zeros elsewhere, bit for
bit in the interpreter. On the GPU it is another kernel than the dense update, and the compiler
may contract multiply-adds differently (an ulp; the GPU tests allow it); at Llama-3.1-8B's size every
element came out equal on an H100 and an H200 (fp32 / bf16 / int8 states, AdamW).

An embedding's int8 signed states (``keep_signed_codes``: those ``Rule.keeps_nonzero_codes`` names, the
format of ``forge_core.dense.EmbeddingState``) are stored with every non-zero value at least one code
from zero: before the store each such value
is raised to its block's code step (``absmax / 127``, the scale the store computes), which the
store then codes as +-1; a value already a step or more from zero is untouched. Why: see
``EmbeddingState``.

``slots=None`` reads a whole dense gradient (row r's gradient is ``row_grads[r]``): the dense step
of an embedding whose state keeps signed codes, which the fused kernel does not store.

Memory-bound: 12 bytes per element with bf16 W and bf16 states (8 with int8 states, plus scales),
plus the T gradient rows and 4 bytes per row of slots. The block shape is a ``RowUpdateConfig``;
small blocks on few warps keep registers low and occupancy high.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import triton
import triton.language as tl

from ..state import BLOCK_SCALED, QBLOCK, ParamState
from .codec import block_scale, rule_scalars, store_state, store_weight
from .device import interpreting, runs_on_device_of
from .launch import (compile_options, kernel_meta, kernel_states, launch_scalars, scalar_arguments, state_pointers,
                     wide_index)
from .layer_apply import apply_layer
from .tile_kernel import decode_states, load_slab, update_columns

_DECORATED_FOR_INTERPRETER = interpreting()


@dataclasses.dataclass(frozen=True)
class RowUpdateConfig:
    """The launch shape of ``row_update``: ``block_m`` rows x ``block_n`` columns per program."""
    block_m: int
    block_n: int
    num_warps: int

    def check(self, state_dtype: str) -> None:
        """A clear error for a shape the kernel cannot run with this state format."""
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"row_update: {name} must be a power of two, got {value}")
        if state_dtype in BLOCK_SCALED and self.block_n % QBLOCK:
            raise ValueError(f"row_update: {state_dtype} states need block_n a multiple of {QBLOCK} (whole scale blocks), "
                             f"got {self.block_n}")


DEFAULT_CONFIGS: Mapping[str, RowUpdateConfig] = {
    "fp32": RowUpdateConfig(8, 256, 4),
    "bf16": RowUpdateConfig(8, 256, 4),
    "int8": RowUpdateConfig(8, 256, 4),
    "fp8": RowUpdateConfig(8, 256, 4),
}
"""Per state format: 8 x 256 on 4 warps, 16 elements of each tensor per thread. Llama-3.1-8B's embedding
at 512 tokens (19 shapes, two rounds agreeing within 0.3%; every element
equal to the dense step's on both GPUs): on an H100
bf16 states 2.106 ms (2.99 TB/s; 16 x 128: 2.119, two passes 2.271, the dense step 2.540),
int8 states 1.487 ms (16 x 256: 1.481, 16 x 128: 1.545, two passes 1.965, dense 2.110); on an H200
bf16 1.516 ms (16 x 128: 1.520), int8 1.137 (16 x 256: 1.167, 16 x 128: 1.208). fp32 states on the H100:
3.508 ms (3.00 TB/s; 16 x 128: 3.504). Raw: results/kernels/{h100,h200}/row_update_onepass."""


@triton.jit
def _raise_to_code_step(value, mask, EVEN: tl.constexpr, HW_MATH: tl.constexpr, BM: tl.constexpr,
                        CN: tl.constexpr, QB: tl.constexpr):
    """A signed state tile with each non-zero value at least its 64-column block's code step from zero
    (the step ``store_state`` computes from the same block maximum, which this leaves unchanged), so
    the store codes it as +-1 or more; blocks whose step is 0 or subnormal are left as they are (the
    store codes them 0)."""
    if not EVEN:
        value = tl.where(mask, value, 0.0)
    NB: tl.constexpr = CN // QB
    blocks = tl.reshape(value, (BM, NB, QB))
    step = block_scale(tl.max(tl.abs(blocks), axis=2), HW_MATH)[:, :, None]
    raised = tl.where(blocks > 0, tl.maximum(blocks, step), tl.minimum(blocks, -step))
    keep = (blocks == 0) | (step < 1.1754943508222875e-38)
    return tl.reshape(tl.where(keep, blocks, raised), (BM, CN))


@triton.jit
def _update_keeping_signed_codes(grad, col0, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, N,
                                 stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row,
                                 c0, c1, c2, c3, c4, c5, c6, c7, seed,
                                 EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, S0_SQRT: tl.constexpr,
                                 S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr, S0_KEEP: tl.constexpr,
                                 S1_KEEP: tl.constexpr, S2_KEEP: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr,
                                 EVEN_MN: tl.constexpr, HW_MATH: tl.constexpr, BM: tl.constexpr, CN: tl.constexpr,
                                 QB: tl.constexpr):
    """``tile_kernel.update_columns`` for int8 states of a regime-1 rule (no accumulator), with the
    signed states given ``S0_KEEP`` / ``S1_KEEP`` / ``S2_KEEP`` raised to their code step before the
    store: the same loads, epilogue, codecs, stores and stochastic-rounding stream, so an element whose
    states keep their codes gets the dense step's bits."""
    offs_n = col0 + tl.arange(0, CN)
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    w_offsets = rows[:, None] * stride_wm + offs_n[None, :] * stride_wn
    s_offsets = rows[:, None] * stride_sm + offs_n[None, :] * stride_sn
    col_block0 = col0 // QB
    n_blocks = tl.cdiv(N, QB)
    w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales = load_slab(
        W, S0, S1, S2, SCALE0, SCALE1, SCALE2, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm, stride_sn,
        stride_scale_row, NUM_STATES, 2, EVEN_MN, CN, QB)
    s0, s1, s2 = decode_states(s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales, NUM_STATES, 2, S0_SQRT,
                               S1_SQRT, S2_SQRT, HW_MATH, BM, CN, QB)
    weight, s0, s1, s2 = EPILOGUE(w_raw.to(tl.float32), grad, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7, HW_MATH)
    if S0_KEEP:
        s0 = _raise_to_code_step(s0, mask, EVEN_MN, HW_MATH, BM, CN, QB)
    if S1_KEEP:
        s1 = _raise_to_code_step(s1, mask, EVEN_MN, HW_MATH, BM, CN, QB)
    if S2_KEEP:
        s2 = _raise_to_code_step(s2, mask, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_STATES >= 1:
        store_state(S0, SCALE0, s0, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                    2, S0_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_STATES >= 2:
        store_state(S1, SCALE1, s1, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                    2, S1_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_STATES >= 3:
        store_state(S2, SCALE2, s2, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                    2, S2_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    # update_columns' store and stochastic-rounding stream
    store_weight(W, w_offsets, weight, mask, rows, offs_n, N, seed, STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH)


@triton.jit(do_not_specialize=["seed"])
def _row_update_kernel(W, S0, S1, S2, SCALE0, SCALE1, SCALE2, SUMS, SLOTS, ROW_GRADS, M, N,
                       stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm,
                       c0, c1, c2, c3, c4, c5, c6, c7, seed, SCALARS,
                       EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
                       S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr,
                       NUM_SUMS: tl.constexpr, HAS_GRAD_ACCUM: tl.constexpr,
                       STOCHASTIC_ROUNDING: tl.constexpr, SCALARS_IN_MEMORY: tl.constexpr,
                       EVEN_MN: tl.constexpr, WIDE_INDEX: tl.constexpr, HW_MATH: tl.constexpr,
                       DENSE_ROWS: tl.constexpr, S0_KEEP: tl.constexpr, S1_KEEP: tl.constexpr,
                       S2_KEEP: tl.constexpr, BM: tl.constexpr, CN: tl.constexpr, QB: tl.constexpr):
    # Consecutive programs walk the columns of one row block: BM whole rows, contiguous in memory.
    tiles_n = tl.cdiv(N, CN)
    pid = tl.program_id(0)
    offs_m = (pid // tiles_n) * BM + tl.arange(0, BM)
    col0 = (pid % tiles_n) * CN
    row_mask = offs_m < M
    if DENSE_ROWS:          # every row has its gradient, at its own index
        slot = tl.where(row_mask, offs_m, -1)
    else:
        slot = tl.load(SLOTS + offs_m, mask=row_mask, other=-1)
    if WIDE_INDEX:
        rows = offs_m.to(tl.int64)
        slot_row = slot.to(tl.int64)
    else:
        rows = offs_m
        slot_row = slot
    offs_n = col0 + tl.arange(0, CN)
    grad_mask = (slot >= 0)[:, None] & (offs_n < N)[None, :]
    # zeros + the gradient row, as the fused kernel's zero-token accumulator + its dense gradient
    # (a -0.0 gradient becomes +0.0 there too)
    grad = tl.zeros((BM, CN), dtype=tl.float32) + tl.load(
        ROW_GRADS + slot_row[:, None] * stride_gm + offs_n[None, :], mask=grad_mask, other=0.0).to(tl.float32)
    c0, c1, c2, c3, c4, c5, c6, c7 = rule_scalars(SCALARS, c0, c1, c2, c3, c4, c5, c6, c7, SCALARS_IN_MEMORY)
    if S0_KEEP or S1_KEEP or S2_KEEP:
        _update_keeping_signed_codes(grad, col0, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, N,
                                     stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row,
                                     c0, c1, c2, c3, c4, c5, c6, c7, seed, EPILOGUE, NUM_STATES, S0_SQRT, S1_SQRT,
                                     S2_SQRT, S0_KEEP, S1_KEEP, S2_KEEP, STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH, BM,
                                     CN, QB)
    else:
        update_columns(grad, col0, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, SUMS, ROW_GRADS,
                       M, N, stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, 1,
                       c0, c1, c2, c3, c4, c5, c6, c7, seed, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False,
                       EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT, S1_SQRT, S2_SQRT, NUM_SUMS, HAS_GRAD_ACCUM,
                       STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH, BM, CN, QB)


def usable_for(tensor: torch.Tensor) -> bool:
    """Whether the kernel runs on ``tensor``'s device (CUDA, or the CPU under the interpreter)."""
    return runs_on_device_of(tensor, _DECORATED_FOR_INTERPRETER)


def _check(weight: torch.Tensor, state: ParamState, slots: Optional[torch.Tensor], row_grads: torch.Tensor) -> None:
    """One-line errors for arguments the kernel would misread."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"row_update: weight must be a 2-D fp32 / bf16 tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    m, n = weight.shape
    if tuple(state.shape) != (m, n):
        raise ValueError(f"row_update: state shape {tuple(state.shape)} does not match the weight's {(m, n)}")
    if slots is None:
        if not isinstance(row_grads, torch.Tensor) or tuple(row_grads.shape) != (m, n):
            raise ValueError(f"row_update: without slots row_grads is the dense gradient, shape {(m, n)}, "
                             f"got {tuple(getattr(row_grads, 'shape', ()))}")
    elif not isinstance(slots, torch.Tensor) or slots.dtype != torch.int32 or slots.shape != (m,) \
            or not slots.is_contiguous():
        raise ValueError(f"row_update: slots must be a contiguous int32 tensor of shape ({m},) (one per weight row), "
                         f"got {getattr(slots, 'dtype', type(slots).__name__)} {tuple(getattr(slots, 'shape', ()))}")
    if not isinstance(row_grads, torch.Tensor) or row_grads.dim() != 2 or row_grads.shape[1] != n:
        raise ValueError(f"row_update: row_grads must be (T, {n}) (the weight's width), "
                         f"got {tuple(getattr(row_grads, 'shape', ()))}")
    if row_grads.dtype != weight.dtype:
        raise ValueError(f"row_update: row_grads must have the weight's dtype {weight.dtype}, got {row_grads.dtype}")
    devices = {t.device for t in (weight, row_grads, *state.values.values())}
    devices |= {slots.device} if slots is not None else set()
    if len(devices) != 1:
        raise ValueError(f"row_update: weight, state, slots and row_grads must share a device, got "
                         f"{sorted(map(str, devices))}")
    if not usable_for(weight):
        raise RuntimeError(f"row_update: tensors on {weight.device}; the Triton kernel needs CUDA or "
                           "TRITON_INTERPRET=1")


def row_update(weight: torch.Tensor, state: ParamState, hp: Mapping[str, Any], step: int, *,
               slots: Optional[torch.Tensor], row_grads: torch.Tensor, stochastic_rounding: bool = False,
               seed: int = 0, device_scalars: Optional[torch.Tensor] = None,
               config: Optional[RowUpdateConfig] = None, keep_signed_codes: bool = False) -> None:
    """One step of ``state.rule`` on every row of ``weight`` (in place, with ``state``), row r's
    gradient being ``row_grads[slots[r]]`` where ``slots[r] >= 0`` and zero where it is -1.

    ``slots``: int32 (M,), values in [-1, T) (not checked: that would sync with the device), or None
    for a dense gradient (``row_grads`` then (M, N), row r's gradient ``row_grads[r]``);
    ``row_grads``: (T, N) in the weight's dtype. ``hp`` / ``step`` / ``stochastic_rounding`` / ``seed`` /
    ``device_scalars`` as ``fused_wgrad_update``'s: the result is that kernel's with zero tokens and the
    dense gradient as ``grad_accum``, at the same seed. ``config``: the block shape (default
    ``DEFAULT_CONFIGS[state.state_dtype]``). ``keep_signed_codes``: with int8 states, store the rule's
    signed states keeping every non-zero value at a non-zero code (``forge_core.dense.EmbeddingState``'s
    format; the result is then the dense step's with that store)."""
    _check(weight, state, slots, row_grads)
    states, scales = kernel_states(state)
    scalars = launch_scalars("row_update", state.rule, hp, step, device_scalars, weight, stochastic_rounding)
    config = config if config is not None else DEFAULT_CONFIGS[state.state_dtype]
    config.check(state.state_dtype)
    m, n = weight.shape
    if row_grads.shape[0] == 0:
        row_grads = weight                  # no slot points into it; any valid pointer of the dtype
    elif row_grads.stride(1) != 1:
        row_grads = row_grads.contiguous()
    s0, s1, s2, scale0, scale1, scale2 = state_pointers(weight, states, scales)
    values, buffer = scalar_arguments(scalars, weight)
    meta = kernel_meta(state, weight.dtype, grad_accum=False,
                       stochastic=bool(stochastic_rounding) and weight.dtype == torch.bfloat16, ieee=False,
                       scalars_in_memory=isinstance(scalars, torch.Tensor))
    for name in ("IEEE_DOT", "UPCAST_DOT"):            # the GEMM's; this kernel has none
        del meta[name]
    # the states Rule.keeps_nonzero_codes names (not a regime-2 rule's: forge_core.dense.EmbeddingState)
    keeps = keep_signed_codes and state.state_dtype == "int8"
    names = state.state_names
    signed = [keeps and index < len(names) and state.rule.keeps_nonzero_codes(names[index]) for index in range(3)]
    sums = state.layer_sums
    if sums is not None:                               # a regime-2 rule: the sums, then the second pass
        sums.zero_()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _row_update_kernel[grid](
        weight, s0, s1, s2, scale0, scale1, scale2, sums if sums is not None else weight,
        slots if slots is not None else weight, row_grads, m, n,
        weight.stride(0), weight.stride(1), s0.stride(0), s0.stride(1), scale0.stride(0), row_grads.stride(0),
        *values, int(seed) & 0x7FFFFFFF, buffer,
        EVEN_MN=m % config.block_m == 0 and n % config.block_n == 0, WIDE_INDEX=wide_index(weight, s0, row_grads),
        HW_MATH=not interpreting(), DENSE_ROWS=slots is None, S0_KEEP=signed[0], S1_KEEP=signed[1],
        S2_KEEP=signed[2], BM=config.block_m, CN=config.block_n, QB=QBLOCK, num_warps=config.num_warps,
        **compile_options(), **meta)
    if sums is not None:
        apply_layer(weight, state, states, scales, scalars, seed, meta)


__all__ = ["DEFAULT_CONFIGS", "RowUpdateConfig", "row_update", "usable_for"]
