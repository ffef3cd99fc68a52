"""The fused weight-gradient + optimizer kernel (one Triton kernel for every rule).

Each program owns one ``BM x BN`` tile of W (Dout x Din). It loops over the token axis in
``BK`` chunks accumulating ``G = dY^T X`` in fp32 registers (``tl.dot``), adds ``grad_accum``
when given, then loads the W tile and the state tiles (fp32 / bf16 / int8 + per-64-block
scales), calls the rule's ``@triton.jit`` epilogue, and stores W and the states. G never
reaches memory. The epilogue is a ``tl.constexpr`` argument, so a new rule needs no change here.
The epilogue may run on ``split_n`` column slabs of the tile one after the other (the accumulator
is split in registers), so large tiles, which re-read X and dY from L2 less, keep it unspilled.

Tile configurations are chosen per (shape, dtypes, state format) by timing candidates on
scratch copies of W and the states (``tune_config``), so tuning never applies an update to the
real tensors; the real launch runs once, afterwards. Under ``TRITON_INTERPRET=1`` one small
fixed configuration is used (tuning in the interpreter would take minutes).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import math
import os
import statistics
import sys
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from ..rules.base import KERNEL_SCALARS, Rule, check_scalar_count
from ..state import QBLOCK, ParamState
from . import hopper_ws, tune_cache, ws_choice
from .reference import check_arguments, flatten_tokens

_STATE_KIND = {"fp32": 0, "bf16": 1, "int8": 2}
NUM_SCALARS = KERNEL_SCALARS
MAX_STATES = 2
SHARED_MEMORY_BYTES = 227 * 1024          # H100 / H200 per-block opt-in limit
MAX_ACCUMULATOR_REGISTERS = 64            # fp32 accumulator registers per thread we allow (see fits)


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


# ----------------------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptr, offsets, mask, EVEN: tl.constexpr):
    """Raw load of a weight-shaped tile (no mask when the tile lies inside the matrix)."""
    if EVEN:
        return tl.load(ptr + offsets)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0)


@triton.jit
def _load_scales(scales_ptr, rows, row_mask, col_block0, n_blocks, stride_scale_row, KIND: tl.constexpr,
                 BN: tl.constexpr, QB: tl.constexpr):
    """The fp32 block scales of an int8 state tile: (BM,) when the tile is one block wide, else
    (BM, BN // QB); a dummy for other kinds."""
    if KIND == 2:
        if BN == QB:
            block_ok = (tl.zeros_like(row_mask.to(tl.int32)) + col_block0) < n_blocks
            return tl.load(scales_ptr + rows * stride_scale_row + col_block0, mask=row_mask & block_ok, other=0.0)
        else:
            NB: tl.constexpr = BN // QB
            block_cols = col_block0 + tl.arange(0, NB)
            scale_mask = row_mask[:, None] & (block_cols[None, :] < n_blocks)
            return tl.load(scales_ptr + rows[:, None] * stride_scale_row + block_cols[None, :], mask=scale_mask,
                           other=0.0)
    else:
        return 0.0


@triton.jit
def _int8_to_float(codes, HW_MATH: tl.constexpr):
    """int8 codes as exact fp32 integers. On the GPU without a conversion instruction (I2F runs at a
    quarter of the FP32 rate, and the int8 epilogue needs one per state element): the code plus
    2^23 + 128 is an fp32 bit pattern whose value is exactly that integer; subtracting it back is exact."""
    if HW_MATH:
        biased = (codes.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True)
        return biased - 8388736.0
    else:
        return codes.to(tl.float32)


@triton.jit
def _decode_state(raw, scales, KIND: tl.constexpr, SQRT_DOMAIN: tl.constexpr, HW_MATH: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """A raw state tile as fp32: fp32 / bf16 as is, int8 codes times their block scale."""
    if KIND == 2:
        if BN == QB:        # one block per row: a broadcast, no reshape
            value = _int8_to_float(raw, HW_MATH) * scales[:, None]
        else:
            NB: tl.constexpr = BN // QB
            value = tl.reshape(tl.reshape(_int8_to_float(raw, HW_MATH), (BM, NB, QB)) * scales[:, :, None], (BM, BN))
        if SQRT_DOMAIN:
            value = value * value
    else:
        value = raw.to(tl.float32)
    return value


@triton.jit
def _to_bf16_nearest_even(value, HW_MATH: tl.constexpr):
    """fp32 -> bf16, round to nearest even. On the GPU the hardware conversion (cvt.rn) does it;
    the interpreter's own cast truncates, so there it is done on the bit pattern (inf / NaN pass
    through unchanged). Both give the same bf16 for every finite value and for inf."""
    if HW_MATH:
        return value.to(tl.bfloat16)
    else:
        bits = value.to(tl.uint32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        rounded = tl.where(finite, rounded, bits)
        return rounded.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _store_tile(ptr, value, mask, EVEN: tl.constexpr, HW_MATH: tl.constexpr):
    """Store an fp32 tile into fp32 / bf16 / int8 memory (bf16: round to nearest even)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        value = _to_bf16_nearest_even(value, HW_MATH)
    else:
        value = value.to(ptr.dtype.element_ty)
    if EVEN:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _block_scale(absmax, HW_MATH: tl.constexpr):
    """``absmax / 127``: on the GPU as absmax times fp32(1 / 127) (within one ulp of the quotient;
    no IEEE division per row and state), in the interpreter exactly as the torch reference."""
    if HW_MATH:
        return absmax * (1.0 / 127.0)
    else:
        return tl.math.div_rn(absmax, 127.0)


@triton.jit
def _int8_codes(signed, scale, SQRT_DOMAIN: tl.constexpr, HW_MATH: tl.constexpr):
    """Codes of one block (or a tile of blocks, ``scale`` broadcast to it): see state.py.

    The rounding to the nearest integer (ties to even) and the conversion to an integer are one
    fp32 add of 1.5 * 2^23: in [2^23, 2^24) the fp32 spacing is 1, so ``y + 1.5 * 2^23`` rounded to
    nearest is ``1.5 * 2^23 + round(y)`` for |y| < 2^22, and its bit pattern is ``0x4B400000 + round(y)``
    in two's complement, whose low byte is the signed code. On the GPU the multiply and the add fuse
    into one FFMA (one rounding of the exact ``y * inverse``), and the result is that int32 pattern
    (the store keeps its low byte): no FRND / F2I (quarter rate), no sign handling, no clamp
    (``|y| * inverse <= 127 * (1 + 2^-22)`` rounds to at most 127). In the interpreter the multiply
    rounds first, as the torch reference does (so would the GPU unfused: the codes stay within one
    of the fused ones; the launch asks for ``enable_fp_fusion``, which Triton 3.10 stops defaulting
    to). A block whose scale is 0 or subnormal divides by 1, and its values (|y| < 1.5e-36) round to
    code 0 with no test; sqrt-domain values are never negative."""
    has_scale = scale >= 1.1754943508222875e-38          # normal; subnormal blocks store zeros
    if HW_MATH:
        # the hardware reciprocal (<= 2 ulp; a code can then differ by one next to a tie): the IEEE
        # division's Newton steps and slow-path branch, per row and state, cost as much as the
        # rounding of 16 elements and pushed the int8 tile into spilling
        inverse = libdevice.fast_dividef(1.0, tl.where(has_scale, scale, 1.0))
        pattern = (signed * inverse + 12582912.0).to(tl.int32, bitcast=True)     # 0x4B400000 + code
        if SQRT_DOMAIN:
            # codes floored at 1 where the block's scale is normal
            return tl.maximum(pattern, 0x4B400000 + has_scale.to(tl.int32))
        else:
            return pattern
    else:              # an fp32 integer value
        inverse = tl.math.div_rn(1.0, tl.where(has_scale, scale, 1.0))
        code = (signed * inverse + 12582912.0) - 12582912.0
        if SQRT_DOMAIN:
            code = tl.where(has_scale, tl.maximum(code, 1.0), code)
        return code


@triton.jit
def _store_state(values_ptr, scales_ptr, value, offsets, mask, rows, row_mask, col_block0, n_blocks,
                 stride_scale_row, KIND: tl.constexpr, SQRT_DOMAIN: tl.constexpr, EVEN: tl.constexpr,
                 HW_MATH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """Store an fp32 state tile: as fp32, rounded to bf16, or re-quantized to int8 (see state.py)."""
    if KIND == 2:
        if not EVEN:
            value = tl.where(mask, value, 0.0)
        if SQRT_DOMAIN:
            value = tl.sqrt(value)        # sqrt-domain states are nonnegative (the rule's contract)
        if BN == QB:        # one block per row: a plain row max, no reshape
            magnitude_in = tl.abs(value)
            scale = _block_scale(tl.max(magnitude_in, axis=1), HW_MATH)
            codes = _int8_codes(value, scale[:, None], SQRT_DOMAIN, HW_MATH)
            _store_tile(values_ptr + offsets, codes, mask, EVEN, HW_MATH)
            block_ok = (tl.zeros_like(row_mask.to(tl.int32)) + col_block0) < n_blocks
            tl.store(scales_ptr + rows * stride_scale_row + col_block0, scale, mask=row_mask & block_ok)
        else:
            NB: tl.constexpr = BN // QB
            blocks = tl.reshape(value, (BM, NB, QB))
            magnitude_in = tl.abs(blocks)
            scale = _block_scale(tl.max(magnitude_in, axis=2), HW_MATH)
            codes = _int8_codes(blocks, scale[:, :, None], SQRT_DOMAIN, HW_MATH)
            codes = tl.reshape(codes, (BM, BN))
            _store_tile(values_ptr + offsets, codes, mask, EVEN, HW_MATH)
            block_cols = col_block0 + tl.arange(0, NB)
            scale_mask = row_mask[:, None] & (block_cols[None, :] < n_blocks)
            tl.store(scales_ptr + rows[:, None] * stride_scale_row + block_cols[None, :], scale, mask=scale_mask)
    else:
        _store_tile(values_ptr + offsets, value, mask, EVEN, HW_MATH)


@triton.jit
def _column_halves(tile, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(ROWS, COLS) -> its left and right (ROWS, COLS // 2) halves. In the MMA accumulator layout
    every thread holds matching elements of both halves, so this is a renaming of registers."""
    return tl.split(tl.permute(tl.reshape(tile, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _load_slab(W, S0, S1, SCALE0, SCALE1, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm, stride_sn,
               stride_scale_row, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr, EVEN_MN: tl.constexpr,
               CN: tl.constexpr, QB: tl.constexpr):
    """Issue the raw loads of one (BM, CN) column slab: W, the states and their int8 block scales.
    Nothing waits for them until their first use, so issuing them early hides their latency."""
    offs_n = col0 + tl.arange(0, CN)
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    w_offsets = rows[:, None] * stride_wm + offs_n[None, :] * stride_wn
    s_offsets = rows[:, None] * stride_sm + offs_n[None, :] * stride_sn
    col_block0 = col0 // QB
    n_blocks = tl.cdiv(N, QB)
    w_raw = _load_tile(W, w_offsets, mask, EVEN_MN)
    s0_raw = 0.0
    s0_scales = 0.0
    s1_raw = 0.0
    s1_scales = 0.0
    if NUM_STATES >= 1:
        s0_raw = _load_tile(S0, s_offsets, mask, EVEN_MN)
        s0_scales = _load_scales(SCALE0, rows, row_mask, col_block0, n_blocks, stride_scale_row, STATE_KIND, CN, QB)
    if NUM_STATES >= 2:
        s1_raw = _load_tile(S1, s_offsets, mask, EVEN_MN)
        s1_scales = _load_scales(SCALE1, rows, row_mask, col_block0, n_blocks, stride_scale_row, STATE_KIND, CN, QB)
    return w_raw, s0_raw, s0_scales, s1_raw, s1_scales


@triton.jit
def _update_columns(grad, col0, offs_m, rows, row_mask, W, S0, S1, SCALE0, SCALE1, GRAD_ACCUM, M, N,
                    stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
                    c0, c1, c2, c3, c4, c5, c6, c7, seed,
                    w_raw, s0_raw, s0_scales, s1_raw, s1_scales, LOADED: tl.constexpr,
                    EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
                    S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, HAS_GRAD_ACCUM: tl.constexpr,
                    STOCHASTIC_ROUNDING: tl.constexpr, EVEN_MN: tl.constexpr, HW_MATH: tl.constexpr,
                    BM: tl.constexpr, CN: tl.constexpr, QB: tl.constexpr):
    """The optimizer on one (BM, CN) column slab of the tile starting at column ``col0``: W and
    states in (unless ``LOADED``: the raw tiles were loaded earlier, see ``_load_slab``), the rule,
    W and states out."""
    offs_n = col0 + tl.arange(0, CN)
    col_mask = offs_n < N
    mask = row_mask[:, None] & col_mask[None, :]
    w_offsets = rows[:, None] * stride_wm + offs_n[None, :] * stride_wn
    s_offsets = rows[:, None] * stride_sm + offs_n[None, :] * stride_sn
    col_block0 = col0 // QB
    n_blocks = tl.cdiv(N, QB)
    if HAS_GRAD_ACCUM:
        grad += tl.load(GRAD_ACCUM + rows[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
    if not LOADED:
        w_raw, s0_raw, s0_scales, s1_raw, s1_scales = _load_slab(
            W, S0, S1, SCALE0, SCALE1, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm, stride_sn,
            stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)
    weight = w_raw.to(tl.float32)
    if NUM_STATES >= 1:
        s0 = _decode_state(s0_raw, s0_scales, STATE_KIND, S0_SQRT, HW_MATH, BM, CN, QB)
    else:
        s0 = tl.zeros((BM, CN), dtype=tl.float32)
    if NUM_STATES >= 2:
        s1 = _decode_state(s1_raw, s1_scales, STATE_KIND, S1_SQRT, HW_MATH, BM, CN, QB)
    else:
        s1 = tl.zeros((BM, CN), dtype=tl.float32)

    weight, s0, s1 = EPILOGUE(weight, grad, s0, s1, c0, c1, c2, c3, c4, c5, c6, c7, HW_MATH)

    if NUM_STATES >= 1:
        _store_state(S0, SCALE0, s0, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                     STATE_KIND, S0_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_STATES >= 2:
        _store_state(S1, SCALE1, s1, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                     STATE_KIND, S1_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if STOCHASTIC_ROUNDING:
        # Add 16 random low bits to the fp32 pattern, then truncate to bf16: unbiased rounding.
        linear = (rows[:, None] * N + offs_n[None, :]).to(tl.uint32)
        noise = tl.randint(seed, linear) & 0xFFFF
        bits = weight.to(tl.uint32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        rounded = tl.where(finite, (bits + noise) & 0xFFFF0000, bits)
        tl.store(W + w_offsets, rounded.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        _store_tile(W + w_offsets, weight, mask, EVEN_MN, HW_MATH)


@triton.jit
def rule_scalars(SCALARS, c0, c1, c2, c3, c4, c5, c6, c7, SCALARS_IN_MEMORY: tl.constexpr):
    """The rule's eight kernel scalars: the launch arguments, or (``SCALARS_IN_MEMORY``, capturable
    mode) the device buffer ``SCALARS``: a CUDA graph replays the launch with whatever the buffer
    holds, so a new step or lr needs no new launch arguments. (Also ``row_update``'s and the Gluon
    epilogue's in hopper_ws: the same loads, the same SASS.)"""
    if SCALARS_IN_MEMORY:
        c0 = tl.load(SCALARS + 0)
        c1 = tl.load(SCALARS + 1)
        c2 = tl.load(SCALARS + 2)
        c3 = tl.load(SCALARS + 3)
        c4 = tl.load(SCALARS + 4)
        c5 = tl.load(SCALARS + 5)
        c6 = tl.load(SCALARS + 6)
        c7 = tl.load(SCALARS + 7)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """Program ``pid``'s (row, column) tile in grouped order: GROUP consecutive row-tiles share the
    same column tiles of X in L2. (Also used by scripts/mainloop_bench.py, to time the same order.)"""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    programs_per_group = GROUP * tiles_n
    first_m = (pid // programs_per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    return first_m + (pid % programs_per_group) % group_rows, (pid % programs_per_group) // group_rows


# ``seed`` changes every step: specialising on it (== 1, divisible by 16) would compile a second
# kernel for one launch in 16 and make a cached plan's compiled kernel wrong for the next seed.
@triton.jit(do_not_specialize=["seed"])
def _fused_wgrad_update_kernel(
        X, DY, X_DESC, DY_DESC, W, S0, S1, SCALE0, SCALE1, GRAD_ACCUM,
        M, N, K,
        stride_xk, stride_xn, stride_dyk, stride_dym,
        stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
        c0, c1, c2, c3, c4, c5, c6, c7, seed, SCALARS,
        EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
        S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, HAS_GRAD_ACCUM: tl.constexpr,
        STOCHASTIC_ROUNDING: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr,
        SCALARS_IN_MEMORY: tl.constexpr,
        EVEN_MN: tl.constexpr, EVEN_K: tl.constexpr, WIDE_INDEX: tl.constexpr, PREFETCH: tl.constexpr,
        HW_MATH: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, QB: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP)

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    row_mask = offs_m < M
    col_mask = offs_n < N

    # Weight-shaped offsets (64-bit only for matrices past 2^31 elements).
    if WIDE_INDEX:
        rows = offs_m.to(tl.int64)
    else:
        rows = offs_m
    col0 = pid_n * BN

    # With PREFETCH, issue the first epilogue slab's W / state loads now: their HBM latency then
    # hides behind the main loop, which only reads X and dY (mostly from L2). Each later slab's loads
    # are issued before the previous slab's update runs (one slab of lookahead).
    CN: tl.constexpr = BN // SPLIT
    w_raw = 0.0
    s0_raw = 0.0
    s0_scales = 0.0
    s1_raw = 0.0
    s1_scales = 0.0
    if PREFETCH:
        w_raw, s0_raw, s0_scales, s1_raw, s1_scales = _load_slab(
            W, S0, S1, SCALE0, SCALE1, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm, stride_sn,
            stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)

    # Main loop: G tile = sum over tokens of dY[k, m] * X[k, n]. With TMA the tiles come through
    # tensor descriptors (X_DESC / DY_DESC: (K, N) / (K, M), blocks (BK, BN) / (BK, BM), zero past
    # the edges): no per-thread addresses or masks, and fewer load instructions competing with the
    # epilogue's. Otherwise pointers advance (64-bit).
    dy_ptrs = DY + offs_k[None, :] * stride_dyk + offs_m[:, None] * stride_dym       # (BM, BK)
    x_ptrs = X + offs_k[:, None] * stride_xk + offs_n[None, :] * stride_xn           # (BK, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k_chunk in range(0, tl.cdiv(K, BK)):
        if TMA:
            dy_tile = DY_DESC.load([k_chunk * BK, pid_m * BM]).T
            x_tile = X_DESC.load([k_chunk * BK, pid_n * BN])
        elif EVEN_K and EVEN_MN:
            dy_tile = tl.load(dy_ptrs)
            x_tile = tl.load(x_ptrs)
        else:
            k_left = K - k_chunk * BK
            dy_tile = tl.load(dy_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            x_tile = tl.load(x_ptrs, mask=(offs_k[:, None] < k_left) & col_mask[None, :], other=0.0)
        if UPCAST_DOT:
            # The Triton 3.9 interpreter multiplies bf16 tiles as raw integers; fp32 is exact here
            # (bf16 x bf16 products are exact in fp32, accumulation is fp32 either way).
            acc = tl.dot(dy_tile.to(tl.float32), x_tile.to(tl.float32), acc, input_precision="ieee")
        elif IEEE_DOT:
            acc = tl.dot(dy_tile, x_tile, acc, input_precision="ieee")
        else:
            acc = tl.dot(dy_tile, x_tile, acc)
        if not TMA:
            dy_ptrs += BK * stride_dyk
            x_ptrs += BK * stride_xk

    c0, c1, c2, c3, c4, c5, c6, c7 = rule_scalars(SCALARS, c0, c1, c2, c3, c4, c5, c6, c7, SCALARS_IN_MEMORY)

    # Epilogue, in SPLIT column slabs of CN columns, one after the other: only one slab's W and
    # states are live in registers at a time (two with PREFETCH), so large tiles need not spill.
    if SPLIT == 1:
        _update_columns(acc, col0, offs_m, rows, row_mask, W, S0, S1, SCALE0, SCALE1, GRAD_ACCUM, M, N,
                        stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
                        c0, c1, c2, c3, c4, c5, c6, c7, seed, w_raw, s0_raw, s0_scales, s1_raw, s1_scales, PREFETCH,
                        EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT, S1_SQRT, HAS_GRAD_ACCUM, STOCHASTIC_ROUNDING,
                        EVEN_MN, HW_MATH, BM, CN, QB)
    else:
        tl.static_assert(SPLIT == 2 or SPLIT == 4, "SPLIT must be 1, 2 or 4")
        left, right = _column_halves(acc, BM, BN)
        if SPLIT == 2:
            slab_0 = left
            slab_1 = right
            slab_2 = left             # unused: only SPLIT == 4 has a third and fourth slab
            slab_3 = right
        else:
            slab_0, slab_1 = _column_halves(left, BM, BN // 2)
            slab_2, slab_3 = _column_halves(right, BM, BN // 2)
        for i in tl.static_range(SPLIT):
            # the next slab's loads go out before this slab's update (PREFETCH only)
            nw_raw = 0.0
            ns0_raw = 0.0
            ns0_scales = 0.0
            ns1_raw = 0.0
            ns1_scales = 0.0
            if PREFETCH and i + 1 < SPLIT:
                nw_raw, ns0_raw, ns0_scales, ns1_raw, ns1_scales = _load_slab(
                    W, S0, S1, SCALE0, SCALE1, col0 + (i + 1) * CN, rows, row_mask, N, stride_wm, stride_wn,
                    stride_sm, stride_sn, stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)
            if i == 0:
                grad = slab_0
            elif i == 1:
                grad = slab_1
            elif i == 2:
                grad = slab_2
            else:
                grad = slab_3
            _update_columns(grad, col0 + i * CN, offs_m, rows, row_mask, W, S0, S1, SCALE0, SCALE1, GRAD_ACCUM,
                            M, N, stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
                            c0, c1, c2, c3, c4, c5, c6, c7, seed, w_raw, s0_raw, s0_scales, s1_raw, s1_scales,
                            PREFETCH, EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT, S1_SQRT, HAS_GRAD_ACCUM,
                            STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH, BM, CN, QB)
            w_raw = nw_raw
            s0_raw = ns0_raw
            s0_scales = ns0_scales
            s1_raw = ns1_raw
            s1_scales = ns1_scales


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the fused kernel."""
    block_m: int
    block_n: int
    block_k: int
    group: int
    num_warps: int
    num_stages: int
    prefetch: bool = False
    """Issue the first epilogue slab's W / state loads before the main loop, and each later slab's
    before the previous slab's update (hides HBM latency behind the GEMM; costs registers)."""
    split_n: int = 1
    """Run the epilogue on ``split_n`` column slabs of the tile one after the other (1, 2 or 4), so
    only one slab's W and states are live at once: large tiles then keep their epilogue in registers."""
    max_registers: int | None = None
    """Cap on registers per thread (Triton's ``maxnreg``): a lower cap lets more programs share an SM."""
    tma: bool = True
    """Load the X and dY tiles of the main loop with TMA where the inputs allow it (``tma_inputs``),
    else with pointers. Measured on an H100 (scripts/mainloop_bench.py): the main loop alone is
    3-11% faster with TMA at the same tile, and it needs no address registers."""

    def epilogue_columns(self) -> int:
        """Columns of one epilogue slab."""
        return self.block_n // self.split_n

    def shared_memory_bytes(self, input_bytes: int) -> int:
        """Shared memory of the software pipeline: ``stages`` buffers of the dY and X tiles."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * input_bytes

    def accumulator_registers(self) -> int:
        """fp32 accumulator registers per thread."""
        return self.block_m * self.block_n // (32 * self.num_warps)


TILE_SIZES = (64, 128, 256)
K_CHUNKS = (32, 64, 128)
GROUPS = (8, 16, 32)
WARPS = (4, 8)
STAGES = (2, 3, 4, 5, 6)
SPLITS = (1, 2, 4)
# The interpreter runs the column-split epilogue (two 64-wide slabs, int8 blocks whole), the
# path the GPU shortlist uses; the unsplit path is covered by explicit configs in the tests.
INTERPRETER_CONFIG = TileConfig(32, 128, 32, 8, 4, 1, split_n=2)
MAX_EPILOGUE_REGISTERS = 224              # estimated epilogue registers per thread we allow (see fits)


def config_space() -> list[TileConfig]:
    """Every configuration the issue names: tiles {64,128,256}^2, BK {32,64,128}, GROUP {8,16,32},
    warps {4,8}, stages 2..6. (16 warps kept large tiles' epilogue in registers but gave wrong
    weights with the column split on the H100, triton 3.6.) The epilogue column split is a separate axis (``candidate_configs`` sets it)."""
    return [TileConfig(bm, bn, bk, group, warps, stages)
            for bm in TILE_SIZES for bn in TILE_SIZES for bk in K_CHUNKS for group in GROUPS
            for warps in WARPS for stages in STAGES]


def epilogue_registers(config: TileConfig) -> float:
    """Estimated fp32 registers per thread the epilogue holds at once: the whole accumulator plus
    W and two states of one column slab."""
    accumulator = config.accumulator_registers()
    return accumulator + 3 * accumulator / config.split_n


def fits(config: TileConfig, input_bytes: int) -> bool:
    """Prune what cannot run well: pipeline shared memory over the H100 limit, or an epilogue
    that would spill. Measured on an H100 (Triton 3.6): without a column split every config past 64
    accumulator registers per thread (estimate 256) spilled 400-660 registers and ran 3x slower;
    offline sm_90 compiles (Triton 3.9) put the split configs up to an estimate of 224 (128x256 on
    8 warps in 4 slabs: 254 registers) spill-free with bf16 states (docs/kernel_notes.md)."""
    return (config.shared_memory_bytes(input_bytes) <= SHARED_MEMORY_BYTES
            and epilogue_registers(config) <= MAX_EPILOGUE_REGISTERS)


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


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


# (BM, BN, BK, warps, split_n, deepest pipeline) worth timing. BT = 512 (memory-bound): the
# X / dY tiles are re-read from L2 K * 2 * (1/BM + 1/BN) bytes per weight element (32 B for 64x64
# tiles, 12 B for 128x256), on top of 12 B of state traffic, so large tiles pay; the column split
# keeps their epilogue in registers, and configs at <= 128 registers let two programs share an SM.
# 16-warp entries are out: on the H100 (triton 3.6) 128x128 /2 and 128x256 /4 on 16 warps gave
# wrong weights (8.3 and 6.9 bf16 steps off the reference; docs/kernel_notes.md, session 3).
SHORTLIST = ((64, 64, 64, 4, 1, 4),
             (64, 64, 32, 4, 1, 6),       # int8 at BT 512: four programs per SM under the register cap
             (64, 128, 64, 8, 2, 4),
             (64, 128, 32, 8, 2, 4),      # int8 at BT 512: 2-3% faster than BK 64 (prefetching, capped)
             (128, 128, 64, 8, 4, 3),
             (128, 128, 64, 8, 2, 4),
             (64, 256, 32, 8, 4, 4),
             (128, 256, 64, 8, 4, 3))


def supports(config: TileConfig, state_dtype: str) -> bool:
    """Whether the kernel can run ``config`` with this state format (see ``check_config``)."""
    try:
        check_config(config, state_dtype)
    except ValueError:
        return False
    return True


def candidate_configs(m: int, n: int, k: int, input_bytes: int) -> list[TileConfig]:
    """The small set worth timing for one shape (GROUP fixed at 8; ``tune_config`` then tries the
    other GROUP values on the winner); the caller drops those its state format cannot run.

    From ``SHORTLIST``, keep the tiles no larger than the weight rounded up to a power of two, at
    one pipeline depth each: the deepest that fits the shared memory, at most the entry's depth
    and at most the number of K chunks (at least 2).
    """
    chosen: list[TileConfig] = []
    max_m, max_n = max(64, _pow2_at_least(m)), max(64, _pow2_at_least(n))
    for bm, bn, bk, warps, split_n, deepest in SHORTLIST:
        if bm > max_m or bn > max_n:
            continue
        k_chunks = max(1, math.ceil(k / bk))
        depths = [s for s in STAGES if s <= max(2, min(deepest, k_chunks))
                  and fits(TileConfig(bm, bn, bk, 8, warps, s, split_n=split_n), input_bytes)]
        if depths:
            chosen.append(TileConfig(bm, bn, bk, 8, warps, max(depths), split_n=split_n))
    return chosen


def default_config(m: int, n: int, k: int, input_bytes: int) -> TileConfig:
    """The untuned choice (``FORGE_AUTOTUNE=0`` or tuning impossible): 128x128 tiles on 8 warps,
    the epilogue in two 64-wide slabs (no spills, int8 blocks whole), a 3-deep pipeline (fits
    fp32 inputs too)."""
    return TileConfig(128, 128, 64, 8, 8, 3, split_n=2)


# TMA in the main loop made the 4-warp BT-512 tiles 3-6% faster and 128x256 at 4096 tokens 5-15%,
# but the 8-warp 64x128 tile 7-23% slower with int8 states (H100, results/kernels/h100/tma_ab):
# which loader wins depends on the tile, so the fastest few are also timed with the other one.
TMA_FLIPS = 3
# Each config above is timed once, by one ~40 ms do_bench, seconds apart from its rivals; under the
# H100's power cap the SM clock moves by 5-10% within a cell (run22: 1740-1830 MHz after the window),
# and candidates a few percent apart swapped places between boots (gate/up with int8 states ran a
# 318 us tile where 64x64x32 s6 measures 301-305 us alone, session 12). So the fastest few, within
# FINALIST_MARGIN of the best, are timed again round-robin, FINAL_ROUNDS times, each round in a new
# order, and ranked by their median: every round sees all finalists at about one clock.
FINALISTS = 4
FINAL_ROUNDS = 5
FINALIST_MARGIN = 1.10
_TUNED: dict[tuple, TileConfig] = {}
_FROM_DISK: set[tuple] = set()       # keys whose choice came from FORGE_TUNE_CACHE, not tuned here


def tune_config(candidates: Iterable[TileConfig], run_on_scratch: Callable[[TileConfig], None],
                time_ms: Callable[[Callable[[], None]], float],
                groups: Iterable[int] = GROUPS, prefetch_options: Iterable[bool] = (False, True),
                tma_flips: int = TMA_FLIPS, finalists: int = FINALISTS,
                final_rounds: int = FINAL_ROUNDS) -> tuple[TileConfig, dict[TileConfig, float]]:
    """Time each candidate with ``run_on_scratch`` (which must only touch scratch copies), with and
    without prefetch, then the ``tma_flips`` fastest with the other main-loop loader (TMA or
    pointers), then the other GROUP values on the fastest, then re-time the ``finalists`` fastest
    round-robin (``final_rounds`` rounds); return the winner and every timing (a finalist's is its
    median over the rounds). A candidate that fails to compile or launch (out of resources) is skipped."""
    timings: dict[TileConfig, float] = {}

    def measure(config: TileConfig) -> None:
        try:
            # Triton prints the whole PTX (~100 KB) to stdout when ptxas refuses a register cap; a
            # tuned model refuses a few, and every sweep cell's log grew by megabytes of it.
            with contextlib.redirect_stdout(io.StringIO()):
                timings[config] = float(time_ms(lambda: run_on_scratch(config)))
        except Exception as error:  # noqa: BLE001 - resource errors differ between Triton versions
            # ptxas refusing a register cap (PTXASError: "Insufficient registers") is a resource limit too
            if not any(name in type(error).__name__ for name in ("OutOfResources", "CompilationError", "PTXASError")) \
                    and "out of resource" not in str(error).lower():
                raise

    candidates = list(candidates)
    for config in candidates:
        measure(config)
    if not timings:
        raise RuntimeError("fused_wgrad_update: no tile configuration could run on this device")
    # Prefetch changes the ranking (it costs registers, so occupancy), so every candidate is timed
    # both ways, and prefetching again under a register cap that keeps 16 warps per SM; then
    # the other GROUP values on the fastest.
    for config in candidates:
        for candidate in prefetch_variants(config, prefetch_options):
            if candidate not in timings:
                measure(candidate)
    for config in sorted(timings, key=timings.get)[:tma_flips]:
        flipped = dataclasses.replace(config, tma=not config.tma)
        if flipped not in timings:
            measure(flipped)
    best = min(timings, key=timings.get)
    for group in groups:
        variant = dataclasses.replace(best, group=group)
        if variant not in timings:
            measure(variant)
    fastest = min(timings.values())
    final = [c for c in sorted(timings, key=timings.get)[:finalists] if timings[c] <= fastest * FINALIST_MARGIN]
    if len(final) > 1 and final_rounds > 0:
        rounds: dict[TileConfig, list[float]] = {config: [] for config in final}
        for round_index in range(final_rounds):
            shift = round_index % len(final)
            for config in final[shift:] + final[:shift]:
                rounds[config].append(float(time_ms(lambda: run_on_scratch(config))))
        timings.update({config: statistics.median(times) for config, times in rounds.items()})
        return min(final, key=timings.get), timings
    return min(timings, key=timings.get), timings


def prefetch_variants(config: TileConfig, prefetch_options: Iterable[bool] = (False, True)) -> list[TileConfig]:
    """What ``tune_config`` times of one candidate: each prefetch setting, and prefetching again under
    the register cap of ``sixteen_warps_per_sm`` (scripts/gpu_kernel_check.py sweeps the same list)."""
    variants = []
    for prefetch in prefetch_options:
        variant = dataclasses.replace(config, prefetch=prefetch)
        capped = sixteen_warps_per_sm(variant) if prefetch else None
        variants += [v for v in (variant, capped) if v is not None]
    return variants


REGISTERS_PER_SM = 65536
RESIDENT_WARPS_TARGET = 16              # warps per SM the register cap aims at (of 64)


def sixteen_warps_per_sm(config: TileConfig) -> TileConfig | None:
    """``config`` capped at the registers per thread that keep 16 warps resident per SM (128: two
    8-warp programs or four 4-warp ones), or None when it already carries a cap. Why: prefetching
    the epilogue's loads took the best BT-512 tiles from 128 to 136-152 registers (one program per
    SM, nothing to overlap a program's epilogue with another's main loop); offline sm_90 compiles
    spill only 8-32 bytes per thread at the cap. Since the int8 epilogue fits in 128 registers
    (2196a6c), four 64x64 programs of 4 warps with a 6-deep BK-32 pipeline beat two 64x128 ones
    by 4-7% at 512 tokens (results/kernels/h100/variants_int8_55b11f9)."""
    cap = REGISTERS_PER_SM // (RESIDENT_WARPS_TARGET * 32)
    if config.max_registers is not None or config.num_warps > RESIDENT_WARPS_TARGET:
        return None
    return dataclasses.replace(config, max_registers=cap)


def use_fixed_config() -> bool:
    """Whether to skip tuning and use ``INTERPRETER_CONFIG`` (in the interpreter)."""
    return interpreting()


def _autotune_enabled() -> bool:
    return os.environ.get("FORGE_AUTOTUNE", "1") != "0"


def _direct_launch_enabled() -> bool:
    """``FORGE_DIRECT_LAUNCH=0`` keeps every launch on Triton's JIT path (to A/B the host cost)."""
    return os.environ.get("FORGE_DIRECT_LAUNCH", "1") != "0"


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _LaunchPlan:
    """Everything a launch needs but the activations, the step's scalars and the seed: built once per
    weight and activation layout, then reused every step (the per-step host path is a signature
    compare and one Triton call; on a host-bound Llama-8B step each fused layer's Python counts)."""
    config: TileConfig
    grid: tuple[int]
    fixed_args: tuple            # weight, states, scales, sizes and strides after x2, dy2 (not the
                                 # accumulator: it is passed per launch, see _run)
    kwargs: Mapping[str, Any]    # tile sizes, warps, stages, layout and rule meta-parameters
    direct: Callable[[tuple], bool] | None = None
    """Launches the kernel this plan compiled without Triton's per-call binding (``_direct_launcher``);
    set after the plan's first launch, for plans that are cached (their arguments keep the
    specialisation the kernel was compiled for)."""
    direct_builds_descriptors: bool = False
    """``direct`` encodes the TMA descriptors of x2 and dy2 itself (``_raw_tma_launch``): ``_run``
    then passes no TensorDescriptor objects."""

    @property
    def tma(self) -> bool:
        """Whether the main loop loads through TMA descriptors (built per launch by ``_run``)."""
        return self.kwargs["TMA"]


# Per ParamState: {signature: plan}. Weak keys: a plan never keeps a dropped optimizer's tensors alive
# through this table, and copying or pickling a ParamState never drags plans along.
_PLANS: "weakref.WeakKeyDictionary[ParamState, dict]" = weakref.WeakKeyDictionary()


def state_pointers(weight: torch.Tensor, states: list[torch.Tensor],
                   scales: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """(S0, S1, SCALE0, SCALE1) as the kernels take them: the weight stands in for a state or scale
    the rule or format lacks (never read: NUM_STATES / STATE_KIND rule it out)."""
    s0 = states[0] if len(states) > 0 else weight
    s1 = states[1] if len(states) > 1 else weight
    scale0 = scales[0] if len(scales) > 0 and scales[0] is not None else weight
    scale1 = scales[1] if len(scales) > 1 and scales[1] is not None else weight
    return s0, s1, scale0, scale1


def wide_index(*matrices: torch.Tensor) -> bool:
    """Whether a kernel's weight-shaped offsets need 64 bits: some 2-D operand's last element lies at
    or past 2^31 - 1 elements from its base (Llama's 128256 x 4096 embedding does not; larger ones may)."""
    return max((t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1)
               for t in matrices if t.dim() == 2) >= 2 ** 31 - 1


def compile_options() -> dict[str, Any]:
    """The compile options every launch of the update kernels asks for on the GPU: FMA contraction,
    which the int8 codes' FFMA relies on (``_int8_codes``) and Triton 3.10 stops defaulting to."""
    return {} if interpreting() else {"enable_fp_fusion": True}


def scalar_arguments(scalars: tuple[float, ...] | torch.Tensor,
                     placeholder: torch.Tensor) -> tuple[tuple[float, ...], torch.Tensor]:
    """(c0..c7, SCALARS) as a launch passes them: the floats and any pointer, or (capturable mode) zeros
    and the device buffer the kernel reads them from (``rule_scalars``)."""
    if isinstance(scalars, torch.Tensor):
        return _NO_SCALARS, scalars
    return scalars, placeholder


def _plan(config: TileConfig, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states: list[torch.Tensor],
          scales: list[torch.Tensor | None], grad_accum: torch.Tensor | None, meta: Mapping[str, Any]) -> _LaunchPlan:
    m, n = weight.shape
    k = x2.shape[0]
    s0, s1, scale0, scale1 = state_pointers(weight, states, scales)
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
    kwargs = dict(BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP=config.group, QB=QBLOCK,
                  num_warps=config.num_warps, num_stages=config.num_stages, **options, **layout, **meta)
    return _LaunchPlan(config, grid, fixed + strides, kwargs)


_NO_SCALARS = (0.0,) * NUM_SCALARS


def _run(plan: _LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor,
         seed: int, grad_accum: torch.Tensor | None = None):
    """One launch. ``scalars``: the rule's floats as launch arguments, or a device buffer holding them
    (the plan was then built with ``SCALARS_IN_MEMORY``). ``grad_accum``: the accumulator, of the
    layout the plan was built with (or None, as the plan was)."""
    tail = kernel_args(plan, x2, dy2, scalars, seed, grad_accum)
    if plan.direct is not None:
        descriptors = (None, None) if plan.direct_builds_descriptors else _descriptors(plan, x2, dy2)
        if plan.direct((x2, dy2, *descriptors, *tail)):
            return None
    return _fused_wgrad_update_kernel[plan.grid](x2, dy2, *_descriptors(plan, x2, dy2), *tail, **plan.kwargs)


def kernel_args(plan: _LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor,
                seed: int, grad_accum: torch.Tensor | None = None) -> tuple:
    """The kernel's runtime arguments after X, DY and their two descriptors (see ``_run``)."""
    weight, s0, s1, scale0, scale1, m, n, k = plan.fixed_args[:8]
    accum = grad_accum if grad_accum is not None else weight
    values, buffer = scalar_arguments(scalars, weight)
    return (weight, s0, s1, scale0, scale1, accum, m, n, k, x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
            *plan.fixed_args[8:], *values, seed, buffer)


def _descriptors(plan: _LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor) -> tuple[Any, Any]:
    """The main loop's TMA descriptors of x2 and dy2, or (None, None) for a pointer plan. A descriptor
    holds the base address: a new one per launch (a graph captures it)."""
    if not plan.tma:
        return None, None
    config = plan.config
    return (TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [config.block_k, config.block_n]),
            TensorDescriptor(dy2, list(dy2.shape), list(dy2.stride()), [config.block_k, config.block_m]))


def _constexpr_tail(kernel: Any = None) -> tuple[str, ...] | None:
    """``kernel``'s constexpr parameter names (default: the fused Triton kernel) when they all follow
    its runtime parameters (the layout the direct launchers rely on), else None."""
    kernel = _fused_wgrad_update_kernel if kernel is None else kernel
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


def _direct_launcher(compiled: Any, plan: _LaunchPlan) -> Callable[[tuple], bool] | None:
    """A launch of ``compiled`` (what ``plan``'s first launch through the JIT returned) that skips the
    JIT's per-call work: binding ~40 arguments, specialising each, hashing the key, reading its knobs
    (about 100 us a launch on the H100 hosts; a 1B eager step makes 113). Only sound when the later
    arguments specialise as the first did, which the plan signature guarantees for everything but
    the seed (not specialised) and the scalar values (floats, never specialised). The launcher
    returns False, launching nothing, when another device is current than at the first launch (the
    JIT path then runs, as it would have: the compiled handle is loaded for that device).

    None where this Triton lays out its compiled kernels differently (the JIT path then stays). For a
    TMA plan whose compiled kernel ``_raw_tma_launch`` understands, the launch encodes the descriptors
    itself and ``plan.direct_builds_descriptors`` is set, so ``_run`` builds none for it."""
    names = _constexpr_tail()
    runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    driver = getattr(getattr(triton, "runtime", None), "driver", None)
    needed = ("run", "function", "packed_metadata", "launch_metadata")
    if names is None or runtime_knobs is None or driver is None or not all(hasattr(compiled, a) for a in needed):
        return None
    try:
        constexprs = tuple(plan.kwargs[name] for name in names)
        current_stream, current_device = driver.active.get_current_stream, driver.active.get_current_device
        device_index = current_device()
    except (KeyError, AttributeError, RuntimeError):
        return None
    run, function, packed, metadata = compiled.run, compiled.function, compiled.packed_metadata, compiled.launch_metadata
    grid = plan.grid
    grid_x = grid[0]
    raw = _raw_tma_launch(compiled) if plan.tma else None
    if raw is not None:
        launcher, cooperative, pdl, (x_meta, dy_meta), encode = raw
        plan.direct_builds_descriptors = True

        def launch_encoding_descriptors(args: tuple) -> bool:
            if current_device() != device_index:
                return False
            stream = current_stream(device_index)
            x2, dy2 = args[0], args[1]
            launcher(grid_x, 1, 1, stream, function, cooperative, pdl, None, None, packed,
                     metadata(grid, stream, *args, *constexprs), runtime_knobs.launch_enter_hook,
                     runtime_knobs.launch_exit_hook, x2, dy2, *encode(x2, x_meta), *encode(dy2, dy_meta),
                     *args[4:], *constexprs)
            return True

        return launch_encoding_descriptors

    def launch(args: tuple) -> bool:
        if current_device() != device_index:
            return False
        stream = current_stream(device_index)
        run(grid_x, 1, 1, stream, function, packed, metadata(grid, stream, *args, *constexprs),
            runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook, *args, *constexprs)
        return True

    return launch


def _go_direct(plan: _LaunchPlan, compiled: Any) -> None:
    """After ``plan``'s launch through the JIT returned ``compiled``: its direct launcher, for the
    launches that follow (unless launches stay on the JIT: the interpreter, ``FORGE_DIRECT_LAUNCH=0``)."""
    if compiled is not None and not interpreting() and _direct_launch_enabled():
        plan.direct = _direct_launcher(compiled, plan)


_TRITON_36_BASE_ARGS = "iiiKKppOOOOOO"      # grid xyz, stream, function, cooperative, pdl, 2 scratches, 4 objects


def _raw_tma_launch(compiled: Any, descriptor_indices: tuple[int, ...] = (2, 3)) -> tuple | None:
    """What a TMA plan's launch needs to skip Triton's descriptor handling, or None when ``compiled``
    is not laid out as in Triton 3.6 with descriptors at exactly ``descriptor_indices`` of its
    parameters (x2's and dy2's for the Triton kernel; the Gluon kernel's five: ``hopper_ws``); the
    ``_direct_launcher`` path with TensorDescriptor objects, or the JIT, then runs.

    Why: Triton 3.6 turns each TensorDescriptor into the launcher's (tensor map, shape, strides)
    arguments in Python, walking every one of the kernel's ~70 parameters per launch, after
    ``TensorDescriptor`` itself validated shape, strides and block in Python: about 20 us a launch
    on the H100 hosts, 226 launches per eager Llama-8B step (``scripts/host_cost.py``). Here the
    tensor maps come from the same encoder with the compiled kernel's own descriptor metadata
    (swizzle, element type, block); the checks ``tma_inputs`` made when the plan was built hold
    for every launch of it (the plan signature holds shapes, strides and alignment).

    Returns (launcher, cooperative, pdl, one meta per descriptor in parameter order, encode)."""
    nvidia_driver = sys.modules.get("triton.backends.nvidia.driver")
    run = getattr(compiled, "run", None)
    inner = getattr(run, "launch", None)
    code, closure = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
    if nvidia_driver is None or code is None or not closure or \
            getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) != _TRITON_36_BASE_ARGS:
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


def _launch(config: TileConfig, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
            states: list[torch.Tensor], scales: list[torch.Tensor | None], grad_accum: torch.Tensor | None,
            scalars: tuple[float, ...] | torch.Tensor, seed: int, meta: Mapping[str, Any]):
    """Launch the kernel with ``config``; returns Triton's compiled-kernel handle (resource report)."""
    return _run(_plan(config, x2, dy2, weight, states, scales, grad_accum, meta), x2, dy2, scalars, seed, grad_accum)


def check_config(config: TileConfig, state_dtype: str) -> None:
    """A clear error for a tile configuration the kernel cannot run."""
    if config.block_n % QBLOCK:
        raise ValueError(f"block_n must be a multiple of {QBLOCK}, got {config.block_n}")
    if config.split_n not in (1, 2, 4) or config.block_n % config.split_n:
        raise ValueError(f"split_n must be 1, 2 or 4 and divide block_n, got {config.split_n} for {config.block_n}")
    if state_dtype == "int8" and config.epilogue_columns() % QBLOCK:
        raise ValueError(f"int8 states need epilogue slabs of whole {QBLOCK}-wide blocks; block_n / split_n = "
                         f"{config.epilogue_columns()}")


def _bench_ms(fn: Callable[[], None]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _tuned_config(key: tuple, state_dtype: str, x2, dy2, weight, states, scales, grad_accum, scalars, seed,
                  meta) -> TileConfig:
    m, n = weight.shape
    k = x2.shape[0]
    input_bytes = x2.element_size()
    if key in _TUNED:
        return _TUNED[key]
    if not _autotune_enabled():
        return default_config(m, n, k, input_bytes)      # not cached: tuning may be enabled later
    candidates = tuning_candidates(m, n, k, input_bytes, state_dtype)
    disk_path, disk_key = tune_cache.cache_path(), None
    if disk_path is not None:
        fingerprint = _tuning_fingerprint(weight, meta, candidates)
        disk_key = tune_cache.entry_key(key, fingerprint)
        cached = tune_cache.lookup(disk_path, disk_key, TileConfig)
        if cached is not None:
            _TUNED[key] = cached
            _FROM_DISK.add(key)
            return cached
        stale = tune_cache.other_fingerprints(disk_path, key)
        if stale:
            warnings.warn(f"{tune_cache.ENV}: {disk_path} holds a tile for {m}x{n} at {k} tokens made for another "
                          f"kernel source, Triton, GPU or candidate list (fingerprint {', '.join(stale)}, this one "
                          f"{fingerprint}); tuning again", RuntimeWarning, stacklevel=3)
    tuned = False
    try:
        scratch_weight = weight.detach().clone()
        scratch_states = [s.clone() for s in states]
        scratch_scales = [s.clone() if s is not None else None for s in scales]
    except torch.OutOfMemoryError:
        warnings.warn(f"fused_wgrad_update: no memory for tuning scratch copies of a {m}x{n} weight; "
                      f"using the default tile configuration", RuntimeWarning, stacklevel=3)
        config = default_config(m, n, k, input_bytes)
    else:
        def run_on_scratch(config: TileConfig) -> None:
            _launch(config, x2, dy2, scratch_weight, scratch_states, scratch_scales, grad_accum, scalars, seed,
                    meta)

        config, _ = tune_config(candidates, run_on_scratch, _bench_ms, finalists=FINALISTS)
        tuned = True
        del scratch_weight, scratch_states, scratch_scales
    _TUNED[key] = config
    if tuned and disk_key is not None:
        tune_cache.store(disk_path, disk_key, config, {
            "shape": f"{m}x{n}", "tokens": k, "device": _device_name(weight), "triton": triton.__version__})
    return config


def _device_name(tensor: torch.Tensor) -> str:
    return torch.cuda.get_device_name(tensor.device) if tensor.is_cuda else str(tensor.device)


def _tuning_fingerprint(weight: torch.Tensor, meta: Mapping[str, Any], candidates: list[TileConfig]) -> str:
    return tuning_fingerprint(meta.get("EPILOGUE"), candidates, triton.__version__, _device_name(weight))


def tuning_fingerprint(epilogue: Any, candidates: list[TileConfig], triton_version: str, device_name: str) -> str:
    """What a tile choice on disk is valid for besides its key: the kernel and the rule's epilogue
    (their sources and what they call, not their line numbers), the Triton version, the GPU, and
    what the tuner chose among."""
    search = (candidates, GROUPS, TMA_FLIPS, FINALISTS, FINAL_ROUNDS, FINALIST_MARGIN, RESIDENT_WARPS_TARGET)
    identity = tune_cache.source_identity
    return tune_cache.fingerprint(identity(_fused_wgrad_update_kernel) + identity(epilogue), triton_version,
                                  device_name, list(search))


def ws_identity(epilogue: Any, triton_config: TileConfig, triton_version: str, device_name: str, graphed: bool) -> str:
    """What a Gluon-or-Triton choice (``ws_choice.chosen``) depends on besides its key: both kernels'
    sources, the rule's epilogue, the Triton tile it was timed against, Triton and the GPU; an eager
    choice also weighs the host's launch cost, so which launch paths were timed."""
    identity = (tune_cache.source_identity(hopper_ws._ws_fused_kernel)
                + tuning_fingerprint(epilogue, [triton_config], triton_version, device_name))
    if not graphed:
        identity += "|eager launches: " + ("direct, both kernels" if _direct_launch_enabled() else "jit")
    return identity


def tuning_candidates(m: int, n: int, k: int, input_bytes: int, state_dtype: str) -> list[TileConfig]:
    """The tiles the tuner times for one weight shape and state format (part of its fingerprint)."""
    return [c for c in candidate_configs(m, n, k, input_bytes) if supports(c, state_dtype)]


def tuned_configs() -> dict[tuple, "TileConfig | hopper_ws.WsConfig"]:
    """The configurations chosen so far in this process, by tuning key (for logs and benchmarks): the
    Triton tile, or the Gluon kernel's config where ``ws_choice`` gave it the weight."""
    return {**_TUNED, **ws_choice.chosen_configs()}


def describe_tuned_configs() -> dict[str, str]:
    """The tuner's choices as short text, for a benchmark row: which tile ran each weight shape.

    Two timings of one model are only comparable when one knows whether the same kernels ran."""
    described = {}
    for key, config in _TUNED.items():
        (m, n), tokens, _, _, rule_name, state_dtype = key[:6]
        described[f"{m}x{n}/bt{tokens}/{rule_name}/{state_dtype}"] = (
            f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} "
            f"g{config.group} split{config.split_n}{' prefetch' if config.prefetch else ''}"
            f"{f' maxnreg{config.max_registers}' if config.max_registers else ''}{'' if config.tma else ' pointers'}"
            f"{' (tune cache)' if key in _FROM_DISK else ''}")
    for key, ws_config in ws_choice._CHOSEN.items():          # key: the tuning key + the timing mode
        if ws_config is not None:
            (m, n), tokens, _, _, rule_name, state_dtype = key[:6]
            described[f"{m}x{n}/bt{tokens}/{rule_name}/{state_dtype}"] = ws_choice.describe(
                ws_config, key in ws_choice._FROM_DISK)
    return described


def fused_wgrad_update(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                       hp: Mapping[str, Any], step: int, *, grad_accum: torch.Tensor | None = None,
                       stochastic_rounding: bool = False, seed: int = 0, config: TileConfig | None = None,
                       device_scalars: torch.Tensor | None = None) -> None:
    """One optimizer step of ``state.rule`` on ``weight`` with G = dY^T X, G never materialized.

    ``x``: (..., Din), ``dy``: (..., Dout), same dtype (bf16 / fp16 / fp32); ``weight`` (Dout, Din)
    bf16 or fp32, updated in place with ``state``. fp32 inputs use IEEE fp32 products unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set. ``seed`` drives stochastic rounding (vary it
    per step). ``config`` pins a tile configuration (benchmarks); otherwise one is tuned per shape.
    ``device_scalars``: a float32 tensor of ``NUM_SCALARS`` on the weight's device holding the rule's
    kernel scalars (``rule.kernel_scalars_on_device``); the kernel reads them there and ``hp`` / ``step``
    are not used, so the launch can be captured in a CUDA graph and replayed at later steps.
    """
    in_memory = device_scalars is not None
    signature = _plan_signature(x, dy, weight, state, grad_accum, stochastic_rounding, config, in_memory)
    plans = _PLANS.get(state)
    cached = plans.get(signature) if plans is not None and signature is not None else None
    if cached is not None:
        # Same weight, states, layouts and dtypes as a call that passed every check below.
        x2, dy2 = flatten_tokens(x, x.shape[-1], "x"), flatten_tokens(dy, dy.shape[-1], "dy")
        scalars = device_scalars if in_memory else _kernel_scalars(state.rule, hp, step)
        if isinstance(cached, _WsPlan):
            cached.run(x2, dy2, scalars)
        else:
            _run(cached, x2, dy2, scalars, int(seed) & 0x7FFFFFFF, grad_accum)
        return
    if not triton_available():
        raise RuntimeError("fused_wgrad_update needs a CUDA device or TRITON_INTERPRET=1; "
                           "use reference_wgrad_update on this machine")
    x2, dy2 = check_arguments(x, dy, weight, state, grad_accum)
    if weight.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"fused_wgrad_update: tensors are on {weight.device}, the Triton kernel needs CUDA")
    rule = state.rule
    states, scales = kernel_states(state)
    scalars = launch_scalars("fused_wgrad_update", rule, hp, step, device_scalars, weight, stochastic_rounding)
    stochastic = bool(stochastic_rounding) and weight.dtype == torch.bfloat16
    ieee = x2.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    meta = kernel_meta(state, x2.dtype, grad_accum=grad_accum is not None, stochastic=stochastic, ieee=ieee,
                       scalars_in_memory=in_memory)
    seed = int(seed) & 0x7FFFFFFF
    if config is None:
        if use_fixed_config():
            config = INTERPRETER_CONFIG
        else:
            key = (tuple(weight.shape), x2.shape[0], x2.dtype, weight.dtype, rule.name, state.state_dtype,
                   grad_accum is not None, stochastic, ieee, str(weight.device))   # one tuning for both scalar sources
            config = _tuned_config(key, state.state_dtype, x2, dy2, weight, states, scales, grad_accum, scalars, seed,
                                    meta)
            ws_plan = _ws_plan(key, state.state_dtype, x2, dy2, weight, states, scales, grad_accum, stochastic,
                               scalars, seed, meta, config)
            if ws_plan is not None:
                ws_plan.run(x2, dy2, scalars)
                if signature is not None:
                    _PLANS[state] = {signature: ws_plan}
                return
    check_config(config, state.state_dtype)
    plan = _plan(config, x2, dy2, weight, states, scales, grad_accum, meta)
    compiled = _run(plan, x2, dy2, scalars, seed, grad_accum)
    if signature is not None and _plans_cacheable(config):      # one layout per weight is the steady state
        _go_direct(plan, compiled)
        _PLANS[state] = {signature: plan}


@dataclasses.dataclass
class _WsPlan:
    """A weight whose update the tuner gave to the warp-specialized Gluon kernel (``ws_choice``):
    its config and tensors, checked once (``hopper_ws.unsupported_reason``) when it was chosen."""
    config: hopper_ws.WsConfig
    weight: torch.Tensor
    states: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    epilogue: Any
    sqrt_domain: tuple[bool, bool]
    direct: Callable[[torch.Tensor, torch.Tensor, Any], bool] | None = None
    """From the second launch: the Gluon kernel launched without its JIT (``hopper_ws.direct_launcher``)."""
    launched: bool = False

    def run(self, x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor) -> None:
        if self.direct is not None and self.direct(x2, dy2, scalars):
            return
        compiled = hopper_ws.launch(x2, dy2, self.weight, self.states, self.epilogue, scalars, self.config,
                                    check=False, scales=self.scales, sqrt_domain=self.sqrt_domain)
        if not self.launched:
            self.launched = True
            if _direct_launch_enabled():
                self.direct = hopper_ws.direct_launcher(compiled, x2, dy2, self.weight, self.states, self.scales,
                                                        self.epilogue, scalars, self.config, self.sqrt_domain)


def _ws_plan(key: tuple, state_dtype: str, x2, dy2, weight, states, scales, grad_accum, stochastic: bool, scalars,
             seed: int, meta, triton_config: TileConfig) -> _WsPlan | None:
    """A plan on the Gluon kernel when it beats the tuned Triton tile on this call (``ws_choice``),
    else None. Both are timed on scratch copies of the weight and states."""
    if interpreting() or not _autotune_enabled() or not isinstance(triton_config, TileConfig):
        return None
    candidates = ws_choice.candidates_for(x2, dy2, weight, states, scales, state_dtype, grad_accum, stochastic)
    if not candidates:
        return None
    sqrt_domain = (meta["S0_SQRT"], meta["S1_SQRT"])

    def plan_on(config, weight, states, scales) -> _WsPlan | None:
        return _WsPlan(config, weight, states, scales, meta["EPILOGUE"], sqrt_domain) if config is not None else None

    # A launch with scalars in device memory is made to be captured in a CUDA graph, where the
    # host's launch cost is gone: time both kernels in graphs then. Otherwise (eager) as the caller
    # pays: do_bench, launch cost included. Through its JIT the Gluon kernel's launch costs the
    # host 180-240 us (H100 host, session 21), which lost it eager choices; its plans launch
    # directly from their second call (hopper_ws.direct_launcher: ~20 us), in the timing too.
    graphed = isinstance(scalars, torch.Tensor)
    choice_key = key + ("graph" if graphed else "eager",)
    if choice_key in ws_choice._CHOSEN:          # chosen before (this process): no scratch copies needed
        return plan_on(ws_choice._CHOSEN[choice_key], weight, states, scales)
    try:
        scratch_weight = weight.detach().clone()
        scratch_states = [s.clone() for s in states]
        scratch_scales = [s.clone() if s is not None else None for s in scales]
    except torch.OutOfMemoryError:
        return None

    # One plan for the Triton tile and one per Gluon candidate, so that their timed launches after
    # the first are direct, as in the steps that follow (through the JIT, each would pay 100-240 us
    # of host time an eager step does not pay).
    triton_plan = _plan(triton_config, x2, dy2, scratch_weight, scratch_states, scratch_scales, None, meta)

    def run_triton() -> None:
        compiled = _run(triton_plan, x2, dy2, scalars, seed)
        if triton_plan.direct is None:
            _go_direct(triton_plan, compiled)

    candidate_plans = {c: plan_on(c, scratch_weight, scratch_states, scratch_scales) for c in candidates}

    def run_ws(config: hopper_ws.WsConfig) -> None:
        candidate_plans[config].run(x2, dy2, scalars)

    identity = ws_identity(meta["EPILOGUE"], triton_config, triton.__version__, _device_name(weight), graphed)
    m, n = weight.shape
    config = ws_choice.chosen(choice_key, candidates, run_triton, run_ws,
                              ws_choice.graph_time_ms if graphed else _bench_ms, identity, {
        "shape": f"{m}x{n}", "tokens": x2.shape[0], "device": _device_name(weight), "triton": triton.__version__,
        "triton_tile": dataclasses.asdict(triton_config)})
    return plan_on(config, weight, states, scales)


def kernel_meta(state: ParamState, input_dtype: torch.dtype, *, grad_accum: bool, stochastic: bool, ieee: bool,
                scalars_in_memory: bool) -> dict[str, Any]:
    """The rule's and the states' compile-time parameters of a launch (its plan adds the tile's)."""
    rule = state.rule
    names = rule.state_names
    return dict(
        EPILOGUE=rule.epilogue, NUM_STATES=len(names), STATE_KIND=_STATE_KIND[state.state_dtype],
        S0_SQRT=len(names) > 0 and state.is_sqrt_domain(names[0]),
        S1_SQRT=len(names) > 1 and state.is_sqrt_domain(names[1]),
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
    """The state tensors and int8 scales a launch takes, in the epilogue's order, once the rule is
    known to have a Triton epilogue the kernels can run."""
    rule = state.rule
    if rule.epilogue is None or rule.kernel_scalars is None:
        raise ValueError(f"rule {rule.name!r} has no Triton epilogue; use reference_wgrad_update")
    if len(rule.state_names) > MAX_STATES:
        raise ValueError(f"rule {rule.name!r} has {len(rule.state_names)} states; the kernel takes at most {MAX_STATES}")
    states = [state.values[name] for name in rule.state_names]
    scales = [state.scales[name] for name in rule.state_names]
    if any(s.stride() != states[0].stride() for s in states):
        raise ValueError("all state tensors of one weight must share strides")
    return states, scales


def launch_scalars(caller: str, rule: Rule, hp: Mapping[str, Any], step: int, device_scalars: torch.Tensor | None,
                   weight: torch.Tensor, stochastic_rounding: bool) -> tuple[float, ...] | torch.Tensor:
    """What a launch passes for the rule's scalars: the checked ``device_scalars`` buffer (capturable
    mode, read by ``rule_scalars`` in the kernel), else the floats of ``_kernel_scalars``."""
    if device_scalars is None:
        return _kernel_scalars(rule, hp, step)
    _check_device_scalars(device_scalars, weight)
    if stochastic_rounding and weight.dtype == torch.bfloat16:
        raise ValueError(f"{caller}: stochastic rounding draws a new seed every step, which a "
                         "replayed launch cannot; use device_scalars=None with stochastic_rounding")
    return device_scalars


_SCALARS: dict[tuple, tuple[float, ...]] = {}


def _kernel_scalars(rule, hp: Mapping[str, Any], step: int) -> tuple[float, ...]:
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


def _plans_cacheable(config: TileConfig | None) -> bool:
    """Whether a plan built with ``config`` may be kept: not the untuned default (``FORGE_AUTOTUNE=0``),
    which ``_tuned_config`` does not keep either. Read when a plan is stored, not per launch (two
    environment reads cost ~5 us a launch on the H100 hosts); a plan kept before the variable changed
    stays in use for its weight."""
    return config is not None or use_fixed_config() or _autotune_enabled()


_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)
"""The cuBLAS TF32 flag without ``torch.backends.cuda.matmul.__getattr__`` (2 us a call)."""


def _plan_signature(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                    grad_accum: torch.Tensor | None, stochastic_rounding: bool, config: TileConfig | None,
                    scalars_in_memory: bool = False):
    """What a cached launch plan depends on; None when the arguments cannot key one.

    The weight by storage address (``param.data = ...`` swaps it under the same Parameter), the
    state tensors by identity (internal tensors: a load replaces or copies into them, never
    re-points them), the activations by shape, strides, dtype and device. No environment read: this
    runs once per fused layer and backward (see ``_plans_cacheable``)."""
    try:
        # the activations' 16-byte alignment too: it decides the TMA path (tma_inputs)
        return (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype, weight.data_ptr(),
                x.data_ptr() % 16 == 0, dy.data_ptr() % 16 == 0,
                tuple(map(id, state.values.values())), tuple(map(id, state.scales.values())),
                None if grad_accum is None else (grad_accum.shape, grad_accum.stride(), grad_accum.dtype,
                                                 grad_accum.device),
                bool(stochastic_rounding), config, _allow_tf32(), scalars_in_memory)
    except (AttributeError, RuntimeError):       # not a plain tensor (a subclass without storage)
        return None
