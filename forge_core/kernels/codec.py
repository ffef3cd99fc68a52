"""The device codec every update kernel shares: how weight-shaped tiles, optimizer states and the
rule's scalars are read from memory and written back.

A state is stored as fp32, bf16 (rounded to nearest even), or int8 or float8_e4m3fn codes with one
fp32 scale per 64-column block (``s = absmax / 127`` or ``absmax / 448``, re-quantized every step;
``forge_core.state`` is the spec). ``KIND`` (a constexpr): 0 fp32, 1 bf16, 2 int8, 3 fp8 (whose codes
the kernels read and write as uint8). ``DOMAIN`` (a constexpr; the kernels' ``S0_SQRT`` ...): a state's
``forge_core.state.ParamState.code_domain``, 0 coded as it is, 1 in the sqrt domain (codes floored at the
smallest positive one), 2 as it is with floored codes (Adamax's ``exp_inf``); fp32 and bf16 ignore it.
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
    """The fp32 block scales of an int8 / fp8 state tile: (BM,) when the tile is one block wide, else
    (BM, BN // QB); a dummy for other kinds."""
    if KIND >= 2:
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
def fp8_to_float(codes, HW_MATH: tl.constexpr):
    """float8_e4m3fn codes (uint8) as fp32, exactly. On the GPU the hardware conversion; the
    interpreter's fp8 casts do not follow torch's, so there the 7 magnitude bits are placed at fp32's
    exponent and mantissa positions (an fp32 of exponent field e and mantissa m: subnormal for e = 0,
    as the fp8 value) and rebiased by 2^(127 - 7), which is exact; the sign bit is copied."""
    if HW_MATH:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bits = codes.to(tl.int32)
        magnitude = ((bits & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e+36    # 2^120
        return (magnitude.to(tl.int32, bitcast=True) | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def decode_state(raw, scales, KIND: tl.constexpr, DOMAIN: tl.constexpr, HW_MATH: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """A raw state tile as fp32: fp32 / bf16 as is, int8 / fp8 codes times their block scale."""
    if KIND == 2:
        if BN == QB:        # one block per row: a broadcast, no reshape
            value = int8_to_float(raw, HW_MATH) * scales[:, None]
        else:
            NB: tl.constexpr = BN // QB
            value = tl.reshape(tl.reshape(int8_to_float(raw, HW_MATH), (BM, NB, QB)) * scales[:, :, None], (BM, BN))
        if DOMAIN == 1:
            value = value * value
    elif KIND == 3:
        if BN == QB:
            value = fp8_to_float(raw, HW_MATH) * scales[:, None]
        else:
            NB: tl.constexpr = BN // QB
            value = tl.reshape(tl.reshape(fp8_to_float(raw, HW_MATH), (BM, NB, QB)) * scales[:, :, None], (BM, BN))
        if DOMAIN == 1:
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
def int8_codes(signed, scale, DOMAIN: tl.constexpr, HW_MATH: tl.constexpr):
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
        if DOMAIN != 0:
            # codes floored at 1 where the block's scale is normal (a sqrt-domain or floored state)
            return tl.maximum(pattern, 0x4B400000 + has_scale.to(tl.int32))
        else:
            return pattern
    else:              # an fp32 integer value
        inverse = tl.math.div_rn(1.0, tl.where(has_scale, scale, 1.0))
        code = (signed * inverse + 12582912.0) - 12582912.0
        if DOMAIN != 0:
            code = tl.where(has_scale, tl.maximum(code, 1.0), code)
        return code


@triton.jit
def fp8_block_scale(absmax, HW_MATH: tl.constexpr):
    """``absmax / 448`` (fp8 states): on the GPU as absmax times fp32(1 / 448), within one ulp of the
    quotient; in the interpreter exactly as the torch reference."""
    if HW_MATH:
        return absmax * (1.0 / 448.0)
    else:
        return tl.math.div_rn(absmax, 448.0)


@triton.jit
def fp8_bits_nearest_even(value):
    """The float8_e4m3fn bit pattern (as int32, 0..255) of fp32 ``value`` (|value| <= 448 up to one
    rounding), rounded to nearest with ties to even as torch's ``.to(torch.float8_e4m3fn)``, in integer
    operations (the interpreter's fp8 cast rounds otherwise). Normal results (|value| >= 2^-6): the fp32
    pattern rounded to 3 mantissa bits (add half an fp8 ulp minus one, plus the kept lowest bit), then
    the exponent rebiased from 127 to 7; below 2^-6 the code is the integer nearest |value| * 2^9
    (the subnormal step), which reaches the smallest normal code (8) exactly where it should."""
    bits = value.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    subnormal = ((tl.abs(value) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.where(magnitude >= 0x3C800000, rounded - 960, subnormal)        # 2^-6; (127 - 7) << 3
    return code | ((bits >> 24) & 0x80)


@triton.jit
def fp8_codes(signed, scale, DOMAIN: tl.constexpr, HW_MATH: tl.constexpr):
    """fp8 codes (int32 patterns whose low byte is stored) of one block, or a tile of blocks with
    ``scale`` broadcast to it: see state.py. A block whose scale is 0 or subnormal multiplies by 1
    (its values round to code 0); sqrt-domain codes lose the sign of a -0.0 and are floored at 1 (the
    smallest positive code) where the block's scale is normal."""
    has_scale = scale >= 1.1754943508222875e-38
    if HW_MATH:
        inverse = libdevice.fast_dividef(1.0, tl.where(has_scale, scale, 1.0))
        code = (signed * inverse).to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        inverse = tl.math.div_rn(1.0, tl.where(has_scale, scale, 1.0))
        code = fp8_bits_nearest_even(signed * inverse)
    if DOMAIN != 0:
        code = tl.maximum(code & 0x7F, has_scale.to(tl.int32))
    return code


@triton.jit
def scale_of_block(absmax, KIND: tl.constexpr, HW_MATH: tl.constexpr):
    """A block's scale for int8 (``KIND`` 2) or fp8 (3) codes."""
    if KIND == 2:
        return block_scale(absmax, HW_MATH)
    else:
        return fp8_block_scale(absmax, HW_MATH)


@triton.jit
def block_codes(signed, scale, KIND: tl.constexpr, DOMAIN: tl.constexpr, HW_MATH: tl.constexpr):
    """The codes of int8 (``KIND`` 2) or fp8 (3) blocks."""
    if KIND == 2:
        return int8_codes(signed, scale, DOMAIN, HW_MATH)
    else:
        return fp8_codes(signed, scale, DOMAIN, HW_MATH)


@triton.jit
def store_state(values_ptr, scales_ptr, value, offsets, mask, rows, row_mask, col_block0, n_blocks,
                 stride_scale_row, KIND: tl.constexpr, DOMAIN: tl.constexpr, EVEN: tl.constexpr,
                 HW_MATH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, QB: tl.constexpr):
    """Store an fp32 state tile: as fp32, rounded to bf16, or re-quantized to int8 / fp8 (see state.py)."""
    if KIND >= 2:
        if not EVEN:
            value = tl.where(mask, value, 0.0)
        if DOMAIN == 1:
            value = tl.sqrt(value)        # sqrt-domain states are nonnegative (the rule's contract)
        if BN == QB:        # one block per row: a plain row max, no reshape
            magnitude_in = tl.abs(value)
            scale = scale_of_block(tl.max(magnitude_in, axis=1), KIND, HW_MATH)
            codes = block_codes(value, scale[:, None], KIND, DOMAIN, HW_MATH)
            store_tile(values_ptr + offsets, codes, mask, EVEN, HW_MATH)
            block_ok = (tl.zeros_like(row_mask.to(tl.int32)) + col_block0) < n_blocks
            tl.store(scales_ptr + rows * stride_scale_row + col_block0, scale, mask=row_mask & block_ok)
        else:
            NB: tl.constexpr = BN // QB
            blocks = tl.reshape(value, (BM, NB, QB))
            magnitude_in = tl.abs(blocks)
            scale = scale_of_block(tl.max(magnitude_in, axis=2), KIND, HW_MATH)
            codes = block_codes(blocks, scale[:, :, None], KIND, DOMAIN, HW_MATH)
            codes = tl.reshape(codes, (BM, BN))
            store_tile(values_ptr + offsets, codes, mask, EVEN, HW_MATH)
            block_cols = col_block0 + tl.arange(0, NB)
            scale_mask = row_mask[:, None] & (block_cols[None, :] < n_blocks)
            tl.store(scales_ptr + rows[:, None] * stride_scale_row + block_cols[None, :], scale, mask=scale_mask)
    else:
        store_tile(values_ptr + offsets, value, mask, EVEN, HW_MATH)


@triton.jit
def store_weight(W, w_offsets, weight, mask, rows, offs_n, N, seed, STOCHASTIC_ROUNDING: tl.constexpr,
                 EVEN: tl.constexpr, HW_MATH: tl.constexpr):
    """Store an fp32 weight tile: to nearest, or (``STOCHASTIC_ROUNDING``, bf16 weights) stochastically,
    adding 16 random low bits to the fp32 pattern, then truncating to bf16 (unbiased); the random
    stream is keyed by the element's position in the weight and the seed."""
    if STOCHASTIC_ROUNDING:
        linear = (rows[:, None] * N + offs_n[None, :]).to(tl.uint32)
        noise = tl.randint(seed, linear) & 0xFFFF
        bits = weight.to(tl.uint32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        rounded = tl.where(finite, (bits + noise) & 0xFFFF0000, bits)
        tl.store(W + w_offsets, rounded.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        store_tile(W + w_offsets, weight, mask, EVEN, HW_MATH)


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
