"""Lean activations for Llama-style decoder blocks: the same forward, fewer bytes kept for backward.

Once the weight-gradient pool is gone (``forge_core.fuse``), the peak of a training step is the
weights, the optimizer states and the activations autograd keeps at the end of the forward. For a
transformers Llama layer at bf16 most of those activations are redundant:

* ``LlamaRMSNorm`` keeps an fp32 copy of its input and a bf16 copy of the normalized input (12
  bytes per element) besides its output, which the q/k/v (or gate/up) projections keep as their
  input. The lean norm keeps its bf16 input and the per-row ``rstd`` only (2 bytes per element).
* The projections' saved input (the norm's output) is not kept at all: it is recomputed from the
  norm's saved input and ``rstd`` when the first projection's backward unpacks it.
* ``act_fn(gate) * up`` keeps ``gate``, ``silu(gate)``, ``up`` and, as ``down_proj``'s input, the
  product. The lean SwiGLU keeps ``gate`` and ``up`` only; the product is recomputed when
  ``down_proj``'s backward unpacks it.

Per Llama-3.1-8B layer and token that is 92 KiB instead of 196 KiB. The recomputations are
elementwise and replay the forward's own ops, so the recomputed tensors are bit-identical to the
ones the forward produced, and the forward is bit-identical to transformers'. The gradients of the
norm and the SwiGLU are those autograd would compute (the SwiGLU's exactly; the norm's up to the
order of fp32 operations).

How the recomputation works: each patched decoder layer runs inside a
``torch.autograd.graph.saved_tensors_hooks`` scope. A lean norm or SwiGLU registers its output
there with a recipe; when any op of the layer saves that output (or a view of it) for backward,
the pack hook stores the recipe instead, and the unpack hook rebuilds the tensor (once per
recipe, shared by q/k/v). Anything else is saved as usual. Because this goes through autograd's
own hook, it works for ``nn.Linear``, ``ForgeLinear`` and any other consumer, eager or captured in
a CUDA graph.

What it does not check: an in-place change of a registered output after it was saved (autograd
would raise for a saved tensor; the recipe would rebuild the value from before the change). The
recipe's own inputs are checked: if one was modified in place before the backward, unpacking
raises.
"""
from __future__ import annotations

import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .dtensors import is_dtensor
from .kernels import rowwise

# transformers classes whose forward is exactly ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``
# (Gemma's ``1 + w`` norm is not one of them)
LEAN_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
# classes whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
LEAN_MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
# one program holds a whole row in registers: wider norms take the plain-torch path
MAX_KERNEL_WIDTH = 16384


class LeanActivationsError(ValueError):
    """The model has nothing lean_activations can make lean."""


# --- the recompute scope ------------------------------------------------------------------------

class _Recipe:
    """Rebuilds one registered output from tensors that backward keeps anyway; built at most once."""

    def __init__(self, build: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...], what: str) -> None:
        self.build = build
        self.inputs = inputs
        self.versions = tuple(t._version for t in inputs)
        self.what = what
        self.value: Optional[torch.Tensor] = None

    def materialize(self) -> torch.Tensor:
        if self.value is None:
            if tuple(t._version for t in self.inputs) != self.versions:
                raise RuntimeError(f"lean_activations: an input of the {self.what} was modified in place between "
                                   "the forward and the backward, so its output cannot be recomputed")
            with torch.no_grad():
                self.value = self.build()
        return self.value


@dataclass
class _Packed:
    """What the pack hook stores for a saved registered output: the recipe and the saved view's geometry."""
    recipe: _Recipe
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def unpack(self) -> torch.Tensor:
        full = self.recipe.materialize()
        return full.as_strided(self.size, self.stride, self.offset)


class SavedTensorScope:
    """The registered outputs of one decoder-layer forward (storage pointer -> output, recipe)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref, _Recipe]] = {}

    def register(self, output: torch.Tensor, recipe: _Recipe) -> None:
        if is_dtensor(output):              # a tensor-parallel DTensor has no storage to match on
            return
        if output.is_contiguous() and output.storage_offset() == 0:
            self.entries[output.untyped_storage().data_ptr()] = (weakref.ref(output), recipe)

    def pack(self, saved: torch.Tensor) -> Any:
        if not self.entries or saved.layout != torch.strided or is_dtensor(saved):
            return saved                    # a DTensor (tensor parallel) has no storage of its own
        entry = self.entries.get(saved.untyped_storage().data_ptr())
        if entry is None:
            return saved
        output = entry[0]()
        # The output must still be alive for the pointer match to mean the same storage.
        if output is None or output.dtype != saved.dtype or output.device != saved.device:
            return saved
        return _Packed(entry[1], saved.size(), saved.stride(), saved.storage_offset())

    @staticmethod
    def unpack(stored: Any) -> torch.Tensor:
        return stored.unpack() if isinstance(stored, _Packed) else stored


_active = threading.local()


def _current_scope() -> Optional[SavedTensorScope]:
    stack = getattr(_active, "scopes", None)
    return stack[-1] if stack else None


def run_in_scope(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` with the tensors autograd saves packed by a new scope: a saved
    output registered in it is kept as its recipe, not as its storage."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        # Under torch.compile the compiler's partitioner chooses what the backward keeps and recomputes.
        return forward(*args, **kwargs)
    scope = SavedTensorScope()
    stack = getattr(_active, "scopes", None)
    if stack is None:
        stack = _active.scopes = []
    stack.append(scope)
    try:
        with torch.autograd.graph.saved_tensors_hooks(scope.pack, scope.unpack):
            return forward(*args, **kwargs)
    finally:
        stack.pop()


def _register(output: torch.Tensor, build: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...],
              what: str) -> None:
    scope = _current_scope()
    if scope is not None:
        scope.register(output, _Recipe(build, inputs, what))


# --- RMSNorm ------------------------------------------------------------------------------------
# The plain-torch functions below are the spec (and the CPU path); on CUDA the Triton kernels of
# ``forge_core.kernels.rowwise`` do the same in one kernel per direction.

def rms_normalize(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm output, given its rstd (the same ops, so the same bits)."""
    return weight * (x.to(torch.float32) * rstd).to(x.dtype)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, rstd) as transformers computes them."""
    rstd = _rstd(x, eps)
    return rms_normalize(x, weight, rstd), rstd


def rms_norm_backward_reference(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                                grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in fp32): autograd's chain for transformers' norm, with its roundings."""
    normalized = (x.to(torch.float32) * rstd).to(x.dtype)
    leading = tuple(range(grad_output.dim() - weight.dim()))
    grad_weight = (grad_output.to(torch.float32) * normalized.to(torch.float32)).sum(dim=leading)
    grad_normalized = (grad_output * weight).to(x.dtype).to(torch.float32)
    x_hat = x.to(torch.float32) * rstd
    mean_dot = (grad_normalized * x_hat).mean(-1, keepdim=True)
    grad_x = ((grad_normalized - x_hat * mean_dot) * rstd).to(x.dtype)
    return grad_x, grad_weight


class _RMSNormFunction(torch.autograd.Function):
    """``w * (x * rstd)`` keeping x (its own dtype) and rstd (fp32, one per row) only; returns
    (output, rstd), rstd not differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, use_kernels: bool):
        if use_kernels:
            output, rstd = rowwise.rms_norm_forward(x, weight, eps)
        else:
            output, rstd = rms_norm_reference(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.use_kernels = use_kernels
        ctx.mark_non_differentiable(rstd)
        return output, rstd

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, _grad_rstd: Any):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        backward = rowwise.rms_norm_backward if ctx.use_kernels else rms_norm_backward_reference
        grad_x, grad_weight = backward(x, weight, rstd, grad_output)
        return (grad_x if ctx.needs_input_grad[0] else None,
                grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None)


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, keeping x and rstd for backward; its output is recomputable."""
    if torch.compiler.is_compiling():      # plain ops: the compiler fuses them and picks what to recompute
        return rms_norm_reference(x, weight, eps)[0]
    use_kernels = rowwise.usable_for(x) and x.shape[-1] <= MAX_KERNEL_WIDTH
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return (rowwise.rms_norm_forward if use_kernels else rms_norm_reference)(x, weight, eps)[0]
    output, rstd = _RMSNormFunction.apply(x, weight, eps, use_kernels)
    if use_kernels:
        def rebuild() -> torch.Tensor:
            return rowwise.rms_norm_forward(x, weight, eps, rstd)[0]
    else:
        def rebuild() -> torch.Tensor:
            return rms_normalize(x, weight, rstd)
    _register(output, rebuild, (x, weight, rstd), "RMSNorm")
    return output


# --- SwiGLU -------------------------------------------------------------------------------------

def swiglu_backward_reference(gate: torch.Tensor, up: torch.Tensor,
                              grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up): autograd's, op for op."""
    return torch.ops.aten.silu_backward(grad_output * up, gate), grad_output * F.silu(gate)


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` keeping gate and up only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, use_kernels: bool) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.use_kernels = use_kernels
        return rowwise.swiglu_forward(gate, up) if use_kernels else F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        backward = rowwise.swiglu_backward if ctx.use_kernels else swiglu_backward_reference
        grad_gate, grad_up = backward(gate, up, grad_output)
        return (grad_gate if ctx.needs_input_grad[0] else None,
                grad_up if ctx.needs_input_grad[1] else None, None)


def lean_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` keeping gate and up for backward; the product is recomputable."""
    if torch.compiler.is_compiling():      # plain ops: the compiler fuses them and picks what to recompute
        return F.silu(gate) * up
    use_kernels = rowwise.usable_for(gate) and gate.shape == up.shape and gate.dtype == up.dtype
    forward = rowwise.swiglu_forward if use_kernels else (lambda g, u: F.silu(g) * u)
    if not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad):
        return forward(gate, up)
    output = _SwiGLUFunction.apply(gate, up, use_kernels)
    _register(output, lambda: forward(gate, up), (gate, up), "SwiGLU")
    return output


# --- patching a model ---------------------------------------------------------------------------

def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return lean_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(lean_swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _scoped_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward_in_scope(*args: Any, **kwargs: Any) -> Any:
        return run_in_scope(forward, *args, **kwargs)
    forward_in_scope.forge_lean_scope = True  # type: ignore[attr-defined]
    return forward_in_scope


@dataclass(frozen=True)
class LeanReport:
    """What lean_activations changed (module counts)."""
    norms: int
    mlps: int
    scopes: int


def _lean_kind(module: nn.Module) -> Optional[str]:
    """"norm" or "mlp" for a module lean_activations can replace the forward of, else None."""
    kind = type(module).__name__
    if kind in LEAN_NORM_CLASSES and hasattr(module, "variance_epsilon"):
        return "norm"
    if (kind in LEAN_MLP_CLASSES and _is_silu(getattr(module, "act_fn", None))
            and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj"))):
        return "mlp"
    return None


def lean_activations(model: nn.Module) -> LeanReport:
    """Make every Llama-style RMSNorm and SiLU-gated MLP of ``model`` keep less for backward.

    Patches the modules' ``forward`` in place (the Parameters, names and state_dict are unchanged)
    and runs each module that owns one of them (the decoder layers) in a recompute scope. Call it
    before ``forge_core.fuse`` or after; calling it twice changes nothing more.
    """
    counts = {"norm": 0, "mlp": 0}
    owners: dict[int, nn.Module] = {}
    for module in model.modules():
        if any(_lean_kind(child) for child in module.children()):
            owners[id(module)] = module
        kind = _lean_kind(module)
        if kind is not None:
            module.forward = types.MethodType(_norm_forward if kind == "norm" else _mlp_forward, module)
            counts[kind] += 1
    if not any(counts.values()):
        raise LeanActivationsError(f"lean_activations: {type(model).__name__} has no Llama-style RMSNorm "
                                   f"({', '.join(LEAN_NORM_CLASSES)}) or SiLU-gated MLP "
                                   f"({', '.join(LEAN_MLP_CLASSES)})")
    for owner in owners.values():
        if not getattr(owner.forward, "forge_lean_scope", False):
            owner.forward = _scoped_forward(owner.forward)
    return LeanReport(norms=counts["norm"], mlps=counts["mlp"], scopes=len(owners))
