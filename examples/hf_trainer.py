"""FORGE inside Hugging Face's ``Trainer``.

``forge_core.fuse`` returns a ``torch.optim.Optimizer``; hand it to the Trainer with a scheduler
through ``optimizers=(optimizer, scheduler)``. Two settings matter:

* ``max_grad_norm=0``: the Trainer's default (1.0) clips the global gradient norm before the
  optimizer step, but a fused weight is updated inside backward and its gradient never exists, so
  clipping could only see the other parameters' gradients (``fuse`` documents why it raises on
  ``max_grad_norm``; ``torch.nn.utils.clip_grad_norm_`` raises on a fused weight). With 0 the
  Trainer does not clip; it still measures a norm for its log (``clip_grad_norm_`` with an infinite
  bound, which FORGE lets through with a warning), so the ``grad_norm`` it logs is the norm of the
  gradients that exist (norms, biases), not of the whole model's.
* the scheduler is built on the FORGE optimizer itself: it edits ``param_groups[i]["lr"]``, which
  the fused update reads at every backward.

Run it (a tiny random-init Llama on synthetic tokens; nothing is downloaded)::

    python examples/hf_trainer.py --steps 20            # FORGE
    python examples/hf_trainer.py --steps 20 --unfused  # the same run with torch's AdamW
    python examples/hf_trainer.py --steps 20 --compile inductor   # the Trainer's torch_compile=True
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Any, Optional, Sequence

import torch
import transformers

import forge_core

HYPERPARAMETERS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
VOCAB = 256


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    """A 2-layer Llama at random init (fp32)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def token_dataset(examples: int, seq: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Synthetic sequences with a pattern to learn (each token is the previous one plus one)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (examples, 1), generator=generator)
    ids = (starts + torch.arange(seq)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def train(model: torch.nn.Module, *, steps: int, fused: bool, output_dir: str, seed: int = 0,
          batch_size: int = 4, seq: int = 32, compile_backend: Optional[str] = None) -> list[dict[str, Any]]:
    """Train ``model`` ``steps`` steps with the Trainer; returns the Trainer's log history. ``compile_backend``:
    the Trainer compiles the model (``torch_compile=True``) with this ``torch.compile`` backend."""
    if fused:
        optimizer = forge_core.fuse(model, "adamw", **HYPERPARAMETERS)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **HYPERPARAMETERS)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=max(1, steps // 10),
                                                             num_training_steps=steps)
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
        max_grad_norm=0.0,                    # no global-norm clipping: fused gradients never exist
        logging_steps=1, save_strategy="no", report_to="none", seed=seed, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), torch_compile=compile_backend is not None,
        **({"torch_compile_backend": compile_backend} if compile_backend is not None else {}))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_dataset(steps * batch_size, seq),
                                   optimizers=(optimizer, scheduler))
    trainer.train()
    return trainer.state.log_history


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--unfused", action="store_true", help="torch's AdamW instead of FORGE")
    parser.add_argument("--output-dir", default=None, help="the Trainer's folder (default: a temporary one)")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="let the Trainer compile the model (torch_compile=True) with this backend, e.g. inductor")
    args = parser.parse_args(argv)
    model = tiny_llama()
    with tempfile.TemporaryDirectory() as scratch:
        history = train(model, steps=args.steps, fused=not args.unfused, output_dir=args.output_dir or scratch,
                        compile_backend=args.compile)
    losses = [entry["loss"] for entry in history if "loss" in entry]
    print(f"{'torch AdamW' if args.unfused else 'FORGE'}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"over {len(losses)} steps")
    return history


if __name__ == "__main__":
    main()
