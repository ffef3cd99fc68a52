"""A plain PyTorch training script with FORGE, launched by ``torchrun`` (or ``python``).

The loop is the usual one; FORGE changes two lines: ``forge_core.fuse`` builds the optimizer (the
fused weights are updated inside ``loss.backward()``), and there is no ``clip_grad_norm_`` (a fused
weight's gradient never exists). The scheduler is torch's, on the FORGE optimizer. A checkpoint
is ``model.state_dict()`` and ``optimizer.state_dict()`` as usual; ``--resume`` loads them into a
model fused the same way.

FORGE trains one model per process: ``fuse`` has no data parallelism (gradients of fused weights
are never all-reduced), so this script refuses a world size above one.

Run it (a tiny random-init Llama on synthetic tokens; nothing is downloaded)::

    torchrun --standalone --nproc_per_node=1 examples/torchrun_train.py --steps 50
    python examples/torchrun_train.py --steps 50 --unfused     # the same run with torch's AdamW
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional, Sequence

import torch
import transformers

import forge_core

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


def main(argv: Optional[Sequence[str]] = None) -> torch.nn.Module:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unfused", action="store_true", help="torch's AdamW instead of FORGE")
    parser.add_argument("--save", default=None, help="write a checkpoint (model + optimizer + step) here at the end")
    parser.add_argument("--resume", default=None, help="continue from a checkpoint written by --save")
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise SystemExit(f"torchrun_train.py: WORLD_SIZE={world_size}, but FORGE trains one model per process "
                         "(fused gradients are never all-reduced); run with --nproc_per_node=1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")

    model = tiny_llama(args.seed, device)
    if args.unfused:
        optimizer = torch.optim.AdamW(model.parameters(), **HYPERPARAMETERS)
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
        loss = model(**batch_at(step, args.batch, args.seq, device)).loss
        loss.backward()              # FORGE: every fused weight is updated here
        optimizer.step()             # the rest: norms, the embedding, ...
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": args.steps}, args.save)
    return model


if __name__ == "__main__":
    main()
