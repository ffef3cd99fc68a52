"""GaLore AdamW (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection"), as galore_torch's ``GaLoreAdamW`` computes it with ``proj_type="std"``. Regime 3
(deferred): the projection reads the layer's whole gradient.

Per weight W (m x n) with gradient G, step t, rank r = min(rank, m, n)::

    every update_proj_gap steps (t = 1, 1 + gap, ...): P from the SVD of G
        m >= n: P = V_r^T (r x n), R = G P^T (m x r)     m < n: P = U_r (m x r), R = P^T G (r x n)
    M <- beta1 M + (1 - beta1) R;  V <- beta2 V + (1 - beta2) R^2          (moments of R's shape)
    N  = M / (sqrt(V) + eps)
    W <- W - lr sqrt(1 - beta2^t) / (1 - beta1^t) * scale * (N P  or  P N)
    W <- W - lr weight_decay W                                            (after the update, as galore_torch)

Composed with FORGE, G is formed, projected and freed inside the layer's backward
(``forge_core.layer_step``): no gradient pool, and moments of rank r. Only the hidden weights are
projected (``Rule.hidden_weights_only``, as GaLore's recipes target attention and MLP weights); the
head, embeddings, norms and biases are stepped by the same AdamW without a projection (``rank=0``).
``svd="randomized"`` takes the projection from ``torch.svd_lowrank`` (r + 10 columns, 2 power
iterations) instead of a full SVD: on Llama-3.1-8B a refresh of every projection by full SVDs takes
minutes (D67). Defaults are galore_torch's: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-6,
weight_decay=0.0`` and its README's ``rank=128, update_proj_gap=200, scale=0.25``. The refresh is a
host decision on the step count, so the step cannot be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .checks import betas_pair
from .rule_optimizer import reference_rule

DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "rank": 128,
            "update_proj_gap": 200, "scale": 0.25, "svd": "full"}
SVD_KINDS = ("full", "randomized")
RANDOMIZED_OVERSAMPLING = 10
RANDOMIZED_ITERATIONS = 2
RANDOMIZED_SEED = 0


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, int, int, float, str]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, eps, weight_decay, scale = (float(full[key]) for key in ("lr", "eps", "weight_decay", "scale"))
    beta1, beta2 = betas_pair("galore_adamw", full["betas"])
    rank, gap, svd = full["rank"], full["update_proj_gap"], full["svd"]
    if not lr >= 0.0:
        raise ValueError(f"galore_adamw: lr must be >= 0, got {lr}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"galore_adamw: betas must lie in [0, 1), got {full['betas']}")
    if not eps >= 0.0 or not weight_decay >= 0.0:
        raise ValueError(f"galore_adamw: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"galore_adamw: rank must be an integer >= 0 (0: no projection), got {rank!r}")
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
        raise ValueError(f"galore_adamw: update_proj_gap must be an integer >= 1, got {gap!r}")
    if svd not in SVD_KINDS:
        raise ValueError(f"galore_adamw: svd must be one of {SVD_KINDS}, got {svd!r}")
    return lr, beta1, beta2, eps, weight_decay, rank, gap, scale, svd


def projected_rank(shape: tuple[int, ...], rank: int) -> int:
    """The rank a weight of ``shape`` is projected to (0: it is not projected)."""
    return min(rank, *shape) if len(shape) == 2 and rank > 0 else 0


def state_shapes(shape: tuple[int, ...], hp: Mapping[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """A projected weight keeps its projection and moments of the projected gradient's shape; any
    other parameter AdamW's two moments of its own shape."""
    r = projected_rank(tuple(shape), _checked(hp)[5])
    if r == 0:
        return {"exp_avg": tuple(shape), "exp_avg_sq": tuple(shape)}
    m, n = shape
    moments = (m, r) if m >= n else (r, n)
    return {"projector": (r, n) if m >= n else (m, r), "exp_avg": moments, "exp_avg_sq": moments}


def orthogonal_basis(grad: torch.Tensor, r: int, svd: str) -> torch.Tensor:
    """galore_torch's projection of ``grad`` (m x n): its top-r right singular vectors as rows
    (r x n) when m >= n, else its top-r left singular vectors (m x r)."""
    m, n = grad.shape
    if svd == "randomized":
        # the range finder's random matrix from a fixed seed, on a forked RNG: the projection is the
        # same on a resumed run, and the training's own random stream (dropout) is left as it was
        with torch.random.fork_rng(devices=[grad.device] if grad.is_cuda else []):
            if grad.is_cuda:
                with torch.cuda.device(grad.device):
                    torch.cuda.manual_seed(RANDOMIZED_SEED)
            else:
                torch.random.default_generator.manual_seed(RANDOMIZED_SEED)
            u, _, v = torch.svd_lowrank(grad, q=min(r + RANDOMIZED_OVERSAMPLING, m, n), niter=RANDOMIZED_ITERATIONS)
        return v[:, :r].t() if m >= n else u[:, :r]
    u, _, vh = torch.linalg.svd(grad, full_matrices=False)
    return vh[:r, :] if m >= n else u[:, :r]


def _step_count(step: Any) -> int:
    if isinstance(step, torch.Tensor):
        raise ValueError("galore_adamw: the projection refresh needs the step count on the host (not capturable)")
    return int(step)


def reference(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One GaLore AdamW step in place (``weight``: fp32 or bf16, each op in fp32; fp32 states)."""
    lr, beta1, beta2, eps, weight_decay, _, gap, scale, svd = _checked(hp)
    t = _step_count(step)
    projector = states32.get("projector")
    wide = grad32.dim() == 2 and grad32.shape[0] >= grad32.shape[1]
    if projector is not None:
        if (t - 1) % gap == 0:
            projector.copy_(orthogonal_basis(grad32, min(projector.shape), svd))
        low = grad32 @ projector.t() if wide else projector.t() @ grad32
    else:
        low = grad32
    exp_avg, exp_avg_sq = states32["exp_avg"], states32["exp_avg_sq"]
    exp_avg.mul_(beta1).add_(low, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
    step_size = lr * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
    direction = exp_avg / exp_avg_sq.sqrt().add_(eps)
    if projector is not None:
        direction = (direction @ projector if wide else projector @ direction).mul_(scale)
    weight.add_(direction, alpha=-step_size)
    if weight_decay > 0.0:
        weight.add_(weight, alpha=-lr * weight_decay)


RULE = reference_rule(
    name="galore_adamw",
    state_names=("projector", "exp_avg", "exp_avg_sq"),
    defaults=DEFAULTS,
    reference=reference,
    state_shapes=state_shapes,
    signed_states=frozenset({"projector", "exp_avg"}),
    hidden_weights_only=True,
    fallback_overrides={"rank": 0},        # the fallback's parameters (head, embeddings, vectors) are not projected
    refusals={"capturable": "the projection is refreshed every update_proj_gap steps, a decision on the host"},
)
