"""FORGE across ranks on ``torch.distributed``: data parallel, FSDP2 and tensor parallel.

The rule (paper, Proposition 3): the fused update is exact where the rank that steps a weight
block holds that block's complete gradient. Each entry below arranges that and returns a
``torch.optim.Optimizer``; the training loop is the single-GPU one (``loss.backward()`` updates the
weights, ``opt.step()`` steps the rest)::

    # torchrun --nproc-per-node N train.py ; dist.init_process_group("nccl") first
    opt = forge_core.distributed.fuse_data_parallel(model, "adamw", lr=3e-4, state_dtype="bf16")
    # FSDP2: fully_shard(block) for each block, fully_shard(model), then
    opt = forge_core.distributed.fuse_fsdp(model, "adamw", lr=3e-4)
    # Tensor parallel: parallelize_module(model, mesh, {"q": ColwiseParallel(), ...}), then
    opt = forge_core.distributed.fuse_tensor_parallel(model, mesh, "adamw", lr=3e-4)

* ``fuse_data_parallel`` (``data_parallel.py``): replicas, the batch split across ranks. A fused
  weight's local gradient goes through a rotating bucket (all-reduced, then the fused update on the
  reduced bucket); SGD with momentum reduces its momentum in place instead (``affine.py``).
  Do not wrap the model in DDP: this is its replacement.
* ``fuse_fsdp`` (``fsdp.py``): FSDP2 shards; each reduce-scattered gradient shard updates its weight
  shard as it arrives, and is freed.
* ``fuse_tensor_parallel``: DTensor weights sharded by ``ColwiseParallel`` / ``RowwiseParallel``;
  the local shard's gradient is complete, so each rank runs the fused kernel on its shard alone.

State dicts: data parallel, rank 0's ``opt.state_dict()`` is every rank's (save it on rank 0, load it
on every rank); FSDP2, the states are DTensors (``torch.distributed.checkpoint``); tensor parallel,
each rank's ``state_dict()`` holds its shards' states (save and load one file per rank, same mesh).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..manager import fuse
from ..backends import resolve_backend
from ..optimizer import ForgeOptimizer
from ..layer_step import takes_layer_path
from ..rules import Rule, get_rule
from ..rules.checks import betas_pair
from ..state import STATE_DTYPES
from .affine import state_reduction_problem
from .data_parallel import DataParallelUpdates
from .fsdp import FsdpForgeOptimizer

REDUCE_MODES = ("auto", "gradient", "state")
DEFAULT_BUCKET_CAP_MB = 25.0
"""DDP's default ``bucket_cap_mb``."""


def _require_initialized(entry: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{entry} needs torch.distributed initialized (dist.init_process_group, e.g. under torchrun)")


def _refuse(entry: str, options: dict[str, Any], refused: dict[str, str]) -> None:
    """A one-line error for an option ``entry`` does not support (its value set to something other
    than the default)."""
    for key, why in refused.items():
        if options.get(key):
            raise ValueError(f"{entry}: {key}={options[key]!r} is not supported ({why})")


def _refuse_rule(entry: str, rule: Rule, sharded: bool) -> None:
    """A one-line error for a rule these entries cannot step: a per-layer-path rule steps from the layer's
    local gradient before any reduction; a rule reading whole-weight norms (LAMB) sees one shard's."""
    if takes_layer_path(rule):
        raise ValueError(f"{entry}: optimizer {rule.name!r} steps each layer in plain torch from its local, "
                         "unreduced gradient (forge_core.layer_step); it is not supported across ranks")
    if sharded and rule.layer_sums:
        raise ValueError(f"{entry}: optimizer {rule.name!r} reads norms of each whole weight, which a shard "
                         "does not hold")


def fuse_data_parallel(model: nn.Module, optimizer: str = "adamw", *, process_group: Any = None,
                       bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, buckets_in_flight: int = 2,
                       reduce: str = "auto", broadcast_from_rank0: bool = True, **fuse_options: Any) -> ForgeOptimizer:
    """Fuse ``model`` (a replica on this rank; not DDP-wrapped) for data parallelism over ``process_group``
    (default: the world) and return its ``ForgeOptimizer``.

    ``fuse_options``: what ``forge_core.fuse`` takes (``lr``, ``state_dtype``, ``accumulate_steps``, ...).
    ``bucket_cap_mb``: the gradient bucket (DDP's default, 25 MB); ``buckets_in_flight``: reductions
    outstanding before the oldest is waited for and applied (the gradient memory is about this many
    buckets, or the largest weight). ``reduce``: "gradient" (the bucket, any rule), "state" (SGD with
    momentum: reduce the momentum in place, no bucket; a one-line error where it cannot,
    ``affine.state_reduction_problem``) or "auto" (state where it can, else gradient).
    ``broadcast_from_rank0``: copy rank 0's parameters and buffers to every rank first, as DDP does.
    With ``accumulate_steps=k`` only the k-th micro-batch is reduced (the fp32 accumulator, in place).
    ``overlap`` has no effect: each update follows its reduction on the backward's stream (the
    reductions overlap the backward). Not supported (one-line error): ``capturable`` (the
    reductions are ordered by the host)."""
    entry = "fuse_data_parallel"
    _require_initialized(entry)
    if reduce not in REDUCE_MODES:
        raise ValueError(f"{entry}: reduce must be one of {REDUCE_MODES}, got {reduce!r}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"{entry}: bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if isinstance(buckets_in_flight, bool) or not isinstance(buckets_in_flight, int) or buckets_in_flight < 1:
        raise ValueError(f"{entry}: buckets_in_flight must be an integer >= 1, got {buckets_in_flight!r}")
    _refuse(entry, fuse_options, {
        "capturable": "the reductions are ordered by the host, which a replayed CUDA graph cannot follow"})
    fuse_options["overlap"] = False         # each update follows its reduction on the backward's stream
    rule = get_rule(optimizer)
    _refuse_rule(entry, rule, sharded=False)
    hyperparameters = {**dict(rule.defaults), **{k: v for k, v in fuse_options.items() if k in rule.defaults}}
    problem = state_reduction_problem(rule.name, hyperparameters, fuse_options.get("state_dtype", "fp32"),
                                      bool(fuse_options.get("stochastic_rounding", False)))
    if reduce == "state" and problem is not None:
        raise ValueError(f"{entry}: reduce='state' cannot reduce this optimizer's state: {problem}")
    if broadcast_from_rank0:
        source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=source, group=process_group)
    forge_optimizer = fuse(model, optimizer, **fuse_options)
    fused = forge_optimizer.fused_weights()
    forge_optimizer.distributed = DataParallelUpdates(
        forge_optimizer, fused, process_group, int(bucket_cap_mb * 1024 * 1024), buckets_in_flight,
        state_reduction=reduce != "gradient" and problem is None)
    forge_optimizer.prepare_for_compiler()      # its layers' updates now stay eager under torch.compile
    return forge_optimizer


def fuse_fsdp(model: nn.Module, optimizer: str = "adamw", *, lr: Optional[float] = None, state_dtype: str = "fp32",
              stochastic_rounding: bool = False, accumulate_steps: int = 1, backend: str = "auto",
              **hyperparameters: Any) -> FsdpForgeOptimizer:
    """Optimizer for a model already sharded by FSDP2 (``fully_shard`` on its blocks and on itself):
    each 2-D weight's gradient shard updates the weight's shard as FSDP2 delivers it, in the
    backward, and is freed; ``step()`` steps the rest (norms, biases) with the rule's torch optimizer.

    The model's Linear layers stay ``nn.Linear`` (FSDP2 needs their unsharded gradients to
    reduce-scatter). ``accumulate_steps=k``: FSDP2 adds the micro-batches' shards, the k-th updates.
    Not supported (one-line error): ``capturable``, ``max_grad_norm``, ``dense_2d=False``,
    ``embedding_rows`` (every 2-D shard is stepped by the kernel from its gradient shard), ``overlap=True``
    and ``probe_inputs=True`` (``fuse``'s defaults; here the update runs inside FSDP2's backward and the
    layers stay ``nn.Linear``): pass them False or leave them out."""
    entry = "fuse_fsdp"
    _require_initialized(entry)
    _refuse(entry, hyperparameters, {
        "capturable": "FSDP2's collectives are issued by the host",
        "max_grad_norm": "global-norm clipping needs every gradient before any weight moves",
        "embedding_rows": "an FSDP2 embedding's gradient is reduce-scattered as a dense shard",
        "overlap": "each shard is updated in the backward where FSDP2 delivers its gradient, not on a side stream",
        "probe_inputs": "FSDP2's layers stay nn.Linear, so there is no swapped layer whose bypass a probe could catch"})
    if hyperparameters.get("dense_2d") is False:
        raise ValueError(f"{entry}: dense_2d=False is not supported (every 2-D shard is stepped by the kernel)")
    for key in ("capturable", "max_grad_norm", "embedding_rows", "dense_2d", "overlap", "probe_inputs"):
        hyperparameters.pop(key, None)
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        raise ValueError(f"{entry}: the model is not sharded by FSDP2; call torch.distributed.fsdp.fully_shard on "
                         "it (and its blocks) first")
    rule = get_rule(optimizer)
    _refuse_rule(entry, rule, sharded=True)
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{entry}: state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ValueError(f"{entry}: accumulate_steps must be an integer >= 1, got {accumulate_steps!r}")
    given = dict(hyperparameters)
    if lr is not None:
        given["lr"] = lr
    unknown = sorted(set(given) - set(rule.defaults))
    if unknown:
        raise ValueError(f"{entry}: optimizer {rule.name!r} has no hyper-parameter(s) {unknown}")
    full = {**dict(rule.defaults), **given}
    for key in [key for key in full if key.endswith("betas")]:
        full[key] = betas_pair(rule.name, full[key], key)
    rule.fallback_optimizer([{"params": []}], **full)          # the rule validates the values
    problem = rule.format_problem(full, state_dtype)
    if problem is not None:
        raise ValueError(f"{entry}: {problem}")
    devices = {p.device for p in model.parameters()}
    return FsdpForgeOptimizer(model, rule=rule, hyperparameters=full, state_dtype=state_dtype,
                              stochastic_rounding=stochastic_rounding, accumulate_steps=accumulate_steps,
                              backend=resolve_backend(backend, devices))


def fuse_tensor_parallel(model: nn.Module, device_mesh: Any, optimizer: str = "adamw",
                         **fuse_options: Any) -> ForgeOptimizer:
    """Fuse a model whose Linear weights ``parallelize_module`` sharded on the 1-D ``device_mesh``
    (``ColwiseParallel``: W by rows, input replicated; ``RowwiseParallel``: W by columns, input
    sharded on its last dimension): each rank's ForgeLinear runs the fused kernel on its shard with
    its local x and dY, no collective of its own. ``fuse_options``: what ``forge_core.fuse`` takes.
    Not supported (one-line error): ``capturable`` (the DTensor collectives around each layer are
    issued by the host). Replicated parameters (norms, embeddings) get the same gradient on every
    rank and are stepped locally."""
    entry = "fuse_tensor_parallel"
    _require_initialized(entry)
    if getattr(device_mesh, "ndim", None) != 1:
        raise ValueError(f"{entry}: device_mesh must be a 1-D DeviceMesh, got {device_mesh!r}")
    _refuse(entry, fuse_options, {"capturable": "the DTensor collectives around each layer are issued by the host"})
    _refuse_rule(entry, get_rule(optimizer), sharded=True)
    return fuse(model, optimizer, device_mesh=device_mesh, **fuse_options)


__all__ = ["fuse_data_parallel", "fuse_fsdp", "fuse_tensor_parallel", "DataParallelUpdates", "FsdpForgeOptimizer",
           "REDUCE_MODES", "DEFAULT_BUCKET_CAP_MB"]
