"""What a ``ForgeOptimizer`` does for its fused modules' compiled path (``forge_core.traced``): the bodies of
the update operators, run on the tensors the compiled graph hands them, and the switch to device scalars
that a replayed CUDA graph needs. A mixin of ``ForgeOptimizer`` (``forge_core.optimizer``), which owns the
state it reads (bindings, dense weights, device step counts and scalars) and the eager update path it calls.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, ContextManager, Iterator, Optional

import torch

from .dense import DenseWeight
from .fused_weight import FusedWeight
from .rules.base import check_scalar_count
from .state import ParamState
from .state_arena import inside, view_in
from .traced import graph_capturing, keep_static, remember_traced_arguments, same_tensors, written_tensors


def write_scalars(target: torch.Tensor, rule_name: str, values: tuple[float, ...]) -> None:
    """Write a rule's host-computed kernel scalars into the first ``len(values)`` elements of ``target`` with one
    copy queued on the current stream: a CUDA target's from a pinned tensor, which torch's caching host allocator
    keeps until the copy has run."""
    check_scalar_count(rule_name, len(values))
    source = torch.tensor(values, dtype=target.dtype)
    if target.is_cuda:
        source = source.pin_memory()
    target[:len(values)].copy_(source, non_blocking=True)


def _update_target(owner: Any) -> torch.Tensor:
    """The tensor a traced operator names as what an update of ``owner`` writes: a fused weight's matrix (a
    3-D expert weight whole: its matrix is a view of it), a dense weight's Parameter."""
    if isinstance(owner, FusedWeight):
        return owner.weight if owner.weight.dim() == 3 else owner.matrix
    return owner.weight


def _state_on(state: ParamState, arenas: tuple[torch.Tensor, ...], given_arenas: list[torch.Tensor],
              others: Iterator[torch.Tensor]) -> ParamState:
    """``state`` over the tensors a traced operator was given instead of its own (what an update of copies
    runs on): a tensor of the state arena's buffer ``arenas[i]`` at its place in ``given_arenas[i]``, any
    other the next of ``others`` (``traced.written_tensors``' order)."""
    def given(tensor: torch.Tensor) -> torch.Tensor:
        index = inside(tensor, arenas)
        return next(others) if index is None else view_in(tensor, arenas[index], given_arenas[index])

    view = copy.copy(state)
    view.values = {}
    view.scales = {}
    for name in state.state_names:
        view.values[name] = given(state.values[name])
        scale = state.scales.get(name)
        view.scales[name] = given(scale) if scale is not None else None
    if state.layer_sums is not None:
        view.layer_sums = given(state.layer_sums)
    return view


class TracedUpdates:
    """The compiled path's side of a ``ForgeOptimizer`` (a mixin: every attribute it reads is the optimizer's)."""

    def prepare_for_compiler(self) -> None:
        """Give each fused and kernel-stepped weight its traced arguments (``remember_traced_arguments``) and
        mark every tensor a traced update writes, and the device scalars, as static for the compiler
        (``traced.keep_static``); ``fuse`` calls it once the states are final, a data-parallel wrap again."""
        tensors = [*self._device_steps, *self._device_scalars]
        for owner in (*self._bindings, *self._dense):
            remember_traced_arguments(owner)
            tensors.extend(written_tensors(owner))
        keep_static(tensors)

    def device_scalars_of(self, owner: "FusedWeight | DenseWeight") -> Optional[torch.Tensor]:
        """The device scalars buffer ``owner``'s updates read once device mode is on, or None where this
        optimizer has none (``device_scalars_problem``)."""
        return self._device_scalars[owner.group_index] if self._device_scalars else None

    def enter_device_mode(self) -> None:
        """From now on every update reads the step count and kernel scalars from device tensors, as
        capturable=True does: a traced update calls this at its first run (outside any CUDA graph capture),
        so a graph recorded later replays correct updates. A no-op where ``device_scalars_problem`` is set
        (the updates keep their host scalars; a capture of them is refused by ``traced_update``)."""
        if self._device_mode or not self._device_steps:
            return
        self.device_steps_from_host()
        self._device_mode = True

    def device_steps_from_host(self) -> None:
        """Set each group's device step count from its weights' host counts (``_group_step_count``), its
        scalars to be rewritten: entering device mode, and ``load_state_dict`` in it."""
        for group, count in enumerate(self._device_steps):
            steps = self._group_step_count(group)
            count.fill_(float(steps))
            self._device_steps_on_host[group] = None if graph_capturing() else steps
            self._scalars_stale[group] = True

    def advance_device_steps(self) -> None:
        """``step()`` in device mode: each group's device step count advanced, and its scalars written for the
        next backward (outside the graph it may replay). A step captured into a CUDA graph advances the counts
        at every replay, which the host does not see: from then on the scalars are computed on the device."""
        capturing = graph_capturing() or torch.compiler.is_compiling()
        for group, count in enumerate(self._device_steps):
            count.add_(1.0)
            known = self._device_steps_on_host[group]
            self._device_steps_on_host[group] = None if capturing or known is None else known + 1
            self._write_device_scalars(group)

    def _write_device_scalars(self, group: int, buffer: Optional[torch.Tensor] = None) -> None:
        """The group's kernel scalars for step (device count + 1) in its device buffer (``buffer``: there instead,
        an update of copies, ``traced_update``). Where the host knows the count and no CUDA graph is being
        captured, ``rule.kernel_scalars`` computes them on the host (the values a launched update passes its
        kernel) and one copy writes them all; else device ops compute them (a fill per float, a copy per
        tensor), so that a captured graph recomputes them at every replay. Why both: the device ops are ~12
        kernels a group, ~400 us of an H200 host's ``step()`` for AdamW, where the step's host time is the
        step's time (a compiled Llama-3.2-1B)."""
        if self.rule.kernel_scalars_on_device is None:       # a per-layer rule reads the device step itself
            return
        hyperparameters = self._kernel_hyperparameters(group)
        target = self._device_scalars[group] if buffer is None else buffer
        known = self._device_steps_on_host[group]
        if known is not None and not graph_capturing():
            write_scalars(target, self.rule.name, self.rule.kernel_scalars(hyperparameters, known + 1))
        else:
            values = self.rule.kernel_scalars_on_device(hyperparameters, self._device_steps[group] + 1)
            check_scalar_count(self.rule.name, len(values))
            for index, value in enumerate(values):
                if isinstance(value, torch.Tensor):
                    target[index].copy_(value)
                else:
                    target[index].fill_(float(value))   # a kernel argument: no host-to-device copy to capture
        if buffer is None:
            self._scalars_stale[group] = False
            self._scalars_written_from[group] = hyperparameters

    def _keep_device_scalars_current(self, group: int, *, on_change_only: bool = False) -> None:
        """Rewrite the group's device scalars when a step made them stale or (outside a CUDA graph capture)
        when its hyper-parameters changed since they were written: a scheduler's lr reaches the next
        update, and a graph recorded after that reads it at every replay. Inside a capture nothing but a
        stale buffer is written: a recorded fill would put back the recorded lr at every replay."""
        stale = self._scalars_stale[group] and not on_change_only
        if not stale and graph_capturing():
            return
        self._rewrite_changed_device_scalars(group, stale)

    def _rewrite_changed_device_scalars(self, group: int, stale: bool) -> None:
        """``_keep_device_scalars_current`` for a caller that knows no capture is running (it checked)."""
        written_from = self._scalars_written_from[group]
        if stale or written_from is None or written_from != self._kernel_hyperparameters(group):
            self._write_device_scalars(group)

    def _group_step_count(self, group: int) -> int:
        """The one step count of the group's fused and kernel-stepped weights (device mode keeps one)."""
        steps = {b.steps_done for b in self._bindings if b.group_index == group}
        steps |= {d.steps_done for d in self._dense if d.group_index == group and d.steps_done}
        if len(steps) > 1:
            raise ValueError(f"device scalars keep one step count per param group, but the fused weights of group "
                             f"{group} were updated {sorted(steps)} times")
        return steps.pop() if steps else 0

    def prepare_traced_update(self, owner: "FusedWeight | DenseWeight") -> None:
        """Device mode for a traced update of ``owner``, and a one-line refusal of what a CUDA graph could not
        replay."""
        if not graph_capturing():
            if not self._device_mode:
                self.enter_device_mode()
            return
        what = repr(owner.name)
        if not self._device_mode:
            problem = self.device_scalars_problem or "the updates have not run once before the capture"
            raise RuntimeError(f"a CUDA graph (torch.compile mode='reduce-overhead', or a capture) cannot replay "
                               f"FORGE's update of {what}: {problem}")
        if self.distributed is not None:
            raise RuntimeError(f"a CUDA graph cannot replay the data-parallel update of {what} (its bucket "
                               "all-reduce is scheduled by the host); compile without mode='reduce-overhead'")

    def updating_on(self, owner: "FusedWeight | DenseWeight", weight: torch.Tensor, written: list[torch.Tensor],
                    scalars: Optional[torch.Tensor]) -> ContextManager[None]:
        """Run ``owner``'s updates inside this block on the tensors a traced operator was given: its own
        (the compiler re-inplaced the operator: nothing to do, no generator-based context manager on the path a
        compiled backward takes once per fused layer), or copies of them (``aot_eager``'s functionalization,
        ``torch.library.opcheck``), which the update then writes instead (``_updating_on_copies``)."""
        if self.given_own_tensors(owner, weight, written, scalars):
            return contextlib.nullcontext()
        return self._updating_on_copies(owner, weight, written, scalars)

    def given_own_tensors(self, owner: "FusedWeight | DenseWeight", weight: torch.Tensor, written: list[torch.Tensor],
                          scalars: Optional[torch.Tensor]) -> bool:
        """Whether a traced operator was given ``owner``'s own tensors (the compiler re-inplaced it), not copies."""
        own_scalars = self.device_scalars_of(owner)
        return same_tensors([weight, *written], [_update_target(owner), *written_tensors(owner)]) and (
            scalars is None or own_scalars is None or same_tensors([scalars], [own_scalars]))

    @contextlib.contextmanager
    def _updating_on_copies(self, owner: "FusedWeight | DenseWeight", weight: torch.Tensor,
                            written: list[torch.Tensor], scalars: Optional[torch.Tensor]) -> Iterator[None]:
        """``owner``'s weight, state, accumulator, slot table and scalars buffer swapped for the copies a traced
        operator was given while the block runs; the compiler copies them back where they were the owner's."""
        own_scalars = self.device_scalars_of(owner)
        own_written = written_tensors(owner)
        arenas = tuple(getattr(owner, "state_arenas", ()))
        target = "matrix" if isinstance(owner, FusedWeight) else "weight"
        extras = [name for name in ("grad_accum", "slots") if getattr(owner, name, None) is not None]
        kept = (target, "state", *extras, *(("state_arenas",) if arenas else ()))
        saved = {name: getattr(owner, name) for name in kept}
        setattr(owner, target, weight if weight.dim() == 2 else weight.detach().view(-1, weight.shape[-1]))
        owner.state = _state_on(owner.state, arenas, written[:len(arenas)], iter(written[len(arenas):]))
        for name, tensor in zip(extras, written[len(own_written) - len(extras):]):
            setattr(owner, name, tensor)
        if arenas:
            owner.state_arenas = tuple(written[:len(arenas)])
        self._scalars_override = scalars if scalars is not None and own_scalars is not None else None
        self._updating_copies = True        # no recorded update replays (it holds the owner's addresses)
        try:
            yield
        finally:
            self._updating_copies = False
            self._scalars_override = None
            for name, value in saved.items():
                setattr(owner, name, value)

    def traced_update(self, binding: FusedWeight, x: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor,
                      written: list[torch.Tensor], scalars: Optional[torch.Tensor]) -> None:
        """The body of ``forge::update_weight_`` (``forge_core.traced``): the backward's update of ``binding``,
        with no side stream, in device mode, on the tensors the operator was given (``updating_on``)."""
        self.prepare_traced_update(binding)
        with self.updating_on(binding, weight, written, scalars):
            self.fused_backward(binding, x, grad_output)

    def traced_row_update(self, dense: DenseWeight, ids: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor,
                          written: list[torch.Tensor], scalars: Optional[torch.Tensor]) -> None:
        """The body of ``forge::update_embedding_rows_``: record this backward's rows and, with one micro-batch
        per step, step the embedding now (``step()`` then finds nothing left to step for it)."""
        self.prepare_traced_update(dense)
        with self.updating_on(dense, weight, written, scalars):
            dense.record_rows(ids, grad_output)
            if self.accumulate_steps == 1:
                self._step_dense(dense)


__all__ = ["TracedUpdates", "write_scalars"]
