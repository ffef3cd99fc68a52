"""The report's first page (``README.md`` of the report folder): what a reader takes in at a glance.

Per device: the headline cell (where an AdamW baseline and the most arms ran, then the largest model,
at its smallest batch x seq), one column per timing (eager, CUDA graph, lean activations) from the
newest run that compared FORGE with AdamW there; where users train (``modes.py``: eager, torch.compile,
reduce-overhead and the hand-captured graph, per model a compile run measured); the peers at
the cell where the newest run with peer arms measured them; FORGE's memory saving / speed-up at every
batch x seq of that model (each shape from its newest run). Everything else, every run, table and
figure, is in ``index.md``, which this page links. Ratios follow the one rule (``ratios.py``): only
within one run on one device.
"""
from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

from forge_bench.results import CHECKPOINTED

from . import modes, ratios, tables
from .data import (BASELINE_PREFERENCE, EAGER_TIMING, GRAPH_TIMING, HEADLINE_KEYS, NOTHING_FUSED_NOTE, across_runs, choose_baseline,
                   cited_run, device_label, find_baseline_row, fmt_memory, fmt_ms, group_title, key_parts, memory_unit,
                   method_cell, newest_run, nothing_fused, records, run_label, slug)
from .ratios import as_number, as_text

CORE_FAMILIES = ("baseline", "forge")
VARIANT_ORDER = [(EAGER_TIMING, "hf"), (GRAPH_TIMING, "hf"), (EAGER_TIMING, "lean"), (GRAPH_TIMING, "lean")]


def variant_label(timing: str, activations: str) -> str:
    """A column name for one timing of the headline cell."""
    flavor = {"lean": ", lean activations", CHECKPOINTED: ", activation checkpointing"}.get(activations, "")
    return ("CUDA graph" if timing == GRAPH_TIMING else "eager") + flavor


def headline_cell(frame: pd.DataFrame) -> tuple[str, int, int] | None:
    """(model, batch, seq) of one device's headline: the cell where an AdamW baseline and the most
    baseline and FORGE arms ran ok, then the largest model, then the fewest tokens per step (then the
    smaller batch). Why the arm count first: a capability cell (the largest model one FORGE arm fits,
    no baseline beside it) would otherwise push the comparison every arm ran off the page. Models on
    which a FORGE arm fused weights come first: a headline where FORGE fused nothing would show only
    its unfused path."""
    ok = frame[(frame["status"] == "ok") & frame["method_family"].isin(CORE_FAMILIES)]
    if ok.empty:
        return None
    fused = ok[(ok["method_family"] == "forge") & (pd.to_numeric(ok["n_fused_params"]).fillna(0) > 0)]
    if not fused.empty:
        ok = ok[ok["model"].isin(set(fused["model"]))]
    sizes = {model: max((as_number(n) or 0.0) for n in group["n_params"]) for model, group in ok.groupby("model")}

    def rank(cell: tuple[str, int, int], methods: set[str]) -> tuple:
        model, batch, seq = cell
        return (bool(methods & set(BASELINE_PREFERENCE)), len(methods), sizes[model], model, -batch * seq, -batch)

    cells = {(m, int(b), int(s)): set(group["method"]) for (m, b, s), group in ok.groupby(["model", "batch", "seq"])}
    return max(cells, key=lambda cell: rank(cell, cells[cell]))


def _cell_text(row: Mapping[str, Any], base: Mapping[str, Any] | None, unit: str) -> str:
    status = as_text(row.get("status"))
    if status != "ok":
        return status or "—"
    peak = as_number(row.get("peak_allocated_gib"))
    speed = "baseline" if base is row else ratios.speedup(row, base).text
    return (f"{fmt_memory(peak, unit)} / " if peak is not None else "") + f"{fmt_ms(row.get('step_ms_median'))} ({speed})"


def _ok_peaks(rows: list[Mapping[str, Any]]) -> list[Any]:
    return [r.get("peak_allocated_gib") for r in rows if as_text(r.get("status")) == "ok"]


def _nothing_fused_lines(rows: list[Mapping[str, Any]]) -> list[str]:
    """The note under a table whose FORGE rows include one where nothing was fused."""
    return [f"_{NOTHING_FUSED_NOTE}_", ""] if any(nothing_fused(r) for r in rows) else []


def headline_section(frame: pd.DataFrame, cell: tuple[str, int, int],
                     figures: Mapping[str, str] | None = None) -> list[str]:
    """The headline cell of one device: one row per baseline / FORGE arm, one column per timing; then
    the headline figure of the last of ``VARIANT_ORDER``'s timings shown (the leanest step), where
    ``figures`` (figure stem -> PNG path relative to the page) has it."""
    model, batch, seq = cell
    rows = frame[(frame["model"] == model) & (frame["batch"] == batch) & (frame["seq"] == seq)
                 & frame["method_family"].isin(CORE_FAMILIES)]
    columns: list[tuple[str, list[dict[str, Any]], str | None, tuple[str, str]]] = []
    present = sorted(set(zip(rows["timing"], rows["activations"])), key=str)
    for timing, activations in VARIANT_ORDER + [v for v in present if v not in VARIANT_ORDER]:
        variant = rows[(rows["timing"] == timing) & (rows["activations"] == activations)]
        if variant.empty:
            continue
        run = cited_run(variant)      # the newest run that compared FORGE with AdamW, else the newest with FORGE
        picked = records(variant[variant["run_id"] == run])
        base_method, _ = choose_baseline(picked)
        columns.append((f"{variant_label(timing, activations)} (run {run_label(run)})", picked, base_method,
                        (timing, activations)))
    if any(column[2] for column in columns):     # a timing no run compared with AdamW adds no ratio: left out
        columns = [column for column in columns if column[2]]
    first = frame[frame["model"] == model].iloc[0]
    every = [r for column in columns for r in column[1]]
    unit = memory_unit(_ok_peaks(every))
    if any(as_number(peak) is not None for peak in _ok_peaks(every)):
        what = f"Peak {unit} / median step ms"
    else:
        why = next((as_text(r.get("peak_reason")) for r in every if as_text(r.get("peak_reason"))), None)
        what = "Median step ms (no peak memory" + (f": {why.rstrip('.')}" if why else "") + ")"
    lines = [f"### Headline: {group_title({'model': model, 'dtype': first['dtype'], 'batch': batch, 'seq': seq})}", "",
             f"{what} (speed-up against torch fused AdamW, `adamw_fused`, of the same run; "
             "`adamw_foreach` where the fused arm did not run). One column per timing, each from the newest "
             "run that measured FORGE beside an AdamW baseline (else the newest that measured it); a timing "
             "that no run compared with AdamW is left out where another was.", "",
             "| Method | " + " | ".join(column[0] for column in columns) + " |",
             "|:--|" + "--:|" * len(columns)]
    methods = tables.sorted_rows(every)
    for method in dict.fromkeys(r["method"] for r in methods):
        cells = []
        for _, picked, base_method, _ in columns:
            row = next((r for r in picked if r["method"] == method), None)
            cells.append("—" if row is None else _cell_text(row, find_baseline_row(row, picked, base_method), unit))
        lines.append(f"| {method_cell(method, every)} | " + " | ".join(cells) + " |")
    lines += [""] + _nothing_fused_lines(every)
    shown = [column for column in columns if column[3] in VARIANT_ORDER] or columns
    if shown and figures:
        _, picked, _, (timing, activations) = max(
            shown, key=lambda c: VARIANT_ORDER.index(c[3]) if c[3] in VARIANT_ORDER else -1)
        keys = {**{k: picked[0][k] for k in HEADLINE_KEYS}, "timing": timing, "activations": activations}
        png = figures.get(slug("headline", *key_parts({k: keys[k] for k in HEADLINE_KEYS})))
        if png:
            lines += [f"![{variant_label(timing, activations)}: peak and step per arm]({png})", ""]
    return lines


def modes_section(frame: pd.DataFrame) -> list[str]:
    """Where users train on this device: each model a compile run measured, its modes side by side."""
    if not modes.device_has_modes(frame):
        return [modes.NO_COMPILE_NOTE, ""]
    return [table.to_markdown(level=3) for table in modes.modes_tables(frame)]


def peers_section(frame: pd.DataFrame) -> list[str]:
    """The newest run with peer arms on this device, at the cell where it measured the most of them:
    every arm of that cell and run, against the same baseline."""
    peers = frame[frame["method_family"] == "peer"]
    if peers.empty:
        return ["### Peers", "", "_No peer arm was measured on this device._", ""]
    run = newest_run(peers)
    in_run = peers[peers["run_id"] == run]
    keys = ["model", "dtype", "batch", "seq", "timing", "activations"]
    counts = in_run.groupby(keys, dropna=False).size()
    key_map = dict(zip(keys, counts.idxmax()))
    group = frame[(frame["run_id"] == run)]
    for name, value in key_map.items():
        group = group[group[name] == value]
    rows = tables.sorted_rows(records(group))
    base_method, base_note = choose_baseline(rows)
    unit = memory_unit(_ok_peaks(rows))
    lines = [f"### Peers: {group_title({**key_map, 'run_id': run})}", "", base_note, "",
             f"| Method | Family | Peak {unit} | Δ peak | Step ms | Speed-up | Status |", "|:--|:--|--:|--:|--:|--:|:--|"]
    for row in rows:
        base = find_baseline_row(row, rows, base_method)
        is_base = base is row
        change = "baseline" if is_base else ratios.peak_change(row, base).text
        speed = "baseline" if is_base else ratios.speedup(row, base).text
        family, peak = row.get("method_family") or "—", fmt_memory(row.get("peak_allocated_gib"), unit)
        lines.append(f"| {method_cell(row['method'], [row])} | {family} | {peak} | {change} | "
                     f"{fmt_ms(row.get('step_ms_median'))} | {speed} | {as_text(row.get('status'))} |")
    return lines + [""] + _nothing_fused_lines(rows)


def grid_section(frame: pd.DataFrame, model: str) -> list[str]:
    """FORGE's memory saving / speed-up at every batch x seq measured on this device, of ``model``
    where it has two or more shapes (else of the model with the most): each shape from the run
    ``tables.grid_run_rank`` picks (the newest that measured a FORGE arm beside its baseline there:
    a FORGE-only run, e.g. a margin check, would leave the shape without a ratio), each ratio within
    that run. The timing with the most shapes is shown (then CUDA graph over eager, lean over hf)."""
    core = frame[frame["method_family"].isin(CORE_FAMILIES)]
    forge_ok = core[(core["status"] == "ok") & (core["method_family"] == "forge")]

    def shapes(rows: pd.DataFrame) -> set[tuple[int, int]]:
        return {(int(b), int(q)) for b, q in zip(rows["batch"], rows["seq"])}

    variants = {(m, t, a): shapes(g) for (m, t, a), g in forge_ok.groupby(["model", "timing", "activations"])}
    wide = {key: found for key, found in variants.items() if len(found) >= 2}
    if not wide:
        return ["### Batch × sequence grid", "", "_No model was measured at two or more batch × seq shapes on this "
                "device._", ""]
    preferred = [key for key in wide if key[0] == model] or list(wide)
    chosen = max(preferred, key=lambda k: (len(wide[k]), k[1] == GRAPH_TIMING, k[2] == "lean", k[0] == model))
    name, timing, activations = chosen
    variant = core[(core["model"] == name) & (core["timing"] == timing) & (core["activations"] == activations)]
    columns = sorted(wide[chosen], key=lambda shape: (shape[0] * shape[1], shape))
    [(_, picked)] = across_runs(variant, ["model"], ["batch", "seq"], tables.grid_run_rank)
    per_shape = {(batch, seq): records(picked[(picked["batch"] == batch) & (picked["seq"] == seq)])
                 for batch, seq in columns}
    methods = dict.fromkeys(r["method"] for r in tables.sorted_rows([r for rows in per_shape.values() for r in rows])
                            if r.get("method_family") == "forge")
    title = group_title({"model": name, "dtype": variant.iloc[0]["dtype"], "timing": timing,
                         "activations": activations})
    runs = ", ".join(f"b{b}×s{q} run {run_label(rows[0]['run_id'])}" for (b, q), rows in per_shape.items())
    lines = [f"### Batch × sequence grid: {title}", "",
             "FORGE's memory saving (share of the baseline's peak) / speed-up against the baseline of the same "
             "run and shape; a status where the arm did not run ok, “fits (baseline oom)” where it ran and the "
             f"baseline ran out of memory. Each shape from the newest run that measured FORGE beside its baseline there (else "
             f"the newest with FORGE): {runs}.", "",
             "| Method | " + " | ".join(f"b{b}×s{q}" for b, q in columns) + " |", "|:--|" + "--:|" * len(columns)]
    for method in methods:
        cells = []
        for shape in columns:
            rows = per_shape[shape]
            row = next((r for r in rows if r["method"] == method), None)
            cells.append("—" if row is None else tables.ratio_pair_text(*tables.grid_ratio(row, rows)))
        every = [r for rows in per_shape.values() for r in rows]
        lines.append(f"| {method_cell(method, every)} | " + " | ".join(cells) + " |")
    return lines + [""] + _nothing_fused_lines([r for rows in per_shape.values() for r in rows])


CPU_NOTE = ("_CPU rows: wall-clock steps on a CPU, FORGE's kernels in Triton's interpreter or its torch "
            "reference, no peak memory. They show that the harness runs end to end and say nothing of FORGE's "
            "speed or memory, which only a GPU measures: a speed-up below is no speed-up of FORGE's._")


def summary_markdown(frame: pd.DataFrame, results_text: str, details: str = "index.md",
                     distributed_rows: pd.DataFrame | None = None, figures: Mapping[str, str] | None = None) -> str:
    """The whole first page, as Markdown. ``frame``: the one-process rows the page's tables read;
    ``distributed_rows`` (the distributed arms') are counted and pointed to (their section is in
    ``details``); ``figures``: figure stem -> PNG path relative to the page, for the headline figure
    each device's section embeds."""
    every = frame if distributed_rows is None else pd.concat([frame, distributed_rows])
    ok = int((every["status"] == "ok").sum())
    runs = every["run_id"].nunique()
    devices = sorted({str(d) for d in frame["device_name"]}, key=lambda d: (device_label(d), d))
    all_devices = sorted({str(d) for d in every["device_name"] if isinstance(d, str)}, key=lambda d: (device_label(d), d))
    lines = ["# FORGE benchmark summary", "",
             f"{len(every)} rows ({ok} ok) from {results_text}: {runs} run{'' if runs == 1 else 's'} on "
             f"{', '.join(device_label(d) for d in all_devices)}. Memory in GiB (2^30 bytes), or in MiB (2^20 bytes) where "
             f"a table's header says so; times in ms. "
             f"Ratios only between rows of one run on one device; {ratios.NOISE_MARK} = inside the step-time "
             f"noise, ≥ / ≤ = a bound (the two cells ran at SM clocks apart). Every run, table and figure, and the "
             f"rule for ratios: [{details}]({details}).", ""]
    if distributed_rows is not None and len(distributed_rows):
        worlds = sorted({int(n) for n in distributed_rows["world_size"].dropna()})
        lines += [f"{len(distributed_rows)} of them are distributed cells (world sizes "
                  f"{', '.join(str(n) for n in worlds)}): their tables and targets are the Across GPUs "
                  f"section of [{details}]({details}#across-gpus).", ""]
    for device in devices:
        on_device = frame[frame["device_name"] == device]
        lines += [f"## {device_label(device)}" + (f" ({device})" if device_label(device) != device else ""), ""]
        if (on_device["device_type"] == "cpu").all():
            lines += [CPU_NOTE, ""]
        cell = headline_cell(on_device)
        if cell is None:
            lines += ["_No baseline or FORGE row ran ok on this device._", ""]
        else:
            lines += headline_section(on_device, cell, figures)
        lines += modes_section(on_device)
        lines += peers_section(on_device)
        lines += grid_section(on_device, cell[0] if cell is not None else "")
    lines += ["## Details", "", f"[{details}]({details}): the runs and the rule for ratios, every headline "
              "table and figure, where users train, the floor, the grids, model scaling, where memory goes, the "
              "hardware comparison, fidelity and what did not run.", ""]
    return "\n".join(lines).rstrip() + "\n"
