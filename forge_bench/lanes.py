"""Cells side by side on disjoint GPUs of one host (``forge-bench sweep --gpus 0,1,2,3``).

Why: a one-GPU cell of an 8B model leaves the other GPUs of a 4- or 8-GPU host idle for its whole
life (process start, model build, tuning, the timed steps), and a grid of such cells is most of a
benchmark's wall time. With ``--gpus``, each cell still runs in a process (tree) of its own, with
``CUDA_VISIBLE_DEVICES`` set to the GPUs it was given: a cell of world size N takes N of them,
and cells start in the suite's order as soon as enough are free (a wider cell waits for the
narrower ones started before it, so no cell overtakes one listed earlier).

What side by side shares: the host's CPU cores, memory bandwidth and PCIe root, not a GPU. Each
row records the GPUs it ran on and how many other cells were running when it started
(``extra.gpus``, ``extra.cells_beside``), so that a reader can keep a ratio's cells under the
same setting. This module imports neither torch nor Triton: the sweep process stays light.
"""
from __future__ import annotations

import os
import threading
from typing import Any

VISIBLE = "CUDA_VISIBLE_DEVICES"
ORDER = "CUDA_DEVICE_ORDER"
CELLS_BESIDE = "FORGE_BENCH_CELLS_BESIDE"
"""Set by the sweep for a cell started beside others: how many were running at its start."""


class LaneError(ValueError):
    """A ``--gpus`` value the sweep cannot use (message names it)."""


def parse_gpus(text: str) -> list[str]:
    """``"0,1,2,3"`` -> ["0", "1", "2", "3"]: GPU indices (or UUIDs) as CUDA_VISIBLE_DEVICES takes them."""
    gpus = [part.strip() for part in text.split(",") if part.strip()]
    if not gpus:
        raise LaneError(f"--gpus {text!r}: name at least one GPU, e.g. --gpus 0,1,2,3")
    repeated = sorted({g for g in gpus if gpus.count(g) > 1})
    if repeated:
        raise LaneError(f"--gpus {text!r}: GPU {', '.join(repeated)} named more than once")
    return gpus


class GpuPool:
    """The free GPUs; ``take`` blocks until a cell's share is free, ``give_back`` returns it."""

    def __init__(self, gpus: list[str]):
        self.gpus = list(gpus)
        self._free = list(gpus)
        self._running = 0
        self._changed = threading.Condition()

    def share_of(self, world_size: int) -> int:
        """GPUs a cell of this world size takes: its world size, or every GPU when it needs more
        than the pool has (its own availability check then says what it lacks)."""
        return max(1, min(int(world_size or 1), len(self.gpus)))

    def take(self, count: int) -> tuple[list[str], int]:
        """``count`` free GPUs (lowest first) and how many cells were running before this one. The
        wait wakes twice a second, so that Ctrl-C reaches the sweep's thread while it waits."""
        with self._changed:
            while len(self._free) < count:
                self._changed.wait(timeout=0.5)
            taken = [g for g in self.gpus if g in self._free][:count]
            for gpu in taken:
                self._free.remove(gpu)
            beside = self._running
            self._running += 1
            return taken, beside

    def give_back(self, gpus: list[str]) -> None:
        with self._changed:
            self._free.extend(gpus)
            self._running -= 1
            self._changed.notify_all()


def child_env(gpus: list[str], beside: int) -> dict[str, str]:
    """The environment a cell started on ``gpus`` gets on top of the sweep's: the GPUs numbered as
    nvidia-smi and NVML number them (PCI bus order; CUDA's default order may differ), so that the
    cell's telemetry reads the GPUs it runs on (``telemetry.nvml_handle``)."""
    return {VISIBLE: ",".join(gpus), ORDER: "PCI_BUS_ID", CELLS_BESIDE: str(beside)}


def lane_extra() -> dict[str, Any]:
    """What a cell process records of its lane (nothing when it ran alone, the default sweep)."""
    if CELLS_BESIDE not in os.environ:
        return {}
    return {"gpus": os.environ.get(VISIBLE, ""), "cells_beside": int(os.environ[CELLS_BESIDE])}
