"""The optimizer rules FORGE can fuse. Adding one = a file here + one line in ``RULES``."""
from __future__ import annotations

from .base import Rule
from . import adafactor, adalomo, adam_mini, adamw, lars, lion, muon, sgd, sm3

RULES: dict[str, Rule] = {
    adamw.RULE.name: adamw.RULE,
    sgd.RULE.name: sgd.RULE,
    lion.RULE.name: lion.RULE,
    muon.RULE.name: muon.RULE,
    adafactor.RULE.name: adafactor.RULE,
    adalomo.RULE.name: adalomo.RULE,
    sm3.RULE.name: sm3.RULE,
    adam_mini.RULE.name: adam_mini.RULE,
    lars.RULE.name: lars.RULE,
}


def get_rule(name: str) -> Rule:
    """The registered rule called ``name`` (case-insensitive); a clear error for anything else."""
    key = str(name).lower()
    if key not in RULES:
        raise ValueError(f"unknown optimizer rule {name!r}; known: {sorted(RULES)}")
    return RULES[key]


__all__ = ["Rule", "RULES", "get_rule"]
