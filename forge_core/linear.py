"""The fused Linear: forward ``y = x W^T (+ b)``, backward ``dX = dY W`` then the fused update.

``ForgeLinear`` is a subclass of ``nn.Linear`` that ``forge_core.fuse`` installs by changing the
class of an existing module in place (``module.__class__ = ForgeLinear``). The module object, its
Parameters, its hooks and its name in the model are all kept, and ``forge_core.unfuse`` turns it
back into a plain ``nn.Linear`` the same way.

Why a custom autograd Function:

* The weight gradient ``G = dY^T X`` is never formed. The backward hands ``x`` and ``dY`` to an
  *updater* (the optimizer's per-weight binding, see ``forge_core.manager``) which runs the fused
  wgrad + optimizer kernel, and returns ``None`` for the weight, so ``W.grad`` is never created.
* ``dX = dY @ W`` is computed from the pre-update ``W`` *before* the updater runs.
* The weight keeps ``requires_grad=True``, so the output requires grad and this backward runs even
  when ``x`` does not (the first layer of a model).

A weight that is a DTensor (tensor parallelism: ``ColwiseParallel`` shards W by rows, ``RowwiseParallel``
by columns) runs ``ShardedLinearFunction``: the same steps on the rank's local shard, whose weight
gradient ``dY_local^T X_local`` is complete on that rank, so each rank updates its shard alone.

``transposed=True`` serves a weight stored ``(Din, Dout)`` (transformers' GPT-2 ``Conv1D``,
``y = x W + b``; ``forge_core.conv1d``): its gradient ``X^T dY`` is the kernel's ``dY^T X`` with x
and dY swapped, so the updater is called with ``(dY, x)`` and the same kernel updates the
``(Din, Dout)`` weight row by row, tile by tile, with no transposed copy of anything.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .dtensors import contiguous_strides, dtensor_module, is_dtensor
from .module_copies import plain_module_reduction
from . import native_hooks
from .overlap import run_update, run_update_outside_autograd
from .traced import arguments_of, count_forward, traced, update_weight_


class WeightUpdater(Protocol):
    """What the backward calls once per use of the layer: apply (or accumulate) the update.

    An updater with a true ``overlap_updates`` attribute is run on a side CUDA stream, overlapping
    the rest of the backward (``forge_core.overlap``)."""

    def __call__(self, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        ...


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear in on ``device_type``, or None when it is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # device types autocast does not know
        return None
    return None


class FusedLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` (``x W + b`` when ``transposed``) whose backward returns dX and db, and
    updates W in place (no dW)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                updater: WeightUpdater, transposed: bool = False) -> torch.Tensor:
        output, x = linear_forward(ctx, x, weight, bias, transposed)
        # Only x is saved for the update; W is the Parameter itself (saving it costs nothing and
        # lets autograd check that nobody modified it between forward and backward).
        ctx.save_for_backward(x, weight)
        ctx.updater = updater
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x, grad_bias, first, second = linear_backward(ctx, x, weight, grad_output)
        run_update_outside_autograd(ctx.updater, first, second)
        # None for the weight: autograd then never creates (or accumulates into) W.grad.
        return grad_x, None, grad_bias, None, None


def linear_forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of a fused Linear (``x W^T + b``, ``x W + b`` when ``transposed``) as autocast would run
    it, and the input to save (cast, when autocast casts it: half the bytes of fp32); records on ``ctx``
    what ``linear_backward`` reads."""
    compute_dtype = autocast_dtype(x.device.type)
    if compute_dtype is not None and x.is_floating_point():
        x = x.to(compute_dtype)
        weight_for_forward = weight.to(compute_dtype)
        bias_for_forward = bias.to(compute_dtype) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            output = F.linear(x, weight_for_forward.t() if transposed else weight_for_forward, bias_for_forward)
    else:
        output = F.linear(x, weight.t() if transposed else weight, bias)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.input_dtype = x.dtype
    ctx.transposed = transposed
    return output, x


def linear_backward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(dX, db, first, second)`` of a fused Linear's backward: dX from the PRE-update weight (this must
    run before the update touches W), and the update kernel's operands, whose ``dY^T X`` (``first`` = x)
    or ``X^T dY`` (a transposed weight: the operands swapped) is the weight's gradient."""
    needs_x_grad, _, needs_bias_grad = ctx.needs_input_grad[:3]
    # The dtype checks below skip a no-op ``.to`` each (a dispatcher call): an eager backward is
    # bound by the host, and this runs once per fused layer.
    dtype = grad_output.dtype
    grad_x = None
    if needs_x_grad:
        matrix = weight if weight.dtype == dtype else weight.to(dtype)
        grad_x = torch.matmul(grad_output, matrix.t() if ctx.transposed else matrix)
        if dtype != ctx.input_dtype:
            grad_x = grad_x.to(ctx.input_dtype)
    grad_bias = None
    if ctx.has_bias and needs_bias_grad:
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0).to(ctx.bias_dtype)
    x_for_update = x if x.dtype == dtype else x.to(dtype)
    first, second = (grad_output, x_for_update) if ctx.transposed else (x_for_update, grad_output)
    return grad_x, grad_bias, first, second


class TracedLinearFunction(torch.autograd.Function):
    """``FusedLinearFunction`` as ``torch.compile`` traces it: the backward's update is the registered
    operator ``forge::update_weight_`` (``forge_core.traced``) over the weight, every tensor its update
    writes (``written``) and its group's device scalars, named by the binding's integer key."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool,
                scalars: Optional[torch.Tensor], key: int, *written: torch.Tensor) -> torch.Tensor:
        output, x = linear_forward(ctx, x, weight, bias, transposed)
        ctx.save_for_backward(x, weight, scalars, *written)
        ctx.key = key
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        x, weight, scalars, *written = ctx.saved_tensors
        grad_x, grad_bias, first, second = linear_backward(ctx, x, weight, grad_output)
        update_weight_(first.detach(), second.detach(), weight, list(written), scalars,
                       [grad_x] if grad_x is not None else [], ctx.key)
        return (grad_x, None, grad_bias, None, None, None, *(None for _ in written))


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], updater: Any,
                  transposed: bool = False) -> torch.Tensor:
    """The fused Linear under ``torch.compile`` (``TracedLinearFunction``): what the compiler sees of a
    ForgeLinear's or ForgeConv1D's forward and backward. Its operator's arguments come as one tuple
    (``traced.remember_traced_arguments``: fewer guards for Dynamo to re-check at every call)."""
    return TracedLinearFunction.apply(x, weight, bias, transposed, *arguments_of(updater))


HOOKED_LINEAR = os.environ.get("FORGE_HOOKED_LINEAR", "1") != "0"
"""Whether eager fused Linears run ``hooked_linear`` where it applies (``FORGE_HOOKED_LINEAR=0``: always
``FusedLinearFunction``, to A/B the host cost); read once at import, a test may set it."""
_GEMM_NODES = ("AddmmBackward0", "MmBackward0")
_VIEW_NODES = ("ViewBackward0", "UnsafeViewBackward0")
_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)
if _saved_tensor_hooks is None or _functorch_active is None or _any_autocast is None:   # a torch without them
    HOOKED_LINEAR = False


def hooked_path_allowed() -> bool:
    """Whether the process-wide state lets ``hooked_linear``'s path (and its C++ twin) run: ``FORGE_HOOKED_LINEAR``
    on, and no saved-tensor hooks, functorch transform or autocast, which only the Function serves."""
    return HOOKED_LINEAR and _saved_tensor_hooks(False) is None and not _functorch_active() and not _any_autocast()


def hooked_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], updater: WeightUpdater,
                  transposed: bool = False) -> Optional[torch.Tensor]:
    """``FusedLinearFunction``'s result and update without a Python autograd Function, or None where
    this path does not apply (the caller then runs the Function).

    Why: an eager step at batch 1 is bound by the host, and a Python Function costs it, per fused
    layer, its forward's and its backward node's Python (ctx, saved tensors, the outputs'
    checks) on top of the GEMMs. Here the forward is torch's own GEMM on the flattened input and a
    detached alias of the weight, so autograd's C++ node computes dX (from the weight as it is
    before this layer's update) and the bias gradient and never dW; a post-hook on that node then
    runs the update with the node's dY and the input. The input is held by the hook until it runs
    once (as the Function's saved tensor is until its backward): a second backward through the same
    graph (``retain_graph=True``) is refused in one line. Where the updater has a native slot
    (``forge_core.native_hooks``) all of this after the first checks runs in C++ as one autograd node of
    its own (the same values as torch's nodes, one node where torch's GEMM of an N-D input makes three and
    the hook a fourth call), which replays a recorded update without Python.

    Applies only where it is exact: no saved-tensor hooks (activation checkpointing, lean
    activations: they manage saved tensors, which this path has none of), no autocast (its casts
    happen in the Function's forward), no functorch transform, one dtype for x, weight and bias, and
    an autograd node to hook (x or the bias requires grad)."""
    if not hooked_path_allowed():
        return None
    slot = getattr(updater, "native_slot", None)
    if slot is not None:              # the rest in C++, the hook too (forge_core.native_hooks)
        return native_hooks.hooked_forward(x, weight, bias, slot, transposed)
    dtype = weight.dtype
    if x.dtype != dtype or (bias is not None and bias.dtype != dtype) or x.dim() < 2:
        return None
    if not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    alias = weight.detach()
    # An input F.linear cannot flatten as a view (MLP-Mixer's token mixing reads a transposed one) it
    # multiplies as a flattened copy, adding the bias after the GEMM (the weight requires grad): the same here.
    unflattened = not transposed and x.dim() > 2 and not x.is_contiguous()
    held = x                          # what the update reads: the input, or the 2-D copy the GEMM read
    if transposed or unflattened:     # transposed: transformers' Conv1D, x W + b, as its own forward computes it
        x2 = held = x.reshape(-1, x.shape[-1])
        if transposed and bias is not None:
            gemm = output = torch.addmm(bias, x2, alias)
        else:
            gemm = output = torch.mm(x2, alias if transposed else alias.t())
        if x.dim() != 2:
            output = output.view(*x.shape[:-1], output.shape[-1])
        if unflattened and bias is not None:
            output = output + bias
    else:
        gemm = output = F.linear(x, alias, bias)   # a (..., Din) input: a view of the GEMM of its 2-D view
    node = gemm.grad_fn
    if node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ not in _GEMM_NODES:
        return None                   # a layout torch computes with another node
    pending, outputs = [held], output.shape[-1]

    def update_after_gradients(grad_inputs: tuple, grad_outputs: tuple) -> None:
        if not pending:
            raise RuntimeError("a fused Linear's graph was run backward twice (retain_graph=True): FORGE updates "
                               "the weight once per forward; run the forward again for another backward")
        x_saved = pending.pop()
        grad_output = grad_outputs[0]
        if grad_output is None:
            grad_output = torch.zeros(*x_saved.shape[:-1], outputs, dtype=dtype, device=x_saved.device)
        first, second = (grad_output, x_saved) if transposed else (x_saved, grad_output)
        run_update_outside_autograd(updater, first, second)

    node.register_hook(update_after_gradients)
    return output


def native_forward(module: nn.Module, x: torch.Tensor, transposed: bool = False) -> Optional[torch.Tensor]:
    """An eager fused module's forward (a ForgeLinear's, a ForgeConv1D's) straight to the C++ forward
    (``hooked_forward``), or None where anything but that path may apply: ``torch.compile`` tracing, no C++
    slot, the fuse-time probe counting forwards, a weight that is not a plain Parameter (a DTensor, a
    parametrization), grad off, or ``hooked_path_allowed`` false. The caller then runs its full forward,
    which decides as before.

    Why: an eager step at batch 1 is the host's time, and torch's Linear costs it one Python call and two
    attribute lookups (``nn.Module.__getattr__``) around the GEMM. Here the same checks as the full forward's
    in the order that rules out the most, the parameters read from the module's own table (no
    ``__getattr__``): ~1 us a layer of checks on a CPU where the full forward's cost ~3 (D131)."""
    if torch.compiler.is_compiling():
        return None
    attributes = module.__dict__
    slot = getattr(attributes.get("forge_updater"), "native_slot", None)
    if slot is None or attributes.get("forge_counting_forwards"):
        return None
    parameters = attributes["_parameters"]
    weight = parameters.get("weight")
    if type(weight) is not nn.Parameter or not weight.requires_grad or not torch.is_grad_enabled():
        return None
    if not hooked_path_allowed():
        return None
    return native_hooks.hooked_forward(x, weight, parameters.get("bias"), slot, transposed)


class ShardedLinearFunction(torch.autograd.Function):
    """``FusedLinearFunction`` for a DTensor weight on a 1-D device mesh, on local shards.

    Colwise (W ``Shard(0)``, x ``Replicate``): ``y`` is ``Shard(-1)``, ``dX`` a ``Partial`` sum (the
    input's DTensor backward all-reduces it). Rowwise (W ``Shard(1)``, x ``Shard(-1)``): ``y`` is
    ``Partial`` (the bias is added on the mesh's first rank, so the sum holds it once), ``dX`` is
    ``Shard(-1)``. In both the rank's ``G = dY_local^T X_local`` is its shard's whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                updater: WeightUpdater) -> torch.Tensor:
        placements = dtensor_module()
        mesh = weight.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"a fused tensor-parallel Linear needs a 1-D device mesh, got {mesh.ndim} dimensions")
        x_local = x.to_local() if is_dtensor(x) else x
        x_placement = x.placements[0] if is_dtensor(x) else placements.Replicate()
        weight_local = weight.to_local()
        bias_local = bias.to_local() if is_dtensor(bias) else bias
        compute_dtype = autocast_dtype(x_local.device.type)
        if compute_dtype is not None and x_local.is_floating_point():
            x_local = x_local.to(compute_dtype)
            weight_for_forward = weight_local.to(compute_dtype)
            bias_local = bias_local.to(compute_dtype) if bias_local is not None else None
        else:
            weight_for_forward = weight_local
        weight_placement = weight.placements[0]
        last = x.dim() - 1
        x_sharded_last = x_placement.is_shard() and x_placement.dim % x.dim() == last
        with torch.autocast(x_local.device.type, enabled=False):
            if weight_placement.is_shard(0) and x_placement.is_replicate():
                output = F.linear(x_local, weight_for_forward, bias_local)
                output_placement = placements.Shard(last)
            elif weight_placement.is_shard(1) and x_sharded_last:
                output = F.linear(x_local, weight_for_forward)
                if bias_local is not None and mesh.get_local_rank() == 0:
                    output = output + bias_local
                output_placement = placements.Partial()
            else:
                raise ValueError(f"a fused tensor-parallel Linear takes W Shard(0) with x Replicate (colwise) or "
                                 f"W Shard(1) with x Shard(-1) (rowwise), got W {weight_placement} and x {x_placement}")
        ctx.save_for_backward(x_local, weight_local)
        ctx.updater, ctx.mesh, ctx.input_was_dtensor = updater, mesh, is_dtensor(x)
        ctx.colwise = weight_placement.is_shard(0)
        ctx.output_placement, ctx.input_placement = output_placement, x_placement
        ctx.input_shape = tuple(x.shape)
        ctx.bias_shape = tuple(bias.shape) if bias is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.input_dtype = x_local.dtype
        shape = (*x.shape[:-1], weight.shape[0])
        return placements.DTensor.from_local(output, mesh, (output_placement,), run_check=False, shape=shape,
                                              stride=contiguous_strides(shape))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        placements = dtensor_module()
        x, weight = ctx.saved_tensors
        needs_x_grad, _, needs_bias_grad, _ = ctx.needs_input_grad
        wanted = placements.Replicate() if ctx.output_placement.is_partial() else ctx.output_placement
        if is_dtensor(grad_output):
            if grad_output.placements[0] != wanted:
                grad_output = grad_output.redistribute(ctx.mesh, (wanted,))
            grad_output = grad_output.to_local()
        dtype = grad_output.dtype
        grad_x = None
        if needs_x_grad:
            grad_x_local = torch.matmul(grad_output, weight if weight.dtype == dtype else weight.to(dtype))
            if dtype != ctx.input_dtype:
                grad_x_local = grad_x_local.to(ctx.input_dtype)
            partial_sum = placements.Partial() if ctx.colwise else ctx.input_placement
            grad_x = placements.DTensor.from_local(grad_x_local, ctx.mesh, (partial_sum,), run_check=False,
                                                   shape=ctx.input_shape, stride=contiguous_strides(ctx.input_shape))
            if not ctx.input_was_dtensor:
                grad_x = grad_x.redistribute(ctx.mesh, (placements.Replicate(),)).to_local()
        grad_bias = None
        if ctx.bias_shape is not None and needs_bias_grad:
            summed = grad_output.reshape(-1, grad_output.shape[-1]).sum(0).to(ctx.bias_dtype)
            bias_placement = placements.Shard(0) if ctx.colwise else placements.Replicate()
            grad_bias = placements.DTensor.from_local(summed, ctx.mesh, (bias_placement,), run_check=False,
                                                      shape=ctx.bias_shape, stride=(1,))
        x_for_update = x if x.dtype == dtype else x.to(dtype)
        with torch.no_grad():
            run_update(ctx.updater, x_for_update, grad_output)
        return grad_x, None, grad_bias, None


class ForgeLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is updated inside its own backward.

    Never constructed directly: ``forge_core.fuse`` sets ``module.__class__ = ForgeLinear`` on an
    existing ``nn.Linear`` and attaches ``module.forge_updater``. Outside autograd (``no_grad``,
    inference) and without an updater it behaves exactly like ``nn.Linear``.
    """

    forge_updater: Optional[WeightUpdater]
    forge_forward_calls: int
    """Forward calls counted while the fuse-time probe runs (see ``forge_core.manager``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        output = native_forward(self, input)
        if output is not None:
            return output
        updater = getattr(self, "forge_updater", None)
        count_forward(self)
        weight = self.weight             # one nn.Module.__getattr__ (a Parameter is not in __dict__)
        if updater is None or not torch.is_grad_enabled() or not weight.requires_grad:
            return F.linear(input, weight, self.bias)
        if is_dtensor(weight):
            return ShardedLinearFunction.apply(input, weight, self.bias, updater)
        if traced(updater):
            return traced_linear(input, weight, self.bias, updater)
        output = hooked_linear(input, weight, self.bias, updater)
        return output if output is not None else FusedLinearFunction.apply(input, weight, self.bias, updater)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", forge_fused=True"

    def __reduce_ex__(self, protocol: int) -> tuple:
        """A deep copy or pickle is a plain ``nn.Linear`` with the same weights (``forge_core.module_copies``)."""
        return plain_module_reduction(self, nn.Linear, protocol)


def install_forge_linear(module: nn.Linear, updater: WeightUpdater) -> None:
    """Turn ``module`` (exactly an ``nn.Linear``) into a ForgeLinear in place."""
    if type(module) is not nn.Linear:
        raise TypeError(f"only plain nn.Linear modules can be fused, got {type(module).__name__}")
    module.__class__ = ForgeLinear
    module.forge_updater = updater
    module.forge_forward_calls = 0
    module.forge_counting_forwards = False


def remove_forge_linear(module: nn.Module) -> None:
    """Turn a ForgeLinear back into a plain ``nn.Linear`` (same object, same Parameters)."""
    if not isinstance(module, ForgeLinear):
        raise TypeError(f"not a ForgeLinear: {type(module).__name__}")
    for attribute in ("forge_updater", "forge_forward_calls", "forge_counting_forwards"):
        module.__dict__.pop(attribute, None)
    module.__class__ = nn.Linear
