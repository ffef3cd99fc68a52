"""One process per cell: spawn, time-limit, OOM retry, crash capture, resume.

A sweep writes into one results folder:

* ``manifest.json``: the run id(s) and the suite(s) the folder holds (written atomically);
* ``<cell_id>.parquet``: one row per finished cell (``forge_bench.results.write_row``);
* ``logs/<cell_id>.attempt<N>.{out,err}``: each cell process's stdout and stderr.

Every cell ends in exactly one row whatever happens to its process: the cell writes ``ok``,
``parity_fail``, ``diverged``, ``unavailable``, ``oom_predicted`` or ``oom`` itself; this module
writes ``timeout`` (killed at the cell's ``timeout_s``: the grid's, else the suite's) and ``crashed`` (the process died
without a row; the row keeps its stderr tail). A distributed arm's cell is one torchrun process tree
(``forge_bench/dist_cell.py``): the same rules hold for the whole tree, a rank out of memory makes
the cell's ``oom`` retry and row (its ranks leave a record under ``logs/``), and any other rank's
death is the cell's ``crashed`` row. ``--resume`` skips cell ids that already have a
readable row, so a ``kill -9`` of the sweep loses no written row and duplicates none; a row file
that does not read is moved aside (``<cell_id>.parquet.corrupt``) and its cell runs again.
``--retry-failed`` also runs again the cells whose row says ``crashed``, ``timeout`` or ``oom``,
under the same run id, replacing those rows. The cell process dies with the sweep (Linux
parent-death signal), so a killed sweep leaves nothing running.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from forge_bench import methods as methods_mod
from forge_bench import lanes, results, turns
from forge_bench.cell import EXIT_OOM_RETRY, MAX_ATTEMPTS, SPAWNED_AT_ENV, base_row, run_cell
from forge_bench.dist_cell import launch_command, oom_markers
from forge_bench.suite import Cell, Suite

MANIFEST = "manifest.json"
LOG_DIR = "logs"
STDERR_TAIL_LINES = 40
STDERR_TAIL_CHARS = 4000
REPO_ROOT = Path(__file__).resolve().parent.parent


class RunnerError(ValueError):
    """A results folder that this sweep must not write into (one line)."""


# --- the manifest ----------------------------------------------------------------------------

def _utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunnerError(f"{path}: unreadable manifest ({exc}); move it away or use another --out") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise RunnerError(f"{path}: not a forge-bench manifest (no 'runs' list)")
    return data


def _write_manifest(out_dir: Path, data: dict[str, Any]) -> None:
    path = Path(out_dir) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def new_run_id(suite: Suite) -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{suite.name}-{secrets.token_hex(3)}"


# the statuses --retry-failed runs again: the cell's process died, hung or ran out of memory, all of
# which a second try on a quieter machine can change (a parity failure or an unavailable arm cannot)
RETRY_STATUSES = ("crashed", "timeout", "oom")


def plan_run(out_dir: Path, suite: Suite, *, resume: bool, allow_mixed: bool,
             retry_failed: bool = False) -> tuple[str, dict[str, Any] | None, set[str]]:
    """Decide the run id without writing: (run_id, manifest to write or None, cell ids already done).

    Refuses (``RunnerError``) to add a different suite to a folder unless ``allow_mixed``, and
    to start over a folder that already holds rows of this suite unless ``resume`` (or
    ``retry_failed``, which resumes and also counts rows of a ``RETRY_STATUSES`` status as not done).
    A row file that does not read is never done (``run_sweep`` sets it aside).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunnerError(f"{out_dir}: --out exists and is not a folder")
    if (out_dir / results.PACKED_ROWS).exists():
        raise RunnerError(f"{out_dir}: its rows are packed into {results.PACKED_ROWS} (a finished record, "
                          "`forge-bench pack`); use another --out")
    resume = resume or retry_failed
    manifest = read_manifest(out_dir)
    statuses = results.scan_rows(out_dir).statuses
    done = {cell_id for cell_id, status in statuses.items() if not (retry_failed and status in RETRY_STATUSES)}
    suite_ids = {c.cell_id for c in suite.cells}
    if manifest is None:
        if statuses:
            raise RunnerError(f"{out_dir}: holds {len(statuses)} result rows but no {MANIFEST}; use an empty --out")
        run_id = new_run_id(suite)
        manifest = {"format": 1, "runs": [_run_entry(suite, run_id)]}
        return run_id, manifest, set()
    runs = manifest["runs"]
    mine = next((r for r in runs if r.get("suite_hash") == suite.sha256), None)
    if mine is None:
        if runs and not allow_mixed:
            other = runs[-1]
            raise RunnerError(
                f"{out_dir}: holds results of suite {other.get('suite_name')!r} (hash {other.get('suite_hash')}), "
                f"not {suite.name!r} (hash {suite.sha256}); use another --out, or --allow-mixed to add it")
        run_id = new_run_id(suite)
        runs.append(_run_entry(suite, run_id))
        return run_id, manifest, set()
    already = done & suite_ids
    if already and not resume:
        raise RunnerError(f"{out_dir}: already holds {len(already)} of {len(suite_ids)} cells of suite {suite.name!r} "
                          f"(run {mine['run_id']}); add --resume to run only the missing cells, or use another --out")
    mine.setdefault("resumed_at", []).append(_utc())
    return mine["run_id"], manifest, already


def _run_entry(suite: Suite, run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, "suite_name": suite.name, "suite_hash": suite.sha256, "suite_path": str(suite.path),
            "cells": len(suite.cells), "created_at": _utc()}


# --- one cell process ------------------------------------------------------------------------

@dataclass
class CellOutcome:
    cell: Cell
    status: str
    row: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False     # already done (resume)


# CUDA-graph cells capture the step into a memory pool of the graph's own, beside the eager steps'
# weights and optimizer states; on an 80 GB GPU the 8B arms with 75-77 GiB eager peaks ran out of
# memory in the capture with the default allocator. Expandable segments let both pools grow in one
# address range without fragments. Replays allocate nothing, so timing is unaffected; the peak
# (allocated bytes) is the same quantity either way.
GRAPH_CELL_ALLOC_CONF = "expandable_segments:True"


# The fused kernel's tile choices are shared by the cells of a sweep through this file in its
# results folder (forge_core.kernels.tune_cache): the first cell of a weight shape tunes, the later
# ones (eager and graph, other arms, a --resume) reuse its choice instead of re-tuning for 40-120 s
# each, and every FORGE cell of the sweep then runs the same kernels.
TUNE_CACHE_FILE = "tune_cache.json"
TUNE_CACHE_ENV = "FORGE_TUNE_CACHE"      # forge_core.kernels.tune_cache.ENV, spelled here so that the
                                         # sweep process never imports Triton (a test pins the two equal)


def _child_env(cell: Cell | None = None, tune_cache: str | None = None,
               lane: Mapping[str, str] | None = None) -> dict[str, str]:
    """The cell process must import this very source tree (no install needed on a GPU box). Graph
    cells get ``GRAPH_CELL_ALLOC_CONF`` unless the user set PYTORCH_CUDA_ALLOC_CONF themselves.
    ``tune_cache``: the FORGE_TUNE_CACHE the cell gets ("" turns it off; None: as inherited).
    ``lane``: the GPUs of a cell run beside others (``lanes.child_env``)."""
    env = dict(os.environ)
    env.pop(lanes.CELLS_BESIDE, None)
    env.pop(lanes.CPUS, None)
    env.update(lane or {})
    if tune_cache is not None:
        env[TUNE_CACHE_ENV] = tune_cache
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cell is not None and cell.cuda_graph:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", GRAPH_CELL_ALLOC_CONF)
    return env


def stderr_tail(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    tail = "\n".join(text.rstrip().splitlines()[-STDERR_TAIL_LINES:])
    return tail[-STDERR_TAIL_CHARS:] or None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def start_cell(suite: Suite, cell: Cell, out_dir: Path, run_id: str, attempt: int, tune_cache: str | None = None,
               threads: int | None = None, lane: Mapping[str, str] | None = None,
               turn: turns.TurnPipe | None = None, peers: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start the cell process (its own process group, stdout and stderr to ``logs/``); returns it and its
    stderr file. ``threads``: the CPU cell's torch threads (None: the suite's ``cpu_threads``);
    ``lane``: its GPUs when it runs beside other cells; ``turn``: its pipes when it takes turns with
    ``peers`` (``--interleave``)."""
    log_dir = out_dir / LOG_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path = log_dir / f"{cell.cell_id}.attempt{attempt}.out"
    err_path = log_dir / f"{cell.cell_id}.attempt{attempt}.err"
    if cell.distributed:
        cmd = launch_command(suite, cell, out_dir, run_id, attempt, os.getpid(), threads)
    else:
        cmd = [sys.executable, "-m", "forge_bench.cell", "--suite", str(suite.path), "--cell-id", cell.cell_id,
               "--out", str(out_dir), "--run-id", run_id, "--attempt", str(attempt), "--parent-pid", str(os.getpid())]
        if threads is not None:
            cmd += ["--threads", str(threads)]
    env = _child_env(cell, tune_cache, lane)
    env[SPAWNED_AT_ENV] = repr(time.time())
    if turn is not None:
        env.update(turn.child_env(peers or []))
    with open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
        proc = subprocess.Popen(cmd, stdout=fout, stderr=ferr, stdin=subprocess.DEVNULL, env=env, cwd=os.getcwd(),
                                start_new_session=True, pass_fds=turn.child_fds if turn is not None else ())
    if turn is not None:
        turn.close_child_ends()
    return proc, err_path


def wait_cell(proc: subprocess.Popen, deadline: float, tick: Callable[[], None] | None = None) -> int | None:
    """The cell process's exit code, or None when it was killed at ``deadline`` (``time.monotonic``).
    ``tick`` may raise to stop the cell (its process group dies)."""
    try:
        while True:
            try:
                return proc.wait(timeout=min(0.25, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if tick:
                    tick()
                if time.monotonic() >= deadline:
                    _kill_group(proc)
                    return None
    except BaseException:
        _kill_group(proc)   # Ctrl-C or an error here: never leave a cell running
        raise


def spawn_cell(suite: Suite, cell: Cell, out_dir: Path, run_id: str, attempt: int, timeout_s: float,
               tick: Callable[[], None] | None = None, tune_cache: str | None = None,
               threads: int | None = None, lane: Mapping[str, str] | None = None) -> tuple[int | None, Path]:
    """Run the cell process; returns (exit code or None when killed at the timeout, stderr file)."""
    proc, err_path = start_cell(suite, cell, out_dir, run_id, attempt, tune_cache, threads, lane)
    return wait_cell(proc, time.monotonic() + timeout_s, tick), err_path


def _load_row(out_dir: Path, cell_id: str) -> dict[str, Any] | None:
    path = results.row_path(out_dir, cell_id)
    if not path.exists():
        return None
    return results.load_table(path).to_pylist()[0]


def _runner_row(suite: Suite, cell: Cell, run_id: str, attempt: int, status: str, reason: str,
                tail: str | None, wall_s: float) -> dict[str, Any]:
    row = base_row(suite, cell, methods_mod.METHODS.get(cell.method), run_id, attempt)
    row.update(status=status, reason=reason, stderr_tail=tail, finished_at=_utc(), wall_s=wall_s)
    return row


def settle(suite: Suite, cell: Cell, out_dir: Path, run_id: str, attempt: int, rc: int | None, err_path: Path,
           started: float, limit_s: float) -> dict[str, Any] | None:
    """The row of an attempt that ended with ``rc`` (None: killed after ``limit_s``), writing the
    runner's own row where the cell wrote none; None when the cell asks for another attempt (out of
    memory) and ``attempt`` is not the last."""
    if rc is None:
        row = _runner_row(suite, cell, run_id, attempt, "timeout", f"killed after the per-cell timeout of {limit_s:g} s",
                          stderr_tail(err_path), time.monotonic() - started)
        results.write_row(out_dir, row)
        return row
    out_of_memory = oom_markers(out_dir, cell.cell_id, attempt) if cell.distributed else []
    if (rc == EXIT_OOM_RETRY or out_of_memory) and attempt < MAX_ATTEMPTS:
        return None
    row = _load_row(out_dir, cell.cell_id)
    if row is not None:
        return row
    if out_of_memory:                  # a rank of the last attempt ran out of memory
        why = out_of_memory[0].read_text(errors="replace").strip()
        row = _runner_row(suite, cell, run_id, attempt, "oom", f"out of memory on attempt {attempt} of "
                          f"{MAX_ATTEMPTS} (each in a fresh process tree): {why}"[:1000], None,
                          time.monotonic() - started)
        results.write_row(out_dir, row)
        return row
    how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
    row = _runner_row(suite, cell, run_id, attempt, "crashed", f"cell process died ({how}) without a row",
                      stderr_tail(err_path), time.monotonic() - started)
    results.write_row(out_dir, row)
    return row


def _unavailable(suite: Suite, cell: Cell) -> bool:
    """Whether the cell's arm says it cannot run here (its row is written without a process)."""
    method = methods_mod.METHODS.get(cell.method)
    return method is not None and method.unavailable_reason(suite.spec.device, cell.cuda_graph,
                                                            cell.world_size) is not None


def run_one(suite: Suite, cell: Cell, out_dir: Path, run_id: str, tick: Callable[[], None] | None = None,
            tune_cache: str | None = None, threads: int | None = None,
            lane: Mapping[str, str] | None = None, first_attempt: int = 1) -> dict[str, Any]:
    """Run a cell to exactly one row (spawning, retrying after OOM once, recording deaths)."""
    if _unavailable(suite, cell):
        run_cell(suite, cell, out_dir, run_id)     # writes the `unavailable` row; builds nothing
        return _load_row(out_dir, cell.cell_id) or {}
    t0 = time.monotonic()
    for attempt in range(first_attempt, MAX_ATTEMPTS + 1):
        rc, err_path = spawn_cell(suite, cell, out_dir, run_id, attempt, cell.timeout_s, tick, tune_cache, threads, lane)
        row = settle(suite, cell, out_dir, run_id, attempt, rc, err_path, t0, cell.timeout_s)
        if row is not None:
            return row
    raise AssertionError("unreachable")


@dataclass
class _TurnTaker:
    """A cell process of a group that takes turns, and its end of the pipes."""
    cell: Cell
    proc: subprocess.Popen
    err_path: Path
    pipe: turns.TurnPipe
    deadline: float
    killed: bool = False       # at its deadline
    ready: bool = False        # it has written READY and waits for GO

    def alive(self) -> bool:
        """Whether the process still runs; past the deadline its process group is killed first."""
        if self.proc.poll() is not None:
            return False
        if time.monotonic() >= self.deadline:
            _kill_group(self.proc)
            self.killed = True
            return False
        return True

    def until(self, token: bytes, tick: Callable[[], None] | None) -> bool:
        return self.pipe.until(token, self.alive, tick)


def run_group(suite: Suite, cells: list[Cell], out_dir: Path, run_id: str, tick: Callable[[], None] | None = None,
              tune_cache: str | None = None, threads: int | None = None,
              lane: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``cells`` (one group, ``turns``) resident together, their timed repeats taking turns; one row each.

    The cells start one after the other, each once the one before is ready (its warm-up over); then
    each ready cell in turn gets the GPU for one repeat. A cell that ran out of memory beside the
    others runs again alone (attempt 2), after the group. A cell's time limit is the group's timeouts
    summed (it waits through the others' turns). A cell whose arm cannot run here gets its row without a
    process, as ``run_one`` writes it."""
    taking_turns = [cell for cell in cells if not _unavailable(suite, cell)]
    if len(taking_turns) < 2:
        return [run_one(suite, cell, out_dir, run_id, tick, tune_cache, threads, lane) for cell in cells]
    rows: dict[str, dict[str, Any] | None] = {cell.cell_id: run_one(suite, cell, out_dir, run_id)
                                              for cell in cells if cell not in taking_turns}
    limit_s = sum(cell.timeout_s for cell in taking_turns)
    t0 = time.monotonic()
    takers: list[_TurnTaker] = []
    try:
        for cell in taking_turns:
            pipe = turns.TurnPipe()
            peers = [other.cell_id for other in taking_turns if other is not cell]
            proc, err_path = start_cell(suite, cell, out_dir, run_id, 1, tune_cache, threads, lane, pipe, peers)
            takers.append(_TurnTaker(cell, proc, err_path, pipe, time.monotonic() + limit_s))
            takers[-1].ready = takers[-1].until(turns.READY, tick)
        while any(taker.ready for taker in takers):
            for taker in takers:
                if taker.ready:
                    taker.ready = (taker.pipe.give() and taker.until(turns.DONE, tick)
                                   and taker.until(turns.READY, tick))
        for taker in takers:
            rc = None if taker.killed else wait_cell(taker.proc, taker.deadline, tick)
            rows[taker.cell.cell_id] = settle(suite, taker.cell, out_dir, run_id, 1, rc, taker.err_path, t0, limit_s)
    except BaseException:
        for taker in takers:
            _kill_group(taker.proc)
        raise
    finally:
        for taker in takers:
            taker.pipe.close()
    return [row if (row := rows[cell.cell_id]) is not None
            else run_one(suite, cell, out_dir, run_id, tick, tune_cache, threads, lane, 2) for cell in cells]


def turn_groups(cells: list[Cell]) -> list[list[Cell]]:
    """``cells`` in groups that take turns (``--interleave``): one-GPU cells of one grid, model, batch, seq,
    dtype and activations, in the order of their first cell; any other cell is a group of its own."""
    groups: dict[tuple, list[Cell]] = {}
    for index, cell in enumerate(cells):
        key = (index,) if cell.distributed or cell.world_size != 1 else (
            cell.grid, cell.model, cell.batch, cell.seq, cell.dtype, cell.activations, cell.activation_checkpointing)
        groups.setdefault(key, []).append(cell)
    return list(groups.values())


def check_gpus(suite: Suite, gpus: list[str] | None) -> None:
    """``--gpus`` places CUDA cells; a CPU suite has nothing to place (``RunnerError``, one line)."""
    if gpus and suite.spec.device_type != "cuda":
        raise RunnerError(f"--gpus runs CUDA cells side by side; suite {suite.name!r} runs on {suite.spec.device}")


def run_sweep(suite: Suite, cells: list[Cell], out_dir: str | Path, *, resume: bool = False,
              allow_mixed: bool = False,
              on_start: Callable[[Cell, int, int], None] | None = None,
              on_done: Callable[[CellOutcome], None] | None = None,
              tick: Callable[[], None] | None = None,
              plan: tuple[str, dict[str, Any] | None, set[str]] | None = None,
              stop_after_s: float | None = None, tune_cache: str | None = None,
              retry_failed: bool = False, threads: int | None = None,
              on_set_aside: Callable[[Path, Path, str], None] | None = None,
              gpus: list[str] | None = None, interleave: bool = False,
              cpus_per_cell: int = 0) -> tuple[str, list[CellOutcome]]:
    """Run ``cells`` (a selection of ``suite``) into ``out_dir``; the sweep goes on whatever a cell does.

    ``plan`` is ``plan_run``'s answer when the caller already asked (so the run id it showed is
    the one used); otherwise it is asked here. ``stop_after_s``: start no new cell once this many
    seconds have passed (a time-boxed machine); the cells left have no row, and ``--resume`` runs
    them later under the same run id. Outcomes are returned, in the cells' order, for the cells that
    ran or were done.
    ``tune_cache``: the cells' FORGE_TUNE_CACHE (``default_tune_cache``); None leaves it as inherited.
    ``retry_failed``: as ``plan_run``'s; a cell run again loses its old row first, so that the row
    read after its process is the new one. ``threads``: the CPU cells' torch threads (None: the
    suite's). Every row file that does not read is moved aside first (``results.set_aside``) and
    reported to ``on_set_aside(file, moved_to, why)``: its cell is not done and runs again.
    ``gpus``: run cells side by side on these GPUs (``forge_bench.lanes``); None: one at a time.
    ``interleave``: the cells of one group (``turn_groups``) not yet done run resident together, their
    timed repeats taking turns on one GPU (``run_group``); a group takes one lane of ``gpus``.
    ``cpus_per_cell``: on a CUDA suite, each lane's cells run their timed windows on that many CPUs of
    their own (``lanes.cpu_sets``; 0: wherever the OS puts them).
    """
    out_dir = Path(out_dir)
    check_gpus(suite, gpus)
    run_id, manifest, done = plan or plan_run(out_dir, suite, resume=resume, allow_mixed=allow_mixed,
                                              retry_failed=retry_failed)
    out_dir.mkdir(parents=True, exist_ok=True)
    if manifest is not None:
        _write_manifest(out_dir, manifest)
    for path, why in results.scan_rows(out_dir).unreadable.items():
        moved = results.set_aside(path)
        if on_set_aside:
            on_set_aside(path, moved, why)
    outcomes: dict[int, CellOutcome] = {}
    report_lock = threading.Lock()          # on_done and tick are called from the lanes' threads

    def finish(index: int, outcome: CellOutcome) -> None:
        with report_lock:
            outcomes[index] = outcome
            if on_done:
                on_done(outcome)

    pool = lanes.GpuPool(gpus) if gpus else None
    stop = threading.Event()
    on_cuda = suite.spec.device_type == "cuda"
    cpu_sets = lanes.cpu_sets(len(gpus) if gpus else 1, cpus_per_cell if on_cuda else 0)

    def pinned(lane: dict[str, str], first_gpu: str | None) -> dict[str, str]:
        if cpu_sets:        # a lane's CPUs follow its first GPU: its cells take turns or follow one another there
            cpus = cpu_sets[gpus.index(first_gpu) if gpus and first_gpu in gpus else 0]
            lane[lanes.CPUS] = ",".join(str(cpu) for cpu in cpus)
        return lane

    def lane_tick() -> None:
        if stop.is_set():
            raise RuntimeError("the sweep stopped")       # spawn_cell kills the cell's process group
        if tick:
            with report_lock:
                tick()

    def run_and_finish(unit: list[tuple[int, Cell]], lane: Mapping[str, str] | None) -> None:
        # (a unit of one cell, or of fewer than two that can run here, is run_one's: run_group hands it on)
        rows = run_group(suite, [cell for _, cell in unit], out_dir, run_id, lane_tick, tune_cache, threads, lane)
        for (index, cell), row in zip(unit, rows):
            finish(index, CellOutcome(cell, row.get("status", "?"), row))

    def run_in_lane(unit: list[tuple[int, Cell]], taken: list[str], beside: int) -> None:
        try:
            run_and_finish(unit, pinned(lanes.child_env(taken, beside), taken[0]))
        finally:
            pool.give_back(taken)

    started = time.monotonic()

    def over_time() -> bool:
        return stop_after_s is not None and time.monotonic() - started >= stop_after_s

    futures = []
    executor = ThreadPoolExecutor(max_workers=len(gpus)) if pool else None
    position = {id(cell): index for index, cell in enumerate(cells)}
    try:
        for group in (turn_groups(cells) if interleave else [[cell] for cell in cells]):
            unit = []
            for cell in group:
                index = position[id(cell)]
                if cell.cell_id in done:
                    kept = _load_row(out_dir, cell.cell_id) or {}
                    finish(index, CellOutcome(cell, kept.get("status", "?"), kept, skipped=True))
                else:
                    unit.append((index, cell))
            if not unit:
                continue
            if over_time():
                break
            if pool is not None:
                lane = pool.take(pool.share_of(unit[0][1].world_size), give_up=over_time)
                if lane is None:
                    break
                taken, beside = lane
                if over_time():
                    pool.give_back(taken)
                    break
            for index, cell in unit:
                if on_start:
                    with report_lock:
                        on_start(cell, index, len(cells))
                results.row_path(out_dir, cell.cell_id).unlink(missing_ok=True)   # a failed row --retry-failed replaces
            if pool is None:
                run_and_finish(unit, pinned({}, None))
            else:
                futures.append(executor.submit(run_in_lane, unit, taken, beside))
    except BaseException:
        stop.set()          # Ctrl-C or an error: the running cells are killed, nothing keeps running
        raise
    finally:
        if executor is not None:
            executor.shutdown(wait=True)
    for future in futures:
        future.result()     # a lane's unexpected error surfaces here, after every cell has ended
    return run_id, [outcomes[i] for i in sorted(outcomes)]


def default_tune_cache(out_dir: Path, option: str | None) -> str:
    """The cells' FORGE_TUNE_CACHE for a ``--tune-cache`` option: "off" -> "" (each cell tunes on its
    own); a path -> that file; unset -> an exported FORGE_TUNE_CACHE, else the results folder's file."""
    if option is not None:
        if option.strip().lower() == "off":
            return ""
        return str(Path(option).expanduser().resolve())
    inherited = os.environ.get(TUNE_CACHE_ENV)
    if inherited is not None:
        return inherited
    return str((Path(out_dir) / TUNE_CACHE_FILE).resolve())


# --- regression check against a committed baseline -------------------------------------------

# graph vs graph, eager vs eager; lean activations vs lean
CHECK_KEYS = ("device_name", "model", "batch", "seq", "dtype", "method", "timing_method", "activations")



TUNE_CACHE_MARK = " (tune cache)"      # forge_core.kernels.describe_tuned_configs' suffix


def _tiles(row: Mapping[str, Any]) -> dict[str, str]:
    """The fused kernel's tile per weight shape a row ran (``extra.kernel_configs``), without the
    tune-cache mark; empty when the row has none (a torch arm, an older row)."""
    extra = row.get("extra")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            return {}
    configs = extra.get("kernel_configs") if isinstance(extra, dict) else None
    if not isinstance(configs, dict):
        return {}
    return {shape: str(tile).removesuffix(TUNE_CACHE_MARK) for shape, tile in configs.items()}


def _tiles_unlike_baseline(row: Mapping[str, Any], baseline_row: Mapping[str, Any]) -> list[str]:
    """Weight shapes whose tile differs from the baseline row's. Why: a cell whose tune cache misses
    (a kernel change moves the cache's fingerprint) tunes again and may pick other tiles, and a
    --check then measures the tuner's choice against the baseline's."""
    now, then = _tiles(row), _tiles(baseline_row)
    return sorted(shape for shape, tile in now.items() if shape in then and then[shape] != tile)


def check_against_baseline(current, baseline, tolerance: float, families: tuple[str, ...] = ("forge",),
                           eager_tolerance: float | None = None) -> tuple[list[str], list[str]]:
    """Compare FORGE rows' median step time with a baseline's rows of the same device, model, shape,
    dtype, method, timing method (CUDA-graph replays only against replays) and activations. Returns (failures, notes); any failure means a regression (or a FORGE cell
    that does not measure), and having nothing to compare is a failure too.

    ``eager_tolerance`` (default: ``tolerance``) applies to rows not timed as graph replays: a small
    model's eager step is bound by the host's Python, whose speed moves from process to process
    (the same tree's Llama-3.2-1B eager FORGE step takes 91 and 115 ms in two processes of one
    H100 boot), while its graph replays repeat to 0.5%."""
    failures: list[str] = []
    notes: list[str] = []
    current, baseline = results.with_activations(current), results.with_activations(baseline)
    cur = current[current["method_family"].isin(families)]
    base = baseline[(baseline["method_family"].isin(families)) & (baseline["status"] == "ok")]
    compared = 0
    for _, row in cur.iterrows():
        label = f"{row['model']} b{row['batch']} s{row['seq']} {row['method']} ({row['timing_method']}) on {row['device_name']}"
        match = base
        for key in CHECK_KEYS:
            match = match[match[key] == row[key]]
        if match.empty:
            notes.append(f"{label}: no baseline row")
            continue
        ref_ms = float(match["step_ms_median"].median())
        if row["status"] != "ok":
            failures.append(f"{label}: status {row['status']} ({row['reason']}), baseline ran at {ref_ms:.2f} ms")
            compared += 1
            continue
        ms = float(row["step_ms_median"])
        change = ms / ref_ms - 1.0
        compared += 1
        line = f"{label}: {ms:.2f} ms vs baseline {ref_ms:.2f} ms ({change:+.1%})"
        allowed = tolerance if eager_tolerance is None or row["timing_method"] == "cuda_graph_replay" else eager_tolerance
        if change > allowed:
            failures.append(f"{line} > +{allowed:.0%}")
        else:
            notes.append(line)
        other_tiles = _tiles_unlike_baseline(row, match.iloc[0])
        if other_tiles:
            notes.append(f"{label}: other tiles than the baseline's for {', '.join(other_tiles)}: this compares "
                         f"tile choices, not only the code (hand the cells the baseline's tune_cache.json with "
                         f"--tune-cache, or re-baseline after a kernel change)")
    if compared == 0:
        devices = sorted(set(cur["device_name"].dropna()))
        failures.append(f"nothing to compare: the baseline has no ok FORGE rows matching device {devices} "
                        f"and these models/shapes/methods")
    return failures, notes
