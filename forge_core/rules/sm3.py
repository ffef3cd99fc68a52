"""SM3 (Anil, Gupta, Koren & Singer 2019, "Memory-Efficient Adaptive Optimization"), SM3-II with
the rows and the columns of a matrix as its cover. Regime 3 (deferred): the accumulators are
maxima over whole rows and columns of the step's second-moment estimate.

Per weight (R x C) with gradient G, row accumulators r (R x 1) and column accumulators c (1 x C)::

    nu(i, j) = min(r(i), c(j)) + G(i, j)^2
    r(i)     = max_j nu(i, j);   c(j) = max_i nu(i, j)
    U        = G / sqrt(nu + eps)
    U       <- momentum m + (1 - momentum) U;  m <- U        (with momentum > 0)
    W       <- W - lr U

A vector's cover is its elements (one accumulator each: Adagrad). Hyper-parameters and defaults
follow the widely used PyTorch port of the authors' optimizer: ``lr=0.1, momentum=0.0, eps=1e-30``
(its exponential-accumulator option ``beta`` is not part of the rule: SM3-II as the paper states
it). The momentum buffer exists only when ``momentum > 0`` at ``fuse`` time / the first step.
torch has no SM3: the unfused form is a ``RuleOptimizer`` on this reference. Where Triton runs, a
matrix takes ``matrix_step``: the same arithmetic in one read of G (``forge_core.kernels.matrix_steps``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .rule_optimizer import reference_rule
from .scalars import row_blocks

DEFAULTS = {"lr": 0.1, "momentum": 0.0, "eps": 1e-30}


def _checked(hp: Mapping[str, Any]) -> tuple[float, float, float]:
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, momentum, eps = float(full["lr"]), float(full["momentum"]), float(full["eps"])
    if not lr >= 0.0:
        raise ValueError(f"sm3: lr must be >= 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"sm3: momentum must lie in [0, 1), got {momentum}")
    if not eps >= 0.0:
        raise ValueError(f"sm3: eps must be >= 0, got {eps}")
    return lr, momentum, eps


def state_shapes(shape: tuple[int, ...], hp: Mapping[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """Row (R, 1) and column (1, C) accumulators of a matrix, one per element of a vector; a
    parameter-shaped momentum buffer when ``momentum > 0``."""
    _, momentum, _ = _checked(hp)
    if len(shape) == 2:
        shapes = {"row_accumulator": (shape[0], 1), "col_accumulator": (1, shape[1])}
    elif len(shape) == 1:
        shapes = {"accumulator": tuple(shape)}
    else:
        raise ValueError(f"sm3: parameters must be 1-D or 2-D, got shape {shape}")
    if momentum > 0.0:
        shapes["momentum_buffer"] = tuple(shape)
    return shapes


def _momentum_buffer(states: Mapping[str, torch.Tensor], momentum: float) -> torch.Tensor | None:
    """The momentum buffer when ``momentum > 0`` (None without momentum); refused when it was never made."""
    if momentum <= 0.0:
        return None
    if "momentum_buffer" not in states:
        raise ValueError("sm3: momentum > 0 needs the momentum buffer, which was not allocated (momentum was 0 "
                         "when the state was made)")
    return states["momentum_buffer"]


def reference(weight: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One SM3-II step in place (``weight``: fp32 or bf16; fp32 states); ``grad32`` is consumed (it
    becomes the update, computed in row blocks: ``scalars.row_blocks``); ``step`` is unused: SM3 has no
    bias correction."""
    lr, momentum, eps = _checked(hp)
    if grad32.dim() == 2:
        rows, cols = states32["row_accumulator"], states32["col_accumulator"]
        new_cols = torch.zeros_like(cols)              # nu >= 0: the column maxima start at 0
        for start, stop in row_blocks(grad32):          # nu and U block by block, U into G
            grad = grad32[start:stop]
            estimate = torch.minimum(rows[start:stop], cols).addcmul_(grad, grad)
            rows[start:stop] = estimate.amax(dim=1, keepdim=True)
            torch.maximum(new_cols, estimate.amax(dim=0, keepdim=True), out=new_cols)
            grad.mul_(estimate.add_(eps).rsqrt_())
        cols.copy_(new_cols)
        update = grad32
    else:
        accumulator = states32["accumulator"]
        accumulator.addcmul_(grad32, grad32)
        update = accumulator.add(eps).rsqrt_().mul_(grad32)
    if momentum > 0.0:
        buffer = _momentum_buffer(states32, momentum)
        buffer.mul_(momentum).add_(update, alpha=1.0 - momentum)
        update = buffer
    weight.add_(update, alpha=-lr)


def matrix_step(weight: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], hp: Mapping[str, Any],
                step: Any, kernels: Any) -> None:
    """``reference`` for a 2-D weight in one Triton pass over G (``kernels.sm3_update``: nu, the
    update, the momentum and W, with per-tile maxima that become the accumulators); G is only read,
    the momentum buffer read and rounded in its stored dtype."""
    lr, momentum, eps = _checked(hp)
    kernels.sm3_update(weight, grad, states["row_accumulator"], states["col_accumulator"], lr, eps, momentum,
                       _momentum_buffer(states, momentum))


RULE = reference_rule(
    name="sm3",
    state_names=("row_accumulator", "col_accumulator", "momentum_buffer"),
    defaults=DEFAULTS,
    reference=reference,
    matrix_step=matrix_step,
    state_shapes=state_shapes,
    layer_capturable=True,
    signed_states=frozenset({"momentum_buffer"}),
)
