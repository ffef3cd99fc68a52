"""AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory Optimization with Adaptive Learning Rate").
Regime 3 (deferred): a factored second moment and grouped update normalization, both of which read
the whole of a layer's gradient.

Per weight (R x C) with gradient G at step t, ``beta_t = 1 - t^decay_rate`` (the weight kept of the
old average; 0 at the first step)::

    r      <- beta_t r + (1 - beta_t) mean_j (G^2 + eps1)        (R x 1)
    c      <- beta_t c + (1 - beta_t) mean_i (G^2 + eps1)        (1 x C)
    U       = G / sqrt(r c / mean(r))                            (factored as Adafactor's)
    U      <- U / max(1, rms(U) / clip_threshold)               (grouped update normalization)
    s       = lr * max(eps2, rms(W))                             (the update scales with the weight)
    W      <- W (1 - s wd) - s U

A vector keeps an unfactored second moment. Hyper-parameters and defaults follow the lomo-optim
package's AdaLomo: ``lr=1e-3, clip_threshold=1.0, decay_rate=-0.8, weight_decay=0.0,
eps=(1e-30, 1e-3)``; its loss scaling and gradient clipping (which need every gradient first) are
not part of the rule. torch has no AdaLomo: the unfused form and the fallback are a
``RuleOptimizer`` on this reference, which is the spec. Where Triton runs, the layer path takes
``matrix_step`` for a 2-D weight: the same arithmetic in three reads of G
(``forge_core.kernels.factored``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .rule_optimizer import reference_rule
from .scalars import at_least, like, rms, step_value

DEFAULTS = {"lr": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8, "weight_decay": 0.0, "eps": (1e-30, 1e-3)}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, float]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, clip, decay_rate, weight_decay = (float(full["lr"]), float(full["clip_threshold"]), float(full["decay_rate"]),
                                          float(full["weight_decay"]))
    eps1, eps2 = (float(value) for value in full["eps"])
    if not lr >= 0.0:
        raise ValueError(f"adalomo: lr must be >= 0, got {lr}")
    if not clip > 0.0:
        raise ValueError(f"adalomo: clip_threshold must be > 0, got {clip}")
    if not decay_rate < 0.0:
        raise ValueError(f"adalomo: decay_rate must be < 0, got {decay_rate}")
    if not weight_decay >= 0.0:
        raise ValueError(f"adalomo: weight_decay must be >= 0, got {weight_decay}")
    if not (eps1 >= 0.0 and eps2 >= 0.0):
        raise ValueError(f"adalomo: eps must be two numbers >= 0, got {full['eps']}")
    return lr, clip, decay_rate, weight_decay, eps1, eps2


def state_shapes(shape: tuple[int, ...], hp: Mapping[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """A matrix keeps a row (R, 1) and a column (1, C) second moment; a vector a full one."""
    if len(shape) == 2:
        return {"exp_avg_sq_row": (shape[0], 1), "exp_avg_sq_col": (1, shape[1])}
    if len(shape) == 1:
        return {"exp_avg_sq": tuple(shape)}
    raise ValueError(f"adalomo: parameters must be 1-D or 2-D, got shape {shape}")


def _mean_square(grad: torch.Tensor, dim: int, eps1: float) -> torch.Tensor:
    """mean(G^2 + eps1) along ``dim`` (keepdim) without a G-sized temporary."""
    return torch.linalg.vector_norm(grad, dim=dim, keepdim=True).square_().div_(grad.size(dim)).add_(eps1)


def reference(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One AdaLomo step in place (``weight``: fp32 or bf16; fp32 states); ``grad32`` is consumed (it
    becomes the update)."""
    lr, clip, decay_rate, weight_decay, eps1, eps2 = _checked(hp)
    new_weight = step_value(step) ** decay_rate              # 1 - beta_t: the new mean's share
    update = grad32
    if update.dim() == 2:
        row, col = states32["exp_avg_sq_row"], states32["exp_avg_sq_col"]
        row.lerp_(_mean_square(update, -1, eps1), like(new_weight, row))
        col.lerp_(_mean_square(update, -2, eps1), like(new_weight, col))
        update.mul_((row / row.mean()).rsqrt_()).mul_(col.rsqrt())
    else:
        second = states32["exp_avg_sq"]
        second.lerp_(update.square().add_(eps1), like(new_weight, second))
        update.mul_(second.rsqrt())
    clipped = at_least(rms(update) / clip, 1.0)
    scale = lr * at_least(rms(weight), eps2)
    if weight_decay != 0.0:
        weight.mul_(1.0 - scale * weight_decay)
    weight.addcmul_(update, -scale / clipped)     # W - scale U / clipped in one pass (no scaled copy of U)


def matrix_step(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
                hp: Mapping[str, Any], step: Any, kernels: Any) -> None:
    """``reference`` for a 2-D weight, its passes over G run by ``kernels``
    (``forge_core.kernels.factored``: the row and column means of G^2 with the sum of W^2, the sum
    of U^2 with the two inverse roots as scales, then W with its decay): G is read three times and
    never written, and the scalars (``s``, the clipping, the decay) are computed in the last kernel.
    The weight decay and the update round a bf16 weight once, where the reference rounds after each."""
    lr, clip, decay_rate, weight_decay, eps1, eps2 = _checked(hp)
    new_weight = step_value(step) ** decay_rate
    row, col = states32["exp_avg_sq_row"], states32["exp_avg_sq_col"]
    rows, cols = grad32.shape
    sums = kernels.square_sums(grad32, weight, 1.0 / cols, 1.0 / rows)
    row.lerp_(sums.rows.add_(eps1).view_as(row), like(new_weight, row))
    col.lerp_(sums.cols.add_(eps1).view_as(col), like(new_weight, col))
    factors = kernels.Factors(row, row.mean(), col, scales=True)
    update_squares = kernels.update_square_sum(grad32, factors)
    scalars = kernels.StepScalars(rho=lr, eps2=eps2, d=clip, decay_rate=weight_decay, decay_by_alpha=True)
    kernels.apply_update(weight, grad32, factors, update_squares, sums.weight_squares, scalars)


RULE = reference_rule(
    name="adalomo",
    state_names=("exp_avg_sq_row", "exp_avg_sq_col"),
    defaults=DEFAULTS,
    reference=reference,
    state_shapes=state_shapes,
    layer_capturable=True,
    matrix_step=matrix_step,
)
