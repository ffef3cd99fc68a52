"""The recorded side of a ``ForgeOptimizer``: its eager updates replayed from CUDA graphs of themselves
(``forge_core.update_graphs``) and handed to the C++ hooks (``forge_core.native_hooks``), which replay them
without Python. A mixin of ``ForgeOptimizer`` (``forge_core.optimizer``), which owns what it reads: the
bindings, dense weights, device scalars and the launched update it falls back to.

Why: an eager (or compiled, not CUDA-graphed) step at batch 1 is bound by the host, and each launch from
Python costs it tens of microseconds where a graph launch costs a few (D108-D110).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import native_hooks
from .dense import DenseWeight
from .fused_weight import FusedWeight, weakly_bound_update
from .state import ParamState
from .traced import graph_capturing, run_traced_update, written_tensors
from .update_graphs import UpdateGraphs


class ReplayedUpdates:
    """The recorded updates of a ``ForgeOptimizer`` (a mixin: every attribute it reads is the optimizer's)."""

    def attach_native_hooks(self) -> bool:
        """Give every fused weight with recorded updates the C++ backward hook (``forge_core.native_hooks``),
        which replays them without Python; False (the Python hook stays) where the extension is unavailable."""
        gate = native_hooks.new_gate()
        if gate is None:
            return False
        self._native_gate = gate
        for binding in self._bindings:
            if binding.update_graphs is not None:
                count = binding.micro_batches
                binding.native_slot = native_hooks.new_slot(gate, binding.matrix, weakly_bound_update(binding))
                binding.native_slot.count = count
                binding.update_graphs.use_native(binding.native_slot)
                native_hooks.name_slot(binding.trace_key, binding.native_slot)
        native_hooks.serve_traced_updates({b.weight.device for b in self._bindings}, run_traced_update)
        return True

    def _open_native_gate(self) -> None:
        """Let the C++ hooks replay the rest of this step's recorded updates: every group's device scalars are
        brought up to date first (a Python update does this once a step; ``step()`` closes the gate again)."""
        gate = self._native_gate
        if gate is None or gate.open:
            return
        for group in range(len(self._device_scalars)):
            self._rewrite_changed_device_scalars(group, self._scalars_stale[group])
        gate.open = True

    def _close_native_gate(self) -> None:
        if self._native_gate is not None:
            self._native_gate.open = False

    def _forget_update_graphs(self) -> None:
        """Drop every recorded update (``forge_core.update_graphs``) and fallback step (``forge_core.fallback_graphs``):
        their weights or states changed."""
        self._close_native_gate()
        for owner in (*self._bindings, *self._dense):
            if owner.update_graphs is not None:
                owner.update_graphs.clear()
        if self._fallback_graphs is not None:
            self._fallback_graphs.clear()

    def _replayed_update(self, graphs: UpdateGraphs, binding: FusedWeight, x: torch.Tensor,
                         grad_output: torch.Tensor) -> bool:
        """``binding``'s update replayed from its recorded graph, or recorded now and replayed when its inputs
        lie where they lay at its previous update (``forge_core.update_graphs``); False where it must be
        launched: fp32 inputs (their plan follows the TF32 switch), the side stream, a traced update on copies
        of the weight's tensors, a graph capture around it, or device mode out of reach (the weights' step counts
        differ). The C++ hooks are handed the recording and may replay the step's later updates."""
        if binding.overlap_updates:
            return False
        return self._replayed(graphs, binding, binding.matrix, x, grad_output,
                              lambda *inputs: self.apply_update(binding, *inputs), hooked=True)

    def _replayed(self, graphs: UpdateGraphs, owner: "FusedWeight | DenseWeight", weight: torch.Tensor,
                  x: torch.Tensor, grad_output: torch.Tensor, update: Callable[[torch.Tensor, torch.Tensor], None],
                  hooked: bool) -> bool:
        """``_replayed_update`` of ``owner``'s ``update(x, grad_output)`` writing ``weight``; ``hooked``: a fused
        weight, whose recordings the C++ hooks replay too."""
        if x.dtype == torch.float32 or self._updating_copies or graph_capturing():
            return False
        key = graphs.key(x, grad_output, weight)
        group = owner.group_index
        if key in graphs.graphs:                    # not capturing (checked above): no second check per layer
            self._rewrite_changed_device_scalars(group, self._scalars_stale[group])
            if hooked:
                self._open_native_gate()
                self._list_natively(graphs, key, owner, x, grad_output)   # (a no-op once listed)
            return graphs.replay(key, x, grad_output)
        if not graphs.wants_recording(key):
            return False
        if not self._device_mode:
            try:
                self.enter_device_mode()
            except ValueError:                      # one step count per group is what device mode keeps
                graphs.stopped = True
                return False
        # before the recording (a recorded write would put these values back at every replay)
        self._rewrite_changed_device_scalars(group, self._scalars_stale[group])
        if not graphs.record_and_replay(key, update, x, grad_output):
            return False
        if hooked:
            self._list_natively(graphs, key, owner, x, grad_output)
            self._open_native_gate()
        return True

    def _list_natively(self, graphs: UpdateGraphs, key: tuple, binding: FusedWeight, x: torch.Tensor,
                       grad_output: torch.Tensor) -> None:
        """Hand a recording the C++ hook has not seen to it, with the tensors it writes and reads (what a compiled
        backward's operator call must hand it for a replay)."""
        graphs.list_natively(key, x, grad_output, written_tensors(binding), self.device_scalars_of(binding))

    def _launch_dense_update(self, dense: DenseWeight, x: torch.Tensor, grad_output: torch.Tensor,
                             weight: torch.Tensor, state: ParamState, grad: Optional[torch.Tensor]) -> None:
        """A dense weight's step from its whole gradient (``grad``, as the kernel's accumulator input), replayed
        from a recording of itself where the gradient lies where it lay (``_replayed``): a tied embedding's
        launch from Python costs an H200 host ~300 us of a step that is the host's (a compiled Llama-3.2-1B)."""
        graphs = dense.update_graphs
        if graphs is not None and grad is not None and weight is dense.weight and self._replayed(
                graphs, dense, weight, grad, grad_output,
                lambda given, _: self._launch_update(dense, x, grad_output, weight, state, given), hooked=False):
            return
        self._launch_update(dense, x, grad_output, weight, state, grad)


__all__ = ["ReplayedUpdates"]
