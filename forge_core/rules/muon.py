"""Muon (Jordan et al. 2024; torch.optim.Muon): momentum, then Newton-Schulz orthogonalization, on
2-D hidden weights. Regime 2: the weight update reads the whole matrix of state.

torch.optim.Muon, per weight with gradient G and momentum buffer B (``mu = momentum``)::

    B <- B.lerp(G, 1 - mu)                      = mu B + (1 - mu) G
    U <- G.lerp(B, mu) if nesterov else B       = mu^2 B_old + (1 - mu^2) G   (Nesterov)
    O <- NS(U)                                    5 quintic Newton-Schulz steps in bf16
    W <- W (1 - lr wd) - adjusted_lr O

The fused path (``layer_update``) never forms G: the momentum accumulates through the GEMM's
beta and alpha, ``B.addmm_(dY^T, X, beta=mu, alpha=1-mu)``. With Nesterov one GEMM writes the
update into a layer-sized transient, ``U = mu^2 B + (1 - mu^2) dY^T X``, and the new buffer follows
from it, ``B <- (U + mu B) / (1 + mu) = B.lerp(U, 1 / (1 + mu))`` (= mu B + (1 - mu) G). The
transient is freed after the layer's Newton-Schulz, which needs layer-sized bf16 scratch anyway.

Everything that is not a fused hidden weight (embeddings, the output head, norms, biases) is stepped
by torch.optim.AdamW, as torch.optim.Muon's documentation tells its users to. Its hyper-parameters
are the ``adamw_*`` keys of the same param group (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
``adamw_weight_decay``; defaults: torch.optim.AdamW's). An LR scheduler scales ``lr`` (Muon's)
only; set ``adamw_lr`` in the param group to move AdamW's.

Micro-batches (``accumulate_steps=k``): without Nesterov the buffer takes every micro-batch itself
(the first with ``beta=mu``, the rest with ``beta=1``; the same sum as accumulating G), so no fp32
accumulator exists; Newton-Schulz and the weight update run on the k-th. Nesterov's update needs the
old buffer and the summed gradient apart, so it keeps the fp32 accumulator of ``accumulate_steps``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ..newton_schulz import ADJUST_LR_FNS, adjusted_lr, zeropower_via_newton_schulz
from ..wgrad_gemm import accumulate_product, product_plus
from .base import Rule, torch_fused_flag
from .checks import betas_pair

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                 "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None}
"""torch.optim.Muon's names and defaults."""
ADAMW_DEFAULTS = {"adamw_lr": 1e-3, "adamw_betas": (0.9, 0.999), "adamw_eps": 1e-8, "adamw_weight_decay": 1e-2}
"""The AdamW that steps every other parameter: torch.optim.AdamW's defaults under an ``adamw_`` prefix."""
DEFAULTS = {**MUON_DEFAULTS, **ADAMW_DEFAULTS}


def checked(hp: Mapping[str, Any]) -> dict[str, Any]:
    """Muon's hyper-parameters from ``hp`` (defaults filled in), validated as torch.optim.Muon does."""
    full = {key: hp.get(key, default) for key, default in DEFAULTS.items()}
    lr, momentum, weight_decay = float(full["lr"]), float(full["momentum"]), float(full["weight_decay"])
    if not lr >= 0.0:
        raise ValueError(f"muon: lr must be >= 0, got {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"muon: momentum must be >= 0, got {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"muon: weight_decay must be >= 0, got {weight_decay}")
    if full["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"muon: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {full['adjust_lr_fn']!r}")
    coefficients = tuple(float(c) for c in full["ns_coefficients"])
    if len(coefficients) != 3:
        raise ValueError(f"muon: ns_coefficients must be 3 numbers, got {full['ns_coefficients']!r}")
    if not 0 <= int(full["ns_steps"]) < 100:
        raise ValueError(f"muon: ns_steps must lie in [0, 100), got {full['ns_steps']}")
    return {**full, "lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": bool(full["nesterov"]),
            "ns_coefficients": coefficients, "ns_steps": int(full["ns_steps"]), "eps": float(full["eps"]),
            "adamw_betas": betas_pair("muon", full["adamw_betas"], "adamw_betas")}


def _apply(weight: torch.Tensor, update: torch.Tensor, hp: Mapping[str, Any]) -> None:
    """Newton-Schulz on ``update``, decoupled weight decay, then the orthogonalized step (torch's ops)."""
    orthogonal = zeropower_via_newton_schulz(update, hp["ns_coefficients"], hp["ns_steps"], hp["eps"])
    weight.mul_(1.0 - hp["lr"] * hp["weight_decay"])
    weight.add_(orthogonal, alpha=-adjusted_lr(hp["lr"], hp["adjust_lr_fn"], weight.shape))


def reference(weight32: torch.Tensor, grad32: torch.Tensor, states32: dict[str, torch.Tensor],
              hp: Mapping[str, Any], step: Any) -> None:
    """One torch.optim.Muon step on a 2-D weight from its gradient, in place (the spec)."""
    hp = checked(hp)
    if weight32.dim() != 2:
        raise ValueError(f"muon: 2-D weights only, got shape {tuple(weight32.shape)}")
    buffer = states32["momentum_buffer"]
    momentum = hp["momentum"]
    buffer.lerp_(grad32, 1.0 - momentum)
    update = grad32.lerp(buffer, momentum) if hp["nesterov"] else buffer
    _apply(weight32, update, hp)


def layer_update(x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states: dict[str, torch.Tensor],
                 hp: Mapping[str, Any], step: Any, *, grad_accum: Optional[torch.Tensor], first_micro_batch: bool,
                 last_micro_batch: bool) -> None:
    """The fused Muon step of one layer (module docstring): the momentum through the GEMM, then,
    on the last micro-batch, Newton-Schulz and the weight update."""
    hp = checked(hp)
    buffer = states["momentum_buffer"]
    momentum = hp["momentum"]
    beta = momentum if first_micro_batch else 1.0
    if not hp["nesterov"]:
        if grad_accum is not None:
            raise RuntimeError("muon: an fp32 gradient accumulator without Nesterov (the buffer takes micro-batches)")
        accumulate_product(buffer, dy2, x2, beta=beta, alpha=1.0 - momentum)
        if last_micro_batch:
            _apply(weight, buffer, hp)
        return
    if not last_micro_batch:
        raise RuntimeError("muon: with nesterov=True micro-batches go to the fp32 accumulator; the param group's "
                           "nesterov changed after fuse(accumulate_steps>1): fuse again")
    square = momentum * momentum
    update = product_plus(buffer, dy2, x2, beta=square, alpha=1.0 - square)
    if grad_accum is not None:
        update.add_(grad_accum.to(update.dtype), alpha=1.0 - square)
    buffer.lerp_(update, 1.0 / (1.0 + momentum))
    _apply(weight, update, hp)


def state_accumulates(hp: Mapping[str, Any]) -> bool:
    """Without Nesterov the momentum buffer takes the micro-batches (no fp32 accumulator)."""
    return not checked(hp)["nesterov"]


def adamw_hyperparameters(hp: Mapping[str, Any]) -> dict[str, Any]:
    """The AdamW fallback's param-group values from a Muon param group's ``adamw_*`` keys."""
    full = checked(hp)
    return {"lr": float(full["adamw_lr"]), "betas": full["adamw_betas"], "eps": float(full["adamw_eps"]),
            "weight_decay": float(full["adamw_weight_decay"])}


def fallback_optimizer(params, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
    """torch.optim.AdamW with the ``adamw_*`` hyper-parameters, for every parameter Muon does not
    fuse (embeddings, the output head, norms, biases, excluded weights)."""
    params = list(params)
    fused = torch_fused_flag(params)
    flags = {"capturable": True} if capturable and fused else {}
    return torch.optim.AdamW(params, **adamw_hyperparameters(hp), **fused, **flags)


def hidden_and_other_parameters(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's parameters, AdamW's) as ``fuse(model, "muon")`` splits a model: the weights of plain
    ``nn.Linear`` modules that are used once and are not the output head, against every other
    trainable parameter. The unfused baseline (torch.optim.Muon + torch.optim.AdamW) uses it."""
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    hidden_ids = {id(module.weight) for module in model.modules()
                  if type(module) is torch.nn.Linear and module is not head and module.weight.requires_grad
                  and uses[id(module.weight)] == 1}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trainable if id(p) in hidden_ids], [p for p in trainable if id(p) not in hidden_ids]


RULE = Rule(
    name="muon",
    state_names=("momentum_buffer",),
    defaults=DEFAULTS,
    reference=reference,
    fallback_optimizer=fallback_optimizer,
    signed_states=frozenset({"momentum_buffer"}),
    regime=2,
    layer_update=layer_update,
    state_dtypes=frozenset({"fp32", "bf16"}),
    hidden_weights_only=True,
    fallback_hyperparameters=adamw_hyperparameters,
    layer_capturable=True,
    state_accumulates=state_accumulates,
)
