"""The optimizer rules FORGE can fuse. Adding one = a file here + one line in ``RULES``."""
from __future__ import annotations

from .base import Rule
from . import adagrad, adamax, adamw, lamb, lion, nadam, radam, rmsprop, sgd

RULES: dict[str, Rule] = {
    adamw.RULE.name: adamw.RULE,
    sgd.RULE.name: sgd.RULE,
    lion.RULE.name: lion.RULE,
    rmsprop.RULE.name: rmsprop.RULE,
    adagrad.RULE.name: adagrad.RULE,
    adamax.RULE.name: adamax.RULE,
    nadam.RULE.name: nadam.RULE,
    radam.RULE.name: radam.RULE,
    lamb.RULE.name: lamb.RULE,
}


def get_rule(name: str) -> Rule:
    """The registered rule called ``name`` (case-insensitive); a clear error for anything else."""
    key = str(name).lower()
    if key not in RULES:
        raise ValueError(f"unknown optimizer rule {name!r}; known: {sorted(RULES)}")
    return RULES[key]


__all__ = ["Rule", "RULES", "get_rule"]
