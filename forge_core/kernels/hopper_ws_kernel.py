"""The device code of the warp-specialized Gluon kernel (``hopper_ws`` launches it; its docstring
says why the kernel exists and what it takes).

One persistent program per SM walks its weight tiles in grouped order; ``gl.warp_specialize`` splits
it into a loader warp for the dY / X ring, a loader warp for the W / state slabs, the MMA warps
(``wgmma``, G parked in shared memory in column halves) and the epilogue warps, which run the rule's
``@triton.jit`` epilogue and store W and the states with the Triton kernel's own codec (``codec``).
Defined only where Gluon imports (``GLUON_IMPORT_ERROR`` says why not).
"""
from __future__ import annotations

from .codec import block_scale, int8_codes, int8_to_float, rule_scalars

try:                                         # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    # Triton 3.6 (the H100 machine) names the TMA load async_copy_global_to_shared; 3.9 async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_IMPORT_ERROR: str | None = None
except ImportError as error:                 # pragma: no cover - depends on the installed Triton
    GLUON_IMPORT_ERROR = f"{type(error).__name__}: {error}"


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _tile_coords(tile, tiles_m, tiles_n, GROUP):
        """Grouped order (as ``tile_kernel.grouped_tile``): GROUP row-tiles share X's column tiles in L2. A
        runtime value: worker partitions take no constexpr arguments in Triton 3.6."""
        per_group = GROUP * tiles_n
        first_m = (tile // per_group) * GROUP
        rows = gl.minimum(tiles_m - first_m, GROUP)
        return first_m + (tile % per_group) % rows, (tile % per_group) // rows

    @gluon.jit
    def _main_loop_loads(x_desc, dy_desc, w_desc, s0_desc, s1_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs,
                         ready, empty, st_ready, st_empty, acc_smem, acc_ready, acc_empty, tiles_m, tiles_n, group, K):
        """Loader warp: every dY / X tile of every weight tile this program owns, into the ring."""
        # Triton 3.6 turns constexpr arguments of worker partitions into int32 tensors: shapes come
        # from the descriptors and buffers instead
        BM: gl.constexpr = dy_desc.block_type.shape[1]
        BN: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        count = 0
        for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, group)
            for kk in range(gl.cdiv(K, BK)):
                slot = count % STAGES
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
                _tma_load(dy_desc, [kk * BK, pid_m * BM], ready.index(slot), a_bufs.index(slot))
                _tma_load(x_desc, [kk * BK, pid_n * BN], ready.index(slot), b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _state_loads(x_desc, dy_desc, w_desc, s0_desc, s1_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs,
                     ready, empty, st_ready, st_empty, acc_smem, acc_ready, acc_empty, tiles_m, tiles_n, group, K):
        """Loader warp: the W and state slabs of every tile, in the epilogue's order, into their ring.
        (In a warp of its own so the epilogue warps never sync around a TMA issue.)"""
        BM: gl.constexpr = dy_desc.block_type.shape[1]
        BN: gl.constexpr = x_desc.block_type.shape[1]
        RM: gl.constexpr = w_desc.block_type.shape[0]
        CN: gl.constexpr = w_desc.block_type.shape[1]
        STATE_STAGES: gl.constexpr = w_bufs.type.shape[0]
        TWO_STATES: gl.constexpr = s1_bufs.type.shape[0] == STATE_STAGES      # a one-slot dummy otherwise
        nbytes: gl.constexpr = (w_desc.block_type.nbytes + s0_desc.block_type.nbytes
                                + (s1_desc.block_type.nbytes if TWO_STATES else 0))
        j = 0
        for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, group)
            for slab in range((BN // CN) * (BM // RM)):          # the epilogue's order: column-major
                row = pid_m * BM + (slab % (BM // RM)) * RM
                col = pid_n * BN + (slab // (BM // RM)) * CN
                slot = j % STATE_STAGES
                mbarrier.wait(st_empty.index(slot), ((j // STATE_STAGES) & 1) ^ 1)
                bar = st_ready.index(slot)
                mbarrier.expect(bar, nbytes)
                _tma_load(w_desc, [row, col], bar, w_bufs.index(slot))
                _tma_load(s0_desc, [row, col], bar, s0_bufs.index(slot))
                if TWO_STATES:
                    _tma_load(s1_desc, [row, col], bar, s1_bufs.index(slot))
                j += 1

    @gluon.jit
    def _main_loop_mma(x_desc, dy_desc, w_desc, s0_desc, s1_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs,
                       ready, empty, st_ready, st_empty, acc_smem, acc_ready, acc_empty, tiles_m, tiles_n, group, K):
        """MMA warps: G = dY^T X per tile with wgmma (one group in flight), then park G in shared memory.
        (Each mbarrier.arrive below is one elected thread; the compiler syncs the warps before it.)"""
        BM: gl.constexpr = dy_desc.block_type.shape[1]
        BN: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        MMA_WARPS: gl.constexpr = gl.num_warps()
        PARKED: gl.constexpr = acc_smem.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                             instr_shape=[16, BN, 16])
        count = 0
        local = 0
        for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            acc = gl.zeros((BM, BN), gl.float32, mma_layout)
            for kk in range(gl.cdiv(K, BK)):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
                if STAGES >= 3:
                    # one wgmma in flight: the previous step's has finished reading its slot
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=kk > 0)
                else:
                    # a two-slot ring: hand this step's slot back at once, so the loader refills it
                    # while the next step multiplies (the shared memory goes to the state ring)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(slot))
                count += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if STAGES >= 3:
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
            # park G in two column halves, each as soon as the epilogue has read that half of the last tile
            left, right = _column_halves(acc, BM, BN)
            # (one buffer: the tile's halves take turns in it, its uses 2 * local and 2 * local + 1)
            mbarrier.wait(acc_empty.index(0), ((local * (2 // PARKED)) & 1) ^ 1)
            acc_smem.index(0).store(left)
            mbarrier.arrive(acc_ready.index(0))
            mbarrier.wait(acc_empty.index(1 % PARKED), ((local * (2 // PARKED) + 1 // PARKED) & 1) ^ 1)
            acc_smem.index(1 % PARKED).store(right)
            mbarrier.arrive(acc_ready.index(1 % PARKED))
            local += 1

    @gluon.jit
    def _column_halves(tile, ROWS: gl.constexpr, COLS: gl.constexpr):
        """(ROWS, COLS) -> its left and right (ROWS, COLS // 2) halves (a renaming of registers in the
        wgmma layout, where every thread holds matching elements of both halves)."""
        return gl.split(gl.permute(gl.reshape(tile, (ROWS, 2, COLS // 2)), (0, 2, 1)))

    @gluon.jit
    def _decode_slab(raw, scales, KIND: gl.constexpr, DOMAIN: gl.constexpr):
        """A state slab as fp32: bf16 as is, int8 codes times their row's block scale (squared for
        a sqrt-domain state), with the Triton kernel's exact steps (``codec.decode_state``)."""
        if KIND == 2:
            value = int8_to_float(raw, True) * gl.expand_dims(scales, 1)
            if DOMAIN == 1:
                value = value * value
        else:
            value = raw.to(gl.float32)
        return value

    @gluon.jit
    def _store_slab(VALUES, SCALES, value, offsets, scale_offsets, KIND: gl.constexpr, DOMAIN: gl.constexpr):
        """Store a state slab: bf16 rounded to nearest even, or int8 re-quantized with a new scale per
        row (the slab is one block wide), with the Triton kernel's exact steps (``codec.store_state``)."""
        if KIND == 2:
            if DOMAIN == 1:
                value = gl.sqrt(value)
            scale = block_scale(gl.max(gl.abs(value), axis=1), True)
            codes = int8_codes(value, gl.expand_dims(scale, 1), DOMAIN, True)
            gl.store(VALUES + offsets, codes.to(gl.int8))
            gl.store(SCALES + scale_offsets, scale)
        else:
            gl.store(VALUES + offsets, value.to(gl.bfloat16))

    @gluon.jit
    def _slab_origin(pid_m, pid_n, slab_rows, SLAB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                     RM: gl.constexpr, CN: gl.constexpr, WIDE_INDEX: gl.constexpr):
        """A slab's rows and first column: slab SLAB of a tile walks its column halves in order, each
        column-major in (RM, CN) slabs."""
        HALF_SLABS: gl.constexpr = (BN // 2 // CN) * (BM // RM)
        rows = pid_m * BM + (SLAB % (BM // RM)) * RM + slab_rows
        if WIDE_INDEX:
            rows = rows.to(gl.int64)
        col0 = pid_n * BN + (SLAB // HALF_SLABS) * (BN // 2) + ((SLAB % HALF_SLABS) // (BM // RM)) * CN
        return rows, col0

    @gluon.jit
    def _slab_scales(SCALE0, SCALE1, rows, col0, stride_scale_row, CN: gl.constexpr, NUM_STATES: gl.constexpr):
        """The int8 states' block scales of one slab (one 64-wide block per row)."""
        s0_scales = gl.load(SCALE0 + rows * stride_scale_row + col0 // CN)
        s1_scales = 0.0
        if NUM_STATES >= 2:
            s1_scales = gl.load(SCALE1 + rows * stride_scale_row + col0 // CN)
        return s0_scales, s1_scales

    @gluon.jit
    def _epilogue_partition(W, S0, S1, SCALE0, SCALE1, w_bufs, s0_bufs, s1_bufs, st_ready, st_empty,
                            acc_smem, acc_ready, acc_empty, tiles_m, tiles_n, group, N, stride_scale_row,
                            c0, c1, c2, c3, c4, c5, c6, c7, SCALARS,
                            EPILOGUE: gl.constexpr, NUM_STATES: gl.constexpr, STATE_KIND: gl.constexpr,
                            S0_SQRT: gl.constexpr, S1_SQRT: gl.constexpr, SCALARS_IN_MEMORY: gl.constexpr,
                            BM: gl.constexpr, BN: gl.constexpr, RM: gl.constexpr, CN: gl.constexpr,
                            STATE_STAGES: gl.constexpr, WIDE_INDEX: gl.constexpr, EPI_WARPS: gl.constexpr,
                            PREFETCH_SCALES: gl.constexpr):
        """Epilogue warps: per (RM, CN) slab, column-major over the tile, G and W / states from shared
        memory into registers (the slab's slot then goes back to the state loader, and after a half's
        last slab that half of G to the MMA warps), the rule, W and states stored."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CN // 8), CN // 8], [EPI_WARPS, 1], [1, 0])
        HALF: gl.constexpr = BN // 2
        ROW_SLABS: gl.constexpr = BM // RM
        HALF_SLABS: gl.constexpr = (HALF // CN) * ROW_SLABS
        PARKED: gl.constexpr = acc_smem.type.shape[0]
        c0, c1, c2, c3, c4, c5, c6, c7 = rule_scalars(SCALARS, c0, c1, c2, c3, c4, c5, c6, c7, SCALARS_IN_MEMORY)
        slab_rows = gl.arange(0, RM, layout=gl.SliceLayout(1, layout))
        slab_cols = gl.arange(0, CN, layout=gl.SliceLayout(0, layout))
        total_tiles = tiles_m * tiles_n
        s0_next = 0.0
        s1_next = 0.0
        if STATE_KIND == 2 and PREFETCH_SCALES:
            # the first slab's scales; each slab then loads the next one's (past the last tile: the
            # last tile's again, unused)
            first_m, first_n = _tile_coords(gl.program_id(0), tiles_m, tiles_n, group)
            rows, col0 = _slab_origin(first_m, first_n, slab_rows, 0, BM, BN, RM, CN, WIDE_INDEX)
            s0_next, s1_next = _slab_scales(SCALE0, SCALE1, rows, col0, stride_scale_row, CN, NUM_STATES)
        j = 0
        local = 0
        for tile in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, group)
            for slab in gl.static_range(2 * HALF_SLABS):
                # constexpr arithmetic inline (a name assigned here would become a tensor): the slab's
                # half of G is slab // HALF_SLABS, its first row (slab % ROW_SLABS) * RM, its first
                # column within the half ((slab % HALF_SLABS) // ROW_SLABS) * CN
                if slab % HALF_SLABS == 0:
                    mbarrier.wait(acc_ready.index((slab // HALF_SLABS) % PARKED),
                                  (local * (2 // PARKED) + (slab // HALF_SLABS) // PARKED) & 1)
                slot = j % STATE_STAGES
                rows, col0 = _slab_origin(pid_m, pid_n, slab_rows, slab, BM, BN, RM, CN, WIDE_INDEX)
                s0_scales = s0_next
                s1_scales = s1_next
                if STATE_KIND == 2 and not PREFETCH_SCALES:
                    # the slab is one 64-wide int8 block per row: its scales, issued before the waits
                    s0_scales, s1_scales = _slab_scales(SCALE0, SCALE1, rows, col0, stride_scale_row, CN, NUM_STATES)
                grad = acc_smem.index((slab // HALF_SLABS) % PARKED).slice((slab % ROW_SLABS) * RM, RM, dim=0).slice(
                    ((slab % HALF_SLABS) // ROW_SLABS) * CN, CN, dim=1).load(layout)
                if slab % HALF_SLABS == HALF_SLABS - 1:
                    mbarrier.arrive(acc_empty.index((slab // HALF_SLABS) % PARKED))   # every warp has read this half
                mbarrier.wait(st_ready.index(slot), (j // STATE_STAGES) & 1)
                w_raw = w_bufs.index(slot).load(layout)
                s0_raw = s0_bufs.index(slot).load(layout)
                if NUM_STATES >= 2:
                    s1_raw = s1_bufs.index(slot).load(layout)
                mbarrier.arrive(st_empty.index(slot))
                weight = w_raw.to(gl.float32)
                s0 = _decode_slab(s0_raw, s0_scales, STATE_KIND, S0_SQRT)
                if NUM_STATES >= 2:
                    s1 = _decode_slab(s1_raw, s1_scales, STATE_KIND, S1_SQRT)
                else:
                    s1 = gl.zeros((RM, CN), gl.float32, layout)
                if STATE_KIND == 2 and PREFETCH_SCALES:
                    # this slab's scales are spent: load the next slab's, its latency hidden by this update
                    if slab + 1 < 2 * HALF_SLABS:
                        next_rows, next_col0 = _slab_origin(pid_m, pid_n, slab_rows, slab + 1, BM, BN, RM, CN,
                                                            WIDE_INDEX)
                    else:
                        next_m, next_n = _tile_coords(gl.minimum(tile + gl.num_programs(0), total_tiles - 1),
                                                      tiles_m, tiles_n, group)
                        next_rows, next_col0 = _slab_origin(next_m, next_n, slab_rows, 0, BM, BN, RM, CN, WIDE_INDEX)
                    s0_next, s1_next = _slab_scales(SCALE0, SCALE1, next_rows, next_col0, stride_scale_row, CN,
                                                    NUM_STATES)
                # (the third state slot: a dummy, as the Triton kernel passes one past NUM_STATES; this
                # kernel takes one or two states)
                weight, s0, s1, s2 = EPILOGUE(weight, grad, s0, s1, s1, c0, c1, c2, c3, c4, c5, c6, c7, True)
                offsets = gl.expand_dims(rows * N, 1) + gl.expand_dims(col0 + slab_cols, 0)
                gl.store(W + offsets, weight.to(gl.bfloat16))
                # bf16 rounded to nearest even, or int8 re-quantized with new block scales (state.py)
                _store_slab(S0, SCALE0, s0, offsets, rows * stride_scale_row + col0 // CN, STATE_KIND, S0_SQRT)
                if NUM_STATES >= 2:
                    _store_slab(S1, SCALE1, s1, offsets, rows * stride_scale_row + col0 // CN, STATE_KIND, S1_SQRT)
                j += 1
            local += 1

    @gluon.jit
    def _ws_fused_kernel(x_desc, dy_desc, w_desc, s0_desc, s1_desc, W, S0, S1, SCALE0, SCALE1, M, N, K, group,
                         stride_scale_row, c0, c1, c2, c3, c4, c5, c6, c7, SCALARS,
                         EPILOGUE: gl.constexpr, NUM_STATES: gl.constexpr, STATE_KIND: gl.constexpr,
                         S0_SQRT: gl.constexpr, S1_SQRT: gl.constexpr, SCALARS_IN_MEMORY: gl.constexpr,
                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                         RM: gl.constexpr, CN: gl.constexpr, STATE_STAGES: gl.constexpr, PARKED: gl.constexpr,
                         WIDE_INDEX: gl.constexpr,
                         MMA_WARPS: gl.constexpr, MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                         EPI_WARPS: gl.constexpr, PREFETCH_SCALES: gl.constexpr):
        gl.static_assert(STATE_STAGES >= 2, "the state ring needs two slots (a one-slot ring marks one state)")
        a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES] + dy_desc.block_type.shape, dy_desc.layout)
        b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        # rows padded by 16 B: the MMA layout's stores and the slabs' 16-byte loads then spread over
        # the banks (unpadded, 512-byte rows put 8 rows on the same banks)
        acc_layout: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[BN // 2, 4]], [BM, BN // 2], [1, 0])
        acc_smem = gl.allocate_shared_memory(gl.float32, [PARKED, BM, BN // 2], acc_layout)   # G's column halves
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STATE_STAGES] + w_desc.block_type.shape, w_desc.layout)
        s0_bufs = gl.allocate_shared_memory(s0_desc.dtype, [STATE_STAGES] + s0_desc.block_type.shape, s0_desc.layout)
        if NUM_STATES >= 2:
            s1_bufs = gl.allocate_shared_memory(s1_desc.dtype, [STATE_STAGES] + s1_desc.block_type.shape,
                                                s1_desc.layout)
        else:
            s1_bufs = gl.allocate_shared_memory(s1_desc.dtype, [1] + s1_desc.block_type.shape, s1_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        acc_ready = gl.allocate_shared_memory(gl.int64, [PARKED, 1], mbarrier.MBarrierLayout())
        acc_empty = gl.allocate_shared_memory(gl.int64, [PARKED, 1], mbarrier.MBarrierLayout())
        st_ready = gl.allocate_shared_memory(gl.int64, [STATE_STAGES, 1], mbarrier.MBarrierLayout())
        st_empty = gl.allocate_shared_memory(gl.int64, [STATE_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(PARKED):
            mbarrier.init(acc_ready.index(i), count=1)
            mbarrier.init(acc_empty.index(i), count=1)
        for i in gl.static_range(STATE_STAGES):
            mbarrier.init(st_ready.index(i), count=1)
            mbarrier.init(st_empty.index(i), count=1)
        fence_async_shared()

        tiles_m = M // BM
        tiles_n = N // BN
        worker_args = (x_desc, dy_desc, w_desc, s0_desc, s1_desc, a_bufs, b_bufs, w_bufs, s0_bufs, s1_bufs,
                       ready, empty, st_ready, st_empty, acc_smem, acc_ready, acc_empty, tiles_m, tiles_n, group, K)
        gl.warp_specialize([
            (_epilogue_partition, (W, S0, S1, SCALE0, SCALE1, w_bufs, s0_bufs, s1_bufs, st_ready, st_empty,
                                   acc_smem, acc_ready, acc_empty, tiles_m, tiles_n, group, N, stride_scale_row,
                                   c0, c1, c2, c3, c4, c5, c6, c7, SCALARS,
                                   EPILOGUE, NUM_STATES, STATE_KIND, S0_SQRT, S1_SQRT, SCALARS_IN_MEMORY,
                                   BM, BN, RM, CN, STATE_STAGES, WIDE_INDEX, EPI_WARPS, PREFETCH_SCALES)),
            (_main_loop_loads, worker_args),
            (_state_loads, worker_args),
            (_main_loop_mma, worker_args),
        ], [1, 1, MMA_WARPS], [LOADER_REGS, LOADER_REGS, MMA_REGS])

    ws_fused_kernel = _ws_fused_kernel
    """The kernel, for the modules that launch and fingerprint it. Its own name keeps the leading
    underscore because profiles name kernels by it (``forge_bench.graph_profile`` classes
    ``_ws_fused_kernel`` as the fused update, as Nsight reports do)."""
else:                                        # pragma: no cover - depends on the installed Triton
    ws_fused_kernel = None
