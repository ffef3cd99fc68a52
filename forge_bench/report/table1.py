"""The paper's Table 1, per cell: every arm's peak, median and mean ± sd step, throughput in model
TF/s, and the paper's figure beside ours where the paper has one.

Model FLOPs per step (PaLM's accounting, App. B): ``6 N T`` for the parameter matrices (forward and
backward, N = the row's parameter count, T = batch x seq tokens) plus ``12 L H S T`` for attention's
score and value products (L layers, H hidden width, S the sequence), read from the zoo's config.
Mixture-of-experts models (a token reaches a few experts, not N parameters) and models without
attention or without a causal-LM config get no TF/s rather than a wrong one. Mean ± sd is over every
timed step of the row (all repeats); the median is the harness's (median of the runs' medians).
"""
from __future__ import annotations

import json
import statistics
from functools import lru_cache
from typing import Any, Mapping

import pandas as pd

from forge_bench import zoo

from .data import (HEADLINE_KEYS, fmt_measured, fmt_ms, fmt_number, group_title, key_parts, method_cell, records,
                   run_label, slug)
from . import ratios
from .ratios import as_number, as_text
from .render import Table
from .tables import sorted_rows

# The paper's Table 1 (H200, bf16 weights and moments): (model, batch, seq) -> arm -> (peak GB, step ms).
PAPER_TABLE1: dict[tuple[str, int, int], dict[str, tuple[float, float]]] = {
    ("llama-3.1-8b", 1, 512): {"adamw_fused": (60.08, 134.3), "forge_bf16": (48.36, 110.2), "forge_int8": (35.32, 155.0)},
}
PAPER_GPU = "H200"


@lru_cache(maxsize=None)
def _config(model: str) -> dict[str, Any] | None:
    spec = zoo.MODEL_ZOO.get(model)
    if spec is None or spec.task != zoo.CAUSAL_LM or not spec.config_path.exists():
        return None
    return json.loads(spec.config_path.read_text())


def model_flops_per_step(model: str, n_params: Any, batch: Any, seq: Any) -> float | None:
    """6 N T + 12 L H S T, or None where that count would be wrong (see the module's docstring)."""
    config = _config(str(model))
    n, b, s = as_number(n_params), as_number(batch), as_number(seq)
    if config is None or n is None or b is None or s is None or config.get("num_experts"):
        return None
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    if not layers or not hidden or not (config.get("num_attention_heads") or config.get("n_head")):
        return None
    tokens = b * s
    return 6.0 * n * tokens + 12.0 * layers * hidden * s * tokens


def tflops(row: Mapping[str, Any]) -> float | None:
    """Model TF/s of an ok row: model FLOPs per step over the median step time."""
    flops = model_flops_per_step(row.get("model"), row.get("n_params"), row.get("batch"), row.get("seq"))
    step_ms = as_number(row.get("step_ms_median"))
    if flops is None or step_ms is None or step_ms <= 0 or as_text(row.get("status")) != "ok":
        return None
    return flops / (step_ms * 1e-3) / 1e12


def mean_sd(row: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the row's timed steps, ms (None without two steps)."""
    steps = row.get("step_ms_all")
    values = [float(v) for v in steps] if steps is not None else []
    if len(values) < 2:
        return None, None
    return statistics.fmean(values), statistics.stdev(values)


def paper_arm(method: str) -> str | None:
    """Which of the paper's Table 1 arms a method stands for: FORGE's variants (chunked loss, graphs)
    under their state dtype, fused AdamW as itself."""
    if method.startswith("adamw_fused"):
        return "adamw_fused"
    for states in ("bf16", "int8"):
        if method.startswith(f"forge_{states}"):
            return f"forge_{states}"
    return None


def paper_text(model: str, batch: int, seq: int, method: str) -> str:
    arm = paper_arm(method)
    figures = PAPER_TABLE1.get((model, batch, seq), {}).get(arm) if arm else None
    return "—" if figures is None else f"{figures[0]:.2f} GB / {figures[1]:.1f} ms"


def table1_tables(frame: pd.DataFrame) -> list[Table]:
    """One table per device x model x dtype x shape x timing x activations (rows of several runs
    each keep their run in the method cell's run column)."""
    tables = []
    for key_values, group in frame.groupby(HEADLINE_KEYS, sort=True, dropna=False):
        keys = dict(zip(HEADLINE_KEYS, key_values))
        rows = sorted_rows(records(group))
        several_runs = group["run_id"].nunique(dropna=False) > 1
        body, recs = [], []
        for row in rows:
            ok = as_text(row.get("status")) == "ok"
            mean, sd = mean_sd(row) if ok else (None, None)
            throughput = tflops(row)
            paper = paper_text(str(keys["model"]), int(keys["batch"]), int(keys["seq"]), str(row["method"]))
            first_step = as_number(ratios.json_field(row.get("extra")).get("first_step_s"))
            body.append([method_cell(str(row["method"]), [row])]
                        + ([run_label(row.get("run_id"))] if several_runs else [])
                        + [fmt_number(row.get("peak_allocated_gib")) if ok else as_text(row.get("status")) or "—",
                           fmt_ms(row.get("step_ms_median")) if ok else "—",
                           "—" if mean is None else f"{fmt_ms(mean)} ± {fmt_number(sd, 2 if sd < 10 else 1)}",
                           fmt_measured(throughput, 0), fmt_measured(first_step, 1), paper])
            recs.append({**keys, "method": row["method"], "run_id": row.get("run_id"), "status": row.get("status"),
                         "peak_gib": as_number(row.get("peak_allocated_gib")) if ok else None,
                         "step_ms_median": as_number(row.get("step_ms_median")) if ok else None,
                         "step_ms_mean": mean, "step_ms_sd": sd, "tflops": throughput, "first_step_s": first_step,
                         "paper": paper})
        if not body:
            continue
        has_paper = any(line[-1] != "—" for line in body)
        caption = ("Peak: the timed window's allocated GiB; step: the median, and mean ± sd over every timed "
                   "step; TF/s: model FLOPs per step (6 N T + 12 L H S T) over the median step; first step: the "
                   "first training step's wall time, tile tuning or tune-cache lookups and compiles included"
                   + (f"; the paper's figure ({PAPER_GPU}, GB as the paper prints them) beside ours." if has_paper
                      else "."))
        tables.append(Table(slug("table1", *key_parts(keys)), f"Table 1, {group_title(keys)}", caption,
                            ["Method"] + (["Run"] if several_runs else [])
                            + ["Peak GiB", "Step ms", "Mean ± sd ms", "TF/s", "First step s", f"Paper ({PAPER_GPU})"],
                            body, "l" + ("l" if several_runs else "") + "rrrrrl", [], recs))
    return tables


__all__ = ["PAPER_GPU", "PAPER_TABLE1", "mean_sd", "model_flops_per_step", "paper_arm", "table1_tables", "tflops"]
