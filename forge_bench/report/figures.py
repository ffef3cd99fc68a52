"""The report's figures (matplotlib, Agg canvas, PNG + PDF by default, nothing clipped).

Every figure uses ``matplotlib.figure.Figure`` with an explicit Agg canvas: no pyplot global
state, no GUI backend, safe in a headless sweep machine. Ratios come from ``ratios.py`` through
the same helpers as the tables, so a figure can never show a ratio that a table refuses.
Each builder returns ``(paths, note)``: the files written, or none plus a one-line reason. Where
several runs measured the same group, the memory figures draw the newest run only, the grid figures the
widest grid (``data.one_per_key``; the grid over runs, ``tables.grid_series``, among them) and the scaling
figures each model's newest run (``scaling.scaling_series``, a family being measured a few sizes at a
time): another run's figure repeats its table's numbers.
Every builder takes ``formats``, the file types each figure is saved as (``FORMATS`` unless the
caller asks for fewer, e.g. ``("png",)`` to skip the PDF twins).
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
import numpy as np
import pandas as pd

from forge_bench.png import compact_png

from . import ratios
from .data import (HEADLINE_KEYS, MIB_PER_GIB, NOTHING_FUSED, cited_run, key_parts, timing_slug, choose_baseline,
                   find_baseline_row, group_title, is_forge, memory_unit, nothing_fused, one_per_key, ordered_methods,
                   params_text, records, run_label, slug)
from .ratios import DIFFERENT_RUN, NOISE_MARK, Ratio, as_number, as_text
from .scaling import models_by_size, scaling_series, scaling_skip_note, scaling_title
from .tables import (ANALYTIC_PARTS, grid_coverage, grid_groups, grid_ratio_cells, grid_series, hardware_cells,
                     hardware_groups, memory_groups, memory_parts, shapes_of, cell_row, sorted_rows)

matplotlib.rcParams.update({"font.size": 9, "axes.titlesize": 10, "figure.dpi": 100})

PNG_DPI = 150
FORMATS: tuple[str, ...] = ("png", "pdf")   # what a figure is saved as, in this order, by default
NA_COLOR = "#d9d9d9"
MEMORY_COLORS = {"Weights": "#4c72b0", "Optimizer states": "#dd8452", "Gradients": "#c44e52",
                 "Activations + rest": "#8c8c8c"}


def method_colors(methods: list[str]) -> dict[str, Any]:
    """One stable colour per method across every figure (tab10, tab20 past ten methods)."""
    cmap = matplotlib.colormaps["tab10" if len(methods) <= 10 else "tab20"]
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``formats`` in ``FORMATS`` order, without repeats; ValueError (one line) for an unknown or
    empty selection."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"figure formats must be one or more of {', '.join(FORMATS)}; got "
                         f"{', '.join(map(repr, formats)) or 'none'}")
    return tuple(f for f in FORMATS if f in formats)


def save(fig: Figure, folder: Path, stem: str, formats: Sequence[str] = FORMATS) -> list[Path]:
    """PNG and/or PDF (``formats``), cropped to the drawn content so no label is clipped;
    reproducible bytes; PNGs with a palette (``compact_png``). Returns the paths in ``FORMATS`` order."""
    folder.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    paths = []
    for kind in check_formats(formats):
        path = folder / f"{stem}.{kind}"
        if kind == "png":
            fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight", metadata={"Software": None})
            compact_png(path)
        else:
            fig.savefig(path, bbox_inches="tight", metadata={"CreationDate": None, "Creator": None})
        paths.append(path)
    return paths


def short_na(ratio: Ratio) -> str:
    """A cell-sized spelling of a refused ratio."""
    if ratio.text == DIFFERENT_RUN:
        return "n/a\n(diff. run)"
    return ratio.text.replace(" (", "\n(")


def _step_errors(rows: list[Mapping[str, Any]]) -> np.ndarray:
    """Asymmetric error bars from the median down to p10 and up to p90 (0 when unknown)."""
    lower, upper = [], []
    for row in rows:
        median = as_number(row.get("step_ms_median"))
        p10, p90 = as_number(row.get("step_ms_p10")), as_number(row.get("step_ms_p90"))
        lower.append(max(0.0, median - p10) if median is not None and p10 is not None else 0.0)
        upper.append(max(0.0, p90 - median) if median is not None and p90 is not None else 0.0)
    return np.array([lower, upper])


def _bar_labels(ax, bars, texts: list[str], vertical: bool = False,
                tops: list[float] | None = None) -> None:
    """Write each text just past the end of its bar (below a negative bar, above a positive),
    or above ``tops`` (e.g. the whisker's end) where given."""
    for k, (bar, text) in enumerate(zip(bars, texts)):
        if not text:
            continue
        height = bar.get_y() + bar.get_height()
        if tops is not None and bar.get_height() >= 0:
            height = max(height, tops[k])
        below = bar.get_height() < 0
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, height),
                    xytext=(0, -2 if below else 2), textcoords="offset points", ha="center",
                    va="top" if below else "bottom", fontsize=7, rotation=90 if vertical else 0)


# --- headline: peak and step per method ---------------------------------------------------------

def headline_run_rows(every_run: pd.DataFrame) -> tuple[Any, list[dict[str, Any]]]:
    """(run, its rows) of one headline group that its figure draws: the run the summary quotes
    (``data.cited_run``), so that the figure has one bar per arm and its numbers are the table's."""
    run = cited_run(every_run)
    return run, records(every_run[every_run["run_id"] == run])


def headline_figures(frame: pd.DataFrame, folder: Path, colors: dict[str, Any],
                     formats: Sequence[str] = FORMATS) -> list[Path]:
    """Per device, model and shape: peak GiB and step ms (p10–p90 whiskers) per method, one bar per arm
    of the run the headline quotes (``data.cited_run``: the newest that measured FORGE beside its
    baseline); the table beside it keeps every run."""
    paths = []
    for keys, every_run in frame.groupby(HEADLINE_KEYS, sort=True, dropna=False):
        if not (every_run["status"] == "ok").any():
            continue
        run, all_rows = headline_run_rows(every_run)
        several_runs = every_run["run_id"].nunique() > 1
        # the same dict objects as all_rows: "is this row its own baseline" is an identity test
        rows = sorted_rows([r for r in all_rows if as_text(r.get("status")) == "ok"])
        if not rows:
            continue
        labels = [r["method"] + (f"\n({NOTHING_FUSED})" if nothing_fused(r) else "") for r in rows]
        base_method, base_note = choose_baseline(all_rows)
        # Side by side for a few arms; one above the other once the bars would make it too wide to read.
        if len(rows) <= 8:
            fig = Figure(figsize=(max(6.0, 1.1 * len(rows) + 2), 3.6))
            ax_mem, ax_time = fig.subplots(1, 2)
        else:
            fig = Figure(figsize=(max(8.0, 0.55 * len(rows) + 2), 7.6))
            ax_mem, ax_time = fig.subplots(2, 1)
        x = np.arange(len(rows))
        peaks = [as_number(r.get("peak_allocated_gib")) for r in rows]
        unit = memory_unit(peaks)
        if any(p is not None for p in peaks):
            scale = MIB_PER_GIB if unit == "MiB" else 1.0
            bars = ax_mem.bar(x, [(p or 0.0) * scale for p in peaks], color=[colors[r["method"]] for r in rows])
            texts = []
            for row, peak in zip(rows, peaks):
                base = find_baseline_row(row, all_rows, base_method)
                texts.append("n/a" if peak is None else
                             ("base" if base is row else ratios.peak_change(row, base).text.replace(
                                 DIFFERENT_RUN, "n/a (other run)")))
            _bar_labels(ax_mem, bars, texts)
            ax_mem.set_ylabel(f"peak allocated memory ({unit})")
            ax_mem.margins(y=0.15)
        else:
            reason = as_text(rows[0].get("peak_reason")) or "not recorded"
            ax_mem.text(0.5, 0.5, "peak memory not measured\n" + textwrap.fill(f"({reason})", 36),
                        ha="center", va="center", transform=ax_mem.transAxes)
            ax_mem.set_yticks([])
        ax_mem.set_title("Peak memory (label: change vs baseline)")
        steps = [as_number(r.get("step_ms_median")) or 0.0 for r in rows]
        errors = _step_errors(rows)
        bars = ax_time.bar(x, steps, yerr=errors, capsize=3,
                           color=[colors[r["method"]] for r in rows])
        texts = []
        for row in rows:
            base = find_baseline_row(row, all_rows, base_method)
            texts.append("base" if base is row else
                         ratios.speedup(row, base).text.replace(DIFFERENT_RUN, "n/a (other run)"))
        whisker_tops = [m + up for m, up in zip(steps, errors[1])]
        _bar_labels(ax_time, bars, texts, tops=whisker_tops)
        ax_time.set_ylim(0, max(whisker_tops + [1e-9]) * 1.15)
        ax_time.set_ylabel("median step time (ms)")
        ax_time.set_title("Step time, p10–p90 whiskers (label: speed-up)")
        ax_time.margins(y=0.15)
        for ax in (ax_mem, ax_time):
            ax.set_xticks(x, labels, rotation=30, ha="right")
            ax.set_xlabel("method")
        if all(p is None for p in peaks):
            ax_mem.set_xticks([])
            ax_mem.set_xlabel("")
        baseline_text = f"baseline {base_method}" if base_method else "no baseline"
        run_text = (f"run {run_label(run)}, the one of {every_run['run_id'].nunique()} runs the summary quotes "
                    "(every run: the table)" if several_runs else f"run {run_label(run)}")
        fig.suptitle(f"{group_title(dict(zip(HEADLINE_KEYS, keys)))}\n{run_text}; {baseline_text}; "
                     f"{NOISE_MARK} = inside step-time noise")
        fig.tight_layout()
        paths += save(fig, folder, slug("headline", *key_parts(dict(zip(HEADLINE_KEYS, keys)))), formats)
    return paths


# --- batch x sequence grid ----------------------------------------------------------------------

def grid_figures(frame: pd.DataFrame, folder: Path, colors: dict[str, Any],
                 formats: Sequence[str] = FORMATS) -> tuple[list[Path], str | None]:
    groups = grid_groups(frame) + grid_series(frame)
    if not groups:
        return [], "no run measured one model at two or more batch × seq shapes"
    paths = []
    # the widest grid of each, a grid over runs included (grid_series); the tables keep every run
    groups = one_per_key(groups, grid_coverage)
    for keys, group in groups:
        stem = slug("grid", keys["device_name"], keys["model"], keys["dtype"], run_label(keys["run_id"]),
                    timing_slug(keys))
        shapes = shapes_of(group)
        paths += _grid_lines(group, keys, shapes, folder, stem, colors, formats)
        forge_methods = [m for m in ordered_methods(group) if is_forge(m)]
        if forge_methods:
            paths += _grid_heatmaps(group, keys, shapes, forge_methods, folder, stem, formats)
    return paths, None


def _grid_lines(group, keys, shapes, folder, stem, colors, formats: Sequence[str]) -> list[Path]:
    """Peak and step per method across shapes (ordered by tokens per step)."""
    shapes = sorted(shapes, key=lambda s: (s[0] * s[1], s))
    fig = Figure(figsize=(max(7.0, 0.8 * len(shapes) + 4), 3.8))
    ax_mem, ax_time = fig.subplots(1, 2)
    x = np.arange(len(shapes))
    any_peak = False
    for method in ordered_methods(group):
        rows = [cell_row(group, method, b, s) for b, s in shapes]
        ok = [(i, r) for i, r in enumerate(rows) if r is not None and as_text(r.get("status")) == "ok"]
        if not ok:
            continue
        idx = [i for i, _ in ok]
        peaks = [as_number(r.get("peak_allocated_gib")) for _, r in ok]
        if any(p is not None for p in peaks):
            any_peak = True
            ax_mem.plot(idx, [np.nan if p is None else p for p in peaks], marker="o",
                        color=colors[method], label=method)
        ax_time.errorbar(idx, [as_number(r.get("step_ms_median")) for _, r in ok],
                         yerr=_step_errors([r for _, r in ok]), marker="o", capsize=3,
                         color=colors[method], label=method)
    if not any_peak:
        reason = (as_text(group["peak_reason"].dropna().iloc[0]) if group["peak_reason"].notna().any()
                  else "no reason recorded")
        ax_mem.text(0.5, 0.5, "peak memory not measured\n" + textwrap.fill(f"({reason})", 36),
                    ha="center", va="center", transform=ax_mem.transAxes)
    ax_mem.set_ylabel("peak allocated memory (GiB)")
    ax_mem.set_title("Peak memory")
    ax_time.set_ylabel("median step time (ms)")
    ax_time.set_title("Step time (p10–p90 error bars)")
    for ax in (ax_mem, ax_time) if any_peak else (ax_time,):
        ax.set_xticks(x, [f"b{b}×s{s}" for b, s in shapes], rotation=30, ha="right")
        ax.set_xlabel("batch × sequence length")
        ax.grid(alpha=0.3)
    if not any_peak:
        ax_mem.set_xticks([])
        ax_mem.set_yticks([])
    handles, labels = ax_time.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), title="method")
    fig.suptitle(f"Batch × sequence grid: {group_title(keys)}")
    fig.tight_layout()
    return save(fig, folder, stem + "-lines", formats)


def _grid_heatmaps(group, keys, shapes, forge_methods, folder, stem, formats: Sequence[str]) -> list[Path]:
    """Per FORGE method: memory saving and speed-up over the baseline at every batch x seq."""
    batches = sorted({b for b, _ in shapes})
    seqs = sorted({s for _, s in shapes})
    base_method, _ = choose_baseline(records(group))
    fig = Figure(figsize=(2 * max(3.2, 0.9 * len(seqs) + 1.6), 0.4 + max(2.2, 0.6 * len(batches) + 1.0) * len(forge_methods)))
    axes = np.atleast_2d(fig.subplots(len(forge_methods), 2, squeeze=False))
    for row_i, method in enumerate(forge_methods):
        cells = grid_ratio_cells(group, method)
        mark = f" ({NOTHING_FUSED})" if any(nothing_fused(r) for r in records(group[group["method"] == method])) else ""
        for col_i, (kind, unit, center, cmap) in enumerate(
                (("memory saving", "% of baseline peak", 0.0, "RdYlGn"),
                 ("speed-up", "× baseline step time", 1.0, "RdYlGn"))):
            ax = axes[row_i, col_i]
            values = np.full((len(batches), len(seqs)), np.nan)
            texts = [["" for _ in seqs] for _ in batches]
            for (b, s), (saving, speed) in cells.items():
                ratio = saving if col_i == 0 else speed
                i, j = batches.index(b), seqs.index(s)
                if ratio.value is None:
                    texts[i][j] = short_na(ratio)
                else:
                    values[i, j] = ratio.value * 100 if col_i == 0 else ratio.value
                    texts[i][j] = ratio.text
            for i in range(len(batches)):
                for j in range(len(seqs)):
                    if (batches[i], seqs[j]) not in cells:
                        texts[i][j] = "not run"
            finite = values[np.isfinite(values)]
            ax.set_facecolor(NA_COLOR)
            colour_of = None
            if finite.size:
                center_v = center * (100 if col_i == 0 else 1)
                span = max(float(np.max(np.abs(finite - center_v))), 1e-6)
                norm = TwoSlopeNorm(vcenter=center_v, vmin=center_v - span, vmax=center_v + span)
                image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
                bar = fig.colorbar(image, ax=ax, fraction=0.08, pad=0.03)
                bar.set_label("saving (%)" if col_i == 0 else "speed-up (×)")
                colour_of = lambda v, n=norm, c=matplotlib.colormaps[cmap]: c(n(v))
            else:
                ax.imshow(np.zeros_like(values), cmap="Greys", vmin=0, vmax=10, aspect="auto")
            for i in range(len(batches)):
                for j in range(len(seqs)):
                    ink = "black"
                    if colour_of is not None and np.isfinite(values[i, j]):
                        r, g, b, _ = colour_of(values[i, j])
                        ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.45 else "black"
                    ax.text(j, i, texts[i][j], ha="center", va="center", fontsize=7, color=ink)
            ax.set_xticks(range(len(seqs)), [str(s) for s in seqs])
            ax.set_yticks(range(len(batches)), [str(b) for b in batches])
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel("batch (sequences)")
            ax.set_title(f"{method}{mark}: {kind}\n({unit})")
    fig.suptitle(f"FORGE vs {base_method or 'no baseline'}: {group_title(keys)}\n"
                 f"({NOISE_MARK} = inside step-time noise; grey = no ratio)")
    fig.tight_layout()
    return save(fig, folder, stem + "-heatmap", formats)


# --- model scaling ------------------------------------------------------------------------------

def scaling_figures(frame: pd.DataFrame, folder: Path, colors: dict[str, Any],
                    formats: Sequence[str] = FORMATS) -> tuple[list[Path], str | None]:
    groups = scaling_series(frame)        # each model from its newest run; the tables keep every run
    if not groups:
        return [], scaling_skip_note(frame)
    paths = []
    for keys, group in groups:
        models = models_by_size(group)
        fig = Figure(figsize=(9.0, 3.8))
        ax_mem, ax_time = fig.subplots(1, 2)
        any_peak = False
        for method in ordered_methods(group):
            ok = records(group[(group["method"] == method) & (group["status"] == "ok")])
            ok = [r for r in ok if as_number(r.get("n_params")) is not None]
            ok.sort(key=lambda r: as_number(r["n_params"]))
            if not ok:
                continue
            n = [as_number(r["n_params"]) for r in ok]
            peaks = [as_number(r.get("peak_allocated_gib")) for r in ok]
            if any(p is not None for p in peaks):
                any_peak = True
                ax_mem.plot(n, [np.nan if p is None else p for p in peaks], marker="o",
                            color=colors[method], label=method)
            ax_time.errorbar(n, [as_number(r.get("step_ms_median")) for r in ok],
                             yerr=_step_errors(ok), marker="o", capsize=3, color=colors[method],
                             label=method)
        sizes = [n for _, n in models if n is not None]
        drawn = (ax_mem, ax_time)
        if not any_peak:
            reason = (as_text(group["peak_reason"].dropna().iloc[0]) if group["peak_reason"].notna().any()
                      else "no reason recorded")
            ax_mem.text(0.5, 0.5, "peak memory not measured\n" + textwrap.fill(f"({reason})", 36),
                        ha="center", va="center", transform=ax_mem.transAxes)
            ax_mem.set_xticks([])
            ax_mem.set_yticks([])
            drawn = (ax_time,)
        for ax in drawn:
            ax.set_xscale("log")
            ax.set_xlabel("parameters (log scale)")
            ax.grid(alpha=0.3, which="both")
            if sizes:
                ax.set_xticks(sizes, [f"{m}\n{params_text(n)}" for m, n in models if n is not None],
                              rotation=0, fontsize=7)
                ax.minorticks_off()
        ax_mem.set_ylabel("peak allocated memory (GiB)")
        ax_mem.set_title("Peak memory vs model size")
        ax_time.set_ylabel("median step time (ms)")
        ax_time.set_title("Step time vs model size (p10–p90 bars)")
        handles, labels = ax_time.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), title="method")
        fig.suptitle(f"Model scaling: {scaling_title(keys)}")
        fig.tight_layout()
        paths += save(fig, folder, slug("scaling", keys["device_name"], keys["family"], keys["dtype"], keys["batch"],
                                        keys["seq"], run_label(keys["run_id"]), timing_slug(keys)), formats)
    return paths, None


# --- where memory goes --------------------------------------------------------------------------

def memory_figures(frame: pd.DataFrame, folder: Path,
                   formats: Sequence[str] = FORMATS) -> tuple[list[Path], str | None]:
    groups = memory_groups(frame)
    if not groups:
        return [], "no row ran ok"
    paths = []
    groups = one_per_key(groups)          # the newest run of each; the tables keep every run
    for keys, group in groups:
        rows = sorted_rows(records(group))
        unit = memory_unit(v for row in rows for v in [*memory_parts(row).values(), row.get("peak_allocated_gib")])
        scale = MIB_PER_GIB if unit == "MiB" else 1.0
        fig = Figure(figsize=(max(5.5, 0.9 * len(rows) + 2.5), 3.8))
        ax = fig.subplots()
        x = np.arange(len(rows))
        bottom = np.zeros(len(rows))
        unknown_rest = []
        labels = [label for _, label in ANALYTIC_PARTS] + ["Activations + rest"]
        for label in labels:
            heights = []
            for i, row in enumerate(rows):
                value = memory_parts(row)[label]
                if label == "Activations + rest" and value is None:
                    unknown_rest.append(i)
                heights.append(max(0.0, value or 0.0) * scale)
            ax.bar(x, heights, bottom=bottom, color=MEMORY_COLORS[label], label=label, width=0.7)
            bottom += np.array(heights)
        for i, row in enumerate(rows):
            peak = as_number(row.get("peak_allocated_gib"))
            if peak is not None:
                peak *= scale
                ax.plot([i - 0.38, i + 0.38], [peak, peak], color="black", linewidth=1.2,
                        label="measured peak" if i == 0 or "measured peak" not in
                        ax.get_legend_handles_labels()[1] else None)
            else:
                ax.annotate("peak n/a", (i, bottom[i]), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [r["method"] + (f"\n({NOTHING_FUSED})" if nothing_fused(r) else "") for r in rows],
                      rotation=30, ha="right")
        ax.set_xlabel("method")
        ax.set_ylabel(f"memory ({unit})")
        peaks = [(as_number(r.get("peak_allocated_gib")) or 0.0) * scale for r in rows]
        ax.set_ylim(0, max(list(bottom) + peaks + [1e-9]) * 1.15)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="part")
        note = ("\n(activations + rest unknown where the peak was not measured)" if unknown_rest else "")
        ax.set_title(f"Where memory goes: {group_title(keys)}{note}")
        fig.tight_layout()
        paths += save(fig, folder, slug("memory", keys["device_name"], keys["model"], keys["dtype"],
                                        keys["batch"], keys["seq"], run_label(keys["run_id"]), timing_slug(keys)),
                      formats)
    return paths, None


# --- hardware comparison ------------------------------------------------------------------------

def hardware_figures(frame: pd.DataFrame, folder: Path,
                     formats: Sequence[str] = FORMATS) -> tuple[list[Path], str | None]:
    groups = hardware_groups(frame)
    if not groups:
        devices = sorted({str(d) for d in frame["device_name"]})
        return [], (f"only one device in these results ({devices[0]})" if len(devices) == 1 else
                    "no cell (model, dtype, batch, seq) was measured on two or more devices")
    paths = []
    for keys, group, pairs in groups:
        devices_seen = [d for d, _ in pairs]
        labels = [(group.loc[group["device_name"] == d, "device_label"].iloc[0]
                   + ("" if devices_seen.count(d) == 1 else f" ({run_label(r)})")) for d, r in pairs]
        cells = {pair: hardware_cells(group, *pair) for pair in pairs}
        methods = [m for m in ordered_methods(group)
                   if any(m in cells[p] and cells[p][m][1].text != "baseline" for p in pairs)]
        if not methods:
            continue
        fig = Figure(figsize=(max(7.0, 1.0 * len(methods) * max(1, len(pairs) / 2) + 3), 3.8))
        ax_mem, ax_time = fig.subplots(1, 2)
        width = 0.8 / len(pairs)
        x = np.arange(len(methods))
        device_colors = matplotlib.colormaps["Set2"]
        for k, (pair, label) in enumerate(zip(pairs, labels)):
            savings, speeds, save_txt, speed_txt = [], [], [], []
            for method in methods:
                hit = cells[pair].get(method)
                change = hit[1] if hit else Ratio(None, "not run")
                speed = hit[2] if hit else Ratio(None, "not run")
                savings.append(0.0 if change.value is None else -change.value * 100)
                speeds.append(0.0 if speed.value is None else speed.value)
                save_txt.append("n/a" if change.value is None else f"{-change.value * 100:.1f}%")
                speed_txt.append("n/a" if speed.value is None else speed.text)
            offset = (k - (len(pairs) - 1) / 2) * width
            bars = ax_mem.bar(x + offset, savings, width, label=label, color=device_colors(k))
            _bar_labels(ax_mem, bars, save_txt, vertical=len(pairs) > 1)
            bars = ax_time.bar(x + offset, speeds, width, label=label, color=device_colors(k))
            _bar_labels(ax_time, bars, speed_txt, vertical=len(pairs) > 1)
        ax_mem.axhline(0, color="black", linewidth=0.8)
        ax_time.axhline(1, color="black", linewidth=0.8, linestyle="--")
        ax_mem.set_ylabel("memory saving vs own baseline (% of peak)")
        ax_time.set_ylabel("speed-up vs own baseline (×)")
        ax_mem.set_title("Memory saving, per device")
        ax_time.set_title("Speed-up, per device")
        for ax in (ax_mem, ax_time):
            ax.set_xticks(x, methods, rotation=30, ha="right")
            ax.set_xlabel("method")
            ax.margins(y=0.25)
        handles, legend_labels = ax_time.get_legend_handles_labels()
        fig.legend(handles, legend_labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), title="device")
        fig.suptitle(f"Hardware comparison: {group_title(keys)}\n(each device's ratios within its "
                     f"own run; no ratio across devices; {NOISE_MARK} = inside noise)")
        fig.tight_layout()
        paths += save(fig, folder, slug("hardware", *key_parts(keys)), formats)
    if not paths:
        return [], "no cell on two or more devices has a non-baseline method"
    return paths, None


# --- fidelity -----------------------------------------------------------------------------------

def fidelity_figures(frame: pd.DataFrame, folder: Path, colors: dict[str, Any],
                     formats: Sequence[str] = FORMATS) -> tuple[list[Path], str | None]:
    gated = frame[frame["status"].isin(["ok", "parity_fail"]) & frame["parity_rms_rel"].notna()
                  & (frame["parity_steps"].fillna(1) != 0)]
    if gated.empty:
        return [], "no row has a parity measurement (gate off or nothing ran)"
    paths = []
    for device, group in gated.groupby("device_name", sort=True):
        methods = ordered_methods(group)
        values = group["parity_rms_rel"].astype(float)
        positive = values[values > 0]
        floor = float(positive.min()) / 10 if not positive.empty else 1e-12
        fig = Figure(figsize=(max(5.5, 0.8 * len(methods) + 2.5), 3.6))
        ax = fig.subplots()
        rng = np.random.default_rng(0)
        for i, method in enumerate(methods):
            rows = records(group[group["method"] == method])
            ys = [max(as_number(r["parity_rms_rel"]) or 0.0, floor) for r in rows]
            xs = i + rng.uniform(-0.15, 0.15, size=len(ys)) if len(ys) > 1 else [i]
            failed = [as_text(r.get("status")) == "parity_fail" for r in rows]
            ax.scatter(xs, ys, color=colors[method], marker="o", zorder=3,
                       edgecolors=["red" if f else "none" for f in failed], linewidths=1.2)
            if any((as_number(r["parity_rms_rel"]) or 0.0) == 0.0 for r in rows):
                ax.annotate("exact (0)", (i, floor), xytext=(0, 4), textcoords="offset points",
                            ha="center", fontsize=7)
        tolerances = sorted({float(t) for t in group["parity_tolerance"].dropna()})
        for t in tolerances:
            ax.axhline(t, color="red", linestyle="--", linewidth=0.9, label=f"gate tolerance {t:.0e}")
        ax.set_yscale("log")
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
        ax.set_xlabel("method")
        ax.set_ylabel("parity rms-rel vs fp32 reference (unitless)")
        ax.set_title(f"Fidelity: {device}\n(one point per cell; red edge = gate failed)")
        ax.grid(alpha=0.3, axis="y")
        if tolerances:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        paths += save(fig, folder, slug("fidelity", device), formats)
    return paths, None
