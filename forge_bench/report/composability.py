"""Composability (paper Fig. 5): FORGE composed with another memory technique, against each alone.

A technique that saves a different part of memory than FORGE (which removes the gradient pool)
should add its saving to FORGE's. Per run and cell of ``suites/composability.yaml``, one line per
technique: fused AdamW (the baseline), the technique alone, FORGE (bf16 moments) alone and the two
composed, each as peak GiB / step ms, and how much below the better of the two alone the composed
arm's peak is. The arms of a line come from one run, as every ratio of the report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from forge_bench.results import CHECKPOINTED

from .data import fmt_ms, fmt_number, group_title, records, slug, timing_slug
from .ratios import as_number, as_text
from .render import Table

COMPOSE_KEYS = ["run_id", "device_name", "model", "dtype", "batch", "seq", "timing"]
BASELINE = ("adamw_fused", "hf")
FORGE_ALONE = ("forge_bf16", "hf")


@dataclass(frozen=True)
class Composition:
    """A technique: the arm that uses it alone and the FORGE arm composed with it, as (method, activations)."""
    label: str
    alone: tuple[str, str]
    composed: tuple[str, str]


COMPOSITIONS = (
    Composition("activation checkpointing", ("adamw_fused", CHECKPOINTED), ("forge_bf16", CHECKPOINTED)),
    Composition("8-bit states", ("bnb_adamw8bit", "hf"), ("forge_int8", "hf")),
    Composition("factored moments (Adafactor)", ("adafactor_unfused", "hf"), ("forge_adafactor_bf16", "hf")),
    Composition("low-rank projection (GaLore)", ("galore_adamw_rsvd", "hf"), ("forge_galore_bf16", "hf")),
)


def _row(rows: list[dict[str, Any]], arm: tuple[str, str]) -> dict[str, Any] | None:
    hits = [r for r in rows if r.get("method") == arm[0] and r.get("activations") == arm[1]]
    return max(hits, key=lambda r: as_text(r.get("finished_at")) or "") if hits else None


def _peak(row: Mapping[str, Any] | None) -> float | None:
    return as_number(row.get("peak_allocated_gib")) if row is not None and as_text(row.get("status")) == "ok" else None


def _cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "—"
    if as_text(row.get("status")) != "ok":
        return as_text(row.get("status")) or "—"
    return f"{fmt_number(row.get('peak_allocated_gib'))} / {fmt_ms(row.get('step_ms_median'))}"


def composability_tables(frame: pd.DataFrame) -> list[Table]:
    """One table per run and cell holding FORGE alone and at least one technique alone."""
    tables = []
    for key_values, group in frame.groupby(COMPOSE_KEYS, sort=True, dropna=False):
        keys = dict(zip(COMPOSE_KEYS, key_values))
        rows = records(group)
        base, forge = _row(rows, BASELINE), _row(rows, FORGE_ALONE)
        present = [c for c in COMPOSITIONS if _row(rows, c.alone) is not None]
        if forge is None or not present:
            continue
        body, recs = [], []
        for composition in present:
            alone, composed = _row(rows, composition.alone), _row(rows, composition.composed)
            better = min((p for p in (_peak(alone), _peak(forge)) if p is not None), default=None)
            below = None if better is None or _peak(composed) is None else better - _peak(composed)
            body.append([composition.label, _cell(base), _cell(alone), _cell(forge),
                         _cell(composed),
                         fmt_number(below)])
            recs.append({**keys, "technique": composition.label, "baseline_peak_gib": _peak(base),
                         "alone_peak_gib": _peak(alone), "forge_peak_gib": _peak(forge),
                         "composed_peak_gib": _peak(composed), "composed_below_best_alone_gib": below,
                         "alone_step_ms": as_number(alone.get("step_ms_median")) if _peak(alone) is not None else None,
                         "composed_step_ms": as_number(composed.get("step_ms_median")) if _peak(composed) is not None
                         else None})
        name = slug("composability", keys["device_name"], keys["model"], keys["dtype"], f"b{keys['batch']}",
                    f"s{keys['seq']}", timing_slug(keys))
        tables.append(Table(
            name, f"Composability, {group_title(keys)}",
            "Peak GiB / step ms of fused AdamW, the technique alone, FORGE (bf16 moments) alone and the two "
            "composed; the last column: how many GiB the composed arm's peak is below the better of the two "
            "alone (positive: the savings add).",
            ["Technique", "Fused AdamW", "Technique alone", "FORGE alone", "Composed", "Below best alone GiB"],
            body, "lrrrrr", [], recs))
    return tables


__all__ = ["COMPOSITIONS", "COMPOSE_KEYS", "Composition", "composability_tables"]
