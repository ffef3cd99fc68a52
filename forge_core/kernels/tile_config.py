"""The launch configurations of the Triton tile kernel (``tile_kernel``): their fields, the space
the tuner chooses from, and what a configuration must satisfy to run well (``fits``) or at all
(``check_config``). Plain Python, no Triton: ``TileConfig`` is part of the package's API
(benchmark rows pin tiles with it) even where Triton is missing.
"""
from __future__ import annotations

import dataclasses
import math

from ..state import BLOCK_SCALED, QBLOCK

SHARED_MEMORY_BYTES = 227 * 1024          # H100 / H200 per-block opt-in limit


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
    else with pointers. Measured on an H100: the main loop alone is
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
    """The whole configuration space: tiles {64,128,256}^2, BK {32,64,128}, GROUP {8,16,32}, warps
    {4,8}, stages 2..6. (16 warps keep large tiles' epilogue in registers but give wrong weights with
    the column split on the H100, Triton 3.6.) The epilogue column split is a separate axis
    (``candidate_configs`` sets it)."""
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
    8 warps in 4 slabs: 254 registers) spill-free with bf16 states (docs/design.md)."""
    return (config.shared_memory_bytes(input_bytes) <= SHARED_MEMORY_BYTES
            and epilogue_registers(config) <= MAX_EPILOGUE_REGISTERS)


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


# (BM, BN, BK, warps, split_n, deepest pipeline) worth timing. BT = 512 (memory-bound): the
# X / dY tiles are re-read from L2 K * 2 * (1/BM + 1/BN) bytes per weight element (32 B for 64x64
# tiles, 12 B for 128x256), on top of 12 B of state traffic, so large tiles pay; the column split
# keeps their epilogue in registers, and configs at <= 128 registers let two programs share an SM.
# 16-warp entries are out: on the H100 (triton 3.6) 128x128 /2 and 128x256 /4 on 16 warps gave
# wrong weights (8.3 and 6.9 bf16 steps off the reference; docs/decisions.md).
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


def check_config(config: TileConfig, state_dtype: str) -> None:
    """A clear error for a tile configuration the kernel cannot run."""
    if config.block_n % QBLOCK:
        raise ValueError(f"block_n must be a multiple of {QBLOCK}, got {config.block_n}")
    if config.split_n not in (1, 2, 4) or config.block_n % config.split_n:
        raise ValueError(f"split_n must be 1, 2 or 4 and divide block_n, got {config.split_n} for {config.block_n}")
    if state_dtype in BLOCK_SCALED and config.epilogue_columns() % QBLOCK:
        raise ValueError(f"{state_dtype} states need epilogue slabs of whole {QBLOCK}-wide blocks; block_n / split_n = "
                         f"{config.epilogue_columns()}")
