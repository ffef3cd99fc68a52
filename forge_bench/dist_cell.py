"""One cell of a distributed arm: one torchrun process tree, every rank measures, rank 0 writes the row.

The runner starts ``python -m forge_bench.dist_cell launch ...`` in its own process group (``launch_command``).
The launcher dies with the sweep (Linux parent-death signal) and runs torchrun in its own process
(``torch.distributed.run``, ``--standalone``: a free port per cell), which starts ``world_size``
ranks of ``python -m forge_bench.dist_cell rank ...``; each rank dies with the launcher. So a timeout
(the runner kills the launcher's process group) or a killed sweep leaves no rank on a GPU.

Each rank: the model on its device from the suite's seed (the same weights everywhere), the arm
(``forge_bench/dist_arms.py``) on ``torch.distributed`` (NCCL on GPUs, gloo on the CPU), its own
batches for a data-split strategy (dp, fsdp2) and the same ones for tensor parallel, warm-up,
``repeats`` x ``timed_steps`` timed steps (CUDA events, or the wall clock on the CPU) with the
peak-memory counter reset at the start of the window. Rank 0 gathers every rank's numbers and
writes the cell's one row: a step's time is the slowest rank's, the peak the largest rank's (each
rank's in ``extra``), tokens per second the global batch's.

Failures: every rank's output goes to the launcher's stderr, and torchrun's closing summary names the
first rank that failed and its exception (``record``), so the ``crashed`` row's stderr tail says why.
A rank out of memory writes ``<cell_id>.attempt<N>.rank<r>.oom`` under the log folder
and exits at once with ``EXIT_OOM_RETRY`` (the other ranks may be blocked in a collective; torchrun
stops them), and the runner retries the cell once, then writes the ``oom`` row. Any other death is
the runner's ``crashed`` row.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import torch.distributed as dist
import typer
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from forge_bench import lanes
from forge_bench import methods as methods_mod
from forge_bench import models as models_mod
from forge_bench import results, telemetry
from forge_bench.arm import ArmUnavailable
from forge_bench.cell import (BATCH_POOL, EXIT_OOM_RETRY, base_row, is_oom, pin_cpu_threads,
                              timing_columns)
from forge_bench.dist_arms import DATA_SPLIT
from forge_bench.peer_probes import hide_peer_packages_except
from forge_bench.suite import Cell, Suite, load_suite
from forge_bench.units import GIB

LOG_DIR = "logs"


def oom_marker(out_dir: Path, cell_id: str, attempt: int, rank: int) -> Path:
    """Where rank ``rank`` of an attempt records that it ran out of memory (one line: why)."""
    return Path(out_dir) / LOG_DIR / f"{cell_id}.attempt{attempt}.rank{rank}.oom"


def oom_markers(out_dir: Path, cell_id: str, attempt: int) -> list[Path]:
    """Every rank's out-of-memory record of an attempt."""
    return sorted((Path(out_dir) / LOG_DIR).glob(f"{cell_id}.attempt{attempt}.rank*.oom"))


def launch_command(suite: Suite, cell: Cell, out_dir: Path, run_id: str, attempt: int, parent_pid: int,
                   threads: int | None = None) -> list[str]:
    """The runner's command for a distributed cell: the launcher, which runs torchrun."""
    command = [sys.executable, "-m", "forge_bench.dist_cell", "launch", "--suite", str(suite.path),
               "--cell-id", cell.cell_id, "--out", str(out_dir), "--run-id", run_id, "--attempt", str(attempt),
               "--parent-pid", str(parent_pid)]
    if threads is not None:
        command += ["--threads", str(threads)]
    return command


# --- the ranks' measurement ---------------------------------------------------------------------

def _finite_everywhere(values: list[float], device: torch.device) -> bool:
    """Whether every rank's losses are finite (a collective: every rank takes the same branch)."""
    flag = torch.tensor([1.0 if all(math.isfinite(v) for v in values) else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def timed_runs(arm: Any, batches: list, repeats: int, steps: int,
               on_cuda: bool) -> tuple[list[list[float]], list[float], list[torch.Tensor]]:
    """``repeats`` runs of ``steps`` steps over the batch pool: each step's ms (CUDA events around it,
    or the wall clock on the CPU), each step's host ms, each step's loss."""
    run_ms: list[list[float]] = []
    host_ms: list[float] = []
    losses: list[torch.Tensor] = []
    index = 0
    for _ in range(repeats):
        times = []
        if on_cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for step in range(steps):
            t0 = time.perf_counter()
            if on_cuda:
                starts[step].record()
            losses.append(arm.step(batches[index % BATCH_POOL]))
            if on_cuda:
                ends[step].record()
            else:
                times.append((time.perf_counter() - t0) * 1000.0)
            host_ms.append((time.perf_counter() - t0) * 1000.0)
            index += 1
        if on_cuda:
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) for start, end in zip(starts, ends)]
        run_ms.append(times)
    return run_ms, host_ms, losses


def measure_rank(suite: Suite, cell: Cell, method: methods_mod.Method, device: str) -> dict[str, Any]:
    """This rank's part of the cell: build, warm up, time; returns what rank 0 gathers."""
    spec = suite.spec
    on_cuda = device.startswith("cuda")
    rank = dist.get_rank()
    model = models_mod.build_model(cell.model, cell.dtype, device, seed=spec.seed)
    models_mod.apply_activations(model, cell.activations)
    n_params = sum(p.numel() for p in model.parameters())
    config = dataclasses.replace(spec.train_config(), world_size=cell.world_size,
                                 **({"bucket_cap_mb": cell.bucket_cap_mb} if cell.bucket_cap_mb else {}))
    torch.manual_seed(spec.seed)
    arm = method.build(model, config)
    offset = rank * BATCH_POOL if DATA_SPLIT[method.strategy] else 0
    batches = [models_mod.make_batch(cell.model, cell.batch, cell.seq, device, seed=spec.seed + offset + i)
               for i in range(BATCH_POOL)]
    warm = [float(arm.step(batches[i % BATCH_POOL])) for i in range(spec.warmup_steps)]
    breakdown = {k: int(v) for k, v in arm.memory_breakdown().items()}
    before_window = 0
    if on_cuda:
        torch.cuda.synchronize()
        before_window = torch.cuda.max_memory_allocated()   # the rank's peak so far: build, tuning, warm-up
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    gc.collect()
    gc.disable()            # as in a one-process cell: no collector pause inside the timed window
    try:
        run_ms, host_ms, losses = timed_runs(arm, batches, cell.timed_repeats(spec), spec.timed_steps, on_cuda)
    finally:
        gc.enable()
    values = warm + [float(loss) for loss in losses]
    return {
        "rank": rank, "run_ms": run_ms, "host_ms": host_ms, "losses": [float(loss) for loss in losses],
        "finite": _finite_everywhere(values, torch.device(device)),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
        "peak_process_gib": max(before_window, torch.cuda.max_memory_allocated()) / GIB if on_cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_cuda else None,
        "breakdown": breakdown, "n_params": n_params, "n_fused_params": int(getattr(arm, "n_fused_params", 0) or 0),
        "settings": {**dict(method.settings), **dict(getattr(arm, "settings", {}) or {})},
    }


def slowest_rank_steps(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Each step's time as the slowest rank's (the ranks step together through their collectives)."""
    return [[max(times) for times in zip(*runs)] for runs in zip(*per_rank)]


def cell_row(suite: Suite, cell: Cell, method: methods_mod.Method, run_id: str, attempt: int,
             gathered: list[dict[str, Any]], nvml: dict[str, Any], started: str, t_start: float) -> dict[str, Any]:
    """Rank 0's row from every rank's numbers."""
    row = base_row(suite, cell, method, run_id, attempt)
    first = gathered[0]
    world = len(gathered)
    tokens = cell.batch * cell.seq * (world if DATA_SPLIT[method.strategy] else 1)
    peaks = [g["peak_allocated_gib"] for g in gathered]
    reserved = [g["peak_reserved_gib"] for g in gathered]
    on_cuda = peaks[0] is not None
    losses = [statistics.fmean(step) for step in zip(*(g["losses"] for g in gathered))]
    gib = {k: v / GIB for k, v in first["breakdown"].items()}
    row.update(
        status="ok", started_at=started, n_params=first["n_params"], n_fused_params=first["n_fused_params"],
        method_settings=first["settings"],
        peak_allocated_gib=max(peaks) if on_cuda else None, peak_reserved_gib=max(reserved) if on_cuda else None,
        peak_process_gib=max(g.get("peak_process_gib") or 0.0 for g in gathered) if on_cuda else None,
        peak_reason=None if on_cuda else "CPU run: torch keeps no peak-memory counter for CPU tensors",
        mem_weights_gib=gib.get("weights"), mem_optimizer_states_gib=gib.get("optimizer_states"),
        mem_gradients_gib=gib.get("gradients"), loss_first=losses[0], loss_last=losses[-1],
        **timing_columns(slowest_rank_steps([g["run_ms"] for g in gathered]), tokens), **nvml)
    row["finished_at"] = telemetry_now()
    row["wall_s"] = time.time() - t_start
    row["extra"] = {
        "peak_allocated_gib_per_rank": peaks if on_cuda else None,
        "peak_reserved_gib_per_rank": reserved if on_cuda else None,
        "step_ms_median_per_rank": [statistics.median([x for run in g["run_ms"] for x in run]) for g in gathered],
        "memory_breakdown_bytes_per_rank": [g["breakdown"] for g in gathered],
        "host_return_ms_median": statistics.median(first["host_ms"]),
        "tokens_per_step": tokens,
        **lanes.lane_extra(),
    }
    return row


def telemetry_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def run_rank(suite: Suite, cell: Cell, out_dir: Path, run_id: str, attempt: int) -> int:
    """One rank of the cell (torch.distributed initialized); rank 0 writes the row. Returns the exit code."""
    t_start = time.time()
    started = telemetry_now()
    method = methods_mod.get_method(cell.method)
    device = suite.spec.device
    rank = dist.get_rank()
    nvml_before = telemetry.nvml_snapshot(torch.device(device).index or 0) if device.startswith("cuda") else None
    try:
        mine = measure_rank(suite, cell, method, device)
    except ArmUnavailable as exc:
        if rank == 0:
            row = base_row(suite, cell, method, run_id, attempt)
            row.update(status="unavailable", reason=str(exc).strip().splitlines()[0][:1000], started_at=started,
                       finished_at=telemetry_now(), wall_s=time.time() - t_start)
            results.write_row(out_dir, row)
        return 0
    except BaseException as exc:
        if not is_oom(exc):
            raise
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        marker = oom_marker(out_dir, cell.cell_id, attempt, rank)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"rank {rank}: {message}"[:1000] + "\n")
        sys.stderr.flush()
        os._exit(EXIT_OOM_RETRY)          # the other ranks may wait in a collective: torchrun stops them
    nvml = telemetry.nvml_columns(nvml_before, telemetry.nvml_snapshot(torch.device(device).index or 0)) \
        if nvml_before is not None else telemetry.cpu_nvml_columns()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return 0
    if not mine["finite"]:
        row = base_row(suite, cell, method, run_id, attempt)
        row.update(status="diverged", reason="non-finite loss on some rank", started_at=started,
                   finished_at=telemetry_now(), wall_s=time.time() - t_start)
        results.write_row(out_dir, row)
        return 0
    results.write_row(out_dir, cell_row(suite, cell, method, run_id, attempt, gathered, nvml, started, t_start))
    return 0


# --- the two entry points -------------------------------------------------------------------------

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def launch(
    suite: Annotated[Path, typer.Option(help="suite YAML file")],
    cell_id: Annotated[str, typer.Option(help="the cell's id")],
    out: Annotated[Path, typer.Option(help="results folder")],
    run_id: Annotated[str, typer.Option(help="run id to record")],
    attempt: Annotated[int, typer.Option(help="attempt number (OOM retry)")] = 1,
    parent_pid: Annotated[Optional[int], typer.Option(help="die with this process (the sweep)")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads per rank on a CPU device")] = None,
) -> None:
    """Run torchrun in this process with the cell's world size: one rank per process."""
    if parent_pid is not None:
        lanes.die_with_parent(parent_pid)
    from torch.distributed.run import main as torchrun

    loaded = load_suite(suite)
    cell = loaded.cell(cell_id)
    rank_args = ["--suite", str(suite), "--cell-id", cell_id, "--out", str(out), "--run-id", run_id,
                 "--attempt", str(attempt)] + (["--threads", str(threads)] if threads is not None else [])
    try:
        torchrun(["--standalone", "--nproc-per-node", str(cell.world_size), "-m", "forge_bench.dist_cell", "rank",
                  *rank_args])
    except ChildFailedError as failure:
        print(failure, file=sys.stderr)      # the summary: the first failing rank and its exception
        raise typer.Exit(1)


@app.command()
@record          # torchrun's failure summary then names the first failing rank's exception (the stderr tail)
def rank(
    suite: Annotated[Path, typer.Option(help="suite YAML file")],
    cell_id: Annotated[str, typer.Option(help="the cell's id")],
    out: Annotated[Path, typer.Option(help="results folder")],
    run_id: Annotated[str, typer.Option(help="run id to record")],
    attempt: Annotated[int, typer.Option(help="attempt number (OOM retry)")] = 1,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads on a CPU device")] = None,
) -> None:
    """One rank, as torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous in the environment)."""
    lanes.die_with_parent(os.getppid())
    loaded = load_suite(suite)
    cell = loaded.cell(cell_id)
    method = methods_mod.get_method(cell.method)
    hide_peer_packages_except(method.requires)
    pin_cpu_threads(loaded, threads)
    device = loaded.spec.device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        loaded = dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"device": device}))
    if device.startswith("cuda"):
        dist.init_process_group("nccl", device_id=torch.device(device))   # this rank's GPU, bound at once
    else:
        dist.init_process_group("gloo")
    try:
        code = run_rank(loaded, cell, out, run_id, attempt)
    finally:
        dist.destroy_process_group()
    # The row is written and the group destroyed: leave without the interpreter's teardown, where a
    # gloo rank on a loaded 2-core machine aborted in a C++ destructor ("terminate called without an
    # active exception", SIGABRT) after its work was done, and torchrun reported the cell crashed (D70).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    app()
