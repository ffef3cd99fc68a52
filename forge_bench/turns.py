"""Cells that take turns on one GPU (``forge-bench sweep --interleave``): the timed window, and the pipes
through which the sweep hands the GPU from one cell's process to the next between repeats.

Why: an eager or compiled step at batch 1 is mostly the host's time, and a host's speed moves 10-50%
from one minute to the next (on one H200 boot, the same Qwen3-0.6B AdamW step took 110 to 245 ms in
windows seconds apart). Two cells run one after the other each see a different stretch of that drift,
and their ratio is the drift's as much as the methods'. With ``--interleave`` the cells of one
model and shape (one *group*: same grid, model, batch, seq, dtype and activations) are all resident at
once, each still in a process of its own (its own allocator peak, compile cache and CUDA context), and
their timed repeats alternate: A's repeat 1, B's repeat 1, A's repeat 2, ... A process waiting for
its turn is blocked on a pipe read, so the one whose turn it is has the GPU and the host to itself.
Model builds, warm-ups and compiles also run one process at a time (a cell says it is ready only
once its warm-up is over), so first-step and compile seconds are each cell's own.

The cell's end (``TurnGate``) is two inherited file descriptors named by ``TURN_FDS_ENV``: before
each repeat it writes ``READY`` and blocks until it reads ``GO``; after the repeat (synchronized) it
writes ``DONE``. The sweep's end is ``TurnPipe``. A cell that does not fit beside the others (an
out-of-memory error or prediction while others are resident) exits for a retry alone
(``cell.EXIT_OOM_RETRY``), and its row says so. Each row of a group records its turn windows and
the other cells (``extra.turns``). This module imports neither torch nor Triton at import time.
"""
from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass, field
from typing import Any, Callable

TURN_FDS_ENV = "FORGE_BENCH_TURN_FDS"
"""``"<read fd>,<write fd>"``: the cell's ends of its two pipes to the sweep (set by the sweep only)."""
TURN_PEERS_ENV = "FORGE_BENCH_TURN_PEERS"
"""The cell ids of the other cells of the group, comma-separated (what ``extra.turns`` records)."""
READY, GO, DONE = b"r", b"g", b"d"


class TurnGate:
    """The cell process's end: ``wait_turn`` before a repeat, ``end_turn`` after it."""

    def __init__(self, read_fd: int, write_fd: int, peers: list[str]) -> None:
        self.read_fd, self.write_fd, self.peers = read_fd, write_fd, peers
        self.windows: list[tuple[float, float]] = []      # wall-clock (time.time) start and end of each turn
        self._started: float | None = None

    @classmethod
    def from_env(cls) -> "TurnGate | None":
        """The gate the sweep set up for this process, or None when the cell runs alone."""
        text = os.environ.get(TURN_FDS_ENV, "").strip()
        if not text:
            return None
        try:
            read_fd, write_fd = (int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"{TURN_FDS_ENV}={text!r}: expected '<read fd>,<write fd>'") from None
        peers = [p for p in os.environ.get(TURN_PEERS_ENV, "").split(",") if p]
        return cls(read_fd, write_fd, peers)

    def wait_turn(self) -> None:
        """Say this cell is ready and block until the sweep gives it the GPU."""
        os.write(self.write_fd, READY)
        got = os.read(self.read_fd, 1)
        if got != GO:
            raise RuntimeError(f"the sweep closed this cell's turn pipe (read {got!r}, expected {GO!r})")
        self._started = time.time()

    def end_turn(self) -> None:
        """Hand the GPU back (call after the repeat's work has synchronized)."""
        if self._started is not None:
            self.windows.append((self._started, time.time()))
            self._started = None
        os.write(self.write_fd, DONE)

    def extra(self) -> dict[str, Any]:
        """What the row records: the group's other cells and this cell's turn windows (epoch seconds)."""
        return {"peers": self.peers, "windows": [[round(a, 3), round(b, 3)] for a, b in self.windows]}


class TurnPipe:
    """The sweep's end of one cell's pipes: ``child_fds`` go to the cell process (``pass_fds``);
    ``until`` reads the cell's next token, ``give`` sends it ``GO``."""

    def __init__(self) -> None:
        self._to_child_r, self._to_child_w = os.pipe()
        self._from_child_r, self._from_child_w = os.pipe()

    @property
    def child_fds(self) -> tuple[int, int]:
        return self._to_child_r, self._from_child_w

    def child_env(self, peers: list[str]) -> dict[str, str]:
        read_fd, write_fd = self.child_fds
        return {TURN_FDS_ENV: f"{read_fd},{write_fd}", TURN_PEERS_ENV: ",".join(peers)}

    def close_child_ends(self) -> None:
        """After the cell process started (it holds its own copies): its exit then reads as EOF here."""
        for fd in self.child_fds:
            os.close(fd)

    def until(self, token: bytes, alive: Callable[[], bool], tick: Callable[[], None] | None = None) -> bool:
        """Block until the cell writes ``token`` (True), or its pipe closes or ``alive`` turns False
        (False: the process ended or was killed). ``tick`` runs every quarter second (it may raise)."""
        while True:
            readable, _, _ = select.select([self._from_child_r], [], [], 0.25)
            if readable:
                got = os.read(self._from_child_r, 1)
                if not got:
                    return False
                if got == token:
                    return True
                raise RuntimeError(f"unexpected turn token {got!r} (waiting for {token!r})")
            if tick:
                tick()
            if not alive():
                return False

    def give(self) -> bool:
        """Send ``GO``; False when the cell process has already closed its end (it died after ``READY``)."""
        try:
            os.write(self._to_child_w, GO)
        except BrokenPipeError:
            return False
        return True

    def close(self) -> None:
        for fd in (self._to_child_w, self._from_child_r):
            try:
                os.close(fd)
            except OSError:
                pass


# --- the timed window (the cell's side) ------------------------------------------------------

@dataclass
class Window:
    """What the timed repeats measured: per-repeat step times (ms), host return times, the losses."""
    run_ms: list[list[float]] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    steps: int = 0
    energy_j: float | None = None        # summed over the cell's own turns (gated CUDA cells only)
    seconds: float = 0.0                 # the wall time of the repeats (own turns only when gated)


def timed_repeats(step: Callable[[Any], Any], batches: list, repeats: int, timed_steps: int, on_cuda: bool,
                  gate: TurnGate | None = None, energy: Callable[[], float] | None = None) -> Window:
    """``repeats`` x ``timed_steps`` steps over ``batches`` in turn: CUDA events on a GPU (the host's
    return time beside them), the wall clock on a CPU. With a ``gate``, each repeat waits for the
    cell's turn and hands the GPU back after it has synchronized; ``energy`` (joules, the board's
    counter) is then read around each turn and summed, so the row's energy is this cell's own."""
    import torch

    window = Window()
    if energy is not None:
        window.energy_j = 0.0
    for _ in range(repeats):
        if gate is not None:
            gate.wait_turn()
        joules = energy() if energy is not None else 0.0
        began = time.perf_counter()
        if on_cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(timed_steps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(timed_steps)]
            for i in range(timed_steps):
                t0 = time.perf_counter()
                starts[i].record()
                window.losses.append(step(batches[window.steps % len(batches)]))
                ends[i].record()
                window.host_ms.append((time.perf_counter() - t0) * 1000.0)
                window.steps += 1
            torch.cuda.synchronize()
            window.run_ms.append([s.elapsed_time(e) for s, e in zip(starts, ends)])
        else:
            times = []
            for _ in range(timed_steps):
                t0 = time.perf_counter()
                window.losses.append(step(batches[window.steps % len(batches)]))
                times.append((time.perf_counter() - t0) * 1000.0)
                window.steps += 1
            window.run_ms.append(times)
        window.seconds += time.perf_counter() - began
        if energy is not None:
            window.energy_j += energy() - joules
        if gate is not None:
            gate.end_turn()
    return window
