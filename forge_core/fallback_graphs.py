"""torch's fused Adam / AdamW over the parameters FORGE does not fuse (norm weights, biases), replayed from CUDA
graphs of its own step (``FORGE_UPDATE_GRAPHS=0`` turns it off with the fused weights' recordings).

Why: where a step's time is the host's (a compiled Llama-3.2-1B at batch 1), torch's step over the 33 norm weights
costs the H200's host ~0.45 ms of per-parameter Python (``_init_group``, the grouping by device and dtype, the
launches); a graph replay costs it a few microseconds.

What makes a replay the same step: where the gradients lie (the key; a parameter without one is part of it), the
states (made by the launched steps before any recording, and kept in place by torch), and the numbers torch hands
its kernel (betas, eps, weight decay, amsgrad, maximize: a change forgets every recording). The learning rate is not
one of them: every step this module serves (launched or replayed) reads it from a float32 device tensor, as torch's
fused kernels accept, written when the group's lr changes, so a schedule reaches a replay and a launched step and a
replay of the same step are the same arithmetic. Outside those steps the groups hold their own float lr: nothing a
state dict or a scheduler sees changes. A step inside a CUDA graph capture or under the compiler is left to torch.
"""
from __future__ import annotations

import collections
from typing import Any, Optional

import torch

from .dtensors import is_dtensor
from .traced import graph_capturing
from .update_graphs import GRAPHS_PER_WEIGHT, RECENT_PLACEMENTS, RECORDINGS_WITHOUT_REPLAY, UPDATE_GRAPHS, Recorder, \
    Replay, record_cuda_graph

_REPLAYABLE = (torch.optim.Adam, torch.optim.AdamW)


def fallback_graphs_problem(optimizer: torch.optim.Optimizer, enabled: bool = UPDATE_GRAPHS) -> Optional[str]:
    """Why ``optimizer``'s steps cannot be replayed from recordings, in one line; None when they can."""
    if not enabled:
        return "FORGE_UPDATE_GRAPHS=0"
    if type(optimizer) not in _REPLAYABLE:
        return f"{type(optimizer).__name__} is not torch's Adam or AdamW"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return "no parameters"
    if not all(group.get("fused") for group in optimizer.param_groups):
        return "not torch's fused implementation (fused=True)"
    if any(group.get("differentiable") or isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
        return "a differentiable step or a tensor lr of the caller's"
    if any(is_dtensor(p) for p in params):
        return "sharded parameters (a step of their local shards and a collective)"
    if len({p.device for p in params}) != 1 or params[0].device.type != "cuda":
        return "CUDA graphs need every parameter on one CUDA device"
    return None


class FallbackGraphs:
    """The recorded steps of one torch fused Adam / AdamW (see the module docstring); ``step()`` runs it."""

    def __init__(self, optimizer: torch.optim.Optimizer, recorder: Recorder = record_cuda_graph) -> None:
        self.optimizer = optimizer
        self.recorder = recorder
        device = optimizer.param_groups[0]["params"][0].device
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        self._lrs_written: list[Optional[float]] = [None] * len(self.lrs)
        self.graphs: dict[tuple, Replay] = {}
        self.recent_keys: collections.deque[tuple] = collections.deque(maxlen=RECENT_PLACEMENTS)
        self.recordings_unreplayed = 0
        self.stopped = False
        self.replays = 0
        self._numbers: Optional[tuple] = None

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> Optional["FallbackGraphs"]:
        """The recordings of ``optimizer``'s steps, or None where they cannot be (``fallback_graphs_problem``)."""
        return None if fallback_graphs_problem(optimizer) is not None else cls(optimizer)

    def step(self) -> bool:
        """One step of the optimizer, replayed where a recording of its gradients' placement exists, recorded where
        the placement came back, launched otherwise; False (nothing run) inside a capture or the compiler, where
        the caller runs torch's own step."""
        if torch.compiler.is_compiling() or graph_capturing():
            return False
        groups = self.optimizer.param_groups
        numbers = tuple(tuple(sorted((k, v) for k, v in group.items() if k not in ("params", "lr"))) for group in groups)
        if any(isinstance(v, torch.Tensor) for group in numbers for _, v in group) or any(
                isinstance(group["lr"], torch.Tensor) for group in groups):
            return False                # a tensor hyper-parameter of the caller's: torch's own step reads it
        if numbers != self._numbers:
            self.clear()
            self._numbers = numbers
        self._write_lrs()
        key = tuple(p.grad.data_ptr() if p.grad is not None else 0 for group in groups for p in group["params"])
        graph = self.graphs.get(key)
        if graph is not None:
            self.recordings_unreplayed = 0
        elif self._wants_recording(key):
            graph = self._record(key)
        if graph is None:
            self._with_device_lrs(self.optimizer.step)
            return True
        graph.replay()
        self.replays += 1
        return True

    def _wants_recording(self, key: tuple) -> bool:
        """Record a placement seen at one of the last launched steps, once every parameter with a gradient has its
        states (a recording that made them would zero them at every replay)."""
        if self.stopped:
            return False
        if key not in self.recent_keys:
            self.recent_keys.append(key)
            return False
        state = self.optimizer.state
        return all(p in state for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None)

    def _record(self, key: tuple) -> Optional[Replay]:
        device = self.lrs[0].device
        graph = self._with_device_lrs(lambda: self.recorder(self.optimizer.step, device), capturing=True)
        if graph is None:
            self.stopped = True
            return None
        self.recordings_unreplayed += 1
        if self.recordings_unreplayed > RECORDINGS_WITHOUT_REPLAY:
            self.stopped = True
        if len(self.graphs) >= GRAPHS_PER_WEIGHT:
            del self.graphs[next(iter(self.graphs))]
        self.graphs[key] = graph
        return graph

    def _write_lrs(self) -> None:
        """Each group's lr into its device tensor where it changed (queued before the step that reads it)."""
        for index, group in enumerate(self.optimizer.param_groups):
            lr = float(group["lr"])
            if self._lrs_written[index] != lr:
                self.lrs[index].fill_(lr)
                self._lrs_written[index] = lr

    def _with_device_lrs(self, run: Any, capturing: bool = False) -> Any:
        """``run()`` with every group reading its lr tensor (and, ``capturing``, marked capturable, as torch's capture
        check asks: its fused step is the same either way), the groups' own values back after."""
        groups = self.optimizer.param_groups
        saved = [(group["lr"], group["capturable"]) for group in groups]
        for group, lr in zip(groups, self.lrs):
            group["lr"] = lr
            group["capturable"] = group["capturable"] or capturing
        try:
            return run()
        finally:
            for group, (lr, capturable) in zip(groups, saved):
                group["lr"], group["capturable"] = lr, capturable

    def clear(self) -> None:
        """Forget every recording (the states were replaced, or a number the kernel takes changed)."""
        self.graphs.clear()
        self.recent_keys.clear()
        self.recordings_unreplayed = 0
        self.stopped = False


__all__ = ["FallbackGraphs", "fallback_graphs_problem"]
