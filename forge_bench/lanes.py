"""Cells side by side on disjoint GPUs of one host (``forge-bench sweep --gpus 0,1,2,3``).

Why: a one-GPU cell of an 8B model leaves the other GPUs of a 4- or 8-GPU host idle for its whole
life (process start, model build, tuning, the timed steps), and a grid of such cells is most of a
benchmark's wall time. With ``--gpus``, each cell still runs in a process (tree) of its own, with
``CUDA_VISIBLE_DEVICES`` set to the GPUs it was given: a cell of world size N takes N of them,
and cells start in the suite's order as soon as enough are free (a wider cell waits for the
narrower ones started before it, so no cell overtakes one listed earlier).

Several sweeps on one host (say one per suite, each with ``--gpus 0,1,2,3``) share the GPUs: a
cell claims each GPU it takes with an exclusive lock on a file of the GPU's name in
``FORGE_BENCH_GPU_LOCK_DIR`` (default ``<temp dir>/forge-bench-gpus``), held until it ends, so no
two sweeps' cells run on one GPU and no GPU idles while another sweep has cells waiting. (A GPU
named by index in one sweep and by UUID in another is not recognised as the same.)

What side by side shares: the host's CPU cores, memory bandwidth and PCIe root, not a GPU. Each
row records the GPUs it ran on and how many other cells were running when it started, its own
sweep's and, one per GPU of its pool they hold, other sweeps' (``extra.gpus``,
``extra.cells_beside``), so that a reader can keep a ratio's cells under the same setting. This
module imports neither torch nor Triton: the sweep process stays light.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no claims across processes, only within the sweep
    fcntl = None

VISIBLE = "CUDA_VISIBLE_DEVICES"
ORDER = "CUDA_DEVICE_ORDER"
CELLS_BESIDE = "FORGE_BENCH_CELLS_BESIDE"
"""Set by the sweep for a cell started beside others: how many were running at its start."""
LOCK_DIR = "FORGE_BENCH_GPU_LOCK_DIR"
"""Where the sweeps of one host claim GPUs (one lock file per GPU name)."""
CPUS = "FORGE_BENCH_CPUS"
"""Set by the sweep for a CUDA cell: the CPUs (comma-separated) its timed window runs on (``pin_threads``)."""
CPUS_PER_CELL = 2
"""``sweep --cpus-per-cell``'s default: the main thread and autograd's device thread, which take turns."""


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


class GpuClaims:
    """Exclusive locks on GPU names, shared by every sweep process of the host (``LOCK_DIR``)."""

    def __init__(self, lock_dir: Optional[str] = None):
        self.lock_dir = lock_dir or os.environ.get(LOCK_DIR) or os.path.join(tempfile.gettempdir(), "forge-bench-gpus")
        self._held: dict[str, int] = {}

    def _path(self, gpu: str) -> str:
        return os.path.join(self.lock_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", gpu) + ".lock")

    def claim(self, gpu: str) -> bool:
        """Lock ``gpu`` for this process; False when another sweep holds it."""
        if fcntl is None:
            return True
        os.makedirs(self.lock_dir, exist_ok=True)
        fd = os.open(self._path(gpu), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[gpu] = fd
        return True

    def release(self, gpu: str) -> None:
        fd = self._held.pop(gpu, None)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def held_elsewhere(self, gpus: list[str]) -> int:
        """How many of ``gpus`` (none held here) another sweep holds now (a claim tried and let go)."""
        busy = 0
        for gpu in gpus:
            if self.claim(gpu):
                self.release(gpu)
            else:
                busy += 1
        return busy


class GpuPool:
    """The free GPUs; ``take`` blocks until a cell's share is free here and unclaimed by any other
    sweep of the host (``GpuClaims``), ``give_back`` returns it."""

    def __init__(self, gpus: list[str], claims: Optional[GpuClaims] = None):
        self.gpus = list(gpus)
        self._free = list(gpus)
        self._running = 0
        self._changed = threading.Condition()
        self._claims = claims or GpuClaims()

    def share_of(self, world_size: int) -> int:
        """GPUs a cell of this world size takes: its world size, or every GPU when it needs more
        than the pool has (its own availability check then says what it lacks)."""
        return max(1, min(int(world_size or 1), len(self.gpus)))

    def take(self, count: int, give_up: Callable[[], bool] = lambda: False) -> Optional[tuple[list[str], int]]:
        """``count`` free GPUs (lowest first) and how many cells were running beside (this sweep's,
        and one per GPU of the pool another sweep holds); None once ``give_up()`` while waiting. The
        wait wakes twice a second, so that Ctrl-C reaches the sweep's thread while it waits."""
        with self._changed:
            while True:
                claimed: list[str] = []
                for gpu in [g for g in self.gpus if g in self._free]:
                    if len(claimed) == count:
                        break
                    if self._claims.claim(gpu):
                        claimed.append(gpu)
                if len(claimed) == count:
                    for gpu in claimed:
                        self._free.remove(gpu)
                    elsewhere = self._claims.held_elsewhere(list(self._free))
                    beside = self._running + elsewhere
                    self._running += 1
                    return claimed, beside
                for gpu in claimed:
                    self._claims.release(gpu)
                if give_up():
                    return None
                self._changed.wait(timeout=0.5)

    def give_back(self, gpus: list[str]) -> None:
        with self._changed:
            for gpu in gpus:
                self._claims.release(gpu)
            self._free.extend(gpus)
            self._running -= 1
            self._changed.notify_all()


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the sweep (or convergence study) that spawned it dies
    (``kill -9`` of the parent must not leave a cell or run going on the GPU, nor writing files a
    resumed parent starts again); elsewhere a watchdog thread does it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except Exception:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:           # the parent died before prctl took effect
        os._exit(1)


def child_env(gpus: list[str], beside: int) -> dict[str, str]:
    """The environment a cell started on ``gpus`` gets on top of the sweep's: the GPUs numbered as
    nvidia-smi and NVML number them (PCI bus order; CUDA's default order may differ), so that the
    cell's telemetry reads the GPUs it runs on (``telemetry.nvml_handle``)."""
    return {VISIBLE: ",".join(gpus), ORDER: "PCI_BUS_ID", CELLS_BESIDE: str(beside)}


def cpu_sets(lanes: int, per_cell: int, available: Optional[list[int]] = None) -> list[list[int]]:
    """The CPUs each of ``lanes`` lanes (one sweep: one lane; ``--gpus``: one per GPU) runs its cells'
    timed windows on: ``per_cell`` of the sweep's own CPUs each, disjoint, the highest-numbered first (the
    lowest keep the sweep and the system); [] (no pinning) for ``per_cell`` 0, or when that would leave
    fewer than one CPU over.

    Why: a virtual machine's CPUs do not run alike (on one H200 boot, GPT-2 XL's eager pair taking turns
    read 0.83x, 1.15x and 0.84x unpinned, and 1.11x, 1.21x and 1.09x with both processes on the same
    two CPUs: each process keeps to the CPU it first landed on, and an eager batch-1 step is the host's
    time). Cells whose times are compared must run on the same CPUs (D114)."""
    if per_cell <= 0 or lanes <= 0:
        return []
    if available is None:
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    available = sorted(available)
    if len(available) < lanes * per_cell + 1:
        return []
    return [available[len(available) - (lane + 1) * per_cell:len(available) - lane * per_cell]
            for lane in range(lanes)]


def pin_threads(cpus: list[int]) -> list[int]:
    """Move every thread of this process (the main one, autograd's, the CUDA driver's, torch's pool)
    onto ``cpus``; threads started later inherit it from the thread that starts them. Returns the CPUs,
    or [] where this OS has no per-thread affinity. Called just before a cell's timed window, so the
    build, the compiles and the warm-up keep every CPU."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return []
    try:
        threads = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return []                       # no per-thread listing here: the window runs unpinned
    every = os.sched_getaffinity(0)
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cpus)
        except ProcessLookupError:
            continue                    # a thread that ended while the list was read
        except OSError as exc:          # CPUs outside this process's cpuset (a container changed it)
            warnings.warn(f"timed window left unpinned: CPUs {','.join(map(str, cpus))} refused ({exc})",
                          stacklevel=2)
            for undo in threads:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(undo, every)
            return []
    return list(cpus)


def cpus_from_env() -> list[int]:
    """The CPUs the sweep gave this cell (``CPUS``); [] when it gave none."""
    text = os.environ.get(CPUS, "").strip()
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise LaneError(f"{CPUS}={text!r}: expected comma-separated CPU numbers, e.g. 14,15") from None


def lane_extra() -> dict[str, Any]:
    """What a cell process records of its lane (nothing when it ran alone, the default sweep)."""
    if CELLS_BESIDE not in os.environ:
        return {}
    return {"gpus": os.environ.get(VISIBLE, ""), "cells_beside": int(os.environ[CELLS_BESIDE])}
