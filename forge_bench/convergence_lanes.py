"""``forge-bench convergence --gpus 0,1,...``: a study's runs side by side, one process per run and GPU.

Why: a convergence study is arms x seeds runs of the same small model (15 by default), each using a
fraction of one GPU's time for its whole length; one after the other they take the study's wall
time times the number of runs. Here each unfinished run is a ``forge-bench convergence`` process
of its own (the same settings, one arm, one seed), started on a free GPU of ``gpus`` as soon as one
is free (``lanes.GpuPool``, so sweeps and studies of one host never share a GPU), with its output in
``OUT/logs/<arm>_seed<seed>.log`` of its folder (a study's repeat runs into a folder of its own).
Each writes its own row and checkpoint as a run in one process does, so a study stopped part-way
continues, with or without ``--gpus``, from the same files.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from forge_bench import lanes

POLL_S = 2.0
"""How often the study's progress is read back from its rows (written at every checkpoint)."""
PARENT_PID = "FORGE_BENCH_STUDY_PID"
"""Set for a run's process: the study's pid, which the run dies with (``lanes.die_with_parent``), so
that a study killed and started again never finds a run of its own still writing its files."""


@dataclass
class LaneRun:
    """One run of the study in its own process: its folder, where its output goes and how it ended."""
    out: Path
    arm: str
    seed: int
    log: Path
    gpus: str = ""
    returncode: Optional[int] = None


def log_path(out: Path, arm: str, seed: int) -> Path:
    return out / "logs" / f"{arm}_seed{seed}.log"


def child_command(out: Path, arm: str, seed: int, options: list[str]) -> list[str]:
    """The ``forge-bench convergence`` command of one run: ``options`` are the study's settings."""
    return [sys.executable, "-m", "forge_bench.cli", "convergence", "--out", str(out), "--arms", arm,
            "--seeds", str(seed), *options]


def run_side_by_side(runs: list[tuple[Path, str, int]], options: list[str], gpus: list[str],
                     on_poll: Callable[[], None] = lambda: None) -> list[LaneRun]:
    """Run every (folder, arm, seed) of ``runs``, in order, in a process of its own on one GPU of
    ``gpus``, as many at a time as there are GPUs; ``on_poll()`` every ``POLL_S`` while they run (the
    caller's progress). Returns each run with its exit status; a run that fails does not stop the others."""
    pool = lanes.GpuPool(gpus)
    queue = [LaneRun(out, arm, seed, log_path(out, arm, seed)) for out, arm, seed in runs]
    pending = list(queue)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                run = pending.pop(0)
            taken = pool.take(1)
            if taken is None:                   # pragma: no cover - take only gives up when asked to
                return
            gpu_list, beside = taken
            run.gpus = ",".join(gpu_list)
            run.log.parent.mkdir(parents=True, exist_ok=True)
            try:
                with run.log.open("ab") as log:
                    log.write(f"# GPU {run.gpus}, {beside} run(s) beside\n".encode())
                    log.flush()
                    run.returncode = subprocess.call(child_command(run.out, run.arm, run.seed, options), stdout=log,
                                                     stderr=subprocess.STDOUT, env={**os.environ,
                                                     **lanes.child_env(gpu_list, beside), PARENT_PID: str(os.getpid())})
            finally:
                pool.give_back(gpu_list)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(len(gpus), len(queue)))]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        on_poll()
        for thread in threads:
            thread.join(timeout=POLL_S / len(threads))
    on_poll()
    return queue


def failure_line(run: LaneRun) -> str:
    """One line for a run whose process failed: its status and the last line of its log that says
    something (an error box's border does not)."""
    lines = run.log.read_text(errors="replace").splitlines() if run.log.exists() else []
    worded = [line.strip(" │╭╮╰╯─") for line in lines if any(c.isalnum() for c in line)]
    last = worded[-1] if worded else "no output"
    return f"{run.arm} seed {run.seed} (GPU {run.gpus}) exited {run.returncode}: {last} (log {run.log})"


__all__ = ["LaneRun", "PARENT_PID", "POLL_S", "child_command", "failure_line", "log_path", "run_side_by_side"]
