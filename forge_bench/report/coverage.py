"""Coverage across the model zoo (paper App. P) and scaling within one model family (paper Fig. 7).

* ``coverage_tables``: per device, one line per model that a FORGE arm ran on: the share of its
  parameters FORGE fused (``n_fused_params / n_params``), and per arm (fused AdamW, FORGE bf16,
  FORGE int8) the resident optimizer state, the peak and the step, plus what ``fuse`` left to the
  fallback optimizer (the FORGE row's ``method_settings["not_fused"]``). The arms come from the newest
  run that measured all three where one did, else each from its newest row. Numbers, no ratios: a
  model's arms may then come from different runs, so no speed-up is claimed here (the headline and
  scaling tables do that within one run).
* ``family_scaling_figures`` / ``largest_fit_tables``: models of one zoo family whose names give
  their size (``qwen3-0.6b`` ... ``qwen3-14b``: ``-<size>b``) at one shape on one device: peak and
  step against the parameter count per arm, cells that did not fit marked, and the largest model
  each arm fits.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from forge_bench import zoo

from .data import fmt_ms, fmt_number, group_title, records, slug
from .figures import FORMATS, save
from .ratios import as_number, as_text
from .render import Table
from .data import params_text

COVERAGE_ARMS = ("adamw_fused", "forge_bf16", "forge_int8")
COVERAGE_KEYS = ["device_name", "dtype", "timing", "activations"]
FAMILY_KEYS = ["device_name", "dtype", "batch", "seq", "timing", "activations"]
FAMILY_NAME = re.compile(r"^(?P<family>.+)-(?P<size>\d+(?:\.\d+)?)b$")
DID_NOT_FIT = ("oom", "oom_predicted")


def _newest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return max(rows, key=lambda r: as_text(r.get("finished_at")) or "") if rows else None


def _not_fused(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "—"
    try:
        settings = json.loads(as_text(row.get("method_settings")) or "{}")
    except ValueError:
        return "—"
    left = settings.get("not_fused") or {}
    return "; ".join(sorted(left)) if left else "nothing"


def _arm_cell(row: Mapping[str, Any] | None, column: str, formatter) -> str:
    if row is None:
        return "—"
    if as_text(row.get("status")) != "ok":
        return str(row.get("status"))
    return formatter(row.get(column))


def coverage_tables(frame: pd.DataFrame) -> list[Table]:
    """Per device, dtype and timing: one line per model that a FORGE arm of ``COVERAGE_ARMS`` ran on."""
    tables = []
    subset = frame[frame["method"].isin(COVERAGE_ARMS)]
    for keys, group in subset.groupby(COVERAGE_KEYS, sort=True, dropna=False):
        keys = dict(zip(COVERAGE_KEYS, keys))
        body, recs = [], []
        models = group[group["method"].str.startswith("forge_")].groupby("model", sort=False)
        sized = sorted(((as_number(g["n_params"].max()) or 0.0, model, int(g["batch"].iloc[0]) * int(g["seq"].iloc[0]))
                        for model, g in models), key=lambda item: (item[0], item[1]))
        for n_params, model, tokens in sized:
            rows = records(group[group["model"] == model])
            complete = [run for run in {r["run_id"] for r in rows}
                        if {r["method"] for r in rows if r["run_id"] == run} >= set(COVERAGE_ARMS)]
            if complete:                        # the newest run that measured every arm, when one did
                run = _newest([r for r in rows if r["run_id"] in complete])["run_id"]
                rows = [r for r in rows if r["run_id"] == run]
            newest = {arm: _newest([r for r in rows if r["method"] == arm]) for arm in COVERAGE_ARMS}
            forge = next((newest[a] for a in ("forge_bf16", "forge_int8")
                          if newest[a] is not None and as_number(newest[a].get("n_fused_params")) is not None), None)
            share = (as_number(forge.get("n_fused_params")) / n_params) if forge is not None and n_params else None
            cells = {column: " / ".join(_arm_cell(newest[arm], column, fmt) for arm in COVERAGE_ARMS)
                     for column, fmt in (("mem_optimizer_states_gib", fmt_number),
                                         ("peak_allocated_gib", fmt_number), ("step_ms_median", fmt_ms))}
            body.append([model, params_text(n_params), str(tokens), "—" if share is None else f"{100 * share:.1f}%",
                         cells["mem_optimizer_states_gib"], cells["peak_allocated_gib"], cells["step_ms_median"],
                         _not_fused(forge)])
            for arm in COVERAGE_ARMS:
                row = newest[arm]
                recs.append({**keys, "model": model, "method": arm, "n_params": n_params, "fused_share": share,
                             "status": None if row is None else as_text(row.get("status")),
                             "optimizer_states_gib": None if row is None else as_number(row.get("mem_optimizer_states_gib")),
                             "peak_gib": None if row is None else as_number(row.get("peak_allocated_gib")),
                             "step_ms_median": None if row is None else as_number(row.get("step_ms_median"))})
        if body:
            tables.append(Table(slug("coverage", keys["device_name"], keys["dtype"],
                                     "graph" if keys["timing"] != "eager" else None,
                                     keys["activations"] if keys["activations"] != "hf" else None),
                                f"Coverage, {group_title(keys)}",
                                "Per model: the share of its parameters FORGE updates inside backward; then fused "
                                "AdamW / FORGE bf16 / FORGE int8: resident optimizer state (GiB, analytic), peak "
                                "(GiB) and median step (ms), from the newest run that measured all three (else each arm's newest "
                                "row); a status where "
                                "the arm did not run ok. Left to the fallback: the module kinds fuse() did not "
                                "fuse (count), from the FORGE row.",
                                ["Model", "Params", "Tokens / step", "Fused", "State GiB", "Peak GiB", "Step ms",
                                 "Left to the fallback"], body, "lrrrrrrl", [], recs))
    return tables


def model_family(name: str) -> tuple[str, float] | None:
    """(family, billions) for a name that gives its size, like ``qwen3-0.6b``; None for any other
    name. The family is the zoo's (``forge_bench/zoo.py``: Llama 3.2 1B and Llama 3.1 8B are one)."""
    match = FAMILY_NAME.match(str(name))
    return (zoo.model_family(str(name)), float(match["size"])) if match else None


def family_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys + family, rows of the newest run per model and method) for every family measured at
    two or more sizes at one shape on one device."""
    out = []
    families = frame["model"].map(lambda m: (model_family(m) or (None,))[0])
    for keys, group in frame.assign(family=families).dropna(subset=["family"]).groupby(
            FAMILY_KEYS + ["family"], sort=True, dropna=False):
        if group["model"].nunique() < 2:
            continue
        newest = [pd.DataFrame([_newest(records(g))]) for _, g in group.groupby(["model", "method"], sort=False)]
        out.append((dict(zip(FAMILY_KEYS + ["family"], keys)), pd.concat(newest, ignore_index=True)))
    return out


def _params(row: Mapping[str, Any]) -> float:
    n = as_number(row.get("n_params"))
    return n if n else (model_family(row["model"]) or ("", 0.0))[1] * 1e9


def largest_fit_tables(frame: pd.DataFrame) -> list[Table]:
    """Per family group: per arm, the largest model that ran ok and the smallest that did not fit."""
    tables = []
    for keys, group in family_groups(frame):
        body, recs = [], []
        for method in [m for m in COVERAGE_ARMS if m in set(group["method"])] + \
                sorted(set(group["method"]) - set(COVERAGE_ARMS)):
            rows = sorted(records(group[group["method"] == method]), key=_params)
            ok = [r for r in rows if as_text(r.get("status")) == "ok"]
            failed = [r for r in rows if as_text(r.get("status")) in DID_NOT_FIT]
            largest = ok[-1] if ok else None
            first_miss = next((r for r in failed if largest is None or _params(r) > _params(largest)), None)
            body.append([f"`{method}`",
                         "none" if largest is None else f"{largest['model']} ({fmt_number(largest.get('peak_allocated_gib'))} GiB)",
                         "—" if first_miss is None else f"{first_miss['model']} ({first_miss['status']})"])
            recs.append({**keys, "method": method, "largest_ok": None if largest is None else largest["model"],
                         "first_not_fitting": None if first_miss is None else first_miss["model"]})
        tables.append(Table(slug("largest-fit", keys["family"], keys["device_name"], keys["batch"], keys["seq"]),
                            f"Largest {keys['family']} model that fits, {group_title(keys)}",
                            "Per arm: the largest model of the family that ran ok (its peak), and the smallest "
                            "larger one that did not fit (oom, or oom_predicted: refused before it ran).",
                            ["Method", "Largest that fits", "Smallest that does not"], body, "lll", [], recs))
    return tables


def family_scaling_figures(frame: pd.DataFrame, folder: Path, colors: dict[str, Any],
                           formats: Sequence[str] = FORMATS) -> tuple[list[Path], str | None]:
    """Peak and step against parameters within one family, per arm; an x at the top of the peak
    panel for each model an arm did not fit."""
    groups = family_groups(frame)
    if not groups:
        return [], "no run measured two or more models of one family (e.g. qwen3-0.6b and qwen3-1.7b) at one shape"
    paths: list[Path] = []
    for keys, group in groups:
        fig = Figure(figsize=(9.5, 3.8))
        ax_mem, ax_time = fig.subplots(1, 2)
        sizes = sorted({(_params(r), r["model"]) for r in records(group)})
        top = max([as_number(v) or 0.0 for v in group["peak_allocated_gib"]] + [1.0]) * 1.12
        for index, method in enumerate([m for m in COVERAGE_ARMS if m in set(group["method"])] +
                                       sorted(set(group["method"]) - set(COVERAGE_ARMS))):
            rows = sorted(records(group[group["method"] == method]), key=_params)
            ok = [r for r in rows if as_text(r.get("status")) == "ok"]
            color = colors.get(method)
            if ok:
                n = [_params(r) for r in ok]
                peaks = [as_number(r.get("peak_allocated_gib")) for r in ok]
                ax_mem.plot(n, [np.nan if p is None else p for p in peaks], marker="o", color=color, label=method)
                ax_time.plot(n, [as_number(r.get("step_ms_median")) for r in ok], marker="o", color=color,
                             label=method)
            missed = [r for r in rows if as_text(r.get("status")) in DID_NOT_FIT]
            if missed:
                ax_mem.scatter([_params(r) for r in missed], [top * (1 + 0.04 * index)] * len(missed), marker="x",
                               color=color, label=f"{method}: did not fit")     # stacked: one x per arm
        for ax in (ax_mem, ax_time):
            ax.set_xscale("log")
            ax.set_xticks([n for n, _ in sizes], [f"{m}\n{params_text(n)}" for n, m in sizes], fontsize=7)
            ax.minorticks_off()
            ax.grid(alpha=0.3, which="both")
            ax.set_xlabel("parameters (log scale)")
        ax_mem.set_ylabel("peak allocated memory (GiB)")
        ax_mem.set_title("Peak memory (x: did not fit)")
        ax_time.set_ylabel("median step time (ms)")
        ax_time.set_title("Step time")
        handles, labels = ax_mem.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), title="method", fontsize=8)
        fig.suptitle(f"{keys['family']} family scaling: {group_title(keys)}")
        fig.tight_layout()
        paths += save(fig, folder, slug("family-scaling", keys["family"], keys["device_name"], keys["dtype"],
                                        keys["batch"], keys["seq"],
                                        "graph" if keys["timing"] != "eager" else None), formats)
    return paths, None


__all__ = ["coverage_tables", "family_groups", "family_scaling_figures", "largest_fit_tables", "model_family"]
