"""Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More"): AdamW with one
second moment per block of parameters instead of one per parameter. Regime 3 (deferred): a block's
second moment is the mean of G^2 over the whole block, which spans many weight tiles.

Per block b of a weight with gradient G, step t::

    W    <- W (1 - lr wd)
    m    <- m.lerp(G, 1 - beta1)                                 (per element, as AdamW)
    v_b  <- beta2 v_b + (1 - beta2) mean_{i in b} G_i^2          (one number per block)
    W    <- W - lr / (1 - beta1^t) * m / (sqrt(v_b / (1 - beta2^t)) + eps)

The partition (the paper's Algorithm 3, by the parameter's name):

* the query and key projections (module names ``q_proj``, ``k_proj``, ``wq``, ``wk``, ``query``,
  ``key``): one block per attention head, i.e. per ``head_dim`` consecutive output rows, when the
  ``head_dim`` hyper-parameter is given and divides the rows (grouped-query keys have fewer heads:
  the same head width, fewer rows);
* every other matrix (value and output projections, MLP, embeddings, the LM head): one block per
  output row (an output neuron; a token for an embedding or the head);
* vectors (norms, biases): one block.

``head_dim=None`` (the default) makes queries and keys per row as well; the harness passes the
model's head width. Defaults: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0``. torch
has no Adam-mini: the unfused form is a ``RuleOptimizer`` on this reference. Where Triton runs, a
matrix takes ``matrix_step``: the same arithmetic in two reads of G (``forge_core.kernels.matrix_steps``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .checks import adam_hyperparameters
from .rule_optimizer import reference_rule
from .scalars import square_root, step_value

DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "head_dim": None}
HEAD_PARTITIONED = ("q_proj", "k_proj", "wq", "wk", "query", "key")
"""Module names whose weight is partitioned by attention head."""


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, Optional[int]]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, beta1, beta2, eps, weight_decay = adam_hyperparameters("adam_mini", full)
    head_dim = None if full["head_dim"] is None else int(full["head_dim"])
    if head_dim is not None and head_dim < 1:
        raise ValueError(f"adam_mini: head_dim must be a positive integer or None, got {full['head_dim']}")
    return lr, beta1, beta2, eps, weight_decay, head_dim


def blocks_of(shape: tuple[int, ...], hp: Mapping[str, Any], name: str) -> int:
    """How many second-moment blocks a parameter of ``shape`` called ``name`` has (the module
    docstring's partition); each block is a run of consecutive rows."""
    head_dim = _checked(hp)[5]
    if len(shape) == 1:
        return 1
    if len(shape) != 2:
        raise ValueError(f"adam_mini: parameters must be 1-D or 2-D, got shape {shape}")
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if module in HEAD_PARTITIONED and head_dim is not None and shape[0] % head_dim == 0:
        return shape[0] // head_dim
    return shape[0]


def state_shapes(shape: tuple[int, ...], hp: Mapping[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """A parameter-shaped first moment and one second moment per block, shaped (blocks, 1)."""
    return {"exp_avg": tuple(shape), "exp_avg_sq": (blocks_of(shape, hp, name), 1)}


def reference(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One Adam-mini step in place (``weight``: fp32 or bf16; fp32 states); the blocks are read off the
    second moment's shape."""
    lr, beta1, beta2, eps, weight_decay, _ = _checked(hp)
    exp_avg, exp_avg_sq = states32["exp_avg"], states32["exp_avg_sq"]
    blocks = exp_avg_sq.shape[0]
    t = step_value(step)
    bias_correction1 = 1.0 - beta1 ** t
    bias_correction2_sqrt = square_root(1.0 - beta2 ** t)
    weight.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad32, 1.0 - beta1)
    per_block = grad32.reshape(blocks, -1)
    block_mean = torch.linalg.vector_norm(per_block, dim=1, keepdim=True).square_().div_(per_block.shape[1])
    exp_avg_sq.mul_(beta2).add_(block_mean, alpha=1.0 - beta2)
    if lr == 0.0:
        return
    # -(sqrt(v / bc2) + eps) * bc1 / lr: one number per block, so the update is one addcdiv
    denominator = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps).mul_(-bias_correction1 / lr)
    weight.view(blocks, -1).addcdiv_(exp_avg.view(blocks, -1), denominator)


def matrix_step(weight: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], hp: Mapping[str, Any],
                step: Any, kernels: Any) -> None:
    """``reference`` for a 2-D weight in two Triton passes over G: the row sums of G^2
    (``kernels.square_sums``), whose block means step the second moments here, then the first
    moment, the decay and W (``kernels.block_adam_update``); G is only read, the first moment read
    and rounded in its stored dtype."""
    lr, beta1, beta2, eps, weight_decay, _ = _checked(hp)
    exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
    blocks = exp_avg_sq.shape[0]
    rows, cols = grad.shape
    row_means = kernels.square_sums(grad, None, 1.0 / cols, columns=False).rows
    block_means = row_means if blocks == rows else row_means.view(blocks, -1).mean(dim=1)
    exp_avg_sq.mul_(beta2).add_(block_means.view_as(exp_avg_sq), alpha=1.0 - beta2)
    t = step_value(step)
    bias2_sqrt = square_root(1.0 - beta2 ** t)
    neg_bias1_over_lr = None if lr == 0.0 else -(1.0 - beta1 ** t) / lr
    kernels.block_adam_update(weight, grad, exp_avg, exp_avg_sq, beta1, 1.0 - lr * weight_decay, eps, bias2_sqrt,
                              neg_bias1_over_lr)


RULE = reference_rule(
    name="adam_mini",
    state_names=("exp_avg", "exp_avg_sq"),
    defaults=DEFAULTS,
    reference=reference,
    matrix_step=matrix_step,
    state_shapes=state_shapes,
    layer_capturable=True,
    signed_states=frozenset({"exp_avg"}),
)
