"""``forge-bench convergence --gpus 0,1,...``: a study's runs side by side, one process per run and GPU.

Why: a convergence study is arms x seeds runs of the same small model (15 by default), each using a
fraction of one GPU's time for its whole length; one after the other they take the study's wall
time times the number of runs. Here each unfinished run is a ``forge-bench convergence`` process
of its own (the same settings, one arm, one seed), started on a free GPU of ``gpus`` as soon as one
is free (``lanes.GpuPool``, so sweeps and studies of one host never share a GPU), with its output in
``OUT/logs/<arm>_seed<seed>.log``. Each writes its own row and checkpoint as a run in one process
does, so a study stopped part-way continues, with or without ``--gpus``, from the same files.

A small model leaves most of a large GPU idle (GPT-2 124M at 16 x 512 bytes: an eager step is
bound by the host's launches), so ``runs_per_gpu`` lets up to that many runs share each GPU
(``GpuShares``): a run takes an unused GPU before it doubles up on a used one.
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
    """One run of the study in its own process: where its output goes and how it ended."""
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


class GpuShares:
    """Up to ``per_gpu`` runs at a time on each GPU of ``gpus``. A GPU is claimed from the host's
    other sweeps and studies (``lanes.GpuPool``) while at least one run is on it, and given back when
    its last run ends; ``take`` prefers an unused GPU, then the least used one with room."""

    def __init__(self, gpus: list[str], per_gpu: int = 1):
        if per_gpu < 1:
            raise ValueError(f"runs per GPU must be at least 1, got {per_gpu}")
        self.pool = lanes.GpuPool(gpus)
        self.per_gpu = per_gpu
        self.load: dict[str, int] = {}
        self.running = 0
        self._changed = threading.Condition()

    def take(self) -> tuple[str, int]:
        """A GPU for one run and how many of this study's runs are running already (blocks until one has room)."""
        with self._changed:
            while True:
                fresh = self.pool.take(1, give_up=lambda: True)
                room = [gpu for gpu, runs in self.load.items() if runs < self.per_gpu]
                gpu = fresh[0][0] if fresh else (min(room, key=self.load.__getitem__) if room else None)
                if gpu is not None:
                    beside, self.running = self.running, self.running + 1
                    self.load[gpu] = self.load.get(gpu, 0) + 1
                    return gpu, beside
                self._changed.wait(timeout=0.5)

    def give_back(self, gpu: str) -> None:
        with self._changed:
            self.load[gpu] -= 1
            self.running -= 1
            if not self.load[gpu]:
                del self.load[gpu]
                self.pool.give_back([gpu])
            self._changed.notify_all()


def run_side_by_side(out: Path, runs: list[tuple[str, int]], options: list[str], gpus: list[str],
                     on_poll: Callable[[], None] = lambda: None, runs_per_gpu: int = 1) -> list[LaneRun]:
    """Run every (arm, seed) of ``runs`` in a process of its own on one GPU of ``gpus``, up to
    ``runs_per_gpu`` on each GPU at a time; ``on_poll()`` every ``POLL_S`` while they run (the
    caller's progress). Returns each run with its exit status; a run that fails does not stop the others."""
    shares = GpuShares(gpus, runs_per_gpu)
    queue = [LaneRun(arm, seed, log_path(out, arm, seed)) for arm, seed in runs]
    pending = list(queue)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                run = pending.pop(0)
            gpu, beside = shares.take()
            run.gpus = gpu
            run.log.parent.mkdir(parents=True, exist_ok=True)
            try:
                with run.log.open("ab") as log:
                    log.write(f"# GPU {run.gpus}, {beside} run(s) beside\n".encode())
                    log.flush()
                    run.returncode = subprocess.call(child_command(out, run.arm, run.seed, options), stdout=log,
                                                     stderr=subprocess.STDOUT, env={**os.environ,
                                                     **lanes.child_env([gpu], beside), PARENT_PID: str(os.getpid())})
            finally:
                shares.give_back(gpu)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(len(gpus) * runs_per_gpu, len(queue)))]
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


__all__ = ["GpuShares", "LaneRun", "PARENT_PID", "POLL_S", "child_command", "failure_line", "log_path", "run_side_by_side"]
