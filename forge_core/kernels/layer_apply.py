"""The second pass of a regime-2 rule (LAMB): the weight, from its stored states and the layer's sums.

Why a pass of its own: LAMB's update of every element reads the trust ratio ``||W|| / ||r||`` of the
whole layer, known only once every tile of the fused kernel has added its part of the two sums
(``tile_kernel``, ``NUM_SUMS``). The fused kernel stores the new moments and leaves W; this elementwise
pass then reads W, the moments (decoded with the fused kernel's own codec) and the two sums, runs the
rule's ``apply`` and stores W. G is never formed: the pass recomputes what it needs of it from the
moments. It streams W once more and the states once more (read only) than a regime-1 update.

Each program owns a ``BM x CN`` block (8 x 256 on 4 warps: the row update's shape, whole int8 / fp8
scale blocks); stochastic rounding draws from the same stream as the fused kernel's (the element's
position in the weight and the seed).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from ..state import QBLOCK, ParamState
from .codec import rule_scalars, store_weight
from .device import interpreting
from .launch import compile_options, scalar_arguments, state_pointers, wide_index
from .tile_kernel import decode_states, load_slab

BLOCK_M = 8
BLOCK_N = 256
NUM_WARPS = 4


@triton.jit(do_not_specialize=["seed"])
def _layer_apply_kernel(W, S0, S1, S2, SCALE0, SCALE1, SCALE2, SUMS, M, N,
                        stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row,
                        c0, c1, c2, c3, c4, c5, c6, c7, seed, SCALARS,
                        APPLY: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
                        S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr,
                        STOCHASTIC_ROUNDING: tl.constexpr, SCALARS_IN_MEMORY: tl.constexpr,
                        EVEN_MN: tl.constexpr, WIDE_INDEX: tl.constexpr, HW_MATH: tl.constexpr,
                        BM: tl.constexpr, CN: tl.constexpr, QB: tl.constexpr):
    tiles_n = tl.cdiv(N, CN)
    pid = tl.program_id(0)
    offs_m = (pid // tiles_n) * BM + tl.arange(0, BM)
    col0 = (pid % tiles_n) * CN
    row_mask = offs_m < M
    if WIDE_INDEX:
        rows = offs_m.to(tl.int64)
    else:
        rows = offs_m
    offs_n = col0 + tl.arange(0, CN)
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales = load_slab(
        W, S0, S1, S2, SCALE0, SCALE1, SCALE2, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm, stride_sn,
        stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)
    s0, s1, s2 = decode_states(s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales, NUM_STATES, STATE_KIND,
                               S0_SQRT, S1_SQRT, S2_SQRT, HW_MATH, BM, CN, QB)
    c0, c1, c2, c3, c4, c5, c6, c7 = rule_scalars(SCALARS, c0, c1, c2, c3, c4, c5, c6, c7, SCALARS_IN_MEMORY)
    sum0 = tl.load(SUMS + 0)
    sum1 = tl.load(SUMS + 1)
    weight = APPLY(w_raw.to(tl.float32), s0, s1, s2, sum0, sum1, c0, c1, c2, c3, c4, c5, c6, c7, HW_MATH)
    w_offsets = rows[:, None] * stride_wm + offs_n[None, :] * stride_wn
    store_weight(W, w_offsets, weight, mask, rows, offs_n, N, seed, STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH)


_META = ("NUM_STATES", "STATE_KIND", "S0_SQRT", "S1_SQRT", "S2_SQRT", "STOCHASTIC_ROUNDING", "SCALARS_IN_MEMORY")


def apply_layer(weight: torch.Tensor, state: ParamState, states: list[torch.Tensor],
                scales: list[torch.Tensor | None], scalars: tuple[float, ...] | torch.Tensor, seed: int,
                meta: Mapping[str, Any]) -> None:
    """The rule's ``apply`` over every element of ``weight`` (in place), after the fused kernel (or the
    row update) has stored the states and added the layer's sums into ``state.layer_sums``. ``states`` /
    ``scales``: as the fused kernel took them (``launch.kernel_states``); ``scalars``: its kernel scalars
    (floats, or the device buffer); ``meta``: its compile-time parameters (``launch.kernel_meta``)."""
    rule = state.rule
    if rule.apply is None or state.layer_sums is None:
        raise ValueError(f"rule {rule.name!r} has no second pass (not a regime-2 rule)")
    m, n = weight.shape
    s0, s1, s2, scale0, scale1, scale2 = state_pointers(weight, states, scales)
    values, buffer = scalar_arguments(scalars, weight)
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    constexprs = {name: meta[name] for name in _META}
    _layer_apply_kernel[grid](
        weight, s0, s1, s2, scale0, scale1, scale2, state.layer_sums, m, n,
        weight.stride(0), weight.stride(1), s0.stride(0), s0.stride(1), scale0.stride(0),
        *values, int(seed) & 0x7FFFFFFF, buffer, APPLY=rule.apply,
        EVEN_MN=m % BLOCK_M == 0 and n % BLOCK_N == 0, WIDE_INDEX=wide_index(weight, s0),
        HW_MATH=not interpreting(), BM=BLOCK_M, CN=BLOCK_N, QB=QBLOCK, num_warps=NUM_WARPS, **compile_options(),
        **constexprs)


__all__ = ["apply_layer"]
