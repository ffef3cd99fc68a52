"""2-D fallback parameters that ``ForgeOptimizer.step()`` updates with the fused kernel.

A vocabulary embedding, a tied or an excluded weight gets no fused update in backward; it is
stepped in ``step()`` from its ``.grad`` (zero tokens, the gradient as the kernel's accumulator
input), or, for a ``ForgeEmbedding``'s weight, from the rows its batch touched (``row_update``).
Why the kernel and not torch's optimizer: see ``DenseWeight``. An untied embedding's int8 states
keep every non-zero first moment at a non-zero code: see ``EmbeddingState``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from .dtensors import is_dtensor
from .kernels.device import interpreting
from .kernels.row_gradient import row_gradient, row_gradient_reference
from .kernels.row_update import row_update
from .rules.base import Rule
from .state import QBLOCK, ParamState
from .traced import remember_traced_arguments
from .update_graphs import UpdateGraphs

LaunchUpdate = Callable[..., None]
"""``ForgeOptimizer``'s update launch: (owner, x, grad_output, weight, state, grad_accum)."""
UpdateArguments = Callable[..., tuple[Mapping[str, Any], int, dict[str, Any]]]
"""``ForgeOptimizer``'s (hyper-parameters, step, keyword arguments) of an owner's next update."""


class EmbeddingState(ParamState):
    """The optimizer state of an untied embedding's weight: a ``ParamState`` whose int8 signed
    states (a first moment) keep every non-zero value at a non-zero code (+-1 where the nearest code
    is 0; a block whose scale is 0 or subnormal codes 0, as in ``ParamState``). Other formats and
    states are ``ParamState``'s.

    Why: int8 codes a value below half its 64-column block's step (``absmax / 127``) as 0. AdamW's
    step ``m / sqrt(v)`` does not depend on the gradient's size (Lion's ``sign(m)`` neither), so torch
    moves such an element by about lr per step, while a zero code stops it. A Linear weight gets a new
    gradient every step and the element moves again at the next one; an embedding row a batch touches
    once keeps the zero code through every later step without gradient, while torch moves it along
    its decaying moments: tiny Llama (vocab 512, width 64, AdamW lr 1e-3, 10 steps of 32 tokens),
    torch's gradients replayed into each weight's int8 update, max |W - W_torch| 3.19 lr for the
    embedding against 0.19-0.81 lr for the blocks' Linear weights and 1.85 for the head. A zero code
    left non-zero puts the element's first moment and its second moment's root (floored at one code
    already) one step each, as torch's ratio has them for an element touched once: the embedding
    then ends 0.75 lr away (Lion: 9.0 -> 2.0 lr; SGD, whose step is the moment's size, 0.007 -> 0.008).
    On every Linear weight the same store is worse (head 1.85 -> 2.93 lr), so it is the embedding's
    alone. ``kernels.row_update(..., keep_signed_codes=True)`` stores the same codes."""

    def store(self, name: str, value32: torch.Tensor) -> None:
        """``ParamState.store``, then (int8, a signed state) a zero code of a non-zero value becomes +-1."""
        super().store(name, value32)
        if self.state_dtype != "int8" or not self.rule.keeps_nonzero_codes(name):
            return
        codes, scale = self.values[name], self.scales[name]
        step = scale.repeat_interleave(QBLOCK, dim=-1)[..., :codes.shape[-1]]
        lost = (codes == 0) & (value32 != 0) & (step >= torch.finfo(torch.float32).tiny)
        codes.copy_(torch.where(lost, torch.sign(value32).to(torch.int8), codes))


def no_tokens(matrix: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(x, dY)`` for a zero-token fused step of ``rows`` rows of ``matrix`` (the accumulator alone)."""
    return matrix.new_zeros((0, matrix.shape[1])), matrix.new_zeros((0, rows))


class DenseWeight:
    """A 2-D fallback parameter (a vocabulary embedding, a tied or excluded weight) that
    ``step()`` updates with the fused kernel from its ``.grad``: zero tokens, the gradient as the
    kernel's accumulator input.

    Why: torch's optimizer keeps such a weight's moments in the weight's dtype, so
    ``state_dtype="int8"`` would leave Llama-3.1-8B's embedding (6.5% of the model) with bf16
    moments, and on an H100 torch's fused AdamW took 4.5 ms per step for that embedding and the
    norms (1.6 TB/s); the kernel streams W and the moments once, in the chosen state format."""

    def __init__(self, name: str, weight: nn.Parameter) -> None:
        self.name = name
        self.weight = weight
        self.group_index = 0
        self.index = 0
        self.state: Optional[ParamState] = None
        self.optimizer: Optional[Any] = None
        """The ``ForgeOptimizer`` that steps it (``forge_core.unfuse`` tells it the model is plain again)."""
        self.steps_done = 0
        """Optimizer steps in which this weight had a gradient; the next update uses steps_done + 1."""
        # Zero-token activations for the kernel call, made once (the launch plan is cached per layout).
        self.no_x, self.no_dy = no_tokens(weight.detach(), weight.shape[0])
        self.records_rows = False
        """Set by ``fuse`` when the weight is a ``ForgeEmbedding``'s: its backward calls ``record_rows``
        and the weight gets no ``.grad``; ``step()`` then updates it with ``kernels.row_update``."""
        self.padding_idx: Optional[int] = None
        self.recorded_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(token ids, output gradient) of each backward since the last step (micro-batches add up)."""
        self.update_graphs: Optional[UpdateGraphs] = None
        """Its steps' recorded CUDA graphs (``forge_core.update_graphs.UpdateGraphs``), where its optimizer
        replays them: keyed by where its gradient lies."""
        self.slots: Optional[torch.Tensor] = None
        """Row r's index in the step's gradient rows, or -1 (``kernels.row_update``); made at the first
        row step and rewritten in place by every later one."""

    def make_embedding_state(self, hp: Optional[Mapping[str, Any]] = None) -> None:
        """Give this weight an ``EmbeddingState`` (``forge_core.fuse``, for an untied embedding's weight,
        before its first step: the state holds its initial values then, so nothing is lost). ``hp``: the
        param group's hyper-parameters, which the state set and initial values follow, as the
        ``ParamState`` it replaces did."""
        if self.steps_done or self.state is None:
            raise RuntimeError(f"{self.name!r}: make_embedding_state() belongs before the first step, on an allocated state")
        state = EmbeddingState(self.weight, self.state.rule, self.state.state_dtype, hp)
        if state.state_names != self.state.state_names:
            raise RuntimeError(f"{self.name!r}: make_embedding_state() got hyper-parameters for the states "
                               f"{list(state.state_names)}, the weight holds {list(self.state.state_names)}")
        self.state = state
        remember_traced_arguments(self)

    def record_rows(self, ids: torch.Tensor, grad_output: torch.Tensor) -> None:
        """The ForgeEmbedding backward: keep this use's ids and output gradient for ``step()``."""
        self.recorded_rows.append((ids.reshape(-1), grad_output.reshape(-1, grad_output.shape[-1])))

    def slot_table(self) -> torch.Tensor:
        """The int32 slot table (one entry per row), made once: a CUDA graph captured around ``step()``
        replays the same buffer, and no step allocates a row-sized tensor."""
        if self.slots is None:
            self.slots = torch.empty(self.weight.shape[0], dtype=torch.int32, device=self.weight.device)
            remember_traced_arguments(self)
        return self.slots

    def slot_table_bytes(self, backend: str) -> int:
        """Bytes of the slot table a row step on ``backend`` keeps (the reference backend builds none)."""
        return 4 * self.weight.shape[0] if self.records_rows and backend == "triton" else 0

    def __repr__(self) -> str:
        return f"DenseWeight({self.name!r}, shape={tuple(self.weight.shape)}, steps={self.steps_done})"


def steppable_by_kernel(parameter: nn.Parameter, rule: Rule, backend: str) -> bool:
    """Whether a fallback parameter can be a ``DenseWeight``: 2-D, fp32 / bf16, contiguous, not a DTensor
    (the torch optimizer steps those shard-wise), on a
    device the backend runs on, and a rule with a Triton epilogue (the reference backend runs the
    same rule's torch reference)."""
    if parameter.dim() != 2 or parameter.numel() == 0 or not parameter.is_contiguous() or is_dtensor(parameter):
        return False
    if parameter.dtype not in (torch.float32, torch.bfloat16) or rule.epilogue is None:
        return False
    if backend == "triton" and parameter.device.type != "cuda" and not interpreting():
        return False
    return True


def step_dense(dense: DenseWeight, *, rule_name: str, backend: str, launch_update: LaunchUpdate,
               update_arguments: UpdateArguments) -> None:
    """``step()``'s update of one 2-D fallback parameter from its ``.grad`` or its recorded rows
    (skipped without either, as torch skips a parameter without a gradient; its step count then
    stays). ``launch_update`` / ``update_arguments``: the optimizer's fused-kernel (or reference)
    launch and its arguments at the weight's next step, so the step matches a fused weight's."""
    rows, dense.recorded_rows = dense.recorded_rows, []
    grad = dense.weight.grad
    if rows and grad is None:
        _step_rows(dense, rows, backend, launch_update, update_arguments)
        dense.steps_done += 1
        return
    if grad is None:
        return
    if rows:                  # the weight was also read outside its embedding: fold the rows in
        for ids, grad_output in rows:
            if dense.padding_idx is not None:          # as torch's backward: no gradient for padding
                grad_output = grad_output * (ids != dense.padding_idx).unsqueeze(1).to(grad_output.dtype)
            grad.index_add_(0, ids, grad_output.to(grad.dtype))
    if grad.is_sparse:
        raise RuntimeError(f"{dense.name!r} has a sparse gradient (nn.Embedding(sparse=True)); the "
                           f"{rule_name} update needs a dense one")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        grad = grad.float()
    if not grad.is_contiguous():
        grad = grad.contiguous()
    with torch.no_grad():
        if backend == "triton" and _keeps_signed_codes(dense):
            # the fused kernel stores ParamState's codes; row_update, on the whole gradient, this state's
            hp, step, arguments = update_arguments(dense)
            row_update(dense.weight.detach(), dense.state, hp, step, slots=None,
                       row_grads=grad.to(dense.weight.dtype), keep_signed_codes=True, **arguments)
        else:
            launch_update(dense, dense.no_x, dense.no_dy, dense.weight, dense.state, grad)
    dense.steps_done += 1


def _step_rows(dense: DenseWeight, rows: list[tuple[torch.Tensor, torch.Tensor]], backend: str,
               launch_update: LaunchUpdate, update_arguments: UpdateArguments) -> None:
    """The dense update of ``dense`` from recorded rows, without its dense gradient: one
    ``row_update`` pass over every row, reading each touched row's gradient through the slot
    table (row r -> its index among the T sorted ids; a repeated id's copies are equal, so any one
    will do). Each element sees the dense step's arithmetic at the dense step's seed (bit for bit
    in the interpreter; on the GPU up to how the compiler contracts multiply-adds in each kernel),
    and rows without a gradient read none (12 instead of 14 bytes per element with bf16 states).
    The slot table is built by device ops only (no host sync), so the step can be captured.
    The reference backend (the spec) scatters the rows into a dense gradient and steps that."""
    ids = torch.cat([r[0] for r in rows]) if len(rows) > 1 else rows[0][0]
    grad_output = torch.cat([r[1] for r in rows]) if len(rows) > 1 else rows[0][1]
    weight = dense.weight.detach()
    with torch.no_grad():
        if backend != "triton":
            touched, row_grads = row_gradient_reference(ids, grad_output, weight.dtype, dense.padding_idx)
            grad = torch.zeros_like(weight)
            grad[touched] = row_grads
            launch_update(dense, dense.no_x, dense.no_dy, weight, dense.state, grad)
            return
        touched, row_grads = row_gradient(ids, grad_output, weight.dtype, dense.padding_idx)
        slots = dense.slot_table()
        slots.fill_(-1)
        slots[touched] = torch.arange(touched.numel(), dtype=torch.int32, device=slots.device)
        hp, step, arguments = update_arguments(dense)
        row_update(weight, dense.state, hp, step, slots=slots, row_grads=row_grads,
                   keep_signed_codes=_keeps_signed_codes(dense), **arguments)


def _keeps_signed_codes(dense: DenseWeight) -> bool:
    """Whether ``dense``'s state stores some int8 state as ``EmbeddingState`` does (``Rule.keeps_nonzero_codes``:
    a regime-2 rule's moments are stored as ``ParamState`` stores them)."""
    return (isinstance(dense.state, EmbeddingState) and dense.state.state_dtype == "int8"
            and any(map(dense.state.rule.keeps_nonzero_codes, dense.state.state_names)))


__all__ = ["DenseWeight", "EmbeddingState", "step_dense", "steppable_by_kernel"]
