"""The per-layer paths of regime-2 and regime-3 rules: their step runs in plain torch inside the
layer's backward, after the weight-gradient GEMM, instead of in the fused kernel's epilogue.

* Regime 2 with a ``layer_update`` (Muon): the rule gets the layer's flattened ``X`` and ``dY`` and
  runs its own GEMM into its state (the momentum accumulates through cuBLAS's beta / alpha), then
  its whole-matrix update.
* Regime 3, deferred (Adafactor, AdaLomo, SM3, Adam-mini, LARS): their state step reads row,
  column or global statistics of G, which no weight tile sees alone. The layer's
  ``G = dY^T X`` is formed (``wgrad_gemm.weight_gradient``: cuBLAS, fp32 accumulate and result),
  the rule's ``reference`` steps the weight from it, and G is freed before the backward moves to
  the next layer. The gradient residency is one layer's G (the rules compute their elementwise
  temporaries into G, in row blocks where they need one: ``rules.scalars.row_blocks``), never the
  model's gradient pool; ``track_gradient_residency`` measures it.
* The largest such weight (an LM head: 4x the size of any other Llama-3.1-8B weight) is stepped
  later instead (``LayerPath.defers``), from the ``X`` and ``dY`` it keeps: right after the last of
  the other fused weights has stepped in this backward, or at the backward's end if that never
  comes. Its G then exists after the activations are freed, not beside them at the start of the
  backward, and before the unfused parameters' gradients (an untied embedding's, as large as a
  bf16 head) are formed. It waits only where its fp32 G is larger than twice what it keeps.

States are ``LayerState``s: a ``ParamState`` whose tensors may have other shapes than the weight
(row and column statistics, one second moment per block), stored fp32 or bf16.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from .kernels.reference import flatten_tokens
from .rules.base import Rule, fp32_states, matrix_step_states
from .state import ParamState
from .traced import in_traced_update
from .wgrad_gemm import accumulate_product, weight_gradient

try:
    from .kernels import matrix_steps as MATRIX_KERNELS
except ImportError:  # pragma: no cover - a torch-only install: the rules' plain-torch references run
    MATRIX_KERNELS = None
"""The regime-3 rules' Triton passes that ``Rule.matrix_step`` takes (``forge_core.kernels.matrix_steps``);
None without Triton."""

LAYER_STATE_DTYPES = ("fp32", "bf16")
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def takes_layer_path(rule: Rule) -> bool:
    """Whether ``rule`` is stepped here (a deferred rule, or a whole-matrix rule stepped in plain
    torch) rather than by the fused kernel's epilogue."""
    return rule.regime == 3 or rule.layer_update is not None


class LayerState(ParamState):
    """The states of one weight stepped on the per-layer path, in fp32 or bf16, of the shapes the
    rule asks for (``Rule.state_shapes``); ``state_dict`` / ``load_state_dict`` / ``nbytes`` as a
    ``ParamState``'s. Zero-initialized, as torch's optimizers start their states."""

    def __init__(self, weight: torch.Tensor, rule: Rule, state_dtype: str, hp: Mapping[str, Any], name: str) -> None:
        if state_dtype not in LAYER_STATE_DTYPES:
            raise ValueError(f"{rule.name}: state_dtype {state_dtype!r} is not supported on the per-layer path "
                             f"(it takes {', '.join(LAYER_STATE_DTYPES)})")
        if weight.dim() != 2:
            raise ValueError(f"LayerState needs a 2-D (Dout, Din) weight, got shape {tuple(weight.shape)}")
        self.rule = rule
        self.state_dtype = state_dtype
        self.shape = tuple(weight.shape)
        storage = _STORAGE[state_dtype]
        self.values = {state: torch.zeros(size, dtype=storage, device=weight.device)
                       for state, size in rule.shapes_of_states(self.shape, hp, name).items()}
        self.scales = {state: None for state in self.values}
        self.state_names = tuple(self.values)
        self.layer_sums = None

    def store(self, name: str, value32: torch.Tensor) -> None:
        """Write fp32 ``value32`` into state ``name`` (rounded to bf16 when so stored)."""
        self._check_name(name)
        target = self.values[name]
        if tuple(value32.shape) != tuple(target.shape):
            raise ValueError(f"state {name!r} has shape {tuple(target.shape)}, got a value of shape "
                             f"{tuple(value32.shape)}")
        if value32.data_ptr() != target.data_ptr():
            target.copy_(value32)

    def rows(self, start: int, stop: int) -> "ParamState":
        raise NotImplementedError(f"{self.rule.name}: the per-layer path steps whole weights, never row blocks")


@dataclass
class GradientResidency:
    """Bytes of per-layer gradients (the G of deferred rules) alive now and at most, while tracked."""
    live_bytes: int = 0
    peak_bytes: int = 0
    formed: int = 0

    def formed_one(self, gradient: torch.Tensor) -> None:
        size = gradient.numel() * gradient.element_size()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.formed += 1
        weakref.finalize(gradient, self._freed, size)

    def _freed(self, size: int) -> None:
        self.live_bytes -= size


_TRACKERS: list[GradientResidency] = []


@contextlib.contextmanager
def track_gradient_residency() -> Iterator[GradientResidency]:
    """Count, while the block runs, the bytes of every G the deferred path forms, until each is
    garbage: a G that outlived its layer's backward would add up across layers in ``peak_bytes``.
    For tests and diagnostics (a CPU run has no allocator peak to read)."""
    tracker = GradientResidency()
    _TRACKERS.append(tracker)
    try:
        yield tracker
    finally:
        _TRACKERS.remove(tracker)


def deferred_update(rule: Rule, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, state: ParamState,
                    hp: Mapping[str, Any], step: Any, grad_accum: Optional[torch.Tensor]) -> None:
    """Regime 3: form G (+ the micro-batch accumulator), step the weight with ``rule.reference``
    (which may consume G in place), free G. The weight is stepped in place in its own dtype (a
    regime-3 reference computes each op in fp32 and rounds a bf16 weight per op, as torch's
    optimizers do on bf16 parameters: no fp32 copy of the weight, which at Llama-3.1-8B's LM head
    would be 2.1 GB beside G); fp32 states in place, bf16 ones through fp32 copies rounded back once (``matrix_step``: a bf16
    layer-sized state read and rounded by its kernel, ``Rule.matrix_step``)."""
    grad32 = weight_gradient(dy2, x2)
    for tracker in _TRACKERS:
        tracker.formed_one(grad32)
    if grad_accum is not None:
        grad32.add_(grad_accum)
    with torch.no_grad():
        if rule.matrix_step is not None and MATRIX_KERNELS is not None and MATRIX_KERNELS.runs_here(grad32, weight):
            states32 = matrix_step_states(state.values, tuple(weight.shape))
            rule.matrix_step(weight.detach(), grad32, states32, hp, step, MATRIX_KERNELS)
        else:
            states32 = fp32_states(state.values)
            rule.reference(weight.detach(), grad32, states32, hp, step)
        del grad32
        for name, value in states32.items():
            state.store(name, value)


def layer_wgrad_update(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                       hp: Mapping[str, Any], step: Any, *, grad_accum: Optional[torch.Tensor] = None,
                       accumulate_steps: int = 1, first_micro_batch: bool = True,
                       last_micro_batch: bool = True) -> None:
    """One backward's work for a weight on the per-layer path: an earlier micro-batch goes into the
    fp32 accumulator ``grad_accum`` (or, where the rule keeps none, into its own state); the last
    one steps the weight. ``step`` is the 1-based step (an int, or a 0-d device tensor when
    capturable). ``x``: (..., Din), ``dy``: (..., Dout)."""
    rule = state.rule
    dout, din = weight.shape
    x2 = flatten_tokens(x, din, "x")
    dy2 = flatten_tokens(dy, dout, "dy")
    if accumulate_steps > 1 and rule.state_accumulates is not None \
            and bool(rule.state_accumulates(hp)) != (grad_accum is None):
        raise RuntimeError(f"{rule.name}: a hyper-parameter that decides where micro-batches accumulate changed "
                           "after fuse(accumulate_steps>1); fuse the model again")
    with torch.no_grad():
        if not last_micro_batch and grad_accum is not None:
            accumulate_product(grad_accum, dy2, x2, beta=1.0, alpha=1.0)
            return
        if rule.layer_update is not None:
            rule.layer_update(x2, dy2, weight.detach(), state.values, hp, step, grad_accum=grad_accum,
                              first_micro_batch=first_micro_batch, last_micro_batch=last_micro_batch)
            return
    if not last_micro_batch:
        raise RuntimeError(f"{rule.name}: an earlier micro-batch needs the fp32 gradient accumulator")
    deferred_update(rule, x2, dy2, weight, state, hp, step, grad_accum)


@dataclass
class PendingUpdate:
    """The deferred step of the largest weight in one backward (graph task ``task``): it runs once,
    when ``others_left`` other fused weights have stepped or at the backward's end, whichever is
    first; ``update`` is None once it ran (which drops the X and dY it kept)."""

    task: int
    update: Optional[Callable[[], None]]
    others_left: int

    def run(self) -> None:
        update, self.update = self.update, None
        if update is not None:
            update()


class LayerPath:
    """What a ``ForgeOptimizer`` whose rule takes this path does with its fused weights: their
    states and accumulators (``attach``), their backward (``backward``), and the refusal of row
    blocks; ``arguments(binding) -> (hp, step)`` is the optimizer's: the group's hyper-parameters
    and the 1-based step (the device count when capturable)."""

    defer_largest = True
    """Step the one largest weight after the other weights of the backward (``defers``); False steps
    every weight inside its own backward."""

    def __init__(self, rule: Rule, state_dtype: str, hyperparameters: Mapping[str, Any], accumulate_steps: int,
                 arguments: Callable[[Any], tuple[Mapping[str, Any], Any]]) -> None:
        self.rule, self.state_dtype, self.accumulate_steps = rule, state_dtype, int(accumulate_steps)
        self.hyperparameters = dict(hyperparameters)
        self.arguments = arguments
        self.sizes: list[int] = []
        """Element counts of the attached weights."""
        self.single_largest: int | None = None
        """The element count of the one largest attached weight; None while two share the largest size."""
        self.state_accumulates = rule.state_accumulates is not None and bool(rule.state_accumulates(hyperparameters))
        """The rule takes earlier micro-batches into its own state: no fp32 accumulator."""
        self.pending: PendingUpdate | None = None
        """The largest weight's step while it waits (``defers``)."""
        self.stepped: tuple[int, int] = (-1, 0)
        """(graph task id, how many weights have stepped in that backward)."""

    def attach(self, binding: Any) -> None:
        """Give a fused weight (``fused_weight.FusedWeight``) its ``LayerState`` and, when micro-batches
        need one, its fp32 accumulator."""
        binding.state = LayerState(binding.matrix, self.rule, self.state_dtype, self.hyperparameters, binding.name)
        self.sizes.append(binding.matrix.numel())
        largest = max(self.sizes)
        self.single_largest = largest if self.sizes.count(largest) == 1 else None
        if self.accumulate_steps > 1 and not self.state_accumulates:
            binding.grad_accum = torch.zeros(binding.matrix.shape, dtype=torch.float32, device=binding.matrix.device)

    def backward(self, binding: Any, x: torch.Tensor, dy: torch.Tensor, *, last: bool) -> None:
        """One backward of ``binding`` whose micro-batch count already counts it (``last``: the k-th),
        or ``step()``'s flush of fewer (``last`` and zero tokens); the accumulator is cleared after."""
        hp, step = self.arguments(binding)
        first = binding.micro_batches == 1 and (not last or self.accumulate_steps == 1)

        def update() -> None:
            layer_wgrad_update(x, dy, binding.matrix, binding.state, hp, step, grad_accum=binding.grad_accum,
                               accumulate_steps=self.accumulate_steps, first_micro_batch=first,
                               last_micro_batch=last)
            if last and binding.grad_accum is not None:
                binding.grad_accum.zero_()

        task = torch._C._current_graph_task_id()
        stepped = self.stepped[1] if self.stepped[0] == task else 0
        if last and self.defers(binding.matrix, x, dy):
            pending = self.pending = PendingUpdate(task, update, others_left=len(self.sizes) - 1 - stepped)
            torch.autograd.Variable._execution_engine.queue_callback(pending.run)
            if pending.others_left <= 0:
                pending.run()
            return
        update()
        if not last:
            return
        self.stepped = (task, stepped + 1)
        pending = self.pending
        if pending is not None and pending.task == task and pending.update is not None:
            pending.others_left -= 1
            if pending.others_left <= 0:
                pending.run()       # every other fused weight has stepped: their activations are gone

    def defers(self, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> bool:
        """Whether ``weight``'s step waits for the other weights' steps (``PendingUpdate``): a deferred rule's (a
        ``layer_update`` rule forms no G), inside an autograd backward, the single largest attached
        weight, and its fp32 G more than twice the bytes of the ``x`` and ``dy`` kept for it."""
        size = weight.numel()
        if (not self.defer_largest or size != self.single_largest or self.rule.layer_update is not None
                or torch._C._current_graph_task_id() == -1 or in_traced_update()):
            return False
        return 4 * size > 2 * (x.numel() * x.element_size() + dy.numel() * dy.element_size())

    def row_update_error(self, name: str) -> ValueError:
        """Why ``name`` cannot be updated row block by row block (the chunked LM-head loss)."""
        return ValueError(f"rule {self.rule.name!r} steps whole weights and cannot update {name!r} row block by "
                          "row block (the chunked LM-head loss): use the model's own loss")


__all__ = ["GradientResidency", "LAYER_STATE_DTYPES", "LayerPath", "LayerState", "MATRIX_KERNELS", "PendingUpdate",
           "deferred_update", "layer_wgrad_update", "takes_layer_path", "track_gradient_residency"]
