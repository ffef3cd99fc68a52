"""Fused mixture-of-experts weights: 3-D expert parameters updated expert by expert in backward.

transformers 5.x stores a MoE layer's experts as two 3-D Parameters of one ``*Experts`` module
(Qwen3-MoE, Qwen2-MoE, Mixtral, ...): ``gate_up_proj`` of shape ``(E, 2I, H)`` and ``down_proj``
of shape ``(E, H, I)``, each expert's slice a Linear weight ``(Dout, Din)``. ``fuse`` gives each
such Parameter an ``ExpertsWeight``: its optimizer state is that of the ``(E * Dout, Din)`` matrix
the Parameter is a view of, so expert ``e`` owns rows ``[e * Dout, (e + 1) * Dout)`` of the
weight and of every state tensor (int8 blocks run along rows, so an expert holds whole blocks).

The module's forward becomes the grouped form (the same arithmetic as transformers'
``grouped_mm`` experts path): token-expert pairs sorted by expert, one grouped GEMM per
projection, the gate, the routing weights, and the sum over each token's experts. Its backward
computes ``dX`` from the pre-update weights and then steps every expert on its routed tokens (``x``
and ``dY`` are contiguous slices of the sorted buffers), so no expert's weight gradient is ever
formed: on the Triton backend in one launch per weight (``kernels.grouped_wgrad_update``; one
launch per expert cost the host 256 launches per layer), on the reference one expert at a time.

**Experts no token reached** (the paper's Remark 1): torch's AdamW steps the whole 3-D Parameter,
whose gradient rows for such experts are zero, and AdamW on a zero gradient still decays both
moments, applies weight decay and moves the weight by the decayed moments. ``opt.step()``
therefore updates those experts' rows with a zero-token fused step (``rows_left_out``), which is
the same arithmetic; the fused weight equals torch's AdamW over the 3-D Parameter. The grouped
launch takes that step in the backward already (an empty token range: a zero gradient).

The per-expert token counts are read on the host once per layer and step (the slicing needs them),
so such a model cannot be captured in a CUDA graph (``fuse(capturable=True)`` leaves its experts to
the fallback). Every expert update of a weight runs on one fixed tile on the GPU: the counts change
every step, and tuning per count would tune for minutes. Each expert's group of rows is padded
with zero rows to a multiple of ``token_block`` (64 on a GPU). It was made for one launch per expert,
whose plan is kept per expert for its last token count (rounded counts repeat from step to step, so
the launch skips Triton's JIT); the grouped launch needs no plan per expert, and the padding stays
until dropping it (it changes the grouped GEMMs' shapes) is measured. A zero row adds nothing to any
product, gradient or update.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from .fused_weight import FusedWeight, RowSliceUpdate
from .kernels.tile_config import default_config
from .module_copies import plain_module_reduction
from .traced import WEIGHT, arguments_of, count_forward, mutating_operator, owner_of, traced, traced_update_scope

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
TOKEN_BLOCK_CUDA = 64


def token_block(device: torch.device) -> int:
    """Rows each expert's group is padded to a multiple of: ``TOKEN_BLOCK_CUDA`` on a GPU, 1 (no
    padding) elsewhere."""
    return TOKEN_BLOCK_CUDA if device.type == "cuda" else 1


def looks_like_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds transformers-style 3-D expert Parameters (``gate_up_proj`` and
    ``down_proj``); whether they can be fused is ``experts_layout_problem``'s question."""
    return all(isinstance(module._parameters.get(name), nn.Parameter) and module._parameters[name].dim() == 3
               for name in EXPERT_PARAMETERS)


def experts_layout_problem(module: nn.Module) -> Optional[str]:
    """None when ``module``'s experts have the layout the fused forward reproduces (concatenated
    gate and up, ``(E, Dout, Din)`` slices, no bias, no post-expert norm, one process holding every
    expert), else why not, in one line."""
    gate_up, down = module.gate_up_proj, module.down_proj
    experts = gate_up.shape[0]
    flags = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for flag, wanted in flags.items():
        if bool(getattr(module, flag, wanted)) != wanted:
            return f"experts with {flag}={not wanted} are not fused (the fused forward reproduces {flag}={wanted})"
    if down.shape[0] != experts or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return (f"expert shapes gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not "
                "(E, 2I, H) / (E, H, I)")
    if not callable(getattr(module, "act_fn", None)):
        return "experts module has no act_fn"
    try:
        names = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        names = []
    if names[1:4] != ["hidden_states", "top_k_index", "top_k_weights"]:
        return f"experts forward takes {names[1:]} (expected hidden_states, top_k_index, top_k_weights)"
    for name in EXPERT_PARAMETERS:
        weight = getattr(module, name)
        if weight.dtype not in (torch.float32, torch.bfloat16):
            return f"{name} dtype {weight.dtype} is not supported by the fused kernel (fp32 or bf16)"
        if not weight.is_contiguous():
            return f"{name} is not contiguous"
    return None


class ExpertsWeight(FusedWeight):
    """One 3-D expert Parameter ``(E, Dout, Din)``: the fused binding of its ``(E * Dout, Din)``
    matrix, updated one expert (row block) at a time with that expert's routed tokens."""

    replayable = False
    """A CUDA graph cannot replay its updates: the per-expert paths read token counts on the host."""

    def __init__(self, name: str, module: nn.Module, parameter_name: str) -> None:
        weight = getattr(module, parameter_name)
        super().__init__(name, module, weight=weight)
        self.parameter_name = parameter_name
        self.num_experts, self.rows_per_expert = int(weight.shape[0]), int(weight.shape[1])
        self.matrix = weight.detach().view(-1, weight.shape[2])
        # Token counts differ per expert and step: one fixed tile on the GPU instead of a tuning
        # per count (the interpreter runs its own fixed tile).
        self.tile_config = default_config(0, 0, 0, 0) if weight.is_cuda else None
        self.updated_experts: set[int] = set()
        self._pass: Optional[tuple[int, RowSliceUpdate]] = None

    def expert_rows(self, expert: int) -> tuple[int, int]:
        """Rows of ``matrix`` (and of the state) that expert ``expert`` owns."""
        return expert * self.rows_per_expert, (expert + 1) * self.rows_per_expert

    def _pass_update(self) -> RowSliceUpdate:
        """One row-block update per backward pass: every expert of the pass is one use of the
        weight (one micro-batch), however many experts had tokens."""
        task = torch._C._current_graph_task_id()
        if self._pass is not None and task != -1 and self._pass[0] == task:
            return self._pass[1]
        update = self.begin_row_updates(None)
        self._pass = (task, update)
        return update

    def update_experts(self, x: torch.Tensor, grad_output: torch.Tensor, ends: torch.Tensor,
                       bounds: tuple[tuple[int, int], ...]) -> None:
        """The backward's update: expert ``e``'s rows from its tokens ``x[s:t]``, ``grad_output[s:t]``
        (``bounds[e]``; ``ends``: their ends on the device). On the Triton backend the last
        micro-batch steps every expert in one launch, the unreached ones with a zero gradient;
        otherwise one update per expert, and an expert whose group is empty (padding included) is
        left to ``rows_left_out``."""
        update = self._pass_update()
        if isinstance(update, RowSliceUpdate) and update.mode == "update" and \
                self.optimizer.apply_grouped_update(self, x, grad_output, ends, self.rows_per_expert):
            self.updated_experts.update(range(self.num_experts))
            return
        for expert, (start, end) in enumerate(bounds):
            if end > start:
                r0, r1 = self.expert_rows(expert)
                update(r0, r1, grad_output[start:end], block_index=expert, x=x[start:end])
                if update.mode == "update":
                    self.updated_experts.add(expert)

    def rows_left_out(self) -> list[tuple[int, int]]:
        return [self.expert_rows(e) for e in range(self.num_experts) if e not in self.updated_experts]

    def end_step(self) -> None:
        self.updated_experts.clear()
        self._pass = None

    def __repr__(self) -> str:
        return f"ExpertsWeight({self.name!r}, shape={tuple(self.weight.shape)}, steps={self.steps_done})"


def _grouped_mm_function() -> Any:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_grouped_mm(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped GEMM on a CUDA bf16 pair (what transformers' grouped_mm path runs there);
    elsewhere one GEMM per expert."""
    return a.is_cuda and a.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and \
        _grouped_mm_function() is not None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``y[s:t] = x[s:t] @ weight[e]^T`` for each expert ``e`` and its rows ``[s, t)`` of ``x``."""
    if _use_grouped_mm(x, weight):
        return _grouped_mm_function()(x, weight.transpose(-2, -1), offs=offsets)
    out = x.new_zeros((x.shape[0], weight.shape[1]))
    for expert, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(x[start:end], weight[expert].t(), out=out[start:end])
    return out


def grouped_input_grad(grad_output: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                       bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``dx[s:t] = dy[s:t] @ weight[e]`` for each expert ``e`` (the input gradient of ``grouped_linear``)."""
    if _use_grouped_mm(grad_output, weight):
        return _grouped_mm_function()(grad_output, weight, offs=offsets)
    out = grad_output.new_zeros((grad_output.shape[0], weight.shape[2]))
    for expert, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(grad_output[start:end], weight[expert], out=out[start:end])
    return out


class ExpertsLinearFunction(torch.autograd.Function):
    """``grouped_linear`` whose backward returns dX and updates each reached expert's weight slice
    in place (no weight gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                bounds: tuple[tuple[int, int], ...], updater: ExpertsWeight) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        ctx.bounds, ctx.updater = bounds, updater
        return grouped_linear(x, weight, offsets, bounds)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        x, weight, offsets = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        # dX from the pre-update weights, for every expert, before any expert is updated.
        grad_x = grouped_input_grad(grad_output, weight, offsets, ctx.bounds) if ctx.needs_input_grad[0] else None
        with torch.no_grad():
            ctx.updater.update_experts(x, grad_output.to(x.dtype), offsets, ctx.bounds)
        return grad_x, None, None, None, None


def _bounds_of(offsets: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Each expert's rows ``[start, end)`` from the cumulative ends ``offsets`` (one host sync)."""
    ends = offsets.tolist()
    return tuple(zip([0] + ends[:-1], ends))


@torch.library.custom_op("forge::experts_mm", mutates_args=())
def _experts_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_linear`` as the compiler sees it: rows past the last expert's are zero."""
    return _traced_product(grouped_linear, x, weight, offsets)


@_experts_mm.register_fake
def _experts_mm_fake(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op("forge::experts_mm_input_grad", mutates_args=())
def _experts_mm_input_grad(grad_output: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_input_grad`` as the compiler sees it: rows past the last expert's are zero."""
    return _traced_product(grouped_input_grad, grad_output, weight, offsets)


@_experts_mm_input_grad.register_fake
def _experts_mm_input_grad_fake(grad_output: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad_output.new_empty((grad_output.shape[0], weight.shape[2]))


def _traced_product(product: Any, a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``product`` (``grouped_linear`` or ``grouped_input_grad``) inside an operator: the grouped GEMM reads the
    groups from ``offsets`` on the device (its rows past the last group zeroed: it leaves them unwritten);
    the per-expert loop reads each expert's rows on the host."""
    grouped = _use_grouped_mm(a, weight)
    out = product(a, weight, offsets, () if grouped else _bounds_of(offsets))
    return _zero_rows_past(out, offsets) if grouped else out


def _zero_rows_past(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows past ``offsets[-1]`` zeroed (the grouped GEMM leaves them unwritten)."""
    rows = torch.arange(out.shape[0], device=out.device).unsqueeze(1)
    return torch.where(rows < offsets[-1], out, torch.zeros((), dtype=out.dtype, device=out.device))


# The experts' update reads each expert's token count on the host: Inductor leaves a graph holding it out of
# CUDA graphs (mode="reduce-overhead" then runs that graph without them) rather than record a host sync.
_HOST_SYNCED = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _experts_update_body(x: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor, written: list[torch.Tensor],
                         offsets: torch.Tensor, after: list[torch.Tensor], key: int) -> None:
    """The backward's update of every expert of the 3-D weight ``key`` names, from its routed rows, once
    ``after`` exist."""
    binding = owner_of(key)
    optimizer = binding.optimizer
    optimizer.prepare_traced_update(binding)
    with optimizer.updating_on(binding, weight, written, None), traced_update_scope():
        binding.update_experts(x, grad_output, offsets, _bounds_of(offsets))


_update_experts = mutating_operator(
    "update_experts_", f"Tensor x, Tensor grad_output, {WEIGHT}, Tensor(b!)[] written, Tensor offsets, "
    "Tensor[] after, int key", _experts_update_body, tags=_HOST_SYNCED)


class TracedExpertsLinearFunction(torch.autograd.Function):
    """``ExpertsLinearFunction`` as ``torch.compile`` traces it: the grouped products and the experts'
    update are registered operators, the token counts stay on the device until the update's body reads them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, key: int,
                *written: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets, *written)
        ctx.key = key
        return _experts_mm(x, weight, offsets)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        x, weight, offsets, *written = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        # dX from the pre-update weights, for every expert, before any expert is updated.
        grad_x = _experts_mm_input_grad(grad_output, weight, offsets) if ctx.needs_input_grad[0] else None
        _update_experts(x, grad_output.to(x.dtype).detach(), weight, list(written), offsets,
                        [grad_x] if grad_x is not None else [], ctx.key)
        return (grad_x, None, None, None, *(None for _ in written))


def _traced_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, updaters: dict[str, "ExpertsWeight"]) -> torch.Tensor:
    """The fused experts forward under ``torch.compile``: the eager one's arithmetic with static shapes
    (the grouped buffer holds every pair plus the largest padding, its tail zero) and no host sync."""
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    experts = self.gate_up_proj.shape[0]
    pairs = num_tokens * top_k
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.zeros(experts, dtype=torch.long, device=expert_ids.device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids))
    block = token_block(hidden_states.device)
    padded = (counts + block - 1) // block * block
    offsets = torch.cumsum(padded, 0, dtype=torch.int32)
    first_row = (offsets - padded).long()
    rank = torch.arange(pairs, device=expert_ids.device) - (torch.cumsum(counts, 0) - counts)[expert_ids]
    rows = first_row[expert_ids] + rank
    x = hidden_states.new_zeros((pairs + experts * (block - 1), hidden), dtype=self.gate_up_proj.dtype)
    x = x.index_put((rows,), hidden_states[order // top_k].to(x.dtype))
    gate_up, down = updaters["gate_up_proj"], updaters["down_proj"]
    h = TracedExpertsLinearFunction.apply(x, self.gate_up_proj, offsets, *arguments_of(gate_up)[1:])
    h = _gate(self, h)
    out = TracedExpertsLinearFunction.apply(h, self.down_proj, offsets, *arguments_of(down)[1:])[rows]
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(pairs, device=order.device))
    return out[inverse].view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The module's gate on the gate/up projection (transformers' ``_apply_gate`` where it exists)."""
    apply_gate = getattr(module, "_apply_gate", None)
    if callable(apply_gate):
        return apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _fused_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    updaters = getattr(self, "forge_expert_updaters", None)
    count_forward(self)
    if not updaters or not torch.is_grad_enabled() or not all(
            getattr(self, name).requires_grad for name in EXPERT_PARAMETERS):
        return type(self).__mro__[1].forward(self, hidden_states, top_k_index, top_k_weights)
    if traced(updaters["gate_up_proj"]):
        return _traced_experts_forward(self, hidden_states, top_k_index, top_k_weights, updaters)
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    experts = self.gate_up_proj.shape[0]
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.bincount(expert_ids, minlength=experts)
    block = token_block(hidden_states.device)
    padded = (counts + block - 1) // block * block
    offsets = torch.cumsum(padded, 0, dtype=torch.int32)
    ends = offsets.tolist()                                                # one host sync per layer
    bounds = tuple(zip([0] + ends[:-1], ends))
    # each pair's row in the padded, expert-grouped layout: its expert's first row + its rank there
    first_row = (offsets - padded).long()
    rank = torch.arange(expert_ids.numel(), device=expert_ids.device) - (torch.cumsum(counts, 0) - counts)[expert_ids]
    rows = first_row[expert_ids] + rank
    x = hidden_states.new_zeros((ends[-1] if ends else 0, hidden), dtype=self.gate_up_proj.dtype)
    x[rows] = hidden_states[order // top_k].to(x.dtype)                    # zero rows pad each group
    h = ExpertsLinearFunction.apply(x, self.gate_up_proj, offsets, bounds, updaters["gate_up_proj"])
    h = _gate(self, h)
    out = ExpertsLinearFunction.apply(h, self.down_proj, offsets, bounds, updaters["down_proj"])[rows]
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    # the sum over each token's experts in the order transformers' grouped path sums them
    return out[inverse].view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _plain_reduction(self: nn.Module, protocol: int) -> tuple:
    """A deep copy or pickle is the experts module's own class with the same weights
    (``forge_core.module_copies``)."""
    return plain_module_reduction(self, type(self).__mro__[1], protocol)


_FUSED_CLASSES: dict[type, type] = {}


def forge_experts_class(base: type) -> type:
    """The fused subclass of experts class ``base``, made once per class."""
    cls = _FUSED_CLASSES.get(base)
    if cls is None:
        cls = type(f"Forge{base.__name__}", (base,), {
            "__doc__": f"{base.__name__} whose 3-D expert weights are updated inside backward (forge_core.experts).",
            "__module__": __name__,
            "forward": _fused_experts_forward,
            "__reduce_ex__": _plain_reduction,
            "forge_fused_experts": True,
        })
        _FUSED_CLASSES[base] = cls
    return cls


def is_forge_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module that ``fuse`` turned into its fused subclass."""
    return bool(getattr(type(module), "forge_fused_experts", False))


def install_forge_experts(module: nn.Module, updaters: dict[str, ExpertsWeight]) -> None:
    """Give ``module`` the fused forward, updating ``updaters[name]``'s weight for each 3-D Parameter."""
    if is_forge_experts(module):
        raise ValueError(f"{type(module).__name__} is already fused: call forge_core.unfuse(model) before fusing again")
    if sorted(updaters) != sorted(EXPERT_PARAMETERS):
        raise ValueError(f"install_forge_experts needs an updater for each of {EXPERT_PARAMETERS}, got {sorted(updaters)}")
    module.__class__ = forge_experts_class(type(module))
    module.forge_expert_updaters = dict(updaters)
    module.forge_updater = updaters["gate_up_proj"]
    module.forge_forward_calls = 0
    module.forge_counting_forwards = False


def remove_forge_experts(module: nn.Module) -> None:
    """The experts module's own class and forward again (same object, same Parameters)."""
    if not is_forge_experts(module):
        raise TypeError(f"not a fused experts module: {type(module).__name__}")
    for attribute in ("forge_expert_updaters", "forge_updater", "forge_forward_calls", "forge_counting_forwards"):
        module.__dict__.pop(attribute, None)
    module.__class__ = type(module).__mro__[1]


__all__ = ["EXPERT_PARAMETERS", "TOKEN_BLOCK_CUDA", "token_block", "ExpertsWeight", "ExpertsLinearFunction", "experts_layout_problem",
           "forge_experts_class", "grouped_input_grad", "grouped_linear", "install_forge_experts",
           "is_forge_experts", "looks_like_experts", "remove_forge_experts"]
