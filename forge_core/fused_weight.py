"""``FusedWeight``: the binding a fused module's backward calls with (x, dY), and its row-block updates.

A binding exists before its optimizer (``fuse`` probes the model with it, counting calls) and is then
attached to a ``forge_core.optimizer.ForgeOptimizer``, which owns its state and applies every update:
the binding only routes a backward's (x, dY), whole or in row blocks, to that optimizer.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from . import kernels
from .dtensors import local_shard
from .overlap import run_update_outside_autograd
from .state import ParamState
from .update_graphs import UpdateGraphs


class UpdateOwner(Protocol):
    """What a binding calls on the optimizer it is attached to (``forge_core.optimizer.ForgeOptimizer``):
    a Protocol, so that this module does not import the optimizer that imports it."""

    def fused_backward(self, binding: "FusedWeight", x: torch.Tensor, grad_output: torch.Tensor) -> None: ...

    def begin_row_updates_of(self, binding: "FusedWeight", x: Optional[torch.Tensor]) -> Any: ...

    def apply_update(self, binding: "FusedWeight", x: torch.Tensor, grad_output: torch.Tensor,
                     part: Optional["RowPart"] = None, seed_offset: int = 0) -> None: ...

    def apply_grouped_update(self, binding: "FusedWeight", x: torch.Tensor, grad_output: torch.Tensor,
                             ends: torch.Tensor, rows_per_group: int) -> bool: ...


class FusedWeight:
    """One fused weight: what its ForgeLinear's (or ForgeConv1D's) backward calls with (x, dY).

    Created by ``fuse`` before the optimizer exists (the probe only counts calls), then attached
    to the ``ForgeOptimizer``, which allocates its state. ``weight`` is the module's ``.weight``
    unless given (a 3-D expert parameter: ``forge_core.experts.ExpertsWeight``)."""

    replayable = True
    """Whether a CUDA graph can replay this weight's updates (with device scalars: ``ForgeOptimizer``)."""

    def __init__(self, name: str, module: nn.Module, weight: Optional[nn.Parameter] = None) -> None:
        self.name = name
        self.module: Optional[nn.Module] = module
        self.weight: nn.Parameter = module.weight if weight is None else weight
        self.matrix: torch.Tensor = local_shard(self.weight)
        """The 2-D (rows, Din) tensor the kernel updates and the state mirrors: the weight itself (its local
        shard when a DTensor: tensor parallel), or a (E * Dout, Din) view of a 3-D expert weight's row blocks."""
        self.tile_config: Optional[kernels.TileConfig] = None
        """A tile every update of this weight runs on (no tuning), or None: tuned per call shape."""
        self.optimizer: Optional[UpdateOwner] = None
        self.group_index = 0
        self.index = 0
        self.state: Optional[ParamState] = None
        self.grad_accum: Optional[torch.Tensor] = None
        self.steps_done = 0
        """Optimizer steps in which this weight was updated; the next update uses steps_done + 1."""
        self.native_slot: Optional[Any] = None
        """Its C++ backward hook's side (``forge_core.native_hooks``), where its optimizer uses one: its recorded
        updates and the backward count, which the C++ hook advances when it replays."""
        self._micro_batches = 0
        self.probing = False
        self.probe_backward_calls = 0
        self.overlap_updates = False
        """Run this weight's updates on the side stream (``forge_core.overlap``); set by ``fuse``."""
        self.update_graphs: Optional[UpdateGraphs] = None
        """Its eager updates' recorded CUDA graphs, where its optimizer replays them (``forge_core.update_graphs``);
        a ``tile_config`` set after an update was recorded reaches only the launched updates."""
        self._row_parts: dict[tuple[int, int], RowPart] = {}

    @property
    def micro_batches(self) -> int:
        """Backward passes seen since the last ``opt.step()``."""
        return self._micro_batches if self.native_slot is None else self.native_slot.count

    @micro_batches.setter
    def micro_batches(self, value: int) -> None:
        if self.native_slot is None:
            self._micro_batches = value
        else:
            self.native_slot.count = value

    def begin_probe(self) -> None:
        self.probing, self.probe_backward_calls = True, 0

    def end_probe(self) -> None:
        self.probing = False

    def detach_from_module(self) -> None:
        self.module = None

    def rows_left_out(self) -> list[tuple[int, int]]:
        """Row blocks of ``matrix`` the step's backward did not update, which ``opt.step()`` must
        update with a zero gradient (experts no token reached); none for a Linear weight."""
        return []

    def end_step(self) -> None:
        """Called by ``opt.step()`` after the step's updates: forget what this step updated."""

    def __call__(self, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        if self.probing:
            self.probe_backward_calls += 1
            return
        if self.optimizer is None:
            raise RuntimeError(f"fused weight {self.name!r} has no ForgeOptimizer attached")
        self.optimizer.fused_backward(self, x, grad_output)

    def begin_row_updates(self, x: Optional[torch.Tensor]) -> "RowSliceUpdate":
        """Start one backward whose ``dY`` arrives in row blocks (vocab chunks of an LM head, or
        the experts of a 3-D expert weight).

        Counts as ONE use of the weight (one micro-batch), however many blocks follow; call the
        returned object once per block with ``(r0, r1, dy_rows, block_index)``, and ``x=`` the
        block's own inputs when ``x`` is None here."""
        if self.probing:
            self.probe_backward_calls += 1
            return RowSliceUpdate(self, x, mode="skip")
        if self.optimizer is None:
            raise RuntimeError(f"fused weight {self.name!r} has no ForgeOptimizer attached")
        return self.optimizer.begin_row_updates_of(self, x)

    def row_part(self, r0: int, r1: int) -> "RowPart":
        """Views of rows ``[r0, r1)`` of the state (and accumulator), built once per block and kept: the
        kernel caches its launch plan per ParamState (load_state_dict copies in place, views stay valid)."""
        part = self._row_parts.get((r0, r1))
        if part is None or part.parent_state is not self.state or part.parent_accum is not self.grad_accum:
            if self.state is None:
                raise RuntimeError(f"fused weight {self.name!r} has no optimizer state yet")
            accum = self.grad_accum[r0:r1] if self.grad_accum is not None else None
            part = RowPart(r0, r1, self.state.rows(r0, r1), accum, self.state, self.grad_accum)
            self._row_parts[(r0, r1)] = part
        return part

    def __repr__(self) -> str:
        return f"FusedWeight({self.name!r}, shape={tuple(self.weight.shape)}, steps={self.steps_done})"


def weakly_bound_update(binding: FusedWeight) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``binding``'s update run outside autograd (``run_update_outside_autograd``) for its C++ hook's slot,
    holding ``binding`` weakly: the slot is the binding's own, and a strong reference back would make a
    cycle through C++ that Python's garbage collector cannot see (the optimizer and its states would leak)."""
    reference = weakref.ref(binding)

    def update(first: torch.Tensor, second: torch.Tensor) -> None:
        target = reference()
        if target is None:
            raise RuntimeError("a fused weight's backward ran after its FusedWeight was deleted")
        run_update_outside_autograd(target, first, second)
    return update


@dataclasses.dataclass
class RowPart:
    """Rows ``[r0, r1)`` of one fused weight's state and accumulator (views), and what they view."""
    r0: int
    r1: int
    state: ParamState
    grad_accum: Optional[torch.Tensor]
    parent_state: Optional[ParamState]
    parent_accum: Optional[torch.Tensor]


# Mixes the block index into the stochastic-rounding seed: blocks of one step get distinct seeds
# (each kernel numbers its elements from 0, so equal seeds would repeat the noise block to block).
BLOCK_SEED_STRIDE = 0x9E3779B1


class RowSliceUpdate:
    """One backward's update of a fused weight, applied one row block at a time.

    Why: an LM head's dlogits arrive vocab chunk by chunk, each freed before the next exists, so its
    rows are updated as soon as it exists. ``mode``: "update" (the last micro-batch: the fused step on
    the rows, with the accumulator's rows), "accumulate" (add dy_rows^T x into the accumulator rows)
    or "skip" (the fuse-time probe)."""

    def __init__(self, binding: FusedWeight, x: Optional[torch.Tensor], mode: str) -> None:
        self.binding = binding
        self.x = x
        self.mode = mode
        self._x32: Optional[torch.Tensor] = None

    def __call__(self, r0: int, r1: int, dy_rows: torch.Tensor, block_index: int = 0,
                 x: Optional[torch.Tensor] = None) -> None:
        """Update (or accumulate) rows ``[r0, r1)`` from ``dy_rows``; ``x``: this block's own
        inputs when its tokens differ from the other blocks' (an expert's routed tokens), else the
        ``x`` the update began with."""
        if self.mode == "skip":
            return
        binding = self.binding
        part = binding.row_part(int(r0), int(r1))
        if dy_rows.shape[-1] != part.r1 - part.r0:
            raise ValueError(f"dy_rows has {dy_rows.shape[-1]} columns for rows [{r0}, {r1}) of {binding.name!r}")
        with torch.no_grad():
            if self.mode == "accumulate":
                if x is not None:
                    x32 = x.reshape(-1, x.shape[-1]).float()
                else:
                    if self._x32 is None:
                        self._x32 = self.x.reshape(-1, self.x.shape[-1]).float()
                    x32 = self._x32
                part.grad_accum.addmm_(dy_rows.reshape(-1, dy_rows.shape[-1]).t().float(), x32)
                return
            binding.optimizer.apply_update(binding, self.x if x is None else x, dy_rows, part=part,
                                            seed_offset=int(block_index) * BLOCK_SEED_STRIDE)


__all__ = ["FusedWeight", "RowPart", "RowSliceUpdate", "UpdateOwner", "BLOCK_SEED_STRIDE", "weakly_bound_update"]
