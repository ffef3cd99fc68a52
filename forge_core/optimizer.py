"""``ForgeOptimizer``: the torch.optim.Optimizer that ``forge_core.fuse`` returns.

It holds every trainable parameter of the model in ``param_groups`` (so LR schedulers and code
that edits ``group["lr"]`` work unchanged) and splits them in two:

* *fused* weights: a ``FusedWeight`` binding each (its ``ParamState``, step count and, with
  ``accumulate_steps > 1``, an fp32 gradient accumulator). The binding is what a ForgeLinear's
  backward calls; it reads the group's hyper-parameters at that moment, so an ``lr`` change
  reaches the next fused update.
* *fallback* parameters (biases, norms, embeddings, tied / excluded weights), stepped in ``step()``
  from their ``.grad``: the 2-D ones (a ``DenseWeight`` each) by the same kernel with zero tokens and
  the gradient as its accumulator input (same ``state_dtype``, moments streamed once), the rest by
  the rule's torch optimizer, whose param_groups are synced from ours first (``dense_2d=False``:
  every fallback parameter by the torch optimizer).

Step count: each fused weight counts the optimizer steps in which it was updated (as torch counts
per parameter); the update during the backward of step t uses t, and ``step()`` advances it.

Row blocks (``FusedWeight.begin_row_updates``): a backward may hand over ``dY`` in blocks of output
features (the vocab chunks of ``forge_core.chunked_lm_head_cross_entropy``); each updates rows
``[r0, r1)`` through views of the weight, its ``ParamState`` and its accumulator. Such a backward is
one use of the weight: the step and micro-batch counts move once, however many blocks it has.

Capturable mode (``fuse(..., capturable=True)``): each group's step count lives in a float64 GPU
tensor that ``step()`` advances with a device op, and the rule's kernel scalars are computed from it
into a device buffer the group's fused kernels read, so forward + backward + ``step()`` can be
captured in a CUDA graph and replayed (a float ``lr`` read at capture is fixed in it, as in torch).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from . import kernels
from .backends import BACKENDS, capturable_problem, check_capturable, resolve_backend
from .backward_update import BackwardUpdateOptimizer
from .dense import DenseWeight, no_tokens, step_dense, steppable_by_kernel
from .fallback_graphs import FallbackGraphs
from .fused_weight import BLOCK_SEED_STRIDE, FusedWeight, RowPart, RowSliceUpdate
from . import native_hooks
from .layer_step import MATRIX_KERNELS, LayerPath, takes_layer_path
from .reduction import DistributedUpdates, RowBlockUpdate
from .rules.base import KERNEL_SCALARS, Rule
from .state import ParamState, restore_entry, saved_entry
from .state_arena import StateArena
from .replayed_updates import ReplayedUpdates
from .traced import state_tensors, trace_key
from .traced_updates import TracedUpdates
from .update_graphs import UPDATE_GRAPHS, UpdateGraphs, replay_problem

GUARD_GROUP_KEY = "forge_state_dict"
"""The key of the last entry of a ``ForgeOptimizer.state_dict()``'s ``param_groups``: a group that lists
one index past the last parameter. Why: torch's ``Optimizer.load_state_dict`` checks only the number
of groups and each group's length before it copies ``state`` into its moments, so without it an
``AdamW`` over the same parameters would take int8 codes and block scales as moments and train on
silently; the group sizes of any optimizer over those parameters add up to one less than these.
``ForgeOptimizer.load_state_dict`` drops the group (and loads a state dict without one)."""
GUARD_GROUP_NOTE = ("a ForgeOptimizer state dict: this group's index names no parameter; it makes other "
                    "optimizers refuse the dict (load it with ForgeOptimizer.load_state_dict)")

UNFUSED_ERROR = ("this ForgeOptimizer's model was unfused (forge_core.unfuse){detail}: its fused weights are "
                 "plain weights again and it cannot step them; call forge_core.fuse(model, ...) again for a new "
                 "optimizer, or use a torch optimizer")
"""``step()``'s error after ``unfuse``; ``detail`` names a fused weight that has grown a ``.grad``."""


def _scalar_hyperparameter(value: Any) -> Any:
    """Kernels take Python scalars: a one-element tensor lr (allowed by torch) becomes a float."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ForgeOptimizer(ReplayedUpdates, TracedUpdates, BackwardUpdateOptimizer):
    """A torch optimizer whose Linear-weight updates happen inside backward (see module docstring).

    Built by ``forge_core.fuse``; not meant to be constructed directly."""

    ADD_PARAM_GROUP_REFUSAL = ("ForgeOptimizer decides fused vs fallback parameters at fuse() time; "
                               "add_param_group is not supported (fuse the model again instead)")

    def __init__(self, params: list[nn.Parameter], bindings: list[FusedWeight], *, rule: Rule,
                 hyperparameters: Mapping[str, Any], state_dtype: str, stochastic_rounding: bool,
                 accumulate_steps: int, backend: str, excluded: Mapping[str, str],
                 model_parameters: list[nn.Parameter], fused_ids: set[int], capturable: bool = False,
                 dense_2d: bool = True, parameter_names: Optional[Mapping[int, str]] = None) -> None:
        if capturable:
            check_capturable(rule, backend, accumulate_steps, stochastic_rounding, bindings)
        super().__init__(params, rule=rule, hyperparameters=hyperparameters, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, accumulate_steps=accumulate_steps, backend=backend)
        self.excluded_modules: dict[str, str] = dict(excluded)
        """Linear-like modules left unfused: qualified name -> reason."""
        self._model_parameters = model_parameters
        self._bindings = bindings
        self._layer_path = LayerPath(rule, state_dtype, hyperparameters, accumulate_steps, lambda b: (
            self._kernel_hyperparameters(b.group_index),
            self._device_steps[b.group_index] + 1 if self._device_mode else b.steps_done + 1)) \
            if takes_layer_path(rule) else None
        # Every fused weight's states in one buffer per device and dtype (forge_core.state_arena, D117).
        arena = StateArena(request for binding in bindings for request in ParamState.storage_requests(
            binding.matrix, rule, state_dtype, hyperparameters)) if self._layer_path is None else None
        for index, binding in enumerate(bindings):
            binding.optimizer = self
            binding.index = index
            binding.group_index = 0
            if arena is None:
                self._layer_path.attach(binding)
                continue
            binding.state = ParamState(binding.matrix, rule, state_dtype, hyperparameters, allocate=arena.allocate)
            binding.state_arenas = arena.holding(state_tensors(binding))
            if self.accumulate_steps > 1:
                binding.grad_accum = torch.zeros(binding.matrix.shape, dtype=torch.float32, device=binding.weight.device)
        self._fallback_params = [p for p in params if id(p) not in fused_ids]
        names = dict(parameter_names or {})
        self._dense: list[DenseWeight] = []
        if dense_2d:
            for parameter in self._fallback_params:
                if steppable_by_kernel(parameter, rule, backend):
                    dense = DenseWeight(names.get(id(parameter), f"parameter {len(self._dense)}"), parameter)
                    dense.index = len(bindings) + len(self._dense)      # distinct stochastic-rounding seeds
                    dense.state = ParamState(parameter, rule, state_dtype, hyperparameters)
                    dense.optimizer = self
                    self._dense.append(dense)
        for owner in (*bindings, *self._dense):
            trace_key(owner)            # the constant a compiled graph names it by (forge_core.traced)
        dense_ids = {id(dense.weight) for dense in self._dense}
        self._torch_params = [p for p in self._fallback_params if id(p) not in dense_ids]
        self.capturable = bool(capturable)
        fallback_groups = [{"params": list(self._torch_params)}]
        if rule.forge_fallback is not None:
            self._fallback = rule.forge_fallback(fallback_groups, capturable=self.capturable,
                                                 matrix_kernels=MATRIX_KERNELS, **hyperparameters)
        else:
            self._fallback = rule.fallback_optimizer(fallback_groups, capturable=self.capturable, **hyperparameters)
        self._fallback_graphs = FallbackGraphs.for_optimizer(self._fallback)
        self._steps_taken = 0
        self.distributed: Optional[DistributedUpdates] = None   # data parallel: forge_core.reduction
        self._unfused = False
        self._hyperparameters_in_backward: dict[int, tuple[int, dict[str, Any]]] = {}
        # Per group, the step count and kernel scalars on the device, whether to recompute them and the
        # hyper-parameters they were computed from. Allocated wherever the updates could read them (a few
        # bytes); read once ``_device_mode`` is on: capturable=True, or after a traced update.
        self._device_steps: list[torch.Tensor] = []
        self._device_steps_on_host: list[Optional[int]] = []   # what each holds, where the host knows it
        self._device_scalars: list[torch.Tensor] = []
        self._scalars_stale: list[bool] = []
        self._scalars_written_from: list[Optional[dict[str, Any]]] = []
        self.device_scalars_problem: Optional[str] = capturable_problem(
            rule, backend, accumulate_steps, stochastic_rounding, bindings)
        """Why this optimizer's updates cannot read their scalars from the device (a CUDA graph could not
        replay them), or None."""
        if self.device_scalars_problem is None and (bindings or self._dense):
            device = (bindings[0].weight if bindings else self._dense[0].weight).device
            for _ in self.param_groups:
                self._device_steps.append(torch.zeros((), dtype=torch.float64, device=device))
                self._device_steps_on_host.append(0)
                self._device_scalars.append(torch.zeros(KERNEL_SCALARS, dtype=torch.float32, device=device))
                self._scalars_stale.append(True)
                self._scalars_written_from.append(None)
        self._device_mode = self.capturable and bool(self._device_steps)
        self._scalars_override: Optional[torch.Tensor] = None
        self._updating_copies = False       # a traced update runs on copies of its owner's tensors (updating_on)
        devices = {b.weight.device for b in bindings}
        self.update_replay_problem: Optional[str] = "the rule steps whole layers (forge_core.layer_step)" \
            if self._layer_path is not None else replay_problem(UPDATE_GRAPHS, backend, self.device_scalars_problem,
                                                                devices)
        """Why this optimizer's eager updates do not replay recorded CUDA graphs (``forge_core.update_graphs``),
        or None when a fused weight's update is recorded once its inputs' placement repeats."""
        if self.update_replay_problem is None:
            for owner in (*bindings, *self._dense):
                owner.update_graphs = UpdateGraphs(kernels.launch_path_counts())
        self._native_gate: Optional[Any] = None
        if self.update_replay_problem is None and native_hooks.wanted(devices):
            self.attach_native_hooks()

    # -- what is fused ----------------------------------------------------------------------

    def fused_parameters(self) -> list[nn.Parameter]:
        """The weights updated inside backward (they never get a ``.grad``)."""
        return [binding.weight for binding in self._bindings]

    def fallback_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters ``step()`` updates from their ``.grad`` (the 2-D ones by the
        kernel, see ``dense_parameters``; the rest by the standard torch optimizer)."""
        return list(self._fallback_params)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The 2-D fallback parameters ``step()`` updates with the fused kernel (``DenseWeight``)."""
        return [dense.weight for dense in self._dense]

    def dense_weights(self) -> list[DenseWeight]:
        """The ``DenseWeight`` of each of ``dense_parameters`` (``fuse`` makes embeddings record rows into them)."""
        return list(self._dense)

    def row_gradient_names(self) -> list[str]:
        """The dense weights whose embedding records its gradient as rows (``forge_core.embedding``):
        they never get a ``.grad``."""
        return [dense.name for dense in self._dense if dense.records_rows]

    def fused_weights(self) -> list[FusedWeight]:
        """The ``FusedWeight`` binding of each of ``fused_parameters``, in the optimizer's order."""
        return list(self._bindings)

    def fused_module_names(self) -> list[str]:
        return [binding.name for binding in self._bindings]

    def mark_unfused(self) -> None:
        """Called by ``forge_core.unfuse``: the model's fused modules are plain again, so ``step()``
        refuses from now on. A stale step would advance the fused weights' step counts and step the
        fallback parameters alone, and a backward through the plain model gives the fused weights a
        ``.grad`` that nothing here applies."""
        self._unfused = True
        self._forget_update_graphs()

    @property
    def unfused(self) -> bool:
        """Whether ``forge_core.unfuse`` was called on this optimizer's model (``step()`` then raises)."""
        return self._unfused

    @property
    def fallback_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer for the fallback parameters that are not ``dense_parameters`` (its
        hyper-parameters follow ours)."""
        return self._fallback

    @property
    def steps_taken(self) -> int:
        """Number of ``step()`` calls (restored by ``load_state_dict``; in capturable mode read from the
        device, so replays of a captured step count)."""
        self._sync_host_step_counts()
        return self._steps_taken

    def _sync_host_step_counts(self) -> None:
        """Capturable mode: set the host counters from the device step counts (a sync; replays of a
        captured step advance only the device counts)."""
        if not self._device_mode:
            return
        counts = [int(t.item()) for t in self._device_steps]
        self._device_steps_on_host = list(counts)      # (a sync: never inside a capture)
        for binding in self._bindings:
            binding.steps_done = counts[binding.group_index]
        for dense in self._dense:
            dense.steps_done = counts[dense.group_index]
        self._steps_taken = counts[0]

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held for training, by kind.

        weights: every parameter of the fused model (frozen ones included). optimizer_states: the
        fused weights' states (+ int8 scales; allocated at ``fuse``) and the fallback optimizer's
        state tensors as currently allocated (torch allocates them at the first step: call this
        after one step for the steady-state figure). gradients: the ``.grad`` of every fallback
        parameter after a backward (one parameter-sized tensor each; fused weights have none), except
        a row-gradient embedding's, which counts its slot table instead (4 bytes per row, kept from its
        first step; its recorded output gradients are activation-sized and not counted), plus the
        fp32 micro-batch accumulators (4 bytes per fused parameter when accumulate_steps > 1)."""
        weights = sum(_tensor_bytes(p) for p in self._model_parameters)
        states = sum(binding.state.nbytes() for binding in self._bindings)
        states += sum(dense.state.nbytes() for dense in self._dense)
        for parameter_state in self._fallback.state.values():
            states += sum(_tensor_bytes(t) for t in parameter_state.values() if isinstance(t, torch.Tensor))
        row_recorded = {id(dense.weight) for dense in self._dense if dense.records_rows}
        gradients = sum(_tensor_bytes(p) for p in self._fallback_params if id(p) not in row_recorded)
        gradients += sum(dense.slot_table_bytes(self.backend) for dense in self._dense)
        gradients += sum(_tensor_bytes(b.grad_accum) for b in self._bindings if b.grad_accum is not None)
        return {"weights": int(weights), "optimizer_states": int(states), "gradients": int(gradients)}

    # -- the update inside backward ---------------------------------------------------------

    def _kernel_hyperparameters(self, group_index: int) -> dict[str, Any]:
        """The group's hyper-parameters as the kernel takes them, read once per backward pass: every
        fused layer of the pass asks (226 times in a Llama-8B step, where the eager step is bound by
        the host), and nothing of the user's runs between two layers of one pass. A new pass (a new
        autograd graph task) or a call outside one (``step()``) reads the group afresh, so a change
        of lr by a scheduler or by hand is seen at the next backward."""
        task = torch._C._current_graph_task_id()
        if task != -1:
            memo = self._hyperparameters_in_backward.get(group_index)
            if memo is not None and memo[0] == task:
                return memo[1]
        group = self.param_groups[group_index]
        hyperparameters = {key: _scalar_hyperparameter(group[key]) for key in self.rule.defaults}
        owners = self._bindings or self._dense
        problem = self.rule.state_set_problem(owners[0].state.state_names, hyperparameters) if owners else None
        if problem is not None:
            raise ValueError(problem)
        if task != -1:
            self._hyperparameters_in_backward[group_index] = (task, hyperparameters)
        return hyperparameters

    def _count_backward(self, binding: FusedWeight) -> bool:
        """Count one backward of ``binding``; True when it is the k-th (the one that updates)."""
        k = self.accumulate_steps
        if binding.micro_batches >= k:
            raise RuntimeError(
                f"fused weight {binding.name!r} received backward number {binding.micro_batches + 1} since the last "
                f"opt.step(), but accumulate_steps={k}: call opt.step() after every {k} backward pass(es) "
                "(or fuse with accumulate_steps= the number of micro-batches per step)")
        binding.micro_batches += 1
        return binding.micro_batches == k

    def fused_backward(self, binding: FusedWeight, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """Called from a ForgeLinear backward: accumulate (micro-batches 1..k-1) or update (k-th)."""
        if self._layer_path is not None:            # regimes 2 and 3: forge_core.layer_step
            return self._layer_path.backward(binding, x, grad_output, last=self._count_backward(binding))
        if not self._count_backward(binding):
            dout, din = binding.matrix.shape
            binding.grad_accum.addmm_(grad_output.reshape(-1, dout).t().float(), x.reshape(-1, din).float())
            return
        if self.distributed is not None:           # data parallel: the gradient is reduced first
            return self.distributed.fused_backward(binding, x, grad_output)
        graphs = binding.update_graphs
        if graphs is not None and self._replayed_update(graphs, binding, x, grad_output):
            return
        self.apply_update(binding, x, grad_output)

    def begin_row_updates_of(self, binding: FusedWeight, x: Optional[torch.Tensor]) -> "RowSliceUpdate | RowBlockUpdate":
        """One backward of ``binding`` delivered in row blocks (see ``FusedWeight.begin_row_updates``)."""
        if self._layer_path is not None:
            raise self._layer_path.row_update_error(binding.name)
        if self.rule.layer_sums:            # (chunked_lm_head_cross_entropy on a fused head)
            raise ValueError(f"rule {self.rule.name!r} reads norms of the whole weight, so {binding.name!r} cannot "
                             "be updated in row blocks; leave it unfused or use the model's own loss")
        last = self._count_backward(binding)
        if last and self.distributed is not None:
            return self.distributed.row_updates(binding, x)
        return RowSliceUpdate(binding, x, mode="update" if last else "accumulate")

    def apply_gradient(self, owner: "FusedWeight | DenseWeight", grad: torch.Tensor) -> None:
        """Update ``owner``'s matrix at its next step from its complete gradient ``grad`` (fp32 or the weight's
        dtype): the kernel's zero-token path, as ``step()`` steps a ``DenseWeight`` (data parallel)."""
        weight = owner.matrix if isinstance(owner, FusedWeight) else owner.weight
        with torch.no_grad():
            self._launch_update(owner, *no_tokens(weight, weight.shape[0]), weight, owner.state, grad)

    def apply_update(self, binding: FusedWeight, x: torch.Tensor, grad_output: torch.Tensor,
                     part: Optional[RowPart] = None, seed_offset: int = 0) -> None:
        """The fused step of ``binding``'s weight, or of rows ``part`` of it (``grad_output`` then
        holds only those rows' columns). The step count is the weight's, whatever the part."""
        if self._layer_path is not None:            # step()'s flush of fewer micro-batches than k
            return self._layer_path.backward(binding, x, grad_output, last=True)
        if part is None:
            weight, state, grad_accum = binding.matrix, binding.state, binding.grad_accum
        else:
            weight = binding.matrix.detach()[part.r0:part.r1]
            state, grad_accum = part.state, part.grad_accum
        self._launch_update(binding, x, grad_output, weight, state, grad_accum, seed_offset)
        if grad_accum is not None:
            grad_accum.zero_()

    def apply_grouped_update(self, binding: FusedWeight, x: torch.Tensor, grad_output: torch.Tensor,
                             ends: torch.Tensor, rows_per_group: int) -> bool:
        """The last micro-batch's step of every row group of ``binding`` in one launch
        (``kernels.grouped_wgrad_update``: group ``e``'s tokens are rows ``[ends[e-1], ends[e])``, a
        group without tokens takes its zero-gradient step). False, doing nothing, where each group
        must be stepped alone: the reference backend, a capturable optimizer."""
        if self.backend != "triton" or self._device_mode or kernels.grouped_wgrad_update is None:
            return False
        hp, step, arguments = self._update_arguments(binding)
        kernels.grouped_wgrad_update(x, grad_output, binding.matrix, binding.state, ends, rows_per_group, hp, step,
                                     grad_accum=binding.grad_accum, seed_stride=BLOCK_SEED_STRIDE,
                                     config=binding.tile_config, **arguments)
        if binding.grad_accum is not None:
            binding.grad_accum.zero_()
        return True

    def _update_arguments(self, owner: "FusedWeight | DenseWeight",
                          seed_offset: int = 0) -> tuple[Mapping[str, Any], int, dict[str, Any]]:
        """(hyper-parameters, step, keyword arguments) of an update at ``owner``'s next step: the
        device scalars of its group in capturable mode (written first when stale), else the group's
        hyper-parameters and a seed. Shared by the fused kernel's and ``row_update``'s launches."""
        step = owner.steps_done + 1
        if self._device_mode:
            group = owner.group_index
            if self._scalars_override is not None:       # a copy of the buffer (``updating_on``)
                self._write_device_scalars(group, buffer=self._scalars_override)
                return {}, step, {"device_scalars": self._scalars_override}
            self._keep_device_scalars_current(group)
            return {}, step, {"device_scalars": self._device_scalars[group]}
        return self._kernel_hyperparameters(owner.group_index), step, {
            "stochastic_rounding": self.stochastic_rounding,
            "seed": (owner.index * 1_000_003 + step + seed_offset) & 0x7FFFFFFF}

    def _launch_update(self, owner: "FusedWeight | DenseWeight", x: torch.Tensor, grad_output: torch.Tensor,
                       weight: torch.Tensor, state: ParamState, grad_accum: Optional[torch.Tensor],
                       seed_offset: int = 0) -> None:
        """One fused-kernel (or reference) update at ``owner``'s next step (``_update_arguments``)."""
        hp, step, arguments = self._update_arguments(owner, seed_offset)
        tile = getattr(owner, "tile_config", None)
        if tile is not None and self.backend == "triton":
            arguments["config"] = tile
        self._update_function(x, grad_output, weight, state, hp, step, grad_accum=grad_accum, **arguments)

    def _step_dense(self, dense: DenseWeight) -> None:
        """``step()``'s update of one 2-D fallback parameter (``forge_core.dense.step_dense``)."""
        step_dense(dense, rule_name=self.rule.name, backend=self.backend, launch_update=self._launch_dense_update,
                   update_arguments=self._update_arguments)

    def _flush_partial_accumulation(self, binding: FusedWeight) -> None:
        """``step()`` after m < k micro-batches: apply the update from the accumulator alone (as
        unfused accumulation steps with whatever gradient it has), via a zero-token fused step."""
        with torch.no_grad():
            self.apply_update(binding, *no_tokens(binding.matrix, binding.matrix.shape[0]))
        binding.micro_batches = self.accumulate_steps

    def _update_rows_without_tokens(self, binding: FusedWeight, r0: int, r1: int) -> None:
        """The step of rows ``[r0, r1)`` that no token reached: AdamW on a zero gradient (plus what
        earlier micro-batches accumulated there) still decays the moments and the weight, as torch's
        step over the whole parameter does (the paper's Remark 1); a zero-token fused step."""
        with torch.no_grad():
            self.apply_update(binding, *no_tokens(binding.matrix, r1 - r0), part=binding.row_part(r0, r1))

    # -- torch.optim.Optimizer interface ----------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the rows recorded by row-gradient embeddings since the last step (they are
        those weights' gradient: a backward whose gradient is zeroed before ``step()`` must not count).
        In device mode the device scalars follow a changed hyper-parameter here (an lr scheduler steps
        between ``step()`` and the next ``zero_grad()``), outside any graph the next backward replays."""
        super().zero_grad(set_to_none)
        self._close_native_gate()
        for dense in self._dense:
            dense.recorded_rows = []
        if self._device_mode:
            for group in range(len(self._device_scalars)):
                self._keep_device_scalars_current(group, on_change_only=True)

    def _sync_fallback_hyperparameters(self) -> None:
        for ours, theirs in zip(self.param_groups, self._fallback.param_groups):
            theirs.update(self.rule.fallback_values(ours))

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Step the fallback parameters and advance the step count of the fused weights.

        The fused weights were already updated during backward. ``closure`` (optional) is run
        first with grad enabled (it should zero grads, run forward and backward, return the loss).
        After ``forge_core.unfuse(model)`` it raises (``UNFUSED_ERROR``)."""
        if self._unfused:
            grown = [binding.name for binding in self._bindings if binding.weight.grad is not None]
            detail = f" and fused weight {grown[0]!r} has a .grad it cannot apply" if grown else ""
            raise RuntimeError(UNFUSED_ERROR.format(detail=detail))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for binding in self._bindings:
            if binding.weight.grad is not None:
                raise RuntimeError(
                    f"fused weight {binding.name!r} has a .grad: something used it outside its ForgeLinear "
                    "(forge_core.unfuse was called, or the model reads the weight directly). Its gradient would "
                    "be ignored; re-fuse the model (the fuse-time probe excludes such weights)")
        if self.distributed is not None:
            self.distributed.before_step()
        k = self.accumulate_steps
        counts = []         # each weight's backward count, read once: a C++ hook's is a call into the extension
        for binding in self._bindings:
            seen = binding.micro_batches
            if 0 < seen < k:
                self._flush_partial_accumulation(binding)
                seen = k
            elif seen == k:
                for r0, r1 in binding.rows_left_out():
                    self._update_rows_without_tokens(binding, r0, r1)
            counts.append(seen)
        for dense in self._dense:
            self._step_dense(dense)
        self._sync_fallback_hyperparameters()
        # torch refuses to capture a non-capturable step even with no parameters; where it can, a recording replays
        if any(group["params"] for group in self._fallback.param_groups) and (
                self._fallback_graphs is None or not self._fallback_graphs.step()):
            self._fallback.step()
        for binding, seen in zip(self._bindings, counts):
            if seen == k:
                binding.steps_done += 1
            if seen:
                binding.micro_batches = 0
            binding.end_step()
        self._steps_taken += 1
        self._close_native_gate()
        if self._device_mode:
            self.advance_device_steps()
        return loss

    def _parameter_order(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's layout (``state`` by parameter index, ``param_groups`` with index lists) plus a
        ``forge`` entry. A fused weight's state: ``step`` (float tensor, as torch) and its
        ``ParamState`` tensors (``name`` and, for int8, ``name + "_scale"``). Tensors are references,
        as in torch: deep-copy or ``torch.save`` it before training on. Like torch (which never
        saves ``.grad``), a micro-batch accumulator between ``opt.step()`` calls is not saved:
        checkpoint at step boundaries. ``param_groups`` ends with a guard group (``GUARD_GROUP_KEY``)
        that makes any other optimizer class's ``load_state_dict`` refuse the dict."""
        self._sync_host_step_counts()
        index_of = {id(p): i for i, p in enumerate(self._parameter_order())}
        state: dict[int, dict[str, Any]] = {}
        for binding in self._bindings:
            state[index_of[id(binding.weight)]] = saved_entry(binding)
        for dense in self._dense:
            if dense.steps_done:          # torch keeps no state for a parameter never stepped
                state[index_of[id(dense.weight)]] = saved_entry(dense)
        for parameter, parameter_state in self._fallback.state.items():
            state[index_of[id(parameter)]] = dict(parameter_state)
        groups = self.packed_param_groups(index_of)
        groups.append({"params": [len(index_of)], GUARD_GROUP_KEY: GUARD_GROUP_NOTE})
        forge = {
            "rule": self.rule.name, "state_dtype": self.state_dtype, "steps_taken": self._steps_taken,
            "accumulate_steps": self.accumulate_steps,
            "fused": sorted(index_of[id(b.weight)] for b in self._bindings),
            "dense": sorted(index_of[id(d.weight)] for d in self._dense),
        }
        return {"state": state, "param_groups": groups, "forge": forge}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restore what ``state_dict`` saved into an optimizer built by the same ``fuse`` call on
        the same architecture (same rule, state dtype, parameters and fused set)."""
        forge = state_dict.get("forge")
        if not isinstance(forge, Mapping):
            raise ValueError("not a ForgeOptimizer state dict (no 'forge' entry); it cannot be loaded here")
        if forge.get("rule") != self.rule.name or forge.get("state_dtype") != self.state_dtype:
            raise ValueError(f"state dict is for rule={forge.get('rule')!r} state_dtype={forge.get('state_dtype')!r}, "
                             f"this optimizer is rule={self.rule.name!r} state_dtype={self.state_dtype!r}")
        saved_groups = list(state_dict["param_groups"])
        if saved_groups and GUARD_GROUP_KEY in saved_groups[-1]:
            saved_groups.pop()          # a dict saved without the guard group loads too
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        for saved, ours in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(f"a param group holds {len(saved['params'])} parameters in the state dict but "
                                 f"{len(ours['params'])} here: a different model")
        order = self._parameter_order()
        index_of = {id(p): i for i, p in enumerate(order)}
        fused_here = sorted(index_of[id(b.weight)] for b in self._bindings)
        if list(forge.get("fused", [])) != fused_here:
            raise ValueError("the state dict fused a different set of weights than this optimizer "
                             "(different model, or the probe / exclusions changed)")
        dense_here = sorted(index_of[id(d.weight)] for d in self._dense)
        if list(forge.get("dense", dense_here)) != dense_here:
            raise ValueError("the state dict stepped a different set of 2-D fallback weights with the kernel than "
                             "this optimizer (fuse(..., dense_2d=) differs, or a different model)")
        saved_state = state_dict["state"]
        for dense in self._dense:
            entry = saved_state.get(index_of[id(dense.weight)])
            if entry is None:                       # never stepped when saved
                dense.state.load_state_dict({k: torch.zeros_like(v) for k, v in dense.state.state_dict().items()})
                dense.steps_done = 0
                continue
            try:
                restore_entry(dense, entry)
            except (KeyError, ValueError) as error:
                raise ValueError(f"state of {dense.name!r} does not fit its {self.state_dtype} kernel state "
                                 f"({error}); a state dict saved with dense_2d=False loads only into "
                                 "fuse(..., dense_2d=False)") from error
        for binding in self._bindings:
            index = index_of[id(binding.weight)]
            if index not in saved_state:
                raise ValueError(f"state dict has no state for fused weight {binding.name!r} (index {index})")
            restore_entry(binding, saved_state[index])
            binding.micro_batches = 0
            if binding.grad_accum is not None:
                binding.grad_accum.zero_()
        for saved, ours in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    ours[key] = copy.deepcopy(value)
        self._sync_fallback_hyperparameters()
        fallback_index = {id(p): i for i, p in enumerate(self._torch_params)}
        fallback_state = {fallback_index[id(order[i])]: value for i, value in saved_state.items()
                          if id(order[i]) in fallback_index}
        fallback_groups = []
        for group in self._fallback.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = [fallback_index[id(p)] for p in group["params"]]
            fallback_groups.append(packed)
        self._fallback.load_state_dict({"state": fallback_state, "param_groups": fallback_groups})
        self._steps_taken = int(forge.get("steps_taken", 0))
        if self._device_mode:
            self.device_steps_from_host()
        self._forget_update_graphs()

    def __repr__(self) -> str:
        return (f"ForgeOptimizer(rule={self.rule.name}, state_dtype={self.state_dtype}, backend={self.backend}, "
                f"capturable={self.capturable}, "
                f"fused={len(self._bindings)}, fallback={len(self._fallback_params)} "
                f"({len(self._dense)} by the kernel), "
                f"accumulate_steps={self.accumulate_steps}, hyperparameters="
                f"{ {k: v for k, v in self.param_groups[0].items() if k != 'params'} })")


__all__ = ["ForgeOptimizer", "FusedWeight", "DenseWeight", "RowSliceUpdate", "resolve_backend", "BACKENDS",
           "steppable_by_kernel", "DistributedUpdates", "RowBlockUpdate", "GUARD_GROUP_KEY", "UNFUSED_ERROR"]
