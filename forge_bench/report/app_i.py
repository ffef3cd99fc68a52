"""The paper's App. I table: every optimizer family fused against unfused.

Rows come from the family arms (``forge_bench.families``): a row's ``method_settings`` names its
``family``, whether it is ``fused``, and (fused) its ``state_dtype``; an unfused arm keeps its
states in the weight dtype. Per device, model, shape and timing, each family gets one line per
state format: the unfused and the FORGE peak and step, FORGE's peak change and speed-up (through
``ratios.py``: one run, one machine state), the GiB FORGE saves, and App. I's figures beside the
fp32 lines (App. I holds every state in fp32; its bf16 lines have no paper figure).
"""
from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

from forge_bench.family_table import FAMILIES, PAPER_PEAK_FALL, PAPER_TIME_FALL, STATE_DTYPES

from . import ratios
from .data import fmt_ms, fmt_number, group_title, records, slug, timing_slug
from .ratios import as_number, as_text, json_field
from .render import Table
from .targets import POOL_SHARE_TARGET, PoolVerdict, gradient_pool_gib, pool_and_speed
from .tables import why_not_run

APP_I_KEYS = ["device_name", "model", "batch", "seq", "timing", "activations"]
WEIGHT_STATES = {"float32": "fp32", "bfloat16": "bf16"}
"""The state format of an unfused arm: torch keeps its states in the weight dtype."""
HEADER = ["Family", "States", "Unfused arm", "Unfused peak GiB", "FORGE peak GiB", "Saved GiB", "Pool share",
          "Peak change", "Unfused step ms", "FORGE step ms", "Speed-up", "Target", "App. I (fp32)"]
BF16_BYTES = 2
"""The target's pool is the bf16 gradient pool (one bf16 gradient per parameter), whatever the weights' dtype."""
STRICTLY_FASTER = frozenset({"muon"})
"""Families whose target asks FORGE to be faster than the unfused optimizer, not only no slower."""


def family_key(row: Mapping[str, Any]) -> tuple[str, bool, str] | None:
    """(family, fused, state format) of a family arm's row; None for any other row."""
    settings = json_field(row.get("method_settings"))
    family = settings.get("family")
    if family not in FAMILIES:
        return None
    fused = bool(settings.get("fused"))
    states = settings.get("state_dtype") if fused else WEIGHT_STATES.get(as_text(row.get("dtype")) or "")
    return (family, fused, states) if states in STATE_DTYPES else None


def paper_text(family: str, states: str) -> str:
    """App. I's claim for this family (fp32 states only)."""
    if states != "fp32":
        return "—"
    low, high = PAPER_PEAK_FALL
    fast, slow = PAPER_TIME_FALL
    text = f"peak −{low:.0%}…−{high:.0%}, step −{fast:.0%}…−{slow:.0%}"
    speedup = FAMILIES[family].paper_speedup
    return text + (f", {speedup:.1f}× faster" if speedup else "")


def _newest(rows: list[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The ok row that finished last, else the last row (its status says why it has no numbers)."""
    if not rows:
        return None
    ok = [r for r in rows if as_text(r.get("status")) == "ok"]
    return max(ok or rows, key=lambda r: as_text(r.get("finished_at")) or "")


def pair(fused_rows: list[Mapping[str, Any]], unfused_rows: list[Mapping[str, Any]]
         ) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """(fused, unfused) rows of one family and state format: the newest fused row and an unfused row
    of the same weight dtype from the same run where there is one (ratios refuse any other)."""
    fused = _newest(fused_rows)
    if fused is None:
        return None, _newest(unfused_rows)
    same_dtype = [r for r in unfused_rows if as_text(r.get("dtype")) == as_text(fused.get("dtype"))]
    same_run = [r for r in same_dtype if ratios.incomparable_reason(fused, r) is None]
    return fused, _newest(same_run or same_dtype)


def _peak(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "not run"
    if as_text(row.get("status")) != "ok":
        return as_text(row.get("status")) or "?"
    return fmt_number(row.get("peak_allocated_gib"))


def _step(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "not run"
    if as_text(row.get("status")) != "ok":
        return as_text(row.get("status")) or "?"
    return fmt_ms(row.get("step_ms_median"))


def _saved(fused: Mapping[str, Any] | None, unfused: Mapping[str, Any] | None) -> float | None:
    if fused is None or unfused is None or ratios.peak_change(fused, unfused).value is None:
        return None
    return as_number(unfused.get("peak_allocated_gib")) - as_number(fused.get("peak_allocated_gib"))


def target_verdict(family: str, fused: Mapping[str, Any] | None, unfused: Mapping[str, Any] | None,
                   saved: float | None, speed: ratios.Ratio) -> PoolVerdict | None:
    """The family's target (``targets.pool_and_speed``) against the bf16 gradient pool of the model; None
    where a row is missing or did not measure."""
    if fused is None or unfused is None or saved is None:
        return None
    pool = gradient_pool_gib(as_number(unfused.get("n_params")), BF16_BYTES)
    return pool_and_speed(saved, pool, speed, strictly_faster=family in STRICTLY_FASTER)


def app_i_tables(frame: pd.DataFrame) -> list[Table]:
    """One App. I table per device, model, shape and timing that holds family rows."""
    rows = [(key, r) for r in records(frame) if (key := family_key(r)) is not None]
    if not rows:
        return []
    groups: dict[tuple, list[tuple[tuple[str, bool, str], Mapping[str, Any]]]] = {}
    for key, row in rows:
        groups.setdefault(tuple(row.get(k) for k in APP_I_KEYS), []).append((key, row))
    tables = []
    for group_key, members in groups.items():
        keys = dict(zip(APP_I_KEYS, group_key))
        body, numbers, notes = [], [], []
        for family in FAMILIES.values():
            for states in STATE_DTYPES:
                fused_rows = [r for (f, fused, s), r in members if f == family.name and fused and s == states]
                unfused_rows = [r for (f, fused, s), r in members if f == family.name and not fused and s == states]
                if not fused_rows and not unfused_rows:
                    continue
                fused, unfused = pair(fused_rows, unfused_rows)
                if fused is not None:
                    change, speed = ratios.peak_change(fused, unfused), ratios.speedup(fused, unfused)
                else:                                # the unfused arm alone (a sweep of it only)
                    change = speed = ratios.Ratio(None, "—", refusal="no FORGE row")
                saved = _saved(fused, unfused) if fused is not None else None
                for ratio in (change, speed):
                    if fused is not None and ratio.text == ratios.DIFFERENT_RUN and ratio.refusal:
                        notes.append(f"{family.label} ({states}): {ratios.DIFFERENT_RUN}: {ratio.refusal}")
                for row in (unfused, fused):
                    if row is not None and as_text(row.get("status")) != "ok":
                        notes.append(f"{row.get('method')}: {as_text(row.get('status'))}: {why_not_run(row)}")
                verdict = target_verdict(family.name, fused, unfused, saved, speed)
                share = verdict.share if verdict is not None else None
                body.append([family.label, states, family.unfused, _peak(unfused), _peak(fused),
                             fmt_number(saved), f"{share:.0%}" if share is not None else "—",
                             change.text if fused else "—", _step(unfused), _step(fused),
                             speed.text if fused else "—", verdict.long_text if verdict else "—",
                             paper_text(family.name, states)])
                numbers.append({
                    "family": family.name, "states": states,
                    "unfused_method": as_text(unfused.get("method")) if unfused else None,
                    "fused_method": as_text(fused.get("method")) if fused else None,
                    "unfused_peak_gib": as_number(unfused.get("peak_allocated_gib")) if unfused else None,
                    "fused_peak_gib": as_number(fused.get("peak_allocated_gib")) if fused else None,
                    "saved_gib": saved, "pool_share": share, "target_met": verdict.met if verdict else None,
                    "peak_change": change.value if fused else None,
                    "unfused_step_ms": as_number(unfused.get("step_ms_median")) if unfused else None,
                    "fused_step_ms": as_number(fused.get("step_ms_median")) if fused else None,
                    "speedup": speed.value if fused else None,
                    "paper_peak_fall": list(PAPER_PEAK_FALL) if states == "fp32" else None,
                    "paper_time_fall": list(PAPER_TIME_FALL) if states == "fp32" else None,
                    "paper_speedup": family.paper_speedup if states == "fp32" else None,
                })
        if not body:
            continue
        name = slug("app-i", keys["device_name"], keys["model"], f"b{keys['batch']}", f"s{keys['seq']}",
                    timing_slug(keys))
        caption = ("Per optimizer family: the unfused optimizer against FORGE with the same state format "
                   "(fp32: App. I's setting, fp32 weights; bf16: bf16 weights). Saved GiB = unfused peak − "
                   "FORGE peak; pool share = saved over the model's bf16 gradient pool; peak change and speed-up are "
                   f"FORGE against the unfused arm of the same run. Target: FORGE saves at least {POOL_SHARE_TARGET:.0%} "
                   "of the bf16 gradient pool and is no slower (~: inside the step-time noise, not measurably "
                   "slower); Muon's is faster.")
        tables.append(Table(name=name, title=f"App. I: optimizer families · {group_title(keys)}", caption=caption,
                            header=HEADER, rows=body, align="lllrrrrrrrrll", footnotes=sorted(set(notes)),
                            records=numbers))
    return tables


__all__ = ["APP_I_KEYS", "app_i_tables", "family_key", "pair", "paper_text"]
