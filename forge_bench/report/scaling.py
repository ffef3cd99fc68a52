"""The report's model-scaling tables (paper Fig. 7 / App. G): peak and step against parameter count,
within one model family. The figure (``figures.scaling_figures``) draws ``scaling_series``.
"""
from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

from .data import (NOTHING_FUSED_NOTE, across_runs, fmt_memory, fmt_ms, group_title, memory_unit, nothing_fused,
                   ordered_methods, params_text, records, run_label, slug, timing_slug)
from .ratios import as_number, as_text
from .render import Table

# A model family (forge_bench/zoo.py) is one architecture at several sizes: scaling compares sizes
# within one family only (tiny-Llama against tiny-GPT-2 is two architectures, not a curve).
SCALING_KEYS = ["run_id", "device_name", "family", "dtype", "batch", "seq", "timing", "activations"]


def scaling_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, rows) of every run x device x model family x dtype x shape measured on two or more
    models of that family."""
    out = []
    for keys, group in frame.groupby(SCALING_KEYS, sort=True, dropna=False):
        if group["model"].nunique() >= 2:
            out.append((dict(zip(SCALING_KEYS, keys)), group))
    return out


def scaling_series(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, rows) per device x family x dtype x shape with two or more models, each model's rows
    from the newest run that measured it. Why: a family is often measured in several runs (the
    small models first, the large ones later), and the figure shows the whole family; a model's
    arms still come from one run, so what its points compare was measured side by side.
    ``keys["run_id"]`` names the runs, oldest first."""
    return across_runs(frame, [k for k in SCALING_KEYS if k != "run_id"], "model")


def scaling_skip_note(frame: pd.DataFrame) -> str:
    """Why the report has no scaling table: which families each run measured at a single size."""
    singles = sorted({f"{family} ({', '.join(sorted(set(group['model'])))})"
                      for (_, family), group in frame.groupby(["run_id", "family"], sort=True)})
    return ("no run measured two or more models of one family at one shape (scaling compares sizes "
            f"within a family; families here: {'; '.join(singles) or 'none'})")


def scaling_title(keys: Mapping[str, Any]) -> str:
    """The title of one family's scaling group."""
    return f"{keys['family']} family · {group_title(keys)}"


def models_by_size(group: pd.DataFrame) -> list[tuple[str, float | None]]:
    sizes: dict[str, float | None] = {}
    for model, n_params in zip(group["model"], group["n_params"]):
        if sizes.get(model) is None:
            sizes[model] = as_number(n_params)
    return sorted(sizes.items(), key=lambda kv: (kv[1] is None, kv[1] or 0.0, kv[0]))


def scaling_tables(frame: pd.DataFrame) -> list[Table]:
    tables = []
    for keys, group in scaling_groups(frame):
        models = models_by_size(group)
        columns = [f"{m} ({params_text(n)})" for m, n in models]
        group_rows = records(group)
        unit = memory_unit(r.get("peak_allocated_gib") for r in group_rows if as_text(r.get("status")) == "ok")
        body, recs = [], []
        for method in ordered_methods(group):
            line = [f"`{method}`"]
            for model, n_params in models:
                hit = records(group[(group["model"] == model) & (group["method"] == method)])
                if not hit:
                    line.append("—")
                    continue
                row = hit[-1]
                if as_text(row.get("status")) != "ok":
                    line.append(str(row.get("status")))
                    continue
                line.append(f"{fmt_memory(row.get('peak_allocated_gib'), unit)} / {fmt_ms(row.get('step_ms_median'))}"
                            + (" (nothing fused)" if nothing_fused(row) else ""))
                recs.append({**keys, "method": method, "model": model, "n_params": n_params,
                             "peak_gib": as_number(row.get("peak_allocated_gib")),
                             "step_ms_median": as_number(row.get("step_ms_median"))})
            body.append(line)
        tables.append(Table(slug("scaling", keys["device_name"], keys["family"], keys["dtype"], keys["batch"],
                                 keys["seq"], run_label(keys["run_id"]), timing_slug(keys)),
                            f"Model scaling, {scaling_title(keys)}",
                            f"Peak {unit} / median step ms per method and model (parameter count "
                            "in brackets), the models of one family.", ["Method"] + columns, body,
                            "l" + "r" * len(models),
                            [NOTHING_FUSED_NOTE] if any(nothing_fused(r) for r in group_rows) else [], recs))
    return tables


__all__ = ["SCALING_KEYS", "models_by_size", "scaling_groups", "scaling_series", "scaling_skip_note", "scaling_tables",
           "scaling_title"]
