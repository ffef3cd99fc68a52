"""The device codec every update kernel shares: how weight-shaped tiles, optimizer states and the
rule's scalars are read from memory and written back.

A state is stored as fp32, bf16 (rounded to nearest even) or int8 codes with one fp32 scale per
64-column block (``s = absmax / 127``, re-quantized every step; ``forge_core.state`` is the spec).
The Triton tile kernel (``tile_kernel``), the Gluon kernel (``hopper_ws_kernel``) and the embedding's
row update (``row_update``) call these same ``@triton.jit`` functions, so all three store the same
codes and bits. ``HW_MATH`` selects the GPU's instructions; without it (the interpreter) each step
is done exactly as the torch reference does it.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def load_tile(ptr, offsets, mask, EVEN: tl.constexpr):
    """Raw load of a weight-shaped tile (no mask when the tile lies inside the matrix)."""
    if EVEN:
        return tl.load(ptr + offsets)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0)


@triton.jit
def load_scales(scales_ptr, rows, row_mask, col_block0, n_blocks, stride_scale_row, KIND: tl.constexpr,
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
def int8_to_float(codes, HW_MATH: tl.constexpr):
    """int8 codes as exact fp32 integers. On the GPU without a conversion instruction (I2F runs at a
    quarter of the FP32 rate, and the int8 epilogue needs one per state element): the code plus
    2^23 + 128 is an fp32 bit pattern whose value is exactly that integer; subtracting it back is exact."""
    if HW_MATH:
        biased = (codes.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True)
        return biased - 8388736.0
    else:
        return codes.to(tl.float32)


@triton.jit
def decode_state(raw, scales, KIND: tl.constexpr, SQRT_DOMAIN: tl.constexpr, HW_MATH: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """A raw state tile as fp32: fp32 / bf16 as is, int8 codes times their block scale."""
    if KIND == 2:
        if BN == QB:        # one block per row: a broadcast, no reshape
            value = int8_to_float(raw, HW_MATH) * scales[:, None]
        else:
            NB: tl.constexpr = BN // QB
            value = tl.reshape(tl.reshape(int8_to_float(raw, HW_MATH), (BM, NB, QB)) * scales[:, :, None], (BM, BN))
        if SQRT_DOMAIN:
            value = value * value
    else:
        value = raw.to(tl.float32)
    return value


@triton.jit
def to_bf16_nearest_even(value, HW_MATH: tl.constexpr):
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
def store_tile(ptr, value, mask, EVEN: tl.constexpr, HW_MATH: tl.constexpr):
    """Store an fp32 tile into fp32 / bf16 / int8 memory (bf16: round to nearest even)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        value = to_bf16_nearest_even(value, HW_MATH)
    else:
        value = value.to(ptr.dtype.element_ty)
    if EVEN:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def block_scale(absmax, HW_MATH: tl.constexpr):
    """``absmax / 127``: on the GPU as absmax times fp32(1 / 127) (within one ulp of the quotient;
    no IEEE division per row and state), in the interpreter exactly as the torch reference."""
    if HW_MATH:
        return absmax * (1.0 / 127.0)
    else:
        return tl.math.div_rn(absmax, 127.0)


@triton.jit
def int8_codes(signed, scale, SQRT_DOMAIN: tl.constexpr, HW_MATH: tl.constexpr):
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
def store_state(values_ptr, scales_ptr, value, offsets, mask, rows, row_mask, col_block0, n_blocks,
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
            scale = block_scale(tl.max(magnitude_in, axis=1), HW_MATH)
            codes = int8_codes(value, scale[:, None], SQRT_DOMAIN, HW_MATH)
            store_tile(values_ptr + offsets, codes, mask, EVEN, HW_MATH)
            block_ok = (tl.zeros_like(row_mask.to(tl.int32)) + col_block0) < n_blocks
            tl.store(scales_ptr + rows * stride_scale_row + col_block0, scale, mask=row_mask & block_ok)
        else:
            NB: tl.constexpr = BN // QB
            blocks = tl.reshape(value, (BM, NB, QB))
            magnitude_in = tl.abs(blocks)
            scale = block_scale(tl.max(magnitude_in, axis=2), HW_MATH)
            codes = int8_codes(blocks, scale[:, :, None], SQRT_DOMAIN, HW_MATH)
            codes = tl.reshape(codes, (BM, BN))
            store_tile(values_ptr + offsets, codes, mask, EVEN, HW_MATH)
            block_cols = col_block0 + tl.arange(0, NB)
            scale_mask = row_mask[:, None] & (block_cols[None, :] < n_blocks)
            tl.store(scales_ptr + rows[:, None] * stride_scale_row + block_cols[None, :], scale, mask=scale_mask)
    else:
        store_tile(values_ptr + offsets, value, mask, EVEN, HW_MATH)


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
