"""``forge-bench tune-cache warm``: tune the fused kernel for a suite's FORGE cells into a tune cache,
measuring nothing.

Why: without a tune cache, a sweep's first FORGE cell of each weight shape tunes in its parity gate
(seconds per shape: an 8B model's first step takes 40-80 s), so a new GPU model, a new model or a grid
of new token counts spends device time tuning between measurements, one cell process at a time. Warming
runs each selected cell's reduced-depth twin (the parity gate's: the model's widths with
``parity.max_layers`` layers, at the cell's batch, sequence, dtype, activations and timing mode) for
``WARM_STEPS`` steps, all in this one process: every weight shape the cell's model launches is tuned
once, under the keys the cell will look up later. ``forge-bench tune-cache ship FILE`` then adds the
choices to the package's per-GPU-model files, so a user's first step on those shapes starts at once.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from forge_bench import methods as methods_mod
from forge_bench import models as models_mod
from forge_bench import tune_cache as tune_cache_mod
from forge_bench.arm import ArmUnavailable
from forge_bench.peer_probes import first_line
from forge_bench.suite import Cell, Suite
from forge_core.kernels import tune_cache as core_tune_cache

WARM_STEPS = 2
"""Steps per twin: the first tunes every shape it launches; the second runs what a first step defers
(a head stepped from kept operands at the end of the backward, a state allocated on first use)."""


class WarmError(ValueError):
    """A warm run that cannot start (no GPU for a GPU suite, a cache file that is not one); one line."""


@dataclass(frozen=True)
class WarmOutcome:
    """What warming one cell did: ``warmed`` (``added`` choices new to the file), ``skipped`` or
    ``failed`` (``reason`` says why, in one line)."""
    cell: Cell
    status: str
    added: int = 0
    reason: str | None = None


def skip_reason(suite: Suite, cell: Cell) -> str | None:
    """Why ``cell`` has nothing to tune (not a FORGE arm, distributed, unavailable here), or None."""
    method = methods_mod.METHODS.get(cell.method)
    if method is None:
        return f"method {cell.method!r} is not registered in this process"
    if method.family != "forge":
        return f"{cell.method} is not a FORGE arm: it launches no fused kernel"
    if cell.distributed:
        return f"{cell.method} is a distributed arm: warm its model with a one-process FORGE cell"
    return method.unavailable_reason(suite.spec.device, cell.cuda_graph, cell.world_size)


def cache_entries(path: Path) -> int:
    """How many choices the tune cache at ``path`` holds (0 when it does not exist yet)."""
    if not path.exists():
        return 0
    try:
        return len(tune_cache_mod.read_cache(path)[1])
    except tune_cache_mod.TuneCacheError as exc:
        raise WarmError(str(exc)) from None


def warm_cell(suite: Suite, cell: Cell) -> None:
    """``WARM_STEPS`` steps of ``cell``'s arm on its reduced-depth twin, built as the parity gate builds
    it: the capturable step for a CUDA-graph cell (its kernels are then chosen for graph replays)."""
    spec, device = suite.spec, suite.spec.device
    method = methods_mod.METHODS[cell.method]
    twin_layers = models_mod.reduced_depth(cell.model, spec.parity.max_layers)
    model = models_mod.build_model(cell.model, cell.dtype, device, seed=spec.seed, num_layers=twin_layers)
    models_mod.apply_activations(model, cell.activations)
    models_mod.apply_activation_checkpointing(model, cell.activation_checkpointing)
    torch.manual_seed(spec.seed)
    arm = method.build(model, spec.train_config(cuda_graph=cell.cuda_graph))
    try:
        for step in range(WARM_STEPS):
            loss = arm.step(models_mod.make_batch(cell.model, cell.batch, cell.seq, device, seed=spec.seed + step))
            if not torch.isfinite(loss).all():
                raise RuntimeError(f"the twin's loss is {float(loss)} at step {step + 1}")
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
    finally:
        del arm, model
        gc.collect()
        if device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.empty_cache()


def warm(suite: Suite, cells: list[Cell], cache: Path,
         on_done: Callable[[WarmOutcome], None] | None = None) -> list[WarmOutcome]:
    """Warm each of ``cells`` in order, the tuner writing its choices to ``cache`` (``FORGE_TUNE_CACHE``
    for the duration); a cell that fails is reported and the next one runs (choices already made are
    in the file). Shapes that the package already ships for this GPU are not tuned again."""
    device = suite.spec.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WarmError(f"{suite.path}: the suite's device is {device} but no CUDA device is visible; "
                        f"tuning times the kernels on the GPU that will run them")
    before = cache_entries(cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get(core_tune_cache.ENV)
    os.environ[core_tune_cache.ENV] = str(cache)
    outcomes: list[WarmOutcome] = []
    try:
        for cell in cells:
            reason = skip_reason(suite, cell)
            if reason is not None:
                outcome = WarmOutcome(cell, "skipped", reason=reason)
            else:
                status, failure = "warmed", None
                try:
                    warm_cell(suite, cell)
                except ArmUnavailable as exc:             # a fact only the arm's build sees, as in a cell
                    status, failure = "skipped", first_line(exc)
                except (RuntimeError, ValueError, TypeError) as exc:   # OOM is a RuntimeError
                    status, failure = "failed", first_line(exc)
                after = cache_entries(cache)
                outcome = WarmOutcome(cell, status, added=after - before, reason=failure)
                before = after
            outcomes.append(outcome)
            if on_done is not None:
                on_done(outcome)
    finally:
        if previous is None:
            os.environ.pop(core_tune_cache.ENV, None)
        else:
            os.environ[core_tune_cache.ENV] = previous
    return outcomes
