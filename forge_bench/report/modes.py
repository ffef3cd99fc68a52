"""Where users train: one table per device and model measured by a compile run (``suites/compile.yaml``),
one line per training mode: eager, ``torch.compile`` (default mode), ``torch.compile`` reduce-overhead
(plain and with lean activations + the chunked loss), and the hand-captured CUDA graph of the headline
(lean activations + chunked loss), each with fused AdamW's and FORGE bf16's step and peak, FORGE's
speed-up against the AdamW of the same mode, and the compiled modes' compile seconds.

Why: a speed-up that exists only inside a hand-captured graph is not one users get; each mode is held
against the baseline in that mode (``forge_bench.compiled_arms``). A mode's pair comes from one run where
a run holds both; otherwise each arm from its own run, both shown and the ratio refused by the one rule
(``ratios.speedup``: "n/a (different run)"). A mode measured for FORGE alone is shown with the target it
is read against: the hand-captured graph's FORGE step on that device (a figure beside it, not a ratio).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from . import ratios
from .data import EAGER_TIMING, GRAPH_TIMING, fmt_ms, fmt_number, group_title, records, run_label, slug
from .ratios import as_number, as_text, json_field
from .render import Table

REDUCE_OVERHEAD = "reduce-overhead"
CELL_KEYS = ["device_name", "model", "dtype", "batch", "seq"]
PROCESS_PEAK_MARK = "†"
LAUNCHED_SHARE_NOTED = 0.05
"""The share of a FORGE step's fused updates launched (not replayed from a recorded graph) above which the
table says so: each launched update costs a host-bound step its Python, ~20-100 us."""


@dataclass(frozen=True)
class Mode:
    """One training mode: the rows of its AdamW and FORGE arms (method, timing, activations)."""
    label: str
    adamw: str
    forge: str
    timing: str = EAGER_TIMING
    activations: str = "hf"
    compile_mode: str | None = None
    always: bool = True        # shown as "not measured" where neither arm has a row; else left out


MODES = (
    Mode("eager", "adamw_fused", "forge_bf16"),
    Mode("torch.compile", "adamw_fused_compile", "forge_bf16_compile", compile_mode="default"),
    Mode("torch.compile reduce-overhead", "adamw_fused_compile_ro", "forge_bf16_compile_ro",
         compile_mode=REDUCE_OVERHEAD),
    Mode("torch.compile reduce-overhead, lean + chunked loss", "adamw_fused_compile_ro", "forge_bf16_cce_compile_ro",
         activations="lean", compile_mode=REDUCE_OVERHEAD, always=False),
    Mode("hand-captured CUDA graph, lean + chunked loss", "adamw_fused", "forge_bf16_cce", timing=GRAPH_TIMING,
         activations="lean", always=False),
)
GRAPH_MODE = MODES[-1]


def compile_mode(row: Mapping[str, Any]) -> str | None:
    """The ``torch.compile`` mode a row's arm ran under (``method_settings.compile_mode``), None for eager."""
    return as_text(json_field(row.get("method_settings")).get("compile_mode"))


def peak_gib(row: Mapping[str, Any]) -> tuple[float | None, bool]:
    """(the row's peak GiB, whether it is the process peak). A reduce-overhead row takes the larger of its
    window peak and its process peak: its CUDA graphs are recorded in the warm-up, and a row measured
    before the cell reset its peak after the compiling step (0d8a7f9) holds the graphs' pool only in
    ``peak_process_gib`` (its window peak is the weights and moments alone: 44.87 GiB for both arms on
    Llama-3.1-8B, against 61.82 and 47.35)."""
    window = as_number(row.get("peak_allocated_gib"))
    process = as_number(row.get("peak_process_gib"))
    if compile_mode(row) == REDUCE_OVERHEAD and process is not None and (window is None or process > window):
        return process, True
    return window, False


def compile_s(row: Mapping[str, Any] | None) -> float | None:
    """A compiled twin's compile seconds (``extra.compile_s``, apart from its step time)."""
    return None if row is None else as_number(json_field(row.get("extra")).get("compile_s"))


@dataclass(frozen=True)
class ModeLine:
    """One mode of one table: the rows it quotes (None: not measured) and FORGE's speed-up."""
    mode: Mode
    adamw: Mapping[str, Any] | None
    forge: Mapping[str, Any] | None
    speed: ratios.Ratio | None

    def runs(self) -> list[str]:
        return list(dict.fromkeys(run_label(r["run_id"]) for r in (self.adamw, self.forge) if r is not None))


def _is_ok(row: Mapping[str, Any]) -> bool:
    return as_text(row.get("status")) == "ok"


def mode_line(rows: pd.DataFrame, mode: Mode, compile_runs: set[Any]) -> ModeLine | None:
    """The rows ``mode`` quotes among ``rows`` (one cell, every run). Of the runs that hold both arms ok, the
    one that also compiled this model, then the newest; else each arm's own (ok first, then a compile run's,
    then the newest), the ratio then refused by the one rule."""
    picked = rows[(rows["timing"] == mode.timing) & (rows["activations"] == mode.activations)]
    arms = {name: records(picked[picked["method"] == name]) for name in (mode.adamw, mode.forge)}

    def rank(run_rows: list[Mapping[str, Any]]) -> tuple:
        run = run_rows[0]["run_id"]
        return (run in compile_runs, max(as_text(r.get("finished_at")) or "" for r in run_rows), as_text(run) or "")

    paired = {}
    for row in arms[mode.adamw]:
        partner = next((f for f in arms[mode.forge] if f["run_id"] == row["run_id"] and _is_ok(f)), None)
        if partner is not None and _is_ok(row):
            paired[row["run_id"]] = (row, partner)
    if paired:
        adamw, forge = max(paired.values(), key=lambda pair: rank(list(pair)))
    else:
        def best(candidates: list[Mapping[str, Any]]) -> Mapping[str, Any] | None:
            return max(candidates, key=lambda r: (_is_ok(r), *rank([r])), default=None)
        adamw, forge = best(arms[mode.adamw]), best(arms[mode.forge])
    if adamw is None and forge is None and not mode.always:
        return None
    speed = ratios.speedup(forge, adamw) if adamw is not None and forge is not None else None
    return ModeLine(mode, adamw, forge, speed)


def _step_text(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "—"
    return fmt_ms(row.get("step_ms_median")) if _is_ok(row) else as_text(row.get("status")) or "—"


def _peak_text(row: Mapping[str, Any] | None) -> str:
    if row is None or not _is_ok(row):
        return "—"
    value, process = peak_gib(row)
    return fmt_number(value) + (PROCESS_PEAK_MARK if process else "")


def _compile_text(line: ModeLine) -> str:
    if line.mode.compile_mode is None:
        return "—"
    return " / ".join(fmt_number(compile_s(r), 1) for r in (line.adamw, line.forge))


def _speed_text(line: ModeLine, target: Mapping[str, Any] | None, notes: list[str]) -> str:
    """FORGE's speed-up over AdamW of the same mode; where FORGE ran alone, the target it is read against."""
    if line.speed is not None:
        if line.speed.within_noise and ratios.NOISE_FOOTNOTE not in notes:
            notes.append(ratios.NOISE_FOOTNOTE)
        if line.speed.bound and ratios.BOUND_FOOTNOTE not in notes:
            notes.append(ratios.BOUND_FOOTNOTE)
        if line.speed.text == ratios.DIFFERENT_RUN:
            notes.append(f"{ratios.DIFFERENT_RUN} for {line.mode.label}: AdamW from run "
                         f"{run_label(line.adamw['run_id'])}, FORGE from run {run_label(line.forge['run_id'])} "
                         f"({line.speed.refusal}); both steps are shown, their ratio is not.")
        return line.speed.text
    if line.forge is None or line.adamw is not None:
        return "—"
    if target is None or not _is_ok(target) or target is line.forge:
        return "n/a (no AdamW row)"
    notes.append(f"{line.mode.label}: FORGE alone in its run (no AdamW twin in this mode), read against the target "
                 f"the hand-captured CUDA graph sets on this device: `{target['method']}` "
                 f"{fmt_ms(target.get('step_ms_median'))} ms (run {run_label(target['run_id'])}); a figure beside "
                 "it, not a ratio (different runs).")
    return f"n/a (no AdamW row); target {fmt_ms(target.get('step_ms_median'))} ms (hand-captured graph)"


def mode_lines(frame: pd.DataFrame) -> list[tuple[dict[str, Any], list[ModeLine]]]:
    """(cell keys, its mode lines) per device, model, dtype and shape that a compile run measured."""
    compiled = frame[[compile_mode(r) is not None for r in frame.to_dict("records")]] if len(frame) else frame
    out = []
    for values, _ in compiled.groupby(CELL_KEYS, sort=True, dropna=False):
        keys = dict(zip(CELL_KEYS, values))
        cell = frame
        for name, value in keys.items():
            cell = cell[cell[name] == value]
        runs = set(compiled[(compiled["device_name"] == keys["device_name"])
                            & (compiled["model"] == keys["model"])]["run_id"])
        lines = [line for line in (mode_line(cell, mode, runs) for mode in MODES) if line is not None]
        out.append((keys, lines))
    return out


def modes_tables(frame: pd.DataFrame) -> list[Table]:
    """One "Where users train" table per device, model, dtype and shape that a compile run measured."""
    tables = []
    for keys, lines in mode_lines(frame):
        graph = next((line for line in lines if line.mode is GRAPH_MODE), None)
        target = graph.forge if graph is not None else None
        notes: list[str] = []
        body, recs = [], []
        for line in lines:
            speed = _speed_text(line, target, notes)
            body.append([line.mode.label, f"`{line.mode.adamw}` / `{line.mode.forge}`",
                         " / ".join(line.runs()) or "not measured", _step_text(line.adamw), _peak_text(line.adamw),
                         _step_text(line.forge), _peak_text(line.forge), speed, _compile_text(line)])
            recs.append(_record(keys, line, speed))
        alternated = sorted({run_label(line.forge["run_id"]) for line in lines if line.adamw is not None
                             and line.forge is not None and ratios.took_turns(line.adamw, line.forge)})
        if alternated:
            pinned = sorted({run_label(line.forge["run_id"]) for line in lines if line.forge is not None
                             and ratios.json_field(line.forge.get("extra")).get("cpus")
                             and run_label(line.forge["run_id"]) in alternated})
            notes.append(f"The pairs of run {', '.join(alternated)} took turns on one GPU (`forge-bench sweep "
                         "--interleave`): both cells resident, their timed repeats alternating, so the host's "
                         "drift fell on both arms alike"
                         + (f"; those of run {', '.join(pinned)} on the same CPUs (`--cpus-per-cell`, D114)."
                            if pinned else "."))
        notes += [note for line in lines if (note := launched_updates_note(line)) is not None]
        if any(PROCESS_PEAK_MARK in cell for row in body for cell in row):
            notes.append(f"{PROCESS_PEAK_MARK} the process peak (`peak_process_gib`), larger than the timed "
                         "window's: see the caption.")
        caption = ("Step: median ms; peak: GiB (2^30), the timed window's allocated peak, except a reduce-overhead "
                   "row's, which is the larger of that and its process peak (`peak_process_gib`): torch.compile "
                   "records its CUDA graphs in the warm-up, and a row measured before the cell reset its peak after "
                   "the compiling step (0d8a7f9) holds the graphs' pool only in its process peak. Speed-up: "
                   "AdamW's step over FORGE's, both in that mode and from one run (else refused). Compile s: the "
                   "first step beyond one timed step (Dynamo and Inductor), AdamW / FORGE, apart from the step. "
                   "The hand-captured graph is the headline's: one CUDA graph per step, lean activations on both "
                   "arms, the chunked loss on FORGE's (AdamW keeps the model's own), as in the compiled lean mode.")
        tables.append(Table(slug("modes", *keys.values()), f"Where users train, {group_title(keys)}", caption,
                            ["Mode", "Arms (AdamW / FORGE)", "Run", "AdamW ms", "AdamW peak GiB", "FORGE ms",
                             "FORGE peak GiB", "Speed-up", "Compile s (AdamW / FORGE)"],
                            body, "lllrrrrrr", notes, recs))
    return tables


def launched_updates_note(line: ModeLine) -> str | None:
    """A note where FORGE's step in ``line`` replays its fused updates from recorded graphs
    (``extra.fused_launches_per_step``) but launches more than ``LAUNCHED_SHARE_NOTED`` of them. Why: a
    host-bound step's speed depends on it, and a run that launches what an earlier one replayed reads slower
    for that reason alone."""
    if line.forge is None or not _is_ok(line.forge):
        return None
    paths = json_field(line.forge.get("extra")).get("fused_launches_per_step") or {}
    launched = sum(as_number(paths.get(path)) or 0.0 for path in ("direct", "jit"))
    replayed = as_number(paths.get("graph")) or 0.0
    if replayed <= 0 or launched <= LAUNCHED_SHARE_NOTED * (launched + replayed):
        return None
    return (f"FORGE's {line.mode.label} step (run {run_label(line.forge['run_id'])}) launched {launched:.1f} of its "
            f"{launched + replayed:.0f} fused updates a step and replayed the rest from their recorded CUDA graphs "
            "(`extra.fused_launches_per_step`); a launched update costs the host its Python.")


def _record(keys: Mapping[str, Any], line: ModeLine, speed_text: str) -> dict[str, Any]:
    """The numbers of one line, for the CSV and the tests."""
    record: dict[str, Any] = {**keys, "mode": line.mode.label}
    for arm, row in (("adamw", line.adamw), ("forge", line.forge)):
        ok = row is not None and _is_ok(row)
        record.update({f"{arm}_method": line.mode.adamw if arm == "adamw" else line.mode.forge,
                       f"{arm}_run": run_label(row["run_id"]) if row is not None else None,
                       f"{arm}_step_ms": as_number(row.get("step_ms_median")) if ok else None,
                       f"{arm}_peak_gib": peak_gib(row)[0] if ok else None,
                       f"{arm}_compile_s": compile_s(row)})
    record.update({"speedup": line.speed.value if line.speed is not None else None, "speedup_text": speed_text,
                   "refusal": line.speed.refusal if line.speed is not None else None})
    return record


def device_has_modes(frame: pd.DataFrame) -> bool:
    """Whether a compile run measured a cell on this frame's rows (the summary's note where none did)."""
    return any(compile_mode(r) is not None for r in frame.to_dict("records"))


NO_COMPILE_NOTE = "_No torch.compile run on this device (`suites/compile.yaml`): no eager / compiled / graph table._"

__all__ = ["GRAPH_MODE", "LAUNCHED_SHARE_NOTED", "MODES", "Mode", "ModeLine", "NO_COMPILE_NOTE", "compile_mode",
           "compile_s", "device_has_modes", "launched_updates_note", "mode_line", "mode_lines", "modes_tables",
           "peak_gib"]
