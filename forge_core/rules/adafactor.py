"""Adafactor (Shazeer & Stern 2018), as torch.optim.Adafactor computes it. Regime 3 (deferred).

Per weight (R x C) with gradient G, step t, ``rho_t = min(lr, t^-0.5)``::

    alpha   = max(eps2, rms(W)) * rho_t
    W      <- W (1 - lr wd)
    r      <- r.lerp(mean_j G^2, t^beta2_decay)          (R x 1, the row statistics)
    c      <- c.lerp(mean_i G^2, t^beta2_decay)          (1 x C, the column statistics)
    V       = (r / mean(r)) c, clamped below at eps1^2
    U       = G / sqrt(V)
    W      <- W - alpha / max(1, rms(U) / d) * U

A vector keeps an unfactored ``variance`` instead of ``r`` and ``c``. The row and column means read
all of G, so no weight tile can step alone: the fused path forms the layer's G, runs this
reference on it and frees it inside the layer's backward (``forge_core.layer_step``). ``V`` and ``U``
are computed in row blocks into G (``scalars.row_blocks``), so the step holds G and one block.
Where Triton runs, the layer path takes ``matrix_step`` instead: the same arithmetic in three reads
of G and three Triton launches (``forge_core.kernels.factored``).

Differences from torch.optim.Adafactor, none of which changes an fp32 result beyond rounding:
``alpha`` and ``max(1, rms(U) / d)`` are 0-d device tensors, where torch reads both norms on the
host (two syncs per weight, and no CUDA graph); ``eps=(None, ...)`` means float32's machine epsilon
(the precision this step runs in), where torch takes the parameter dtype's, the same for fp32
parameters and 2^-7 for bf16 ones; 3-D and larger parameters are refused (torch factors their last
two dimensions). Names and defaults are torch's: ``lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3),
d=1.0, weight_decay=0.0, maximize=False``.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .base import Rule, known_hyperparameters
from .rule_optimizer import RuleOptimizer
from .scalars import at_least, at_most, like, rms, row_blocks, step_value

DEFAULTS = {"lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": 0.0, "maximize": False}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float, float, float, float, bool]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, beta2_decay, d, weight_decay = (float(full["lr"]), float(full["beta2_decay"]), float(full["d"]),
                                        float(full["weight_decay"]))
    eps1, eps2 = full["eps"]
    eps1 = torch.finfo(torch.float32).eps if eps1 is None else float(eps1)
    eps2 = float(eps2)
    if not lr >= 0.0:
        raise ValueError(f"adafactor: lr must be >= 0, got {lr}")
    if not beta2_decay <= 0.0:
        raise ValueError(f"adafactor: beta2_decay must be <= 0, got {beta2_decay}")
    if not (eps1 >= 0.0 and eps2 >= 0.0):
        raise ValueError(f"adafactor: eps must be two numbers >= 0 (the first may be None), got {full['eps']}")
    if not d >= 1.0:
        raise ValueError(f"adafactor: d must be >= 1, got {d}")
    if not weight_decay >= 0.0:
        raise ValueError(f"adafactor: weight_decay must be >= 0, got {weight_decay}")
    return lr, beta2_decay, eps1, eps2, d, weight_decay, bool(full["maximize"])


def state_shapes(shape: tuple[int, ...], hp: Mapping[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """A matrix keeps a row (R, 1) and a column (1, C) statistic; a vector its full variance."""
    if len(shape) == 2:
        return {"row_var": (shape[0], 1), "col_var": (1, shape[1])}
    if len(shape) == 1:
        return {"variance": tuple(shape)}
    raise ValueError(f"adafactor: parameters must be 1-D or 2-D, got shape {shape}")


def reference(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One Adafactor step in place (``weight``: fp32 or bf16, each op computed in fp32; fp32 states);
    ``grad32`` is consumed: it may be overwritten."""
    lr, beta2_decay, eps1, eps2, d, weight_decay, maximize = _checked(hp)
    t = step_value(step)
    one_minus_beta2 = t ** beta2_decay
    alpha = at_least(rms(weight), eps2) * at_most(t ** -0.5, lr)      # from the weight before its decay
    if weight_decay != 0.0:
        weight.mul_(1.0 - lr * weight_decay)
    grad = grad32.neg_() if maximize else grad32
    if grad.dim() == 2:
        row_var, col_var = states32["row_var"], states32["col_var"]
        row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        row_var.lerp_(row_mean, like(one_minus_beta2, row_var))
        col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        col_var.lerp_(col_mean, like(one_minus_beta2, col_var))
        row_mean = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)
        for start, stop in row_blocks(grad):         # V = (r / mean(r)) c, U = G / sqrt(V), into G
            # the division on the row vector, not on the layer-sized estimate: one pass fewer over it
            estimate = row_var[start:stop].div(row_mean) @ col_var
            grad[start:stop].mul_(estimate.clamp_(min=eps1 * eps1).rsqrt_())
        update = grad
    else:
        variance = states32["variance"]
        variance.lerp_(grad * grad, like(one_minus_beta2, variance))
        update = variance.clamp(min=eps1 * eps1).rsqrt_().mul_(grad)
    denominator = at_least(rms(update) / d, 1.0)
    weight.addcmul_(update, -alpha / denominator)      # W + coef U in one pass (no scaled copy of U)


def matrix_step(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
                hp: Mapping[str, Any], step: Any, kernels: Any) -> None:
    """``reference`` for a 2-D weight, its passes over G run by ``kernels``
    (``forge_core.kernels.factored``: the row and column means of G^2 with the sum of W^2, the sum
    of U^2, then W with its decay), so G is read three times and never written, and the scalars
    (``alpha``, the clipping, the decay) are computed in the last kernel. ``maximize`` flips the
    update's sign instead of G's (the squares do not see it). The weight decay and the update
    round a bf16 weight once, where the reference rounds after each."""
    lr, beta2_decay, eps1, eps2, d, weight_decay, maximize = _checked(hp)
    t = step_value(step)
    one_minus_beta2 = t ** beta2_decay
    rho = at_most(t ** -0.5, lr)
    row_var, col_var = states32["row_var"], states32["col_var"]
    rows, cols = grad32.shape
    sums = kernels.square_sums(grad32, weight, 1.0 / cols, 1.0 / rows)
    row_var.lerp_(sums.rows.view_as(row_var), like(one_minus_beta2, row_var))
    col_var.lerp_(sums.cols.view_as(col_var), like(one_minus_beta2, col_var))
    factors = kernels.Factors(row_var, row_var.mean(), col_var, mean_floor=eps1, eps_sq=eps1 * eps1)
    update_squares = kernels.update_square_sum(grad32, factors)
    scalars = kernels.StepScalars(rho=like(rho, row_var), eps2=eps2, d=d, sign=-1.0 if maximize else 1.0,
                                  decay_rate=lr * weight_decay)
    kernels.apply_update(weight, grad32, factors, update_squares, sums.weight_squares, scalars)


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.Adafactor with the same hyper-parameters; a ``RuleOptimizer`` on this reference
    when capturable (torch's reads two norms on the host per parameter)."""
    if capturable:
        return forge_fallback(params, capturable=True, **hp)
    known = known_hyperparameters(hp, DEFAULTS)
    _checked(known)
    return torch.optim.Adafactor(params, **known)


def forge_fallback(params, capturable: bool = False, matrix_kernels: Any = None, **hp: Any) -> torch.optim.Optimizer:
    """What a ForgeOptimizer steps the parameters it does not fuse with (``Rule.forge_fallback``): a
    ``RuleOptimizer`` on this reference, which syncs nothing with the host, and steps a 2-D parameter
    (the embedding) with ``matrix_step`` where ``matrix_kernels`` run. The unfused arm stays
    torch.optim.Adafactor (``fallback_optimizer``)."""
    return RuleOptimizer(params, RULE, capturable=capturable, matrix_kernels=matrix_kernels,
                         **known_hyperparameters(hp, DEFAULTS))


RULE = Rule(
    name="adafactor",
    state_names=("row_var", "col_var"),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    forge_fallback=forge_fallback,
    regime=3,
    matrix_step=matrix_step,
    state_shapes=state_shapes,
    state_dtypes=frozenset({"fp32", "bf16"}),
    layer_capturable=True,
)
