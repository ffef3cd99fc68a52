"""The fused weight-gradient + optimizer kernel in Triton (one kernel for every rule).

Each program owns one ``BM x BN`` tile of W (Dout x Din). It loops over the token axis in
``BK`` chunks accumulating ``G = dY^T X`` in fp32 registers (``tl.dot``), adds ``grad_accum``
when given, then loads the W tile and up to three state tiles (fp32 / bf16 / int8 / fp8 + per-64-block
scales), calls the rule's ``@triton.jit`` epilogue, and stores W and the states. G never
reaches memory. The epilogue is a ``tl.constexpr`` argument, so a new rule needs no change here.
``NUM_STATES`` (0-3) is a constexpr: a state slot past it issues no load and no store, and the
epilogue's dummy for it is dead code, so a rule compiles as it would with fewer slots.
A regime-2 rule (``NUM_SUMS`` > 0, LAMB) stores the states but not W, and adds each of its
epilogue's term tiles, summed, into ``SUMS`` (one fp32 atomic per program and slab); the weight is
written by a second pass (``layer_apply``).
The epilogue may run on ``split_n`` column slabs of the tile one after the other (the accumulator
is split in registers), so large tiles, which re-read X and dY from L2 less, keep it unspilled.

The tile shapes it runs are ``tile_config.TileConfig``; ``launch`` builds and launches its calls.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .codec import decode_state, load_scales, load_tile, rule_scalars, store_state, store_weight


@triton.jit
def _column_halves(tile, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(ROWS, COLS) -> its left and right (ROWS, COLS // 2) halves. In the MMA accumulator layout
    every thread holds matching elements of both halves, so this is a renaming of registers."""
    return tl.split(tl.permute(tl.reshape(tile, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def load_slab(W, S0, S1, S2, SCALE0, SCALE1, SCALE2, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm,
              stride_sn, stride_scale_row, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
              EVEN_MN: tl.constexpr, CN: tl.constexpr, QB: tl.constexpr):
    """Issue the raw loads of one (BM, CN) column slab: W, the states and their int8 / fp8 block scales.
    Nothing waits for them until their first use, so issuing them early hides their latency."""
    offs_n = col0 + tl.arange(0, CN)
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    w_offsets = rows[:, None] * stride_wm + offs_n[None, :] * stride_wn
    s_offsets = rows[:, None] * stride_sm + offs_n[None, :] * stride_sn
    col_block0 = col0 // QB
    n_blocks = tl.cdiv(N, QB)
    w_raw = load_tile(W, w_offsets, mask, EVEN_MN)
    s0_raw = 0.0
    s0_scales = 0.0
    s1_raw = 0.0
    s1_scales = 0.0
    s2_raw = 0.0
    s2_scales = 0.0
    if NUM_STATES >= 1:
        s0_raw = load_tile(S0, s_offsets, mask, EVEN_MN)
        s0_scales = load_scales(SCALE0, rows, row_mask, col_block0, n_blocks, stride_scale_row, STATE_KIND, CN, QB)
    if NUM_STATES >= 2:
        s1_raw = load_tile(S1, s_offsets, mask, EVEN_MN)
        s1_scales = load_scales(SCALE1, rows, row_mask, col_block0, n_blocks, stride_scale_row, STATE_KIND, CN, QB)
    if NUM_STATES >= 3:
        s2_raw = load_tile(S2, s_offsets, mask, EVEN_MN)
        s2_scales = load_scales(SCALE2, rows, row_mask, col_block0, n_blocks, stride_scale_row, STATE_KIND, CN, QB)
    return w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales


@triton.jit
def decode_states(s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales, NUM_STATES: tl.constexpr,
                  STATE_KIND: tl.constexpr, S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr,
                  HW_MATH: tl.constexpr, BM: tl.constexpr, CN: tl.constexpr, QB: tl.constexpr):
    """The three state slots as fp32 tiles: the loaded states decoded, zeros past ``NUM_STATES``."""
    if NUM_STATES >= 1:
        s0 = decode_state(s0_raw, s0_scales, STATE_KIND, S0_SQRT, HW_MATH, BM, CN, QB)
    else:
        s0 = tl.zeros((BM, CN), dtype=tl.float32)
    if NUM_STATES >= 2:
        s1 = decode_state(s1_raw, s1_scales, STATE_KIND, S1_SQRT, HW_MATH, BM, CN, QB)
    else:
        s1 = tl.zeros((BM, CN), dtype=tl.float32)
    if NUM_STATES >= 3:
        s2 = decode_state(s2_raw, s2_scales, STATE_KIND, S2_SQRT, HW_MATH, BM, CN, QB)
    else:
        s2 = tl.zeros((BM, CN), dtype=tl.float32)
    return s0, s1, s2


@triton.jit
def update_columns(grad, col0, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, SUMS, GRAD_ACCUM,
                    M, N, stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
                    c0, c1, c2, c3, c4, c5, c6, c7, seed,
                    w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales, LOADED: tl.constexpr,
                    EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
                    S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr, NUM_SUMS: tl.constexpr,
                    HAS_GRAD_ACCUM: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr, EVEN_MN: tl.constexpr,
                    HW_MATH: tl.constexpr, BM: tl.constexpr, CN: tl.constexpr, QB: tl.constexpr):
    """The optimizer on one (BM, CN) column slab of the tile starting at column ``col0``: W and
    states in (unless ``LOADED``: the raw tiles were loaded earlier, see ``load_slab``), the rule,
    W and states out (a regime-2 rule: states out and its terms' sums into ``SUMS``)."""
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
        w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales = load_slab(
            W, S0, S1, S2, SCALE0, SCALE1, SCALE2, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm,
            stride_sn, stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)
    weight = w_raw.to(tl.float32)
    s0, s1, s2 = decode_states(s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales, NUM_STATES, STATE_KIND,
                               S0_SQRT, S1_SQRT, S2_SQRT, HW_MATH, BM, CN, QB)

    if NUM_SUMS == 0:
        weight, s0, s1, s2 = EPILOGUE(weight, grad, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7, HW_MATH)
    else:
        tl.static_assert(NUM_SUMS == 2, "a regime-2 epilogue returns two term tiles")
        weight, s0, s1, s2, term0, term1 = EPILOGUE(weight, grad, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7,
                                                    HW_MATH)
        tl.atomic_add(SUMS + 0, tl.sum(tl.where(mask, term0, 0.0)))
        tl.atomic_add(SUMS + 1, tl.sum(tl.where(mask, term1, 0.0)))

    if NUM_STATES >= 1:
        store_state(S0, SCALE0, s0, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                     STATE_KIND, S0_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_STATES >= 2:
        store_state(S1, SCALE1, s1, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                     STATE_KIND, S1_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_STATES >= 3:
        store_state(S2, SCALE2, s2, s_offsets, mask, rows, row_mask, col_block0, n_blocks, stride_scale_row,
                     STATE_KIND, S2_SQRT, EVEN_MN, HW_MATH, BM, CN, QB)
    if NUM_SUMS == 0:
        store_weight(W, w_offsets, weight, mask, rows, offs_n, N, seed, STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH)


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """Program ``pid``'s (row, column) tile in grouped order: GROUP consecutive row-tiles share the
    same column tiles of X in L2."""
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
        c0, c1, c2, c3, c4, c5, c6, c7, seed, SCALARS, S2, SCALE2, SUMS,
        EPILOGUE: tl.constexpr, NUM_STATES: tl.constexpr, STATE_KIND: tl.constexpr,
        S0_SQRT: tl.constexpr, S1_SQRT: tl.constexpr, S2_SQRT: tl.constexpr, NUM_SUMS: tl.constexpr,
        HAS_GRAD_ACCUM: tl.constexpr,
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
    s2_raw = 0.0
    s2_scales = 0.0
    if PREFETCH:
        w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw, s2_scales = load_slab(
            W, S0, S1, S2, SCALE0, SCALE1, SCALE2, col0, rows, row_mask, N, stride_wm, stride_wn, stride_sm,
            stride_sn, stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)

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
        update_columns(acc, col0, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, SUMS, GRAD_ACCUM,
                        M, N, stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm, stride_gn,
                        c0, c1, c2, c3, c4, c5, c6, c7, seed, w_raw, s0_raw, s0_scales, s1_raw, s1_scales, s2_raw,
                        s2_scales, PREFETCH, EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT, S1_SQRT, S2_SQRT, NUM_SUMS,
                        HAS_GRAD_ACCUM, STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH, BM, CN, QB)
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
            ns2_raw = 0.0
            ns2_scales = 0.0
            if PREFETCH and i + 1 < SPLIT:
                nw_raw, ns0_raw, ns0_scales, ns1_raw, ns1_scales, ns2_raw, ns2_scales = load_slab(
                    W, S0, S1, S2, SCALE0, SCALE1, SCALE2, col0 + (i + 1) * CN, rows, row_mask, N, stride_wm,
                    stride_wn, stride_sm, stride_sn, stride_scale_row, NUM_STATES, STATE_KIND, EVEN_MN, CN, QB)
            if i == 0:
                grad = slab_0
            elif i == 1:
                grad = slab_1
            elif i == 2:
                grad = slab_2
            else:
                grad = slab_3
            update_columns(grad, col0 + i * CN, offs_m, rows, row_mask, W, S0, S1, S2, SCALE0, SCALE1, SCALE2, SUMS,
                            GRAD_ACCUM, M, N, stride_wm, stride_wn, stride_sm, stride_sn, stride_scale_row, stride_gm,
                            stride_gn, c0, c1, c2, c3, c4, c5, c6, c7, seed, w_raw, s0_raw, s0_scales, s1_raw,
                            s1_scales, s2_raw, s2_scales, PREFETCH, EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT,
                            S1_SQRT, S2_SQRT, NUM_SUMS, HAS_GRAD_ACCUM, STOCHASTIC_ROUNDING, EVEN_MN, HW_MATH, BM, CN,
                            QB)
            w_raw = nw_raw
            s0_raw = ns0_raw
            s0_scales = ns0_scales
            s1_raw = ns1_raw
            s1_scales = ns1_scales
            s2_raw = ns2_raw
            s2_scales = ns2_scales


fused_wgrad_update_kernel = _fused_wgrad_update_kernel
"""The kernel, for the modules that launch, tune and fingerprint it. Its own name keeps the leading
underscore because profiles name kernels by it (``forge_bench.graph_profile`` classes
``_fused_wgrad_update`` as the fused update, as Nsight reports do)."""
