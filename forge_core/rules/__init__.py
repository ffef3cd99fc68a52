"""The optimizer rules FORGE can fuse. Adding one = a file here + one line in ``RULES``."""
from __future__ import annotations

from .base import Rule
from . import (adafactor, adagrad, adalomo, adam_mini, adamax, adamw, galore_adamw, lamb, lars, lion, muon, nadam, radam,
               rmsprop, sgd, sm3)

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
    muon.RULE.name: muon.RULE,
    adafactor.RULE.name: adafactor.RULE,
    adalomo.RULE.name: adalomo.RULE,
    sm3.RULE.name: sm3.RULE,
    adam_mini.RULE.name: adam_mini.RULE,
    lars.RULE.name: lars.RULE,
    galore_adamw.RULE.name: galore_adamw.RULE,
}


def get_rule(name: str) -> Rule:
    """The registered rule called ``name`` (case-insensitive); a clear error for anything else."""
    key = str(name).lower()
    if key not in RULES:
        raise ValueError(f"unknown optimizer rule {name!r}; known: {sorted(RULES)}")
    return RULES[key]


__all__ = ["Rule", "RULES", "get_rule"]
