"""Choosing the Triton tile kernel's configuration per weight shape, and the record of every choice.

Tile configurations are chosen per (shape, dtypes, state format) by timing candidates on scratch
copies of W and the states (``tune_config``), so tuning never applies an update to the real
tensors; the real launch runs once, afterwards. Under ``TRITON_INTERPRET=1`` one small fixed
configuration is used (tuning in the interpreter would take minutes). Each choice is kept in the
process (``TUNED``) and, with ``FORGE_TUNE_CACHE``, on disk under a fingerprint of what made it
valid (``tuning_fingerprint``; ``tune_cache`` holds the file format). ``ws_choice`` then decides
whether the Gluon kernel beats the chosen tile. ``tuned_configs`` / ``describe_tuned_configs`` list
both kinds of choice; ``rekey_tune_cache_entries`` moves a cache's choices to this tree's fingerprints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import statistics
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
import triton

from ..rules import get_rule
from ..rules.base import parse_kernel_name
from ..traced import graph_capturing
from . import tune_cache, ws_choice
from .device import interpreting
from .direct_launch import direct_launch_enabled
from .hopper_ws import WsConfig
from .hopper_ws_kernel import GLUON_IMPORT_ERROR, ws_fused_kernel
from .launch import launch_tile
from .tile_config import GROUPS, TileConfig, candidate_configs, default_config, supports
from .tile_kernel import fused_wgrad_update_kernel

# TMA in the main loop makes the 4-warp BT-512 tiles 3-6% faster and 128x256 at 4096 tokens 5-15%,
# but the 8-warp 64x128 tile 7-23% slower with int8 states (H100, results/kernels/h100/tma_ab):
# which loader wins depends on the tile, so the fastest few are also timed with the other one.
TMA_FLIPS = 3
# Each candidate is timed once, by one ~40 ms do_bench, seconds apart from its rivals; under the
# H100's power cap the SM clock moves by 5-10% within a cell (1740-1830 MHz after the window), and
# candidates a few percent apart swap places between boots (gate/up with int8 states can run a
# 318 us tile where 64x64x32 s6 measures 301-305 us alone). So the fastest few, within
# FINALIST_MARGIN of the best, are timed again round-robin, FINAL_ROUNDS times, each round in a new
# order, and ranked by their median: every round sees all finalists at about one clock.
FINALISTS = 4
FINAL_ROUNDS = 5
FINALIST_MARGIN = 1.10
TUNED: dict[tuple, TileConfig] = {}
"""The tile chosen per tuning key in this process (tuned here or read from the tune cache)."""
FROM_DISK: set[tuple] = set()
"""The keys of ``TUNED`` whose choice came from ``FORGE_TUNE_CACHE``, not tuned here."""


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
    the register cap of ``sixteen_warps_per_sm``."""
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


def autotune_enabled() -> bool:
    """``FORGE_AUTOTUNE=0`` skips tuning: every weight runs ``default_config``."""
    return os.environ.get("FORGE_AUTOTUNE", "1") != "0"


QUIET_ENV = "FORGE_TUNE_QUIET"
"""``FORGE_TUNE_QUIET=1`` keeps the tuner's progress lines off stderr."""


def tuning_message(m: int, n: int, k: int, state_dtype: str, n_candidates: int) -> str:
    """The line the tuner prints before it times a shape: a first step that tunes takes seconds per
    weight shape (an 8B model's first step, 40-80 s without a tune cache), and this says why."""
    return (f"forge_core: tuning the fused kernel for a {m}x{n} weight at {k} tokens, {state_dtype} states "
            f"({n_candidates} candidate tiles; {tune_cache.ENV} keeps the choice for later processes)...")


def announce_tuning(m: int, n: int, k: int, state_dtype: str, n_candidates: int) -> None:
    """Print ``tuning_message`` to stderr, unless ``FORGE_TUNE_QUIET`` is set to anything but 0."""
    if os.environ.get(QUIET_ENV, "0") in ("", "0"):
        print(tuning_message(m, n, k, state_dtype, n_candidates), file=sys.stderr, flush=True)


def bench_ms(fn: Callable[[], None]) -> float:
    """Median ms of ``fn`` as an eager caller pays it (``do_bench``: launch cost included)."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def tuned_config(key: tuple, state_dtype: str, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
                 states: list[torch.Tensor], scales: list[torch.Tensor | None], grad_accum: torch.Tensor | None,
                 scalars: tuple[float, ...] | torch.Tensor, seed: int, meta: Mapping[str, Any]) -> TileConfig:
    """The tile for tuning key ``key``: chosen before in this process, read from ``FORGE_TUNE_CACHE``,
    then from the choices shipped for this GPU model (``tune_cache.SHIPPED_DIR``), or tuned now on
    scratch copies of the weight and states (then kept in the process and in ``FORGE_TUNE_CACHE``)."""
    m, n = weight.shape
    k = x2.shape[0]
    input_bytes = x2.element_size()
    if key in TUNED:
        return TUNED[key]
    if not autotune_enabled():
        return default_config(m, n, k, input_bytes)      # not cached: tuning may be enabled later
    if k == 0:
        # a zero-token launch (a flush: the update without a gradient) has no GEMM to time: tuning it
        # would compile and time every candidate for nothing, on a first step already long
        TUNED[key] = default_config(m, n, k, input_bytes)
        return TUNED[key]
    candidates = tuning_candidates(m, n, k, input_bytes, state_dtype)
    disk_path, disk_key, gpu = tune_cache.cache_path(), None, device_name(weight)
    shipped = tune_cache.shipped_path(gpu)
    if disk_path is not None or shipped is not None:
        fingerprint = _tuning_fingerprint(weight, meta, candidates)
        disk_key = tune_cache.entry_key(key, fingerprint)
    cached = tune_cache.lookup(disk_path, disk_key, TileConfig) if disk_path is not None else None
    if cached is None and shipped is not None:
        cached = tune_cache.lookup_shipped(shipped, disk_key, TileConfig)
    if cached is not None:
        TUNED[key] = cached
        FROM_DISK.add(key)
        return cached
    if disk_path is not None:
        stale = tune_cache.other_fingerprints(disk_path, key)
        if stale:
            warnings.warn(f"{tune_cache.ENV}: {disk_path} holds a tile for {m}x{n} at {k} tokens made for another "
                          f"kernel source, Triton, GPU or candidate list (fingerprint {', '.join(stale)}, this one "
                          f"{fingerprint}); tuning again", RuntimeWarning, stacklevel=3)
    if graph_capturing():
        raise RuntimeError(capture_refusal(m, n, k))
    announce_tuning(m, n, k, state_dtype, len(candidates))
    tuned = False
    scratch = scratch_copies(weight, states, scales)
    if scratch is None:
        warnings.warn(f"fused_wgrad_update: no memory for tuning scratch copies of a {m}x{n} weight; "
                      f"using the default tile configuration", RuntimeWarning, stacklevel=3)
        config = default_config(m, n, k, input_bytes)
    else:
        scratch_weight, scratch_states, scratch_scales = scratch
        # a regime-2 rule's kernel adds into per-layer sums: scratch ones too
        scratch_sums = torch.zeros(2, dtype=torch.float32, device=weight.device) if meta.get("NUM_SUMS") else None

        def run_on_scratch(config: TileConfig) -> None:
            launch_tile(config, x2, dy2, scratch_weight, scratch_states, scratch_scales, grad_accum, scalars, seed,
                        meta, scratch_sums)

        config, _ = tune_config(candidates, run_on_scratch, bench_ms, finalists=FINALISTS)
        tuned = True
        del scratch, scratch_weight, scratch_states, scratch_scales
    TUNED[key] = config
    if tuned and disk_path is not None:
        tune_cache.store(disk_path, disk_key, config, {
            "shape": f"{m}x{n}", "tokens": k, "device": gpu, "triton": triton.__version__})
    return config


def capture_refusal(m: int, n: int, k: int) -> str:
    """The one line a first call inside a CUDA graph capture gets: tuning times launches, which a capture cannot
    hold (it would fail later with a CUDA error naming no cause)."""
    return (f"forge_core: the fused kernel for a {m}x{n} weight at {k} tokens is tuned at its first call, which cannot "
            "run inside a CUDA graph capture: run one step before capturing, keep the choices in FORGE_TUNE_CACHE, or "
            "set FORGE_AUTOTUNE=0")


def scratch_copies(weight: torch.Tensor, states: list[torch.Tensor], scales: list[torch.Tensor | None]
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]] | None:
    """Copies of a weight, its states and their scales for timed launches, which step what they are
    given (a choice must not step the real weight); None when the GPU has no room for them."""
    try:
        return (weight.detach().clone(), [s.clone() for s in states],
                [s.clone() if s is not None else None for s in scales])
    except torch.OutOfMemoryError:
        return None


def device_name(tensor: torch.Tensor) -> str:
    """The GPU's name (part of a tune-cache fingerprint), or the device for CPU tensors."""
    return torch.cuda.get_device_name(tensor.device) if tensor.is_cuda else str(tensor.device)


def _tuning_fingerprint(weight: torch.Tensor, meta: Mapping[str, Any], candidates: list[TileConfig]) -> str:
    return tuning_fingerprint(meta.get("EPILOGUE"), candidates, triton.__version__, device_name(weight))


def tuning_fingerprint(epilogue: Any, candidates: list[TileConfig], triton_version: str, device_name: str) -> str:
    """What a tile choice on disk is valid for besides its key: the kernel and the rule's epilogue
    (their sources and what they call, not their line numbers), the Triton version, the GPU, and
    what the tuner chose among."""
    search = (candidates, GROUPS, TMA_FLIPS, FINALISTS, FINAL_ROUNDS, FINALIST_MARGIN, RESIDENT_WARPS_TARGET)
    identity = tune_cache.source_identity
    return tune_cache.fingerprint(identity(fused_wgrad_update_kernel) + identity(epilogue), triton_version,
                                  device_name, list(search))


def ws_identity(epilogue: Any, triton_config: TileConfig, triton_version: str, device_name: str, graphed: bool) -> str:
    """What a Gluon-or-Triton choice (``ws_choice.stored`` / ``measure``) depends on besides its key: both kernels'
    sources, the rule's epilogue, the Triton tile it was timed against, Triton and the GPU; an eager
    choice also weighs the host's launch cost, so which launch paths were timed."""
    if ws_fused_kernel is None:
        raise RuntimeError(f"a Gluon-or-Triton choice names the Gluon kernel, which this Triton cannot import "
                           f"({GLUON_IMPORT_ERROR})")
    identity = (tune_cache.source_identity(ws_fused_kernel)
                + tuning_fingerprint(epilogue, [triton_config], triton_version, device_name))
    if not graphed:
        identity += "|eager launches: " + ("direct, both kernels" if direct_launch_enabled() else "jit")
    return identity


def tuning_candidates(m: int, n: int, k: int, input_bytes: int, state_dtype: str) -> list[TileConfig]:
    """The tiles the tuner times for one weight shape and state format (part of its fingerprint)."""
    return [c for c in candidate_configs(m, n, k, input_bytes) if supports(c, state_dtype)]


def tuned_configs() -> dict[tuple, TileConfig | WsConfig]:
    """The configurations chosen so far in this process, by tuning key (for logs and benchmarks): the
    Triton tile, or the Gluon kernel's config where ``ws_choice`` gave it the weight."""
    return {**TUNED, **ws_choice.chosen_configs()}


def describe_tuned_configs() -> dict[str, str]:
    """The tuner's choices as short text, for a benchmark row: which tile ran each weight shape.

    Two timings of one model are only comparable when one knows whether the same kernels ran."""
    described = {}
    for key, config in TUNED.items():
        (m, n), tokens, _, _, rule_name, state_dtype = key[:6]
        described[f"{m}x{n}/bt{tokens}/{rule_name}/{state_dtype}"] = (
            f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} "
            f"g{config.group} split{config.split_n}{' prefetch' if config.prefetch else ''}"
            f"{f' maxnreg{config.max_registers}' if config.max_registers else ''}{'' if config.tma else ' pointers'}"
            f"{' (tune cache)' if key in FROM_DISK else ''}")
    for key, ws_config in ws_choice.CHOSEN.items():          # key: the tuning key + the timing mode
        if ws_config is not None:
            (m, n), tokens, _, _, rule_name, state_dtype = key[:6]
            described[f"{m}x{n}/bt{tokens}/{rule_name}/{state_dtype}"] = ws_choice.describe(
                ws_config, key in ws_choice.FROM_DISK)
    return described


def _current_fingerprint(key: str, entry: Mapping[str, Any]) -> tuple[tuple, str]:
    """(the tuning key, the fingerprint this tree computes for it) of one tune-cache entry; a
    one-line ValueError naming the entry when it cannot be read."""
    try:
        _, key_text = tune_cache.split_entry_key(key)
        tuning_key = eval(key_text, {"__builtins__": {}}, {"torch": torch})      # noqa: S307 - the cache's own repr
        (m, n), tokens, input_dtype, _, kernel_name, state_dtype = tuning_key[:6]
        rule_name, held = parse_kernel_name(kernel_name)
        rule = get_rule(rule_name)
        state_names = held if held is not None else rule.state_names
        epilogue = rule.epilogue_for(state_names)
        triton_version, device = entry["triton"], entry["device"]
        if tuning_key[-1] == "hopper_ws":          # a Gluon-or-Triton choice (ws_choice.measure)
            triton_tile = TileConfig(**entry["triton_tile"])
        else:
            input_bytes = torch.empty((), dtype=input_dtype).element_size()
    except Exception as exc:  # noqa: BLE001 - any malformed key or entry gets the same one-line error
        raise ValueError(f"tune cache entry {key!r} cannot be read ({type(exc).__name__}: {exc})") from None
    if tuning_key[-1] == "hopper_ws":
        identity = ws_identity(epilogue, triton_tile, triton_version, device, graphed=tuning_key[-2] == "graph")
        candidates = ws_choice.shape_candidates(m, n, state_dtype, len(state_names))
        return tuning_key, ws_choice.disk_fingerprint(identity, candidates)
    candidates = tuning_candidates(m, n, tokens, input_bytes, state_dtype)
    return tuning_key, tuning_fingerprint(epilogue, candidates, triton_version, device)


def rekey_tune_cache_entries(entries: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """A tune cache's entries under the fingerprints this tree computes, and how many keys changed.

    Why: every entry is keyed by a fingerprint of the kernel's source, so any change to a kernel
    makes the new tree tune again, and the tuner's pick among candidates a few percent apart moves
    between runs: an old-vs-new A/B would measure the tuner as well as the code. The same choices
    under this tree's fingerprints (each entry keeps its own Triton version and GPU name) run both
    sides on the same tiles. Gluon-or-Triton choices (keys ending in ``'hopper_ws'``) are re-keyed
    with the candidates their weight shape is offered on a contiguous, aligned call. The result is
    for A/Bs, not a tuning result: its tiles were chosen for the other kernel."""
    rekeyed, changed = {}, 0
    for key, entry in entries.items():
        tuning_key, fingerprint = _current_fingerprint(key, entry)
        changed += fingerprint != tune_cache.split_entry_key(key)[0]
        rekeyed[tune_cache.entry_key(tuning_key, fingerprint)] = entry
    return rekeyed, changed


def count_current_tune_cache_entries(entries: Mapping[str, Any]) -> tuple[int, int]:
    """(entries this tree's kernels would look up as they are, all entries) of a tune cache."""
    _, changed = rekey_tune_cache_entries(entries)
    return len(entries) - changed, len(entries)

