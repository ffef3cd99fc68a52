"""The constant-token law (paper Table 2): a step's peak depends on batch x seq only through their
product, the tokens per step, so along each anti-diagonal of the batch x seq grid (b1 x s2048,
b2 x s1024, b4 x s512) one method's peaks are equal.

``token_law_points`` finds, per device x model x dtype x timing x activations x method, every token
count measured at two or more shapes and the relative spread of their peaks ((max - min) / min);
``token_law_tables`` renders them with the verdict against ``TOLERANCE``. Peaks are compared across
runs: allocator peaks repeat exactly between runs of the same code, unlike step times, and the grid
of a GPU is often measured one anti-diagonal cell per run. A change of code that moved one cell's
peak would show here as a spread, which is the point of the check.

One term of a peak is not a function of the tokens: where the peak falls in the attention backward,
one layer's batch x heads x seq x seq bf16 scores (2 bytes a query-key pair and head: a score matrix,
or a workspace of that size in the attention backward; which kernel holds it is not yet profiled). On the H200 at f502daf the FORGE arms'
peaks along every anti-diagonal differ by exactly that, to 0.001 GiB, from 1024 to 4096 tokens
(0.50 GiB between b1 x s4096 and b2 x s2048). The table gives each spread without it too, so a miss
it explains is told apart from one it does not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pandas as pd

from forge_bench.zoo import MODEL_ZOO

from ..units import GIB
from .data import group_title, method_cell, ordered_methods, records, run_label, slug, timing_slug
from .ratios import as_number, as_text
from .render import Table

TOLERANCE = 0.01
LAW_KEYS = ["device_name", "model", "dtype", "timing", "activations"]
SCORE_BYTES = {"bfloat16": 2, "float16": 2}


@lru_cache(maxsize=None)
def attention_heads(model: str) -> int | None:
    """The model's attention heads from its zoo config (None: no such model, or no attention); read
    once per model, where every shape of every anti-diagonal asks."""
    spec = MODEL_ZOO.get(model)
    if spec is None or not spec.config_path.exists():
        return None
    config = json.loads(spec.config_path.read_text())
    heads = config.get("num_attention_heads", config.get("n_head"))
    return int(heads) if heads else None


def attention_scores_gib(model: str, dtype: str, batch: int, seq: int) -> float | None:
    """One layer's attention scores, batch x heads x seq x seq at the weights' 16-bit width, GiB: the
    one peak term quadratic in seq (None where the model has no attention or the weights are fp32)."""
    heads, width = attention_heads(model), SCORE_BYTES.get(dtype)
    return None if heads is None or width is None else batch * heads * seq * seq * width / GIB


@dataclass(frozen=True)
class TokenLawPoint:
    """One method's peaks at one token count: (batch, seq, peak GiB, run id) per shape, and their spread."""
    keys: dict[str, Any]
    method: str
    tokens: int
    shapes: tuple[tuple[int, int, float, str], ...]

    @property
    def spread(self) -> float:
        peaks = [peak for _, _, peak, _ in self.shapes]
        return (max(peaks) - min(peaks)) / min(peaks)

    @property
    def holds(self) -> bool:
        return self.spread <= TOLERANCE

    @property
    def spread_without_scores(self) -> float | None:
        """The spread once each shape's ``attention_scores_gib`` is taken off its peak (None: no such term)."""
        terms = [attention_scores_gib(str(self.keys["model"]), str(self.keys["dtype"]), b, s)
                 for b, s, _, _ in self.shapes]
        if any(term is None for term in terms):
            return None
        peaks = [peak - term for (_, _, peak, _), term in zip(self.shapes, terms)]
        return (max(peaks) - min(peaks)) / min(peaks)

    @property
    def verdict(self) -> str:
        if self.holds:
            return "yes"
        rest = self.spread_without_scores
        return "no; yes without the scores" if rest is not None and rest <= TOLERANCE else "no"


def _newest_ok_per_shape(rows: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """The latest finished ok row with a peak at each (batch, seq)."""
    chosen: dict[tuple[int, int], dict[str, Any]] = {}
    for row in rows:
        if as_text(row.get("status")) != "ok" or as_number(row.get("peak_allocated_gib")) is None:
            continue
        shape = (int(row["batch"]), int(row["seq"]))
        if shape not in chosen or (as_text(row.get("finished_at")) or "") > (as_text(chosen[shape].get("finished_at")) or ""):
            chosen[shape] = row
    return chosen


def token_law_points(frame: pd.DataFrame) -> list[TokenLawPoint]:
    """Every (group, method, token count) measured ok at two or more batch x seq shapes."""
    points = []
    for key_values, group in frame.groupby(LAW_KEYS, sort=True, dropna=False):
        keys = dict(zip(LAW_KEYS, key_values))
        for method in ordered_methods(group):
            by_shape = _newest_ok_per_shape(records(group[group["method"] == method]))
            by_tokens: dict[int, list[tuple[int, int, float, str]]] = {}
            for (batch, seq), row in sorted(by_shape.items()):
                by_tokens.setdefault(batch * seq, []).append(
                    (batch, seq, float(row["peak_allocated_gib"]), as_text(row.get("run_id")) or ""))
            points += [TokenLawPoint(keys, method, tokens, tuple(shapes))
                       for tokens, shapes in sorted(by_tokens.items()) if len(shapes) >= 2]
    return points


def token_law_tables(frame: pd.DataFrame) -> list[Table]:
    """One table per device x model x dtype x timing x activations with an anti-diagonal measured."""
    points = token_law_points(frame)
    tables = []
    for key_values in dict.fromkeys(tuple(p.keys[k] for k in LAW_KEYS) for p in points):
        keys = dict(zip(LAW_KEYS, key_values))
        group = [p for p in points if tuple(p.keys[k] for k in LAW_KEYS) == key_values]
        rows, recs = [], []
        for point in group:
            shapes = " · ".join(f"b{b}×s{s} {peak:.2f}" for b, s, peak, _ in point.shapes)
            runs = sorted({run for *_, run in point.shapes})
            rest = point.spread_without_scores
            rows.append([method_cell(point.method), str(point.tokens), shapes, f"{point.spread * 100:.2f}%",
                         point.verdict, "—" if rest is None else f"{rest * 100:.2f}%",
                         ", ".join(run_label(r) for r in runs)])
            recs.append({**keys, "method": point.method, "tokens": point.tokens, "spread": point.spread,
                         "holds": point.holds, "spread_without_scores": rest,
                         "shapes": [f"b{b}xs{s}" for b, s, _, _ in point.shapes],
                         "peaks_gib": [peak for _, _, peak, _ in point.shapes]})
        held = sum(p.holds for p in group)
        name = slug("token-law", keys["device_name"], keys["model"], keys["dtype"], timing_slug(keys))
        tables.append(Table(
            name, f"Constant-token law, {group_title(keys)}",
            f"Peak GiB of each method at the shapes of one token count (batch × seq), their spread "
            f"((max − min) / min) and whether it is within {TOLERANCE:.0%}: {held} of {len(group)} hold. Without "
            f"scores: the spread once one layer's attention scores (batch × heads × seq² × 2 bytes, the one peak "
            f"term quadratic in seq, where the peak falls in the attention backward) are taken off each peak.",
            ["Method", "Tokens", "Peaks by shape (GiB)", "Spread", f"≤ {TOLERANCE:.0%}", "Without scores", "Runs"],
            rows, "lrlrlrl", [], recs))
    return tables


__all__ = ["LAW_KEYS", "TOLERANCE", "TokenLawPoint", "attention_heads", "attention_scores_gib", "token_law_points",
           "token_law_tables"]
