"""The report's tables: built once as cells of text plus numeric records, rendered to Markdown,
LaTeX (booktabs) and CSV (``render.py``).

Every ratio in here comes from ``ratios.py`` (one rule, shared with the figures); every
baseline choice from ``data.py``.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import pandas as pd

from forge_bench.floor import floor_ms, power_floor_ms

from . import ratios
from .render import Table
from .data import (BASELINE_PREFERENCE, EAGER_TIMING, HEADLINE_KEYS, NOTHING_FUSED_NOTE, across_runs, key_parts, timing_slug, choose_baseline,
                   find_baseline_row, finished_last, fmt_memory, fmt_ms, fmt_number, group_title, is_forge, memory_unit,
                   method_cell, method_sort_key, nothing_fused, ordered_methods, records, run_label, slug)
from .ratios import BOUND_FOOTNOTE, DIFFERENT_RUN, NOISE_FOOTNOTE, Ratio, as_number, as_text
from .targets import INT8_AGAINST_BF16, POWER_FLOOR_TARGET, no_slower

SPREAD_NOTE = ("Step ms is the median over runs of each run's median step; p10–p90 spans all "
               "timed steps; spread is the largest per-run IQR / median.")


# --- cells ---------------------------------------------------------------------------------------

def parity_text(row: Mapping[str, Any]) -> str:
    steps = as_number(row.get("parity_steps"))
    value = as_number(row.get("parity_rms_rel"))
    if steps is not None and steps == 0:
        return "gate off"
    return "—" if value is None else f"{value:.1e}"


def spread_text(row: Mapping[str, Any]) -> str:
    spread = as_number(row.get("step_ms_spread_max"))
    return "—" if spread is None else f"{spread * 100:.1f}%"


def p10_p90_text(row: Mapping[str, Any]) -> str:
    p10, p90 = as_number(row.get("step_ms_p10")), as_number(row.get("step_ms_p90"))
    if p10 is None or p90 is None:
        return "—"
    return f"{fmt_ms(p10)}–{fmt_ms(p90)}"


def one_line(text: Any, limit: int | None = None) -> str:
    value = re.sub(r"\s+", " ", as_text(text) or "").strip()
    if limit is not None and len(value) > limit:
        value = value[: limit - 1] + "…"
    return value


def why_not_run(row: Mapping[str, Any]) -> str:
    """The row's reason, else the last non-empty line of its stderr tail."""
    reason = one_line(row.get("reason"))
    if reason:
        return reason
    tail = [line for line in (as_text(row.get("stderr_tail")) or "").splitlines() if line.strip()]
    return one_line(tail[-1]) if tail else "no reason recorded"


class _Notes:
    """Footnotes collected while filling one table, each printed once, in first-seen order."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, note: str) -> None:
        if note not in self.items:
            self.items.append(note)

    def ratio(self, ratio: Ratio, who: str) -> None:
        if ratio.within_noise:
            self.add(NOISE_FOOTNOTE)
        if ratio.bound:
            self.add(BOUND_FOOTNOTE)
        if ratio.text.startswith("fits (baseline "):
            self.add("fits (baseline oom / oom_predicted): the arm ran ok at a shape where the AdamW baseline of "
                     "its run ran out of memory (oom_predicted: the memory model said it would, so it was not "
                     "started): there is no ratio, only that it fits.")
        if ratio.text == DIFFERENT_RUN:
            self.add(f"{DIFFERENT_RUN} for {who}: {ratio.refusal}; a ratio is computed only within "
                     f"one sweep run on one device (same versions; for times also SM clocks within "
                     f"{ratios.CLOCK_TOLERANCE:.0%} and one machine boot).")


def sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in reading order: by method (``data.method_sort_key``), then by run id."""
    return sorted(rows, key=lambda r: (method_sort_key(r["method"], r.get("method_family") or ""),
                                       as_text(r.get("run_id")) or ""))


# --- headline -----------------------------------------------------------------------------------

MARGIN_TARGET_GIB = 0.5
"""How far a FORGE arm's whole-process peak (``peak_process_gib``: build, tile tuning, warm-up and the
timed window) may exceed the timed window's peak. Whether a run fits is decided by its highest peak,
so a saving measured in the window holds for a user only when the first steps stay within this of it."""


def process_margin(row: Mapping[str, Any]) -> tuple[float | None, str]:
    """(whole-process peak minus the window's peak in GiB, its text): ``+0.12 GiB``, and for a FORGE
    row ``pass`` or ``miss`` against ``MARGIN_TARGET_GIB``; (None, "—") where either peak is unknown."""
    process, window = as_number(row.get("peak_process_gib")), as_number(row.get("peak_allocated_gib"))
    if process is None or window is None:
        return None, "—"
    margin = process - window
    text = f"{margin:+.2f} GiB"
    if is_forge(str(row.get("method")), as_text(row.get("method_family")) or ""):
        text += " pass" if margin <= MARGIN_TARGET_GIB else " miss"
    return margin, text


def int8_against_bf16(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run holding both arms of an ``INT8_AGAINST_BF16`` pair, ok: the int8 arm's speed
    against the bf16 arm's (bf16 step / int8 step) and whether it is no slower."""
    lines = []
    for int8, bf16 in INT8_AGAINST_BF16:
        for run in dict.fromkeys(r["run_id"] for r in rows):
            pair = [next((r for r in rows if r["method"] == m and r["run_id"] == run
                          and as_text(r.get("status")) == "ok"), None) for m in (int8, bf16)]
            if None in pair:
                continue
            speed = ratios.speedup(*pair)
            verdict = "n/a" if not speed.is_number else "met" if no_slower(speed) else "not met"
            shown = speed.text.replace(f"{speed.value:.2f}×", f"{speed.value:.3f}×") if speed.is_number else speed.text
            lines.append(f"`{int8}` against `{bf16}` (run {run_label(run)}): {shown}, {verdict} "
                         "(target: an eager int8 step no slower than bf16's).")
    return lines


def headline_tables(frame: pd.DataFrame) -> list[Table]:
    """Per device, model, dtype and shape: one row per method (and run, when several)."""
    tables = []
    for keys, group in frame.groupby(HEADLINE_KEYS, sort=True, dropna=False):
        key_map = dict(zip(HEADLINE_KEYS, keys))
        rows = sorted_rows(records(group))
        base_method, base_note = choose_baseline(rows)
        several_runs = group["run_id"].nunique(dropna=False) > 1
        unit = memory_unit(r.get("peak_allocated_gib") for r in rows)
        header = ["Method"] + (["Run"] if several_runs else []) + [
            f"Peak {unit}", f"Process peak {unit}", "Margin", "Δ peak", "Step ms", "p10–p90 ms", "Spread", "Speed-up", "J/step", "Mean W",
            "Parity rms-rel", "Status"]
        notes = _Notes()
        body, recs = [], []
        for row in rows:
            base = find_baseline_row(row, rows, base_method)
            is_base = base is row
            extra = ratios.json_field(row.get("extra"))
            change = ratios.peak_change(row, base)
            speed = ratios.speedup(row, base)
            who = f"{row['method']} (run {run_label(row['run_id'])})"
            if not is_base:
                notes.ratio(change, who)
                notes.ratio(speed, who)
            if as_text(row.get("status")) == "ok" and as_number(row.get("peak_allocated_gib")) is None:
                notes.add(f"Peak not measured: {one_line(row.get('peak_reason')) or 'no reason recorded'}.")
            if as_text(row.get("status")) != "ok":
                notes.add("Rows with a status other than ok: see “What did not run” for the reason.")
            if nothing_fused(row):
                notes.add(NOTHING_FUSED_NOTE)
            margin, margin_text = process_margin(row)
            body.append([method_cell(row["method"], [row])] + ([run_label(row["run_id"])] if several_runs else []) + [
                fmt_memory(row.get("peak_allocated_gib"), unit), fmt_memory(row.get("peak_process_gib"), unit),
                margin_text,
                "baseline" if is_base else change.text,
                fmt_ms(row.get("step_ms_median")), p10_p90_text(row), spread_text(row),
                "baseline" if is_base else speed.text,
                fmt_number(extra.get("energy_j_per_step")), fmt_number(extra.get("power_w_mean"), 0),
                parity_text(row), str(row.get("status"))])
            recs.append({**key_map, "method": row["method"], "run_id": row["run_id"],
                         "baseline_method": base_method, "is_baseline": is_base,
                         "peak_gib": as_number(row.get("peak_allocated_gib")),
                         "peak_process_gib": as_number(row.get("peak_process_gib")),
                         "process_margin_gib": margin,
                         "margin_ok": None if margin is None or not is_forge(row["method"], row.get("method_family") or "")
                         else margin <= MARGIN_TARGET_GIB,
                         "peak_change": None if is_base else change.value,
                         "step_ms_median": as_number(row.get("step_ms_median")),
                         "step_ms_p10": as_number(row.get("step_ms_p10")),
                         "step_ms_p90": as_number(row.get("step_ms_p90")),
                         "step_ms_spread_max": as_number(row.get("step_ms_spread_max")),
                         "speedup": None if is_base else speed.value,
                         "speedup_within_noise": speed.within_noise,
                         "speedup_bound": None if is_base else speed.bound,
                         "speedup_text": "baseline" if is_base else speed.text,
                         "peak_change_text": "baseline" if is_base else change.text,
                         "parity_rms_rel": as_number(row.get("parity_rms_rel")),
                         "energy_j_per_step": as_number(extra.get("energy_j_per_step")),
                         "power_w_mean": as_number(extra.get("power_w_mean")),
                         "nothing_fused": nothing_fused(row),
                         "status": row.get("status")})
        if key_map.get("timing") == EAGER_TIMING:
            for line in int8_against_bf16(rows):
                notes.add(line)
        timing = {as_text(r.get("timing_method")) for r in rows if as_text(r.get("timing_method"))}
        caption = (f"{base_note} Peak: the timed window's peak allocated memory; process peak: the whole "
                   f"measurement's, model build, tile tuning and warm-up included (— in rows without it); margin: "
                   f"process peak minus window peak, and for a FORGE arm pass when within {MARGIN_TARGET_GIB} GiB. "
                   f"Δ peak: change of peak allocated memory ({unit} = 2^{30 if unit == 'GiB' else 20} bytes); "
                   f"speed-up: baseline step time / this step time. J/step and mean W: the board's "
                   f"energy counter (NVML) over the timed window, per step and per second (— where a row has "
                   f"no energy reading, e.g. on a CPU). {SPREAD_NOTE}"
                   + (f" Timing: {', '.join(sorted(timing))}." if timing else ""))
        tables.append(Table(
            name=slug("headline", *key_parts(key_map)), title=group_title(key_map), caption=caption,
            header=header, rows=body, align="l" * (2 if several_runs else 1) + "r" * 11 + "l",
            footnotes=notes.items, records=recs))
    return tables


# --- batch x sequence grid ----------------------------------------------------------------------

GRID_KEYS = ["run_id", "device_name", "model", "dtype", "timing", "activations"]


def grid_coverage(group: pd.DataFrame) -> tuple[int, int, str]:
    """How much a grid shows, for picking one run of a grid: shapes, ok rows, then the newest."""
    return len(shapes_of(group)), int((group["status"] == "ok").sum()), finished_last(group)


def grid_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, rows) of every run x device x model x dtype measured at two or more shapes."""
    out = []
    for keys, group in frame.groupby(GRID_KEYS, sort=True, dropna=False):
        if group[["batch", "seq"]].drop_duplicates().shape[0] >= 2:
            out.append((dict(zip(GRID_KEYS, keys)), group))
    return out


def grid_series(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, rows) per suite x device x model x dtype x timing x activations whose shapes were measured
    over two or more runs: each shape's rows from the newest run that measured FORGE beside its
    baseline there (``grid_run_rank``), as the summary page's grid (``summary.grid_section``). Why: a
    grid is often measured a few shapes at a time, and the paper's Table 2 is the whole grid; a
    shape's arms still come from one run, so its ratios compare cells measured side by side. One
    suite's runs only: another suite's cells of the same model (the optimizer families) are not the
    grid's. ``keys["run_id"]`` names the runs, oldest first."""
    return across_runs(frame, [k for k in GRID_KEYS if k != "run_id"], ["batch", "seq"], grid_run_rank,
                       group_only=["suite_name"], min_runs=2)


def grid_run_rank(rows: pd.DataFrame) -> tuple[bool, bool, str]:
    """How a grid shape's run is chosen among the runs that measured it (highest wins): FORGE and
    its baseline both ok there, then FORGE ok there (a FORGE-only run, a margin check say, still
    beats one without FORGE), then the newest."""
    ok = set(rows.loc[rows["status"] == "ok", "method_family"])
    return "forge" in ok and "baseline" in ok, "forge" in ok, finished_last(rows)


def shapes_of(group: pd.DataFrame) -> list[tuple[int, int]]:
    pairs = group[["batch", "seq"]].drop_duplicates().itertuples(index=False)
    return sorted((int(b), int(s)) for b, s in pairs)


def cell_row(group: pd.DataFrame, method: str, batch: int, seq: int) -> dict[str, Any] | None:
    """The row of one method at one shape (the latest written, should a cell appear twice)."""
    hit = group[(group["method"] == method) & (group["batch"] == batch) & (group["seq"] == seq)]
    if hit.empty:
        return None
    return records(hit.sort_values("finished_at", na_position="first"))[-1]


OUT_OF_MEMORY = ("oom", "oom_predicted")


def grid_ratio(row: Mapping[str, Any], shape_rows: list[Mapping[str, Any]]) -> tuple[Ratio, Ratio]:
    """(memory saving, speed-up) of one FORGE row against its shape's baseline, as every grid view (the
    tables, the heatmaps, the summary page) prints it: a row that did not run ok reads its status
    (``oom``, as the peak table does); one that ran where the AdamW baseline of its run ran out of
    memory reads ``fits (baseline oom)``, the one fact that shape has; else ``ratios.py``'s ratios."""
    status = as_text(row.get("status"))
    if status != "ok":
        refused = Ratio(None, status or "—", refusal=f"this row status {status}")
        return refused, refused
    base_method, _ = choose_baseline(shape_rows)
    base = find_baseline_row(row, shape_rows, base_method)
    if base is None:
        failed = [r for r in shape_rows if r["method"] in BASELINE_PREFERENCE
                  and as_text(r.get("status")) in OUT_OF_MEMORY and ratios.incomparable_reason(row, r) is None]
        if failed:
            fits = Ratio(None, f"fits (baseline {as_text(failed[0].get('status'))})",
                         refusal=f"{failed[0]['method']} status {as_text(failed[0].get('status'))}")
            return fits, fits
    return ratios.memory_saving(row, base), ratios.speedup(row, base)


def ratio_pair_text(saving: Ratio, speed: Ratio) -> str:
    """``saving / speed-up``, or the one text both share (a status, ``fits (baseline oom)``)."""
    return saving.text if saving.text == speed.text else f"{saving.text} / {speed.text}"


def grid_ratio_cells(group: pd.DataFrame, method: str) -> dict[tuple[int, int], tuple[Ratio, Ratio]]:
    """Per shape: (memory saving, speed-up) of ``method`` against that shape's baseline (``grid_ratio``)."""
    out = {}
    for batch, seq in shapes_of(group):
        shape_rows = records(group[(group["batch"] == batch) & (group["seq"] == seq)])
        row = cell_row(group, method, batch, seq)
        if row is None:
            continue
        out[(batch, seq)] = grid_ratio(row, shape_rows)
    return out


def grid_tables(frame: pd.DataFrame) -> list[Table]:
    """Per run, its grid; then per device and model the whole grid over runs (``grid_series``)."""
    tables = []
    for keys, group in grid_groups(frame) + grid_series(frame):
        shapes = shapes_of(group)
        methods = ordered_methods(group)
        columns = [f"b{b}×s{s}" for b, s in shapes]
        title = group_title(keys)
        group_rows = records(group)
        unit = memory_unit(r.get("peak_allocated_gib") for r in group_rows if as_text(r.get("status")) == "ok")
        peak_rows, step_rows, peak_recs, step_recs = [], [], [], []
        notes = _Notes()
        if any(nothing_fused(r) for r in group_rows):
            notes.add(NOTHING_FUSED_NOTE)
        for method in methods:
            peak_cells, step_cells = [method_cell(method, group_rows)], [method_cell(method, group_rows)]
            for batch, seq in shapes:
                row = cell_row(group, method, batch, seq)
                if row is None:
                    peak_cells.append("—")
                    step_cells.append("—")
                    continue
                status = as_text(row.get("status"))
                if status != "ok":
                    peak_cells.append(status or "—")
                    step_cells.append(status or "—")
                    continue
                peak_cells.append(fmt_memory(row.get("peak_allocated_gib"), unit))
                spread = as_number(row.get("step_ms_spread_max"))
                step_cells.append(fmt_ms(row.get("step_ms_median"))
                                  + ("" if spread is None else f" ({spread * 100:.0f}%)"))
                if as_number(row.get("peak_allocated_gib")) is None:
                    notes.add(f"Peak not measured: {one_line(row.get('peak_reason')) or 'no reason'}.")
                record = {**keys, "method": method, "batch": batch, "seq": seq}
                peak_recs.append({**record, "peak_gib": as_number(row.get("peak_allocated_gib"))})
                step_recs.append({**record, "step_ms_median": as_number(row.get("step_ms_median")),
                                  "step_ms_spread_max": spread})
            peak_rows.append(peak_cells)
            step_rows.append(step_cells)
        name = slug("grid", keys["device_name"], keys["model"], keys["dtype"], run_label(keys["run_id"]),
                    timing_slug(keys))
        tables.append(Table(name + "-peak", f"Peak {unit}, {title}",
                            f"Peak allocated memory per method and batch × seq ({unit} = 2^{30 if unit == 'GiB' else 20} bytes); "
                            "a status in place of a number: the cell did not run ok.",
                            ["Method"] + columns, peak_rows, "l" + "r" * len(shapes),
                            list(notes.items), peak_recs))
        tables.append(Table(name + "-step", f"Step ms, {title}",
                            "Median step time per method and batch × seq, ms; in brackets the "
                            "largest per-run IQR / median.",
                            ["Method"] + columns, step_rows, "l" + "r" * len(shapes),
                            [NOTHING_FUSED_NOTE] if any(nothing_fused(r) for r in group_rows) else [], step_recs))
        ratio_rows, ratio_recs = [], []
        ratio_notes = _Notes()
        for method in methods:
            if not is_forge(method):
                continue
            cells = grid_ratio_cells(group, method)
            line = [method_cell(method, group_rows)]
            if any(r.get("method") == method and nothing_fused(r) for r in group_rows):
                ratio_notes.add(NOTHING_FUSED_NOTE)
            for shape in shapes:
                if shape not in cells:
                    line.append("—")
                    continue
                saving, speed = cells[shape]
                ratio_notes.ratio(saving, f"{method} at b{shape[0]}×s{shape[1]}")
                ratio_notes.ratio(speed, f"{method} at b{shape[0]}×s{shape[1]}")
                line.append(ratio_pair_text(saving, speed))
                ratio_recs.append({**keys, "method": method, "batch": shape[0], "seq": shape[1],
                                   "memory_saving": saving.value, "speedup": speed.value,
                                   "speedup_within_noise": speed.within_noise, "speedup_bound": speed.bound})
            ratio_rows.append(line)
        if ratio_rows:
            _, base_note = choose_baseline(records(group))
            tables.append(Table(name + "-ratios", f"FORGE saving / speed-up, {title}",
                                f"Memory saving (share of the baseline's peak) / speed-up per "
                                f"batch × seq. {base_note}",
                                ["Method"] + columns, ratio_rows, "l" + "r" * len(shapes),
                                ratio_notes.items, ratio_recs))
    return tables


# --- the floor of a FORGE step ------------------------------------------------------------------

FLOOR_KEYS = ["run_id", "device_name", "model", "dtype", "batch", "seq", "timing", "activations"]
FLOOR_METHOD = "no_optimizer"
FLOOR_BASELINE = "adamw_fused"


def forge_rule(row: Mapping[str, Any]) -> str:
    """The rule a FORGE row steps: its ``family`` setting, else the rule its ``optimizer`` fuses, else
    adamw (rows from before either was recorded). The floor counts AdamW's two moments."""
    settings = ratios.json_field(row.get("method_settings"))
    fused = re.search(r"fuse\((\w+)\)", str(settings.get("optimizer", "")))
    return str(settings.get("family") or (fused.group(1) if fused else "adamw"))


def floor_tables(frame: pd.DataFrame) -> list[Table]:
    """Each FORGE arm against its floor, from the no_optimizer row of the same run and shape:
    floor = no_optimizer step - wgrad + max(wgrad, state bytes / copy bandwidth)
    (``forge_bench/floor.py``; the terms are measured in the no_optimizer cell)."""
    tables = []
    for keys, group in frame.groupby(FLOOR_KEYS, sort=True, dropna=False):
        key_map = dict(zip(FLOOR_KEYS, keys))
        rows = records(group[group["status"] == "ok"])
        floor_rows = [r for r in rows if r["method"] == FLOOR_METHOD]
        terms = ratios.json_field(floor_rows[0].get("extra")).get("floor_terms") if floor_rows else None
        forge_rows = [r for r in sorted_rows(rows) if is_forge(r["method"], r.get("method_family") or "")
                      and forge_rule(r) == "adamw"]
        if not terms or not forge_rows:
            continue
        no_opt_ms = float(floor_rows[0]["step_ms_median"])
        no_opt_w = as_number(ratios.json_field(floor_rows[0].get("extra")).get("power_w_mean"))
        power_floors = {sd: power_floor_ms(no_opt_ms, no_opt_w, terms, sd) for sd in terms.get("traffic_ms", {})}
        with_power = any(v is not None for v in power_floors.values())
        fused = [r for r in rows if r["method"] == FLOOR_BASELINE]
        fused_ms = as_number(fused[0].get("step_ms_median")) if fused else None
        body, recs = [], []
        for row in forge_rows:
            state_dtype = ratios.json_field(row.get("method_settings")).get("state_dtype")
            if state_dtype not in terms.get("traffic_ms", {}):
                continue
            floor = floor_ms(no_opt_ms, terms, state_dtype)
            step = float(row["step_ms_median"])
            best = fused_ms / floor if fused_ms else None
            got = fused_ms / step if fused_ms else None
            got_text = ratios.speedup(row, fused[0]).text if fused else "—"
            power_floor = power_floors.get(state_dtype)
            near = step / power_floor <= POWER_FLOOR_TARGET if power_floor else None
            power_cells = ([fmt_ms(power_floor), f"{step / power_floor:.2f}×", "met" if near else "missed"]
                           if power_floor else ["—", "—", "—"]) if with_power else []
            body.append([method_cell(row["method"], [row]), state_dtype, fmt_ms(terms["traffic_ms"][state_dtype]),
                         fmt_ms(floor), fmt_ms(step), f"{step / floor:.2f}×"] + power_cells
                        + [f"{best:.2f}×" if best else "—", got_text])
            recs.append({**key_map, "method": row["method"], "state_dtype": state_dtype,
                         "no_optimizer_ms": no_opt_ms, "wgrad_ms": float(terms["wgrad_ms"]),
                         "traffic_ms": float(terms["traffic_ms"][state_dtype]),
                         "copy_gbps": float(terms["copy_bytes_per_s"]) / 1e9, "floor_ms": floor,
                         "step_ms_median": step, "step_over_floor": step / floor,
                         "adamw_fused_ms": fused_ms, "best_speedup_vs_adamw_fused": best,
                         "speedup_vs_adamw_fused": got, "power_floor_ms": power_floor,
                         "step_over_power_floor": step / power_floor if power_floor else None,
                         "power_floor_target_met": near if with_power else None})
        if not body:
            continue
        caption = (f"floor = no_optimizer step ({no_opt_ms:.1f} ms) − cuBLAS wgrad ({float(terms['wgrad_ms']):.2f} ms) "
                   f"+ max(wgrad, state bytes / copy bandwidth ({float(terms['copy_bytes_per_s']) / 1e9:.0f} GB/s)), "
                   "all measured in this run. Best speed-up = adamw_fused step / floor; measured = "
                   "adamw_fused step / this step.")
        if with_power:
            caption += (f" Power floor: the step's dynamic energy at the board's {float(terms['power_limit_w']):.0f} W "
                        f"limit (no_optimizer at {no_opt_w:.0f} W, idle {float(terms['idle_w']):.0f} W, copy "
                        f"{float(terms['copy_j_per_byte']) * 1e12:.0f} pJ/byte; an estimate, forge_bench/floor.py); "
                        f"target: a step within {POWER_FLOOR_TARGET:.2f}× of it.")
        power_headers = ["Power floor ms", "Step / power floor", f"≤ {POWER_FLOOR_TARGET:.2f}×"] if with_power else []
        tables.append(Table(slug("floor", key_map["device_name"], key_map["model"], key_map["dtype"],
                                 key_map["batch"], key_map["seq"], run_label(key_map["run_id"]), timing_slug(key_map)),
                            f"FORGE against its floor, {group_title(key_map)}", caption,
                            ["Method", "States", "Traffic ms", "Floor ms", "Step ms", "Step / floor"] + power_headers
                            + ["Best speed-up", "Measured speed-up"], body, "llrrrr" + "rrl" * with_power + "rr",
                            [NOISE_FOOTNOTE, BOUND_FOOTNOTE]
                            + ([NOTHING_FUSED_NOTE] if any(nothing_fused(r) for r in forge_rows) else []),
                            recs))
    return tables


# --- where memory goes --------------------------------------------------------------------------

MEMORY_KEYS = ["run_id", "device_name", "model", "dtype", "batch", "seq", "timing", "activations"]
ANALYTIC_PARTS = (("mem_weights_gib", "Weights"), ("mem_optimizer_states_gib", "Optimizer states"),
                  ("mem_gradients_gib", "Gradients"))


def memory_parts(row: Mapping[str, Any]) -> dict[str, float | None]:
    """Weights, optimizer states, gradients (analytic) and activations + rest = peak - those."""
    parts: dict[str, float | None] = {label: as_number(row.get(col)) for col, label in ANALYTIC_PARTS}
    peak = as_number(row.get("peak_allocated_gib"))
    known = [v for v in parts.values() if v is not None]
    if peak is None or len(known) != len(parts):
        parts["Activations + rest"] = None
    else:
        parts["Activations + rest"] = peak - sum(known)
    return parts


def memory_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    out = []
    for keys, group in frame.groupby(MEMORY_KEYS, sort=True, dropna=False):
        ok = group[group["status"] == "ok"]
        if not ok.empty:
            out.append((dict(zip(MEMORY_KEYS, keys)), ok))
    return out


def memory_tables(frame: pd.DataFrame) -> list[Table]:
    tables = []
    for keys, group in memory_groups(frame):
        body, recs = [], []
        notes = _Notes()
        rows = sorted_rows(records(group))
        unit = memory_unit(v for row in rows for v in [*memory_parts(row).values(), row.get("peak_allocated_gib")])
        for row in rows:
            parts = memory_parts(row)
            rest = parts["Activations + rest"]
            if rest is None:
                notes.add("Activations + rest unknown: "
                          + (one_line(row.get("peak_reason")) or "peak or an analytic part missing") + ".")
            elif rest < 0:
                notes.add("A negative activations + rest means the analytic parts over-count what "
                          "was alive at the peak.")
            if nothing_fused(row):
                notes.add(NOTHING_FUSED_NOTE)
            body.append([method_cell(row["method"], [row])] + [fmt_memory(parts[label], unit) for _, label in ANALYTIC_PARTS]
                        + [fmt_memory(rest, unit), fmt_memory(row.get("peak_allocated_gib"), unit)])
            recs.append({**keys, "method": row["method"], **{k: v for k, v in parts.items()},
                         "peak_gib": as_number(row.get("peak_allocated_gib"))})
        tables.append(Table(slug("memory", keys["device_name"], keys["model"], keys["dtype"],
                                 keys["batch"], keys["seq"], run_label(keys["run_id"]), timing_slug(keys)),
                            f"Where memory goes, {group_title(keys)}",
                            f"{unit} ({'2^30' if unit == 'GiB' else '2^20'} bytes). Weights, optimizer states and "
                            "gradients are analytic byte counts of what each arm holds; activations + rest = "
                            "measured peak minus them.",
                            ["Method"] + [f"{name} {unit}" for name in ("Weights", "Opt. states", "Gradients",
                                                                        "Activations + rest", "Peak")],
                            body, "lrrrrr", notes.items, recs))
    return tables


# --- hardware comparison ------------------------------------------------------------------------

CELL_KEYS = ["model", "dtype", "batch", "seq", "timing", "activations"]


def hardware_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame, list[tuple[str, str]]]]:
    """(cell keys, rows, [(device, run_id) ...]) for every cell measured on two or more devices."""
    out = []
    for keys, group in frame.groupby(CELL_KEYS, sort=True, dropna=False):
        if group["device_name"].nunique() >= 2:
            pairs = sorted({(str(d), str(r)) for d, r in zip(group["device_name"], group["run_id"])})
            out.append((dict(zip(CELL_KEYS, keys)), group, pairs))
    return out


def hardware_cells(group: pd.DataFrame, device: str, run_id: str) -> dict[str, tuple[dict, Ratio, Ratio]]:
    """Per method on one device and run: (row, peak change, speed-up), ratios within that run."""
    rows = records(group[(group["device_name"] == device) & (group["run_id"] == run_id)])
    base_method, _ = choose_baseline(rows)
    out = {}
    for row in rows:
        base = find_baseline_row(row, rows, base_method)
        if base is row:
            out[row["method"]] = (row, Ratio(0.0, "baseline"), Ratio(1.0, "baseline"))
        else:
            out[row["method"]] = (row, ratios.peak_change(row, base), ratios.speedup(row, base))
    return out


def hardware_tables(frame: pd.DataFrame) -> list[Table]:
    tables = []
    for keys, group, pairs in hardware_groups(frame):
        devices_seen = [d for d, _ in pairs]
        labels = [(group.loc[group["device_name"] == d, "device_label"].iloc[0]
                   + ("" if devices_seen.count(d) == 1 else f" ({run_label(r)})")) for d, r in pairs]
        cells = {pair: hardware_cells(group, *pair) for pair in pairs}
        methods = ordered_methods(group)
        group_rows = records(group)
        unit = memory_unit(r.get("peak_allocated_gib") for r in group_rows if as_text(r.get("status")) == "ok")
        notes = _Notes()
        if any(nothing_fused(r) for r in group_rows):
            notes.add(NOTHING_FUSED_NOTE)
        mem_rows, time_rows, recs = [], [], []
        for method in methods:
            mem_line, time_line = [method_cell(method, group_rows)], [method_cell(method, group_rows)]
            for pair, label in zip(pairs, labels):
                hit = cells[pair].get(method)
                if hit is None:
                    mem_line += ["—", "—"]
                    time_line += ["—", "—"]
                    continue
                row, change, speed = hit
                notes.ratio(change, f"{method} on {label}")
                notes.ratio(speed, f"{method} on {label}")
                if as_text(row.get("status")) != "ok":
                    mem_line += [str(row.get("status")), "—"]
                    time_line += [str(row.get("status")), "—"]
                else:
                    mem_line += [fmt_memory(row.get("peak_allocated_gib"), unit), change.text]
                    spread = as_number(row.get("step_ms_spread_max"))
                    time_line += [fmt_ms(row.get("step_ms_median"))
                                  + ("" if spread is None else f" ({spread * 100:.0f}%)"), speed.text]
                recs.append({**keys, "method": method, "device_name": pair[0], "run_id": pair[1],
                             "peak_gib": as_number(row.get("peak_allocated_gib")),
                             "peak_change": change.value,
                             "step_ms_median": as_number(row.get("step_ms_median")),
                             "speedup": speed.value})
            mem_rows.append(mem_line)
            time_rows.append(time_line)
        title = group_title(keys)
        base_notes = sorted({choose_baseline(records(group[(group["device_name"] == d) & (group["run_id"] == r)]))[1]
                             for d, r in pairs})
        rule = ("Each device's ratios are against its own baseline in its own run; no ratio is "
                "ever taken across devices. " + " ".join(base_notes))
        mem_header = ["Method"] + [x for label in labels for x in (f"{label} peak {unit}", f"{label} Δ peak")]
        time_header = ["Method"] + [x for label in labels for x in (f"{label} step ms", f"{label} speed-up")]
        name = slug("hardware", *key_parts(keys))
        tables.append(Table(name + "-memory", f"Hardware comparison (memory), {title}", rule,
                            mem_header, mem_rows, "l" + "r" * (2 * len(pairs)), notes.items, recs))
        tables.append(Table(name + "-time", f"Hardware comparison (time), {title}",
                            rule + " Step ms in brackets: largest per-run IQR / median.",
                            time_header, time_rows, "l" + "r" * (2 * len(pairs)), notes.items, []))
    return tables


# --- fidelity -----------------------------------------------------------------------------------

def fidelity_tables(frame: pd.DataFrame) -> list[Table]:
    """Per device: each method's parity rms-rel against the fp32 reference over its cells."""
    tables = []
    gated = frame[frame["status"].isin(["ok", "parity_fail"])]
    for device, group in gated.groupby("device_name", sort=True, dropna=False):
        body, recs = [], []
        for method in ordered_methods(group):
            rows = records(group[group["method"] == method])
            values = [v for v in (as_number(r.get("parity_rms_rel")) for r in rows) if v is not None]
            gate_off = all(as_number(r.get("parity_steps")) == 0 for r in rows)
            tolerances = sorted({v for v in (as_number(r.get("parity_tolerance")) for r in rows) if v is not None})
            fails = sum(as_text(r.get("status")) == "parity_fail" for r in rows)
            models = sorted({as_text(r.get("parity_model")) or as_text(r.get("model")) or "?" for r in rows})
            worst = max(values) if values else None
            median = float(pd.Series(values).median()) if values else None
            body.append([f"`{method}`", str(len(rows)),
                         "gate off" if gate_off else ("—" if worst is None else f"{worst:.1e}"),
                         "—" if median is None else f"{median:.1e}",
                         ", ".join(f"{t:.0e}" for t in tolerances) or "—", str(fails), ", ".join(models)])
            recs.append({"device_name": device, "method": method, "cells": len(rows),
                         "parity_rms_rel_max": worst, "parity_rms_rel_median": median,
                         "parity_fail_cells": fails})
        tables.append(Table(slug("fidelity", device), f"Fidelity, {device}",
                            "rms(W − W_ref) / rms(W_ref) after the parity steps against an fp32 "
                            "reference, over every cell where the gate ran (ok and parity_fail rows).",
                            ["Method", "Cells", "Max rms-rel", "Median rms-rel", "Tolerance",
                             "Failed", "Gate model"], body, "lrrrrrl", [], recs))
    return tables


# --- what did not run ---------------------------------------------------------------------------

def not_run_table(frame: pd.DataFrame) -> Table | None:
    bad = frame[frame["status"] != "ok"]
    if bad.empty:
        return None
    rows = sorted(records(bad), key=lambda r: (str(r["device_name"]), str(r["model"]), int(r["batch"]),
                                               int(r["seq"]), method_sort_key(r["method"], r.get("method_family") or "")))
    body, recs = [], []
    for row in rows:
        reason = why_not_run(row)
        body.append([str(row["device_label"]), str(row["model"]), f"b{int(row['batch'])}×s{int(row['seq'])}",
                     f"`{row['method']}`", str(row["status"]), one_line(reason, 300), run_label(row["run_id"])])
        recs.append({"device_name": row["device_name"], "model": row["model"], "batch": row["batch"],
                     "seq": row["seq"], "method": row["method"], "status": row["status"],
                     "reason": reason, "run_id": row["run_id"]})
    return Table("not-run", "What did not run",
                 f"Every row whose status is not ok ({len(rows)} of {len(frame)}), with its reason "
                 "(or the last line of the cell's stderr).",
                 ["Device", "Model", "Shape", "Method", "Status", "Reason", "Run"], body, "lllllll", [], recs)
