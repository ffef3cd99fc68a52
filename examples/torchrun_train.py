"""A plain PyTorch training script with FORGE, launched by ``torchrun`` (or ``python``).

The loop is the usual one; FORGE changes two lines: ``forge_core.fuse`` builds the optimizer (the
fused weights are updated inside ``loss.backward()``), and there is no ``clip_grad_norm_`` (a fused
weight's gradient never exists). The scheduler is torch's, on the FORGE optimizer. A checkpoint
is ``model.state_dict()`` and ``optimizer.state_dict()`` as usual; ``--resume`` loads them into a
model fused the same way.

With more than one process (``torchrun --nproc_per_node=N``) the script trains data parallel:
``forge_core.distributed.fuse_data_parallel`` takes the place of both ``fuse`` and DDP (each rank
holds a replica and a slice of the global batch; each fused layer's gradient is all-reduced through
a rotating bucket and then applied by the fused kernel). NCCL on GPUs, gloo on CPUs; rank 0 prints
the global batch's loss and writes the checkpoint, which every rank loads on ``--resume``.
``--unfused`` runs torch's AdamW (inside DDP across processes) for comparison.

Run it (a tiny random-init Llama on synthetic tokens; nothing is downloaded)::

    torchrun --standalone --nproc_per_node=2 examples/torchrun_train.py --steps 50
    python examples/torchrun_train.py --steps 50              # the same run in one process
    python examples/torchrun_train.py --steps 50 --unfused    # the same run with torch's AdamW
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import transformers
from torch.nn.parallel import DistributedDataParallel

import forge_core
import forge_core.distributed

HYPERPARAMETERS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
VOCAB = 256


def tiny_llama(seed: int, device: torch.device) -> transformers.PreTrainedModel:
    """A 2-layer Llama at random init (fp32)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config).to(device)


def batch_at(step: int, batch: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Step ``step``'s synthetic batch (each token the previous one plus one), the same on every run."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = (torch.randint(0, VOCAB, (batch, 1), generator=generator) + torch.arange(seq)) % VOCAB
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def warmup_cosine(steps: int, warmup: int):
    """The learning-rate multiplier of each step: linear warm-up, then cosine to 10%."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def local_slice(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's rows of the global batch (equal slices: the mean of the ranks' losses is the global one)."""
    rows = next(iter(batch.values())).shape[0] // world_size
    return {key: value[rank * rows:(rank + 1) * rows] for key, value in batch.items()}


def main(argv: Optional[Sequence[str]] = None) -> torch.nn.Module:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, over all processes")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unfused", action="store_true", help="torch's AdamW instead of FORGE")
    parser.add_argument("--save", default=None, help="write a checkpoint (model + optimizer + step) here at the end")
    parser.add_argument("--resume", default=None, help="continue from a checkpoint written by --save")
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world_size:
        raise SystemExit(f"torchrun_train.py: --batch {args.batch} does not split over {world_size} processes")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world_size > 1 else 0

    model = tiny_llama(args.seed, device)
    trained = model                 # what steps: the model, or its DDP wrapper (--unfused across processes)
    if args.unfused:
        optimizer = torch.optim.AdamW(model.parameters(), **HYPERPARAMETERS)
        if world_size > 1:
            trained = DistributedDataParallel(model)
    elif world_size > 1:            # instead of DDP: the fused layers' gradients are reduced bucket by bucket
        optimizer = forge_core.distributed.fuse_data_parallel(model, "adamw", **HYPERPARAMETERS)
    else:
        optimizer = forge_core.fuse(model, "adamw", **HYPERPARAMETERS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps, max(1, args.steps // 10)))
    start = 0
    if args.resume:
        saved = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        start = saved["step"]

    model.train()
    for step in range(start, args.steps):
        batch = local_slice(batch_at(step, args.batch, args.seq, device), rank, world_size)
        loss = trained(**batch).loss
        loss.backward()              # FORGE: every fused weight is updated here (across ranks: after its reduction)
        optimizer.step()             # the rest: norms, the embedding, ...
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            shown = loss.detach().clone()
            if world_size > 1:
                dist.all_reduce(shown)
                shown /= world_size
            if rank == 0:
                print(f"step {step:4d}  loss {shown.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if args.save and rank == 0:      # the replicas are identical: one file, which every rank loads
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": args.steps}, args.save)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return model


if __name__ == "__main__":
    main()
