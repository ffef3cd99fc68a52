"""forge_core: apply the optimizer inside the kernel that produces each weight gradient.

Public API::

    opt = forge_core.fuse(model, optimizer="adamw", lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                          state_dtype="bf16")     # a torch.optim.Optimizer
    loss.backward()                               # fused Linear weights are updated here
    opt.step(); opt.zero_grad()                   # the rest (biases, norms, embeddings, tied weights)
    forge_core.unfuse(model)                      # plain nn.Linear again, weights as trained

    # An LM head + causal-LM cross-entropy by vocab chunks: no logits tensor, and a fused head is
    # updated chunk by chunk inside this loss's backward (no weight gradient either).
    hidden = model.model(input_ids=ids).last_hidden_state
    loss = forge_core.chunked_lm_head_cross_entropy(hidden, model.lm_head, labels)

    # Llama-style blocks keep about half the activations for backward (same forward, same grads).
    forge_core.lean_activations(model)

Importing forge_core wraps ``torch.optim.Optimizer.load_state_dict`` once, so that a ForgeOptimizer state
dict given to another optimizer class (a FORGE checkpoint resumed by torch's AdamW) is refused in one line
naming it (``forge_core.torch_guards``); every other load is torch's own.
"""
from __future__ import annotations

from .lean import LeanActivationsError, lean_activations
from .linear import ForgeLinear
from .lm_head_loss import chunked_lm_head_cross_entropy, default_chunk_size, keeps_logits
from .manager import fuse, unfuse
from .optimizer import ForgeOptimizer
from .rules import RULES, get_rule
from .state import STATE_DTYPES
from .torch_guards import install_load_guard

install_load_guard()

__all__ = ["fuse", "unfuse", "ForgeOptimizer", "ForgeLinear", "RULES", "get_rule", "STATE_DTYPES",
           "chunked_lm_head_cross_entropy", "default_chunk_size", "keeps_logits", "lean_activations",
           "LeanActivationsError"]
