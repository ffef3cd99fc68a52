"""FORGE's fused updates as operators that ``torch.compile`` sees.

Why: under ``torch.compile`` an autograd Function whose backward calls into Python objects (the
optimizer, its counters, a side stream) breaks the graph at every fused layer, and a CUDA graph
recorded by ``mode="reduce-overhead"`` replays only device work. So the compiled path of each fused
module is an autograd Function whose backward computes ``dX`` (from the pre-update weight), then calls
one registered mutating operator with every tensor the update writes: the weight, its optimizer state
(the state arena's buffers its moments and int8 / fp8 scales lie in, per-layer sums, accumulator) and the
group's device scalars buffer. The
operator is opaque to the compiler (``torch.library.custom_op``, with a fake kernel that returns
nothing): its body runs at run time, where it finds its owner (``FusedWeight`` / ``DenseWeight``)
through an integer key the graph holds as a constant, and launches the same kernels as the eager
path, with no side stream. Its optimizer reads the step count and the rule's scalars from device
tensors once a traced update has run (``ForgeOptimizer.traced_update``), so a recorded CUDA graph
replays correct updates at later steps, and a learning-rate schedule changes nothing the compiler
guards on.

The owner's methods do the work; this module holds only the operators, their keys and the written
tensors' list, so it imports nothing of forge_core.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from typing import Any, Iterator, Optional

import torch

from forge_core import state_arena

_OWNERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_IN_TRACED_UPDATE = [0]


def trace_key(owner: Any) -> int:
    """The integer a compiled graph names ``owner`` by (made once per owner, kept in ``owner.trace_key``)."""
    key = getattr(owner, "trace_key", None)
    if key is None or _OWNERS.get(key) is not owner:
        key = next(_KEYS)
        _OWNERS[key] = owner
        owner.trace_key = key
    return key


def traced(owner: Any) -> bool:
    """Whether a fused module's forward takes its compiled path: under ``torch.compile``, for an owner that a
    single-process ``ForgeOptimizer`` gave its traced arguments (``remember_traced_arguments``)."""
    return torch.compiler.is_compiling() and getattr(owner, "traced_arguments", None) is not None


def remember_traced_arguments(owner: Any) -> None:
    """Keep on ``owner`` what its compiled forward hands the update operator (``arguments_of``): ``(shared, key,
    *own)``, the number of its entry in the table of tensors many owners write (its group's device scalars and
    the state arena's buffers, ``_SHARED``), its key (``trace_key``) and its written tensors that lie in no
    arena; None where its updates stay eager. The distributed entries' updates stay eager (the compiler breaks
    the graph at each of their modules): FORGE-FSDP2's owners have no key, and FORGE-DP applies a layer's
    update when its bucket is reduced, after the layer's backward, which an operator that must have written
    its tensors when it returns cannot express.

    Why one tuple: Dynamo re-checks, at every call of a compiled forward, each attribute the trace read.
    Reading the owner's state, its dicts, its optimizer, key and accumulator cost ~30 guards a fused layer
    (a 16-layer tiny Llama's guard check: 346 us a call against fused AdamW's 93, 2-core CPU); a tuple costs
    its length check and a guard an element. Why a shared table: a tensor that two layers' tuples both hold
    reaches Dynamo by two paths, and it re-checks that they are one tensor with a Python guard a layer
    (~1-2 us each, twice a layer with device scalars); read from one global entry it is one input, checked
    once. The tuple is made again wherever one of its parts changes: at ``fuse``, a data-parallel wrap, an
    embedding's new state or slot table."""
    optimizer = getattr(owner, "optimizer", None)
    key = getattr(owner, "trace_key", None)
    if key is None or optimizer is None or getattr(optimizer, "distributed", None) is not None:
        owner.traced_arguments = None
        return
    arenas = tuple(getattr(owner, "state_arenas", ()))
    written = written_tensors(owner)
    shared = _share(optimizer, (optimizer.device_scalars_of(owner), *arenas))
    owner.traced_arguments = (shared, key, *written[len(arenas):])


_SHARED: dict[int, tuple] = {}
"""The tensors that many owners' updates write, one entry per optimizer and (scalars, arenas) set, read by
``arguments_of`` under the compiler; an entry lives as long as its optimizer (``_share``)."""
_SHARED_KEYS: "weakref.WeakKeyDictionary[Any, dict[tuple, int]]" = weakref.WeakKeyDictionary()


def _share(optimizer: Any, tensors: tuple) -> int:
    """The ``_SHARED`` entry holding ``tensors`` for ``optimizer`` (made on first use, dropped with it). Found by
    the tensors' ids: the entry holds them for as long as ``optimizer`` lives, so no other tensor can take one."""
    entries = _SHARED_KEYS.get(optimizer)
    if entries is None:
        entries = _SHARED_KEYS[optimizer] = {}
    identity = tuple(id(tensor) for tensor in tensors)
    number = entries.get(identity)
    if number is None:
        number = next(_KEYS)
        entries[identity] = number
        _SHARED[number] = tensors
        weakref.finalize(optimizer, _SHARED.pop, number, None)
    return number


def arguments_of(owner: Any) -> tuple:
    """What a compiled forward hands ``owner``'s update operator: ``(scalars, key, *written)``, its group's
    device scalars buffer (None without one), its key and ``written_tensors(owner)`` in their order."""
    shared, key, *own = owner.traced_arguments
    scalars, *arenas = _SHARED[shared]
    return (scalars, key, *arenas, *own)


def count_forward(module: Any) -> None:
    """Count a fused module's forward while the fuse-time probe runs (``forge_core.manager``). Under the
    compiler the count is never taken (the probe runs eagerly), and not reading the flag there spares Dynamo
    two guards a layer, re-checked at every call of the compiled forward."""
    if not torch.compiler.is_compiling() and getattr(module, "forge_counting_forwards", False):
        module.forge_forward_calls += 1


def owner_of(key: int) -> Any:
    """The owner ``trace_key`` gave ``key``; a one-line error when it is gone (its optimizer was dropped)."""
    owner = _OWNERS.get(int(key))
    if owner is None:
        raise RuntimeError(f"a compiled FORGE update names fused weight #{key}, which no longer exists: the model "
                           "was fused again or its optimizer dropped; compile the model again after forge_core.fuse")
    return owner


def state_tensors(owner: Any) -> list[torch.Tensor]:
    """The tensors of ``owner``'s state, in a fixed order: each state's values and scales, a regime-2 rule's
    per-layer sums."""
    state = owner.state
    tensors: list[torch.Tensor] = []
    if state is not None:
        for name in state.state_names:
            tensors.append(state.values[name])
            scale = state.scales.get(name)
            if scale is not None:
                tensors.append(scale)
        if state.layer_sums is not None:
            tensors.append(state.layer_sums)
    return tensors


def written_tensors(owner: Any) -> list[torch.Tensor]:
    """Every tensor an update of ``owner`` writes besides the weight, in a fixed order (the operator's
    ``written`` argument): the state arena's buffers its states lie in (``owner.state_arenas``, set by
    ``ForgeOptimizer``: ``forge_core.state_arena``), its state tensors that lie in none, the micro-batch
    accumulator and an embedding's slot table."""
    arenas = tuple(getattr(owner, "state_arenas", ()))
    tensors = list(arenas)
    tensors += [tensor for tensor in state_tensors(owner) if state_arena.inside(tensor, arenas) is None]
    accumulator = getattr(owner, "grad_accum", None)
    if accumulator is not None:
        tensors.append(accumulator)
    slots = getattr(owner, "slots", None)
    if slots is not None:
        tensors.append(slots)
    return tensors


def keep_static(tensors: list[torch.Tensor]) -> None:
    """Tell the compiler that ``tensors`` keep their addresses for the life of the model
    (``torch._dynamo.mark_static_address``): a CUDA graph recorded by ``mode="reduce-overhead"`` then
    reads and writes them in place instead of copying each into a buffer of its own at every replay
    (an 8B model's moments are 32 GB) and updating the copy."""
    on_gpu = [tensor for tensor in tensors if tensor.is_cuda]
    if not on_gpu:                 # CUDA graphs only: a CPU model need not import the compiler
        return
    import torch._dynamo

    for tensor in on_gpu:
        torch._dynamo.mark_static_address(tensor, guard=False)


def same_tensors(given: list[torch.Tensor], owned: list[torch.Tensor]) -> bool:
    """Whether ``given`` are ``owned`` themselves (same storage, shape and strides), not copies of them
    (``torch.library.opcheck`` calls an operator on copies)."""
    if len(given) != len(owned):
        return False
    for a, b in zip(given, owned):
        if a is not b and (a.data_ptr() != b.data_ptr() or a.shape != b.shape or a.stride() != b.stride()):
            return False
    return True


@contextlib.contextmanager
def traced_update_scope() -> Iterator[None]:
    """Marks the run-time body of a traced update: no side stream, no deferral to the backward's end."""
    _IN_TRACED_UPDATE[0] += 1
    try:
        yield
    finally:
        _IN_TRACED_UPDATE[0] -= 1


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a build or machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def in_traced_update() -> bool:
    """Whether the caller runs inside a traced update's body (``traced_update_scope``)."""
    return _IN_TRACED_UPDATE[0] > 0


def _declares_weight_mutation() -> bool:
    """Whether the operators declare the weight among the tensors they mutate. AOTAutograd accepts an
    in-place update of a grad-requiring forward input inside the backward from torch 2.13 on (it copies
    the result back under no_grad); torch 2.11 refuses it ("a leaf Variable that requires grad is being
    used in an in-place operation"). There the weight is updated in place undeclared, after the
    tensors named in the operator's ``after`` (the layer's dX: the only reader of the pre-update weight).
    ``FORGE_DECLARE_WEIGHT_MUTATION=0`` / ``1`` overrides (tests run both)."""
    override = os.environ.get("FORGE_DECLARE_WEIGHT_MUTATION")
    if override is not None:
        return override != "0"
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


DECLARES_WEIGHT_MUTATION = _declares_weight_mutation()
MUTATED = ("weight", "written", "scalars") if DECLARES_WEIGHT_MUTATION else ("written", "scalars")
"""What the update operators declare they mutate (``_declares_weight_mutation``)."""


_LIBRARY = torch.library.Library("forge", "FRAGMENT")


def mutating_operator(name: str, arguments: str, body: Any, tags: tuple = ()) -> Any:
    """Register ``forge::<name>(<arguments>) -> ()``, whose run-time kernel is ``body`` and whose fake kernel
    does nothing, and return its ``OpOverload``. ``arguments`` writes the schema's alias annotations itself
    (``Tensor(a!) weight``: what the operator mutates).

    Why not ``torch.library.custom_op``: its Python layers around the kernel (an autograd kernel, a version
    bump per mutated tensor, an aliasing check, default filling) ran at every call of a compiled backward,
    once per fused layer: a no-op operator took 35.6 us a call through them against 3.9 through the
    dispatcher alone (2-core CPU); the update operators return nothing and need no autograd formula."""
    _LIBRARY.define(f"{name}({arguments}) -> ()", tags=tags)
    _LIBRARY.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"forge::{name}", _does_nothing, lib=_LIBRARY)
    return getattr(torch.ops.forge, name).default


def _does_nothing(*args: Any, **kwargs: Any) -> None:
    """The fake kernel of an operator that returns nothing: what the compiler traces of its call."""
    return None


WEIGHT = "Tensor(a!) weight" if DECLARES_WEIGHT_MUTATION else "Tensor weight"
"""The weight argument of the update operators' schemas (``MUTATED``)."""


def run_traced_update(x: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor, written: list[torch.Tensor],
                      scalars: Optional[torch.Tensor], after: list[torch.Tensor], key: int) -> None:
    """One fused update of the weight ``key`` names from ``(x, grad_output)`` (its kernel's ``dY^T X``),
    once ``after`` exist: the body of ``forge::update_weight_``. On CUDA tensors, where the C++ hook is loaded,
    the operator's kernel is ``forge_core.native_hooks``', which replays the weight's recorded update where
    it was given its owner's tensors and calls this otherwise."""
    owner = owner_of(key)
    with traced_update_scope():
        owner.optimizer.traced_update(owner, x, grad_output, weight, written, scalars)


update_weight_ = mutating_operator(
    "update_weight_", f"Tensor x, Tensor grad_output, {WEIGHT}, Tensor(b!)[] written, Tensor(c!)? scalars, "
    "Tensor[] after, int key", run_traced_update)


def _update_embedding_rows(ids: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor,
                           written: list[torch.Tensor], scalars: Optional[torch.Tensor], key: int) -> None:
    """The row update of the embedding ``key`` names from this backward's ids and output gradient."""
    owner = owner_of(key)
    with traced_update_scope():
        owner.optimizer.traced_row_update(owner, ids, grad_output, weight, written, scalars)


update_embedding_rows_ = mutating_operator(
    "update_embedding_rows_", f"Tensor ids, Tensor grad_output, {WEIGHT}, Tensor(b!)[] written, "
    "Tensor(c!)? scalars, int key", _update_embedding_rows)


__all__ = ["DECLARES_WEIGHT_MUTATION", "MUTATED", "WEIGHT", "arguments_of", "count_forward", "graph_capturing", "in_traced_update", "keep_static", "mutating_operator", "owner_of", "remember_traced_arguments", "run_traced_update", "same_tensors", "state_tensors", "trace_key", "traced", "traced_update_scope", "update_embedding_rows_",
           "update_weight_", "written_tensors"]
