"""Compiled twins of the arms: the same model and optimizer, the step's forward and loss under
``torch.compile``, as users compile them (torchtitan, Lightning, HF Trainer's ``torch_compile=True``).

Why twins rather than a grid option: a compiled arm is compared with the baseline compiled the same
way, in the same run, and its name says the mode in every table. ``MODES`` maps a twin's suffix to
the ``torch.compile`` mode: ``_compile`` (the default mode: Inductor, no CUDA graphs) and
``_compile_ro`` (``mode="reduce-overhead"``: Inductor's kernels replayed from CUDA graphs). The
backward runs as the compiler partitioned it; the optimizer's ``step()`` runs eagerly after it (a
FORGE arm's fused updates run inside the compiled backward, as registered operators:
``forge_core.traced``). The first steps compile; the cell reports that time as ``compile_s``, apart
from the step time (``forge_bench.cell``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import nn

from forge_bench.arm import Arm, TrainConfig

MODES: dict[str, str] = {"compile": "default", "compile_ro": "reduce-overhead"}
"""A compiled twin's name suffix -> its ``torch.compile`` mode."""


def graph_breaks() -> int:
    """Graph breaks Dynamo counted in this process so far (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


class CompiledArm:
    """An arm (``TorchArm`` / ``ForgeArm`` or a chunked-loss one) whose ``loss_of`` runs compiled.

    Under ``reduce-overhead`` each step begins a new CUDA-graph step
    (``torch.compiler.cudagraph_mark_step_begin``) and returns a copy of its loss: the graph's output
    buffer is overwritten by the next replay."""

    def __init__(self, inner: Any, mode: str) -> None:
        if not callable(getattr(inner, "loss_of", None)) or not callable(getattr(inner, "finish_step", None)):
            raise TypeError(f"{type(inner).__name__} has no loss_of / finish_step: it has no compiled twin")
        self.inner = inner
        self.mode = mode
        # Compiled code is cached per function and shared by every arm of the process: a cell's parity
        # gate compiles a twin on its smaller model first. Forget it, so this arm's first step compiles.
        torch._dynamo.reset()
        self.loss_of = torch.compile(inner.loss_of, mode=None if mode == "default" else mode)
        self.settings = inner.settings
        self.settings["compile_mode"] = mode
        self.n_fused_params = int(getattr(inner, "n_fused_params", 0) or 0)
        self._breaks_at_build = graph_breaks()

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        replays = self.mode == "reduce-overhead"
        if replays:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.loss_of(batch)
        loss.backward()
        self.finish_step()
        self.settings["graph_breaks"] = graph_breaks() - self._breaks_at_build
        return loss.detach().clone() if replays else loss.detach()

    def finish_step(self) -> None:
        """What follows the backward: the inner arm's optimizer step (eager, as torch.compile leaves it)."""
        self.inner.finish_step()

    @property
    def model(self) -> nn.Module:
        """The arm's model (eager: evaluation and checkpoints read it as it is)."""
        return self.inner.model

    @property
    def optimizer(self) -> Any:
        """The arm's optimizer (a training loop sets its lr, a checkpoint saves it)."""
        return self.inner.optimizer

    def memory_breakdown(self) -> Mapping[str, int]:
        return self.inner.memory_breakdown()


def compiled_builder(build: Callable[[nn.Module, TrainConfig], Arm], mode: str
                     ) -> Callable[[nn.Module, TrainConfig], CompiledArm]:
    """The builder of ``build``'s compiled twin in ``mode``."""
    def build_compiled(model: nn.Module, cfg: TrainConfig) -> CompiledArm:
        return CompiledArm(build(model, cfg), mode)
    return build_compiled


def compiled_twins(methods: tuple[Any, ...], names: tuple[str, ...]) -> tuple[Any, ...]:
    """A ``_compile`` and a ``_compile_ro`` twin of each method of ``methods`` named in ``names``."""
    twins = []
    for method in methods:
        if method.name not in names:
            continue
        for suffix, mode in MODES.items():
            twins.append(dataclasses.replace(
                method, name=f"{method.name}_{suffix}", build=compiled_builder(method.build, mode),
                description=f"{method.description}; forward and loss under torch.compile(mode={mode!r})",
                graphable=False, compile_mode=mode, settings={**dict(method.settings), "compile_mode": mode}))
    return tuple(twins)


__all__ = ["CompiledArm", "MODES", "compiled_builder", "compiled_twins", "graph_breaks"]
