"""Which kernel updates a weight: the Triton kernel's tuned tile, or the warp-specialized Gluon kernel.

Why a choice and not a switch: measured on the H100 (``results/kernels/h100/ws_s20`` to ``ws_s25``),
the Gluon kernel (``hopper_ws``) is 3-13% faster than the Triton kernel's tuned tile at 512 tokens
for the Llama-8B layer shapes with bf16 states, and draws ~10% fewer joules, but 2-3% slower for the
lm_head and 10-15% slower at 2048 tokens and more, where one 128x128 wgmma warpgroup is no match for
the Triton kernel's GEMM tiles (256x128 tiles on two warpgroups close part of that at 1024 tokens).
With int8 states (eight epilogue warps) it is within a few percent of the Triton kernel either way
at 512 tokens, depending on the shape and the boot, and 15-20% faster at 1024. Deeper operand rings
make it the faster one for most weights at 2048 tokens too, and with the grouped tile order it is
level with the Triton tile or a few percent ahead at 4096. So after the Triton tile is tuned, the
Gluon kernel's candidates that can take the call are timed against it on the same scratch copies,
and the faster one is kept (per tuning key, in the process and in ``FORGE_TUNE_CACHE`` beside the
tile). ``FORGE_WS_KERNEL=0`` keeps every update on the Triton kernel (for A/B runs).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import warnings
from typing import Any, Callable, Mapping

import torch

from . import graph_timing, hopper_ws, tune_cache
from .hopper_ws import WsConfig

ENV = "FORGE_WS_KERNEL"
# The configurations worth timing (H100, results/kernels/h100/ws_s20 to ws_s25): 32x64 slabs four deep
# with the grouped tile order and with whole rows of tiles; 64x64 slabs; a two-slot main ring whose
# shared memory goes to six 32x64 state slots. For int8 states only (bf16 slabs of that ring do not
# fit in shared memory): eight epilogue warps, two per scheduler to hide the codec's ALU latency, on
# three 64x64 slabs, with a six-slot main ring of 32-deep k steps. With two 64-deep slots Nsight has
# the MMA warps waiting for operand loads half their time; six 32-deep slots, half as many bytes again
# in flight, run it 2.5-6% faster at 512 tokens and 12-18% at 1024, and four 32-deep slots (the same
# bytes as two 64-deep ones) do not (results/kernels/h100/ws_s23 call 7).
# The next two (results/kernels/h100/ws_s25): deeper operand rings of small k steps. Seven 32-deep
# slots (three state slots) for the 32x64-slab candidate run 8% faster than the Triton tile and
# 11-12% faster than its three 64-deep slots at 1024 tokens (gate, q), and 5% faster at 512 for k;
# twelve 16-deep slots for the int8 candidate run 0.5-2% faster than its six 32-deep ones at 512 tokens.
# The last: the seven-slot config in the grouped tile order (8 row-tiles share X's column tiles). Walking
# whole rows, the programs running at once read all of X once per row of tiles, which at 4096 tokens
# is 117 MB per row for down (X is T x 14336), more than L2 holds. Grouped, it runs down 16-38% faster
# at 2048-4096 tokens, level with the Triton tile (results/kernels/h100/ws_s25/group).
_SEVEN_SLOTS = WsConfig(block_k=32, stages=7, slab_m=32, slab_n=64, state_stages=3, group=1)
CANDIDATES = (WsConfig(slab_m=32, slab_n=64, state_stages=4),
              WsConfig(slab_m=32, slab_n=64, state_stages=4, group=1),
              WsConfig(slab_m=64, slab_n=64, group=1),
              WsConfig(stages=2, slab_m=32, slab_n=64, state_stages=6, group=1),
              WsConfig(block_k=32, stages=6, slab_m=64, slab_n=64, state_stages=3, group=1, epilogue_warps=8,
                       max_registers=128),
              _SEVEN_SLOTS,
              WsConfig(block_k=16, stages=12, slab_m=64, slab_n=64, state_stages=3, group=1, epilogue_warps=8,
                       max_registers=128),
              dataclasses.replace(_SEVEN_SLOTS, group=8))
# For two bf16 states only (AdamW's family): 256x128 tiles on two MMA warpgroups with one parked half
# of G (results/kernels/h100/ws_s22 call 3): at 1024 tokens 2.6% faster than the Triton tile and 6%
# faster than the 128x128 candidates, level with them at 512. Offline sm_90 (Triton 3.6) its epilogue
# spills with int8 states (216 B on four warps; eight do not fit the register file beside two MMA
# warpgroups) and with SGD's one state (64 B), not with AdamW's or Lion's. The second: five 32-deep
# operand slots on 32x64 slabs, 8% faster than the Triton tile and 11-13% faster than the first at
# 1024 tokens (results/kernels/h100/ws_s25), level with it at 512. The third: the second in the grouped
# tile order (see the last of CANDIDATES): 1-4% faster than the Triton tile for gate and down at
# 2048-4096 tokens.
_WIDE = WsConfig(block_m=256, stages=2, slab_m=64, slab_n=64, state_stages=2, group=1, mma_warps=8,
                 max_registers=128, mma_registers=168, parked_halves=1)
_WIDE_FIVE_SLOTS = dataclasses.replace(_WIDE, block_k=32, stages=5, slab_m=32)
BF16_ONLY = (_WIDE, _WIDE_FIVE_SLOTS, dataclasses.replace(_WIDE_FIVE_SLOTS, group=8))
ROUNDS = 5
"""Round-robin re-timings of the Triton tile against the fastest Gluon candidate (a few percent
apart under the power cap; see tuning.FINAL_ROUNDS)."""

CHOSEN: dict[tuple, WsConfig | None] = {}
"""Per tuning key and timing mode ("graph" / "eager"): the Gluon config that won, or None (the tile)."""
FROM_DISK: set[tuple] = set()
"""The keys of ``CHOSEN`` read from ``FORGE_TUNE_CACHE`` rather than timed in this process."""


def enabled() -> bool:
    """``FORGE_WS_KERNEL=0`` keeps every update on the Triton kernel."""
    return os.environ.get(ENV, "1") != "0"


def candidates_for(x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states: list[torch.Tensor],
                   scales: list[torch.Tensor | None], state_dtype: str, grad_accum: torch.Tensor | None,
                   stochastic: bool, layer_sums: int = 0) -> list[WsConfig]:
    """The candidates that can take this call (none outside the Gluon kernel's scope: see
    ``hopper_ws.unsupported_reason``; bf16 or int8 states, a regime-1 rule of one or two states, no
    gradient accumulator, no stochastic rounding)."""
    if state_dtype not in ("bf16", "int8") or grad_accum is not None or stochastic or not enabled():
        return []
    return [c for c in _pool(state_dtype, len(states))
            if hopper_ws.unsupported_reason(x2, dy2, weight, states, c, scales, layer_sums) is None]


def _pool(state_dtype: str, num_states: int) -> tuple[WsConfig, ...]:
    return CANDIDATES + (BF16_ONLY if state_dtype == "bf16" and num_states == 2 else ())


def shape_candidates(m: int, n: int, state_dtype: str, num_states: int) -> list[WsConfig]:
    """The candidates ``candidates_for`` offers a contiguous, aligned CUDA call on an ``m x n`` weight,
    from the shape alone: what a tune cache's Gluon choice was made among (``tuning.rekey_tune_cache_entries``
    recomputes its fingerprint on a machine without a GPU)."""
    if state_dtype not in ("bf16", "int8") or hopper_ws.GLUON_IMPORT_ERROR is not None:
        return []
    state_bytes = 1 if state_dtype == "int8" else 2
    return [c for c in _pool(state_dtype, num_states)
            if hopper_ws.config_problem(c, state_bytes) is None and hopper_ws.tile_problem(c, m, n) is None]


def disk_fingerprint(identity: str, candidates: list[WsConfig]) -> str:
    """The tune-cache fingerprint of a choice among ``candidates`` (``identity``: ``tuning.ws_identity``)."""
    return tune_cache.fingerprint(identity, "", "", [candidates, ROUNDS])


def failure_line(error: BaseException, limit: int = 200) -> str:
    """``error``'s type and the first line of its message, at most ``limit`` characters: a CUDA error's text
    runs to several lines of advice, and the cause is the first."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    line = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def choose(run_triton: Callable[[], None], run_ws: Mapping[WsConfig, Callable[[], None]],
           time_ms: Callable[[Callable[[], None]], float], rounds: int = ROUNDS
           ) -> tuple[WsConfig | None, dict[str, float]]:
    """Time every Gluon candidate once, then the fastest against the Triton tile ``rounds`` times,
    alternating which goes first; the Gluon config when its median is lower, else None. A candidate
    that fails to compile or launch is skipped. Returns the choice and the medians, for a log."""
    timings: dict[WsConfig, float] = {}
    for config, run in run_ws.items():
        try:
            timings[config] = float(time_ms(run))
        except Exception as error:   # noqa: BLE001 - compile / resource errors differ between Triton versions
            warnings.warn(f"{ENV}: a Gluon candidate did not run ({failure_line(error)}) and is skipped: {config}",
                          RuntimeWarning, stacklevel=2)
    if not timings:
        return None, {}
    best = min(timings, key=timings.get)
    series: dict[str, list[float]] = {"triton": [], "hopper_ws": []}
    for index in range(max(1, rounds)):
        order = [("triton", run_triton), ("hopper_ws", run_ws[best])]
        for name, run in (order if index % 2 == 0 else order[::-1]):
            series[name].append(float(time_ms(run)))
    medians = {name: statistics.median(values) for name, values in series.items()}
    return (best if medians["hopper_ws"] < medians["triton"] else None), medians


@dataclasses.dataclass(frozen=True)
class _Decision:
    """What the tune cache keeps: the Gluon config's fields, or None for the Triton tile."""
    hopper_ws: dict | None


def _disk_key(key: tuple, candidates: list[WsConfig], identity: str) -> str:
    return tune_cache.entry_key(key + ("hopper_ws",), disk_fingerprint(identity, candidates))


def stored(key: tuple, candidates: list[WsConfig], identity: str, device: str) -> tuple[bool, WsConfig | None]:
    """``(True, choice)`` when the choice for ``key`` is known without timing (in the process, in
    ``FORGE_TUNE_CACHE``, or shipped for GPU model ``device``), else ``(False, None)``. Asked before any
    scratch copy is made: a step whose choices are all stored allocates nothing beyond its own tensors
    (a first Llama-3.1-8B step that copied each weight and its moments, the LM head's the largest,
    only to look a choice up peaked 2.3 GiB above the steps after it)."""
    if key in CHOSEN:
        return True, CHOSEN[key]
    if not candidates:
        return True, None
    path = tune_cache.cache_path()
    shipped = tune_cache.shipped_path(device) if device else None
    if path is None and shipped is None:
        return False, None
    disk_key = _disk_key(key, candidates, identity)
    cached = tune_cache.lookup(path, disk_key, _Decision) if path is not None else None
    if cached is None and shipped is not None:
        cached = tune_cache.lookup_shipped(shipped, disk_key, _Decision)
    if cached is None:
        return False, None
    config = WsConfig(**cached.hopper_ws) if cached.hopper_ws is not None else None
    CHOSEN[key] = config
    FROM_DISK.add(key)
    return True, config


def measure(key: tuple, candidates: list[WsConfig], run_triton: Callable[[], None],
            run_ws: Callable[[WsConfig], None], time_ms: Callable[[Callable[[], None]], float],
            identity: str, note: dict[str, Any]) -> WsConfig | None:
    """Time ``candidates`` against the Triton tile (``choose``) and keep the faster for ``key`` in the
    process and in ``FORGE_TUNE_CACHE``; for a key ``stored`` does not know (``dispatch.ws_plan`` asks
    ``stored`` first, then makes the scratch copies ``run_*`` must only touch). ``key``: a tuning key
    plus how the kernels were timed ("graph" or "eager"); ``identity``: what the choice depends on
    besides the key (both kernels' sources, the Triton tile, the Triton version, the GPU)."""
    config, medians = choose(run_triton, {c: (lambda c=c: run_ws(c)) for c in candidates}, time_ms)
    CHOSEN[key] = config
    path = tune_cache.cache_path()
    if path is not None and medians:
        tune_cache.store(path, _disk_key(key, candidates, identity),
                         _Decision(dataclasses.asdict(config) if config else None), dict(note, medians_ms=medians))
    return config


def graph_time_ms(run: Callable[[], None], launches: int = 10, replays: int = 10) -> float:
    """Median ms of one ``run()`` replayed in a CUDA graph of ``launches`` calls (no host launch
    cost: what a captured training step pays), after eager warm-up calls (compiles)."""
    graph = graph_timing.captured(lambda _: run(), range(launches))
    ms = graph_timing.replay_ms(graph, launches, replays)
    del graph
    return ms


def chosen_configs() -> dict[tuple, WsConfig]:
    """The tuning keys (without the timing mode) whose updates run on the Gluon kernel, with its config."""
    return {key[:-1]: config for key, config in CHOSEN.items() if config is not None}


def describe(config: WsConfig, from_disk: bool) -> str:
    """Short text of a Gluon choice, for a benchmark row (as ``tuning.describe_tuned_configs``)."""
    return (f"hopper_ws {config.block_m}x{config.block_n}x{config.block_k} s{config.stages} "
            f"slab{config.slab_m}x{config.slab_n}x{config.state_stages} g{config.group} "
            f"epi{config.epilogue_warps}{' (tune cache)' if from_disk else ''}")
