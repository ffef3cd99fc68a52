"""The distributed arms: torch's and FORGE's data parallel, FSDP2 and tensor parallel.

Each builder runs on every rank of one torchrun process tree (``forge_bench/dist_cell.py``), with
``torch.distributed`` initialized (NCCL on GPUs, gloo on the CPU) and the model built on the
rank's device from the same seed on every rank. The baselines are the stock torch recipes:

* ``ddp_adamw_fused``: ``DistributedDataParallel(bucket_cap_mb=..., gradient_as_bucket_view=True)``
  and ``AdamW(fused=True)``. Bucket views are DDP's memory-lean setting: the gradients live in the
  reducer's buckets (one gradient pool, allocated for good) instead of beside them (two);
* ``fsdp2_adamw``: ``fully_shard`` on every decoder block and on the model, ``AdamW(foreach=True)``
  over the sharded (DTensor) parameters;
* ``tp_adamw``: ``parallelize_module`` with the Llama plan (``llama_tp_plan``), ``AdamW(foreach=True)``.

The FORGE arms put ``forge_core.distributed`` on the same layouts. ``forge_core`` is imported inside
their builders: a torch arm's cell never imports Triton.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from forge_bench.arm import ArmUnavailable, TrainConfig, trainable_parameters

STRATEGIES = ("dp", "fsdp2", "tp")
"""dp: replicas, the batch split across ranks; fsdp2: sharded weights, the batch split; tp: weights
sharded by Linear rows / columns, every rank on the same batch."""

DATA_SPLIT = {"dp": True, "fsdp2": True, "tp": False}
"""Whether each rank trains on its own batch (a global batch of world_size x batch sequences)."""

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return int(total)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's state tensors on this rank."""
    return local_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


class DistArm:
    """One rank's arm: ``step`` runs forward (through ``wrapped``, e.g. the DDP module), backward,
    the optimizer step and frees the gradients; ``memory_breakdown`` counts this rank's bytes."""

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any], wrapped: nn.Module | None = None,
                 gradient_bytes: Callable[[], int] | None = None, n_fused_params: int = 0) -> None:
        self.model = model
        self.wrapped = wrapped if wrapped is not None else model
        self.optimizer = optimizer
        self.settings = dict(settings)
        self.n_fused_params = int(n_fused_params)
        self._gradient_bytes = gradient_bytes or (lambda: local_bytes(trainable_parameters(model)))

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = self.wrapped(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def memory_breakdown(self) -> Mapping[str, int]:
        breakdown = getattr(self.optimizer, "memory_breakdown", None)
        if callable(breakdown):
            return {k: int(v) for k, v in breakdown().items()}
        states = sum(s.state.nbytes() for s in getattr(self.optimizer, "sharded", []))
        fallback = getattr(self.optimizer, "fallback_optimizer", self.optimizer)
        return {"weights": local_bytes(self.model.parameters()), "optimizer_states": states + state_bytes(fallback),
                "gradients": self._gradient_bytes()}


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder blocks (transformers: ``model.model.layers``, GPT-2's
    ``transformer.h``); ArmUnavailable when there is none."""
    for name in ("model.layers", "transformer.h", "layers"):
        try:
            blocks = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return blocks
    raise ArmUnavailable(f"{type(model).__name__} has no stack of decoder blocks (model.layers) to shard")


def shard_fsdp2(model: nn.Module) -> None:
    """FSDP2 as its docs recommend: ``fully_shard`` on every decoder block, then on the model."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_blocks(model):
        fully_shard(block)
    fully_shard(model)


def llama_tp_plan(model: nn.Module, world_size: int) -> dict[str, Any]:
    """The Megatron split of a Llama-style block: q, k, v, gate, up column-wise; o, down row-wise
    (attention heads and the MLP's hidden units divided across ranks). ArmUnavailable for a model
    without those projections, or whose head counts the world size does not divide."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, attribute, None)
        if isinstance(count, int) and count % world_size:
            raise ArmUnavailable(f"tensor parallel over {world_size} ranks needs {attribute} ({count}) divisible by it")
    plan: dict[str, Any] = {}
    for index, block in enumerate(decoder_blocks(model)):
        names = dict(block.named_modules())
        missing = [name for name in COLWISE + ROWWISE if name not in names]
        if missing:
            raise ArmUnavailable(f"the tensor-parallel plan needs Llama-style blocks; block {index} lacks {missing}")
        prefix = f"{_blocks_name(model)}.{index}"
        plan.update({f"{prefix}.{name}": ColwiseParallel() for name in COLWISE})
        plan.update({f"{prefix}.{name}": RowwiseParallel() for name in ROWWISE})
    return plan


def _blocks_name(model: nn.Module) -> str:
    blocks = decoder_blocks(model)
    return next(name for name, module in model.named_modules() if module is blocks)


def shard_tensor_parallel(model: nn.Module) -> Any:
    """``parallelize_module`` with ``llama_tp_plan`` on a 1-D mesh of every rank; returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    parallelize_module(model, mesh, llama_tp_plan(model, dist.get_world_size()))
    return mesh


def _adamw(params: list[nn.Parameter], cfg: TrainConfig, flags: Mapping[str, bool]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **flags)


def _adamw_settings(cfg: TrainConfig, **more: Any) -> dict[str, Any]:
    return {"optimizer": "torch.optim.AdamW", "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps,
            "weight_decay": cfg.weight_decay, **more}


def build_ddp_adamw_fused(model: nn.Module, cfg: TrainConfig) -> DistArm:
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True)
    flags = {"fused": True}
    optimizer = _adamw(trainable_parameters(model), cfg, flags)
    settings = _adamw_settings(cfg, strategy="dp", wrapper="DistributedDataParallel",
                               bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True, **flags)
    return DistArm(model, optimizer, settings, wrapped=wrapped)


def build_fsdp2_adamw(model: nn.Module, cfg: TrainConfig) -> DistArm:
    shard_fsdp2(model)
    flags = {"foreach": True}
    optimizer = _adamw(trainable_parameters(model), cfg, flags)
    return DistArm(model, optimizer, _adamw_settings(cfg, strategy="fsdp2", wrapper="fully_shard", **flags))


def build_tp_adamw(model: nn.Module, cfg: TrainConfig) -> DistArm:
    shard_tensor_parallel(model)
    flags = {"foreach": True}
    optimizer = _adamw(trainable_parameters(model), cfg, flags)
    return DistArm(model, optimizer, _adamw_settings(cfg, strategy="tp", plan="llama colwise/rowwise", **flags))


def _forge_settings(cfg: TrainConfig, entry: str, state_dtype: str, optimizer: Any, **more: Any) -> dict[str, Any]:
    return {"optimizer": f"forge_core.distributed.{entry}(adamw)", "lr": cfg.lr, "betas": list(cfg.betas),
            "eps": cfg.eps, "weight_decay": cfg.weight_decay, "state_dtype": state_dtype,
            "backend": getattr(optimizer, "backend", "auto"), **more}


def forge_dp_builder(state_dtype: str) -> Callable[[nn.Module, TrainConfig], DistArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> DistArm:
        from forge_core.distributed import fuse_data_parallel

        optimizer = fuse_data_parallel(model, "adamw", lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                       weight_decay=cfg.weight_decay, state_dtype=state_dtype,
                                       bucket_cap_mb=cfg.bucket_cap_mb)
        settings = _forge_settings(cfg, "fuse_data_parallel", state_dtype, optimizer, strategy="dp",
                                   bucket_cap_mb=cfg.bucket_cap_mb,
                                   row_gradient_embeddings=optimizer.row_gradient_names())
        return DistArm(model, optimizer, settings,
                       n_fused_params=sum(p.numel() for p in optimizer.fused_parameters()))
    return build


def forge_fsdp2_builder(state_dtype: str) -> Callable[[nn.Module, TrainConfig], DistArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> DistArm:
        from forge_core.distributed import fuse_fsdp

        shard_fsdp2(model)
        optimizer = fuse_fsdp(model, "adamw", lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                              weight_decay=cfg.weight_decay, state_dtype=state_dtype)
        settings = _forge_settings(cfg, "fuse_fsdp", state_dtype, optimizer, strategy="fsdp2")
        return DistArm(model, optimizer, settings,
                       gradient_bytes=lambda: local_bytes(optimizer.fallback_parameters()),
                       n_fused_params=sum(p.numel() for p in optimizer.sharded_parameters()))
    return build


def forge_tp_builder(state_dtype: str) -> Callable[[nn.Module, TrainConfig], DistArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> DistArm:
        from forge_core.distributed import fuse_tensor_parallel

        mesh = shard_tensor_parallel(model)
        optimizer = fuse_tensor_parallel(model, mesh, "adamw", lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                         weight_decay=cfg.weight_decay, state_dtype=state_dtype)
        settings = _forge_settings(cfg, "fuse_tensor_parallel", state_dtype, optimizer, strategy="tp",
                                   plan="llama colwise/rowwise")
        return DistArm(model, optimizer, settings,
                       n_fused_params=sum(p.numel() for p in optimizer.fused_parameters()))
    return build


__all__ = ["DATA_SPLIT", "DistArm", "STRATEGIES", "build_ddp_adamw_fused", "build_fsdp2_adamw", "build_tp_adamw",
           "decoder_blocks", "forge_dp_builder", "forge_fsdp2_builder", "forge_tp_builder", "llama_tp_plan",
           "local_bytes", "shard_fsdp2", "shard_tensor_parallel"]
