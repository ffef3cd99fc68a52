"""The ranks of tests/test_distributed.py: one pair of gloo processes runs every scenario.

Why one pair for all: starting a process that imports torch, Triton and forge_core takes 10-20 s on
a loaded 2-core machine, a scenario well under one. Each scenario writes, per rank, what the tests
compare (losses, gathered parameters, states, counters, error messages) to ``out/<name>.r<rank>``;
the single-process references run in the test process (``single_run``).

The model: an embedding (a row-gradient embedding under FORGE), two Linear layers with biases, a
LayerNorm and an untied head; a global batch of token ids, split across ranks by rows.
"""
from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import forge_core

VOCAB, DIM, HIDDEN = 11, 8, 24
BATCH, SEQ = 4, 5
GATE_STEPS = 20
SHORT_STEPS = 10
PLACE = {"device": torch.device("cpu"), "dtype": torch.float32}
"""Where the models and batches live: the CPU in fp32 under gloo; a rank's GPU in bf16 under NCCL."""


class TinyLM(nn.Module):
    """Embedding -> residual MLP -> LayerNorm -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(ids)
        return self.norm(hidden + self.down(torch.relu(self.up(hidden))))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(PLACE["device"], PLACE["dtype"])


def make_moe(seed: int = 0) -> nn.Module:
    """A one-layer Qwen3-MoE (8 experts, top-1): fused 3-D expert weights, some experts reached on one
    rank's tokens and not on the other's."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=8, num_experts_per_tok=1, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(config).to(PLACE["device"], PLACE["dtype"])


def moe_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def global_batches(steps: int, micro_batches: int = 1, seed: int = 1) -> list[torch.Tensor]:
    """``steps * micro_batches`` global batches of token ids (BATCH x SEQ each)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(PLACE["device"])
            for _ in range(steps * micro_batches)]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), ids.roll(1, 1).reshape(-1))


def chunked_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``lm_loss`` through the vocab-chunked LM-head loss, 4 vocabulary rows a chunk: a fused head
    is updated (or, under data parallel, its gradient gathered) row block by row block."""
    return forge_core.chunked_lm_head_cross_entropy(model.hidden(ids), model.head, ids.roll(1, 1), shift=False,
                                                   chunk_size=4)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter, gathered where it is a DTensor, in one fp32 vector."""
    parts = []
    for parameter in model.parameters():
        value = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        parts.append(value.detach().float().reshape(-1).cpu())
    return torch.cat(parts)


def flat_states(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Every state tensor of ``optimizer.state_dict()``, local shards, in one fp32 vector."""
    parts = []
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        for key in sorted(state[index]):
            value = state[index][key]
            if isinstance(value, torch.Tensor):
                value = value.to_local() if hasattr(value, "to_local") else value
                parts.append(value.detach().float().reshape(-1).cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


def single_run(optimizer: str, steps: int, *, micro_batches: int = 1, loss_fn: Callable[..., torch.Tensor] = lm_loss,
               model_fn: Callable[[], nn.Module] = make_model, **fuse_options: Any) -> dict[str, Any]:
    """The single-process reference: FORGE on the global batches."""
    model = model_fn()
    opt = forge_core.fuse(model, optimizer, probe_inputs=False, accumulate_steps=micro_batches, **fuse_options)
    batches = global_batches(steps, micro_batches)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            loss = loss_fn(model, batches[step * micro_batches + micro]) / micro_batches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": flat_parameters(model)}


# ----------------------------------------------------------------------------------------------
# Scenarios (each runs on every rank)
# ----------------------------------------------------------------------------------------------

def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], steps: int,
           micro_batches: int = 1, split: bool = True, after_backward: Callable[[], None] | None = None,
           loss_fn: Callable[..., torch.Tensor] = lm_loss) -> list[float]:
    """Steps on the global batches; with ``split`` each rank takes its rows. Returns the global batches'
    losses (the ranks' mean, gathered once at the end: one collective fewer per step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            ids = batches[step * micro_batches + micro]
            local = ids.chunk(world)[rank] if split else ids
            loss = loss_fn(model, local) / micro_batches
            loss.backward()
            total += float(loss.detach())
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    if not split:
        return losses
    summed = torch.tensor(losses, dtype=torch.float64, device=PLACE["device"])
    dist.all_reduce(summed)
    return (summed / world).tolist()


def scenario_dp_adamw(out: dict[str, Any], backend: str = "reference", steps: int = GATE_STEPS,
                      loss_fn: Callable[..., torch.Tensor] = lm_loss, model_fn: Callable[..., nn.Module] = make_model,
                      **options: Any) -> None:
    from forge_core.distributed import fuse_data_parallel
    model = model_fn(seed=0 if dist.get_rank() == 0 else 7)      # rank 0's weights are broadcast
    opt = fuse_data_parallel(model, "adamw", lr=1e-2, weight_decay=0.1, probe_inputs=False, backend=backend,
                             **options)
    out["row_embeddings"] = opt.row_gradient_names()
    out["losses"] = _train(model, opt, global_batches(steps), steps, loss_fn=loss_fn)
    out["params"] = flat_parameters(model)
    out["states"] = flat_states(opt)
    out["reductions"] = opt.distributed.reductions_started


def compiled_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    """``lm_loss`` through ``torch.compile(model, backend="aot_eager")`` (the compiled path of the fused layers)."""
    compiled = torch.compile(model, backend="aot_eager")
    return lambda _model, ids: lm_loss(compiled, ids)


def scenario_dp_compiled(out: dict[str, Any]) -> None:
    from torch._dynamo.utils import counters

    from forge_core.distributed import fuse_data_parallel
    model = make_model(seed=0 if dist.get_rank() == 0 else 7)
    opt = fuse_data_parallel(model, "adamw", lr=1e-2, weight_decay=0.1, probe_inputs=False, backend="reference")
    counters.clear()
    out["losses"] = _train(model, opt, global_batches(SHORT_STEPS), SHORT_STEPS, loss_fn=compiled_loss(model))
    out["params"] = flat_parameters(model)
    out["graph_breaks"] = sum(counters["graph_break"].values())
    out["reductions"] = opt.distributed.reductions_started


def scenario_fsdp_compiled(out: dict[str, Any]) -> None:
    from forge_core.distributed import fuse_fsdp
    model = _fsdp_model()
    opt = fuse_fsdp(model, "adamw", lr=1e-2, weight_decay=0.1, backend="reference")
    out["losses"] = _train(model, opt, global_batches(SHORT_STEPS), SHORT_STEPS, loss_fn=compiled_loss(model))
    out["params"] = flat_parameters(model)


def scenario_dp_accumulate(out: dict[str, Any]) -> None:
    from forge_core.distributed import fuse_data_parallel
    model = make_model()
    opt = fuse_data_parallel(model, "adamw", lr=1e-2, weight_decay=0.1, probe_inputs=False, backend="reference",
                             accumulate_steps=2, embedding_rows=False)
    out["losses"] = _train(model, opt, global_batches(6, 2), 6, micro_batches=2)
    out["params"] = flat_parameters(model)


def scenario_dp_sgd(out: dict[str, Any], backend: str = "reference", steps: int = SHORT_STEPS,
                    micro_batches: int = 1) -> None:
    from forge_core.distributed import fuse_data_parallel
    model = make_model()
    opt = fuse_data_parallel(model, "sgd", lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01,
                             probe_inputs=False, backend=backend, accumulate_steps=micro_batches)
    out["state_reduction"] = opt.distributed.momentum is not None
    out["losses"] = _train(model, opt, global_batches(steps, micro_batches), steps, micro_batches=micro_batches)
    out["params"] = flat_parameters(model)
    out["states"] = flat_states(opt)
    out["reductions"] = opt.distributed.reductions_started


def scenario_dp_state_dict(out: dict[str, Any], folder: Path) -> None:
    from forge_core.distributed import fuse_data_parallel
    batches = global_batches(6)
    model = make_model()
    opt = fuse_data_parallel(model, "adamw", lr=1e-2, probe_inputs=False, backend="reference", state_dtype="bf16")
    _train(model, opt, batches[:3], 3)
    path = folder / "dp_checkpoint.pt"
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    out["continued"] = _train(model, opt, batches[3:], 3)
    resumed_model = make_model(seed=5)
    resumed = fuse_data_parallel(resumed_model, "adamw", lr=1e-2, probe_inputs=False, backend="reference",
                                 state_dtype="bf16", broadcast_from_rank0=False)
    checkpoint = torch.load(path, weights_only=False)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    out["resumed"] = _train(resumed_model, resumed, batches[3:], 3)
    out["params_continued"] = flat_parameters(model)
    out["params_resumed"] = flat_parameters(resumed_model)


def place_mesh() -> Any:
    """A one-dimensional mesh of every rank on this process's device type. FSDP2's ``fully_shard``
    without a mesh takes the accelerator whenever there is one: on a GPU machine it would move the
    gloo scenarios' CPU models to the GPU, and their CPU batches would no longer meet them."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(PLACE["device"].type, (dist.get_world_size(),))


def _fsdp_model() -> TinyLM:
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    mesh = place_mesh()
    for block in (model.up, model.down, model.head):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def scenario_fsdp(out: dict[str, Any], backend: str = "reference", steps: int = GATE_STEPS,
                  state_dtype: str = "fp32") -> None:
    from forge_core.distributed import fuse_fsdp
    model = _fsdp_model()
    opt = fuse_fsdp(model, "adamw", lr=1e-2, weight_decay=0.1, backend=backend, state_dtype=state_dtype)
    grads_left = []

    def after_backward() -> None:
        grads_left.append(sum(p.grad is not None for p in opt.sharded_parameters()))
    out["losses"] = _train(model, opt, global_batches(steps), steps, after_backward=after_backward)
    out["params"] = flat_parameters(model)
    out["sharded"] = len(opt.sharded_parameters())
    out["shard_updates"] = opt.shard_updates
    out["grads_left_after_backward"] = max(grads_left)
    out["local_state_numel"] = sum(s.state.values["exp_avg"].numel() for s in opt.sharded)


def scenario_fsdp_checkpoint(out: dict[str, Any], folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from forge_core.distributed import fuse_fsdp
    batches = global_batches(6)
    model = _fsdp_model()
    opt = fuse_fsdp(model, "adamw", lr=1e-2, backend="reference", state_dtype="int8")
    _train(model, opt, batches[:3], 3)
    checkpoint = str(folder / "fsdp_checkpoint")
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=checkpoint)
    out["continued"] = _train(model, opt, batches[3:], 3)
    resumed_model = _fsdp_model()
    resumed = fuse_fsdp(resumed_model, "adamw", lr=1e-2, backend="reference", state_dtype="int8")
    resumed.initialize_state()
    template = {"model": resumed_model.state_dict(), "optimizer": resumed.state_dict()}
    dcp.load(template, checkpoint_id=checkpoint)
    resumed_model.load_state_dict(template["model"])
    resumed.load_state_dict(template["optimizer"])
    out["resumed"] = _train(resumed_model, resumed, batches[3:], 3)


def _tensor_parallel_model() -> tuple[TinyLM, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = place_mesh()
    model = make_model()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, mesh


def scenario_tp(out: dict[str, Any], folder: Path, backend: str = "reference", steps: int = SHORT_STEPS) -> None:
    from forge_core.distributed import fuse_tensor_parallel
    model, mesh = _tensor_parallel_model()
    opt = fuse_tensor_parallel(model, mesh, "adamw", lr=1e-2, weight_decay=0.1, probe_inputs=False, backend=backend)
    out["fused"] = opt.fused_module_names()
    out["local_up_state"] = tuple(model.up.forge_updater.state.shape)
    batches = global_batches(steps)
    out["losses"] = _train(model, opt, batches, steps, split=False)
    out["params"] = flat_parameters(model)
    if backend != "reference":
        return
    path = folder / f"tp_optimizer.r{dist.get_rank()}.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    out["continued"] = _train(model, opt, batches[:3], 3, split=False)
    resumed_model, mesh = _tensor_parallel_model()
    resumed = fuse_tensor_parallel(resumed_model, mesh, "adamw", lr=1e-2, weight_decay=0.1, probe_inputs=False,
                                   backend=backend)
    saved = torch.load(path, weights_only=False)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    out["resumed"] = _train(resumed_model, resumed, batches[:3], 3, split=False)


def _message(call: Callable[[], Any]) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def scenario_refusals(out: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from forge_core.distributed import fuse_data_parallel, fuse_fsdp
    out["ddp"] = _message(lambda: forge_core.fuse(DistributedDataParallel(make_model()), probe_inputs=False))
    sharded = make_model()
    fully_shard(sharded, mesh=place_mesh())
    out["fsdp"] = _message(lambda: forge_core.fuse(sharded, probe_inputs=False))
    out["tensor_parallel"] = _message(lambda: forge_core.fuse(_tensor_parallel_model()[0], probe_inputs=False))
    out["capturable"] = _message(lambda: fuse_data_parallel(make_model(), capturable=True, probe_inputs=False))
    out["state_adamw"] = _message(lambda: fuse_data_parallel(make_model(), "adamw", reduce="state",
                                                             probe_inputs=False))
    out["state_int8"] = _message(lambda: fuse_data_parallel(make_model(), "sgd", momentum=0.9, reduce="state",
                                                            state_dtype="int8", probe_inputs=False))
    out["fsdp_plain"] = _message(lambda: fuse_fsdp(make_model()))
    out["fsdp_overlap"] = _message(lambda: fuse_fsdp(make_model(), overlap=True))
    out["fsdp_probe"] = _message(lambda: fuse_fsdp(make_model(), probe_inputs=True))


SCENARIOS: dict[str, Callable[..., None]] = {
    "dp_adamw": scenario_dp_adamw,
    "dp_adamw_buckets": lambda out: scenario_dp_adamw(out, steps=4, bucket_cap_mb=400 / 2**20, buckets_in_flight=1),
    "dp_adamw_kernel": lambda out: scenario_dp_adamw(out, backend="auto", steps=3),
    "dp_chunked_loss": lambda out: scenario_dp_adamw(out, steps=4, loss_fn=chunked_loss),
    "dp_experts": lambda out: scenario_dp_adamw(out, steps=4, loss_fn=moe_loss, model_fn=make_moe),
    "dp_accumulate": scenario_dp_accumulate,
    "dp_compiled": scenario_dp_compiled,
    "fsdp_compiled": scenario_fsdp_compiled,
    "dp_sgd": scenario_dp_sgd,
    "dp_sgd_kernel_accumulate": lambda out: scenario_dp_sgd(out, backend="auto", steps=3, micro_batches=2),
    "dp_state_dict": scenario_dp_state_dict,
    "fsdp": scenario_fsdp,
    "fsdp_kernel_int8": lambda out: scenario_fsdp(out, backend="auto", steps=3, state_dtype="int8"),
    "fsdp_checkpoint": scenario_fsdp_checkpoint,
    "tp": scenario_tp,
    "tp_kernel": lambda out, folder: scenario_tp(out, folder, backend="auto", steps=3),
    "refusals": scenario_refusals,
    # the gates on GPUs (NCCL, bf16 weights, the Triton kernels): tests/test_distributed.py's gpu test
    "gpu_dp_adamw": lambda out: scenario_dp_adamw(out, backend="auto"),
    "gpu_dp_sgd": lambda out: scenario_dp_sgd(out, backend="auto", steps=GATE_STEPS),
    "gpu_fsdp": lambda out: scenario_fsdp(out, backend="auto", state_dtype="bf16"),
    "gpu_tp": lambda out, folder: scenario_tp(out, folder, backend="auto", steps=GATE_STEPS),
}
NEEDS_FOLDER = {"dp_state_dict", "fsdp_checkpoint", "tp", "tp_kernel", "gpu_tp"}
CPU_SCENARIOS = [name for name in SCENARIOS if not name.startswith("gpu_")]
GPU_SCENARIOS = [name for name in SCENARIOS if name.startswith("gpu_")]


def place(device_type: str, dtype: torch.dtype, rank: int = 0) -> None:
    """Put the models and batches of this process on ``device_type`` (a CUDA rank: its own GPU)."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        PLACE["device"] = torch.device("cuda", rank)
    else:
        PLACE["device"] = torch.device("cpu")
    PLACE["dtype"] = dtype


def run_rank(rank: int, world_size: int, store: str, folder: str, names: list[str], device_type: str = "cpu",
             dtype: torch.dtype = torch.float32) -> None:
    """One rank: every scenario in ``names``; a failure is written as that scenario's ``error``.
    gloo on the CPU, NCCL with one GPU per rank."""
    place(device_type, dtype, rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=180))
    try:
        for name in names:
            out: dict[str, Any] = {}
            started = time.perf_counter()
            try:
                if name in NEEDS_FOLDER:
                    SCENARIOS[name](out, Path(folder))
                else:
                    SCENARIOS[name](out)
            except Exception:                       # reported by the test that reads this scenario
                out = {"error": traceback.format_exc()}
            out["seconds"] = time.perf_counter() - started      # printed by a failing test, never asserted
            torch.save(out, os.path.join(folder, f"{name}.r{rank}"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
