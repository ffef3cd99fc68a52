"""Loading result rows for the report, method ordering, grouping and baseline choice.

Tables and figures both go through here so that they agree on which row is the baseline of
which, and on the order and names in which methods and devices appear.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import pandas as pd

from forge_bench.results import CHECKPOINTED, ResultsError, iter_result_files, load_results, with_activations
from forge_bench.zoo import model_family

from .ratios import as_number, as_text, comparable, incomparable_reason

# Baseline of every ratio: torch's fused AdamW; where it did not run (CPU: it needs CUDA), the
# foreach AdamW, and the caption says so.
BASELINE_PREFERENCE = ("adamw_fused", "adamw_foreach")

# Known methods in reading order: floor and baselines, then FORGE arms; peers and unknown names
# are placed by family, then alphabetically.
KNOWN_METHOD_ORDER = ("no_optimizer", "adamw_foreach", "adamw_fused", "adamw_fused_cce", "sgd",
                      "forge_fp32", "forge_bf16", "forge_int8", "forge_bf16_cce", "forge_int8_cce")
FAMILY_ORDER = {"baseline": 0, "peer": 1, "forge": 2}

EAGER_TIMING = "eager"
GRAPH_TIMING = "CUDA graph"
HEADLINE_KEYS = ["device_name", "model", "dtype", "batch", "seq", "timing", "activations"]


class NoResultsError(ResultsError):
    """The results folder is missing or holds no parquet rows (message names the folder)."""


def as_folders(results_dirs: str | Path | Sequence[str | Path]) -> list[Path]:
    """One results folder (or parquet file), or several, as a list of paths."""
    return [Path(results_dirs)] if isinstance(results_dirs, (str, Path)) else [Path(p) for p in results_dirs]


def skip_on_stderr(path: Path, reason: str) -> None:
    """Name a parquet file the report skips, in one line on stderr."""
    print(f"forge-bench report: skipping {path}: {reason}", file=sys.stderr)


def load_rows(results_dirs: str | Path | Sequence[str | Path],
              on_foreign: Callable[[Path, str], None] | None = skip_on_stderr) -> pd.DataFrame:
    """Every row under ``results_dirs`` (one folder or parquet file, or several: e.g. one run per
    GPU, for the hardware comparison) with a few derived display columns. A parquet file of
    another kind goes to ``on_foreign`` and is skipped (None: it is an error)."""
    folders = as_folders(results_dirs)
    if not folders:
        raise NoResultsError("no results folder given")
    frames, empty = [], []
    for folder in folders:
        if not folder.exists():
            raise NoResultsError(f"results folder {folder} does not exist")
        if not iter_result_files(folder):
            empty.append(f"no forge-bench parquet result files under {folder}")
            continue
        try:
            frames.append(load_results(folder, on_foreign))
        except ResultsError as exc:
            if on_foreign is None:
                raise
            empty.append(str(exc))                         # every parquet file there is of another kind
    if not frames:
        raise NoResultsError(empty[0])
    # A folder without sweep rows beside folders with them (a convergence run's, say) adds nothing
    # here; the report reads its rows of the other kinds on their own.
    frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
    duplicated = frame["cell_id"].astype(str) + "/" + frame["run_id"].astype(str)
    if duplicated.duplicated().any():
        first = duplicated[duplicated.duplicated()].iloc[0]
        raise NoResultsError(f"the same row (cell/run {first}) is under two of the given folders: "
                             "pass each run's folder once")
    frame["method_family"] = frame["method_family"].fillna("")
    frame["run_short"] = frame["run_id"].map(run_label)
    frame["device_label"] = frame["device_name"].map(device_label)
    frame["shape_label"] = [f"b{int(b)}×s{int(s)}" for b, s in zip(frame["batch"], frame["seq"])]
    frame["family"] = frame["model"].map(model_family)     # the registry's (forge_bench/zoo.py)
    # Eager steps and CUDA-graph replays of the same cell are different measurements: every table
    # and figure groups by this, so a ratio never mixes the two.
    timing = frame["timing_method"] if "timing_method" in frame else pd.Series([None] * len(frame), index=frame.index)
    frame["timing"] = [GRAPH_TIMING if t == "cuda_graph_replay" else EAGER_TIMING for t in timing]
    # Lean activations change every arm's memory and time: their rows are compared among themselves.
    return with_activations(frame)


def params_text(n_params: float | None) -> str:
    """A parameter count as the tables print it: 596.0M, 1.72B."""
    if n_params is None:
        return "?"
    scale, suffix, digits = next(((s, x, d) for s, x, d in ((1e9, "B", 2), (1e6, "M", 1)) if n_params >= s),
                                 (1e3, "K", 1))
    return f"{n_params / scale:.{digits}f}{suffix}"


def run_label(run_id: Any) -> str:
    """A short label for a run id that stays unique: the harness's ids end in a random hex
    token (``20261123T093814Z-smoke-72d475``), which is kept; other ids are shown whole."""
    text = as_text(run_id) or "?"
    tail = text.rsplit("-", 1)[-1]
    if tail != text and len(tail) >= 6:
        return tail
    return text


def newest_run(frame: pd.DataFrame) -> Any:
    """The run id of ``frame`` whose rows finished last (largest ``finished_at``; then the largest id)."""
    return max(frame.groupby("run_id", dropna=False),
               key=lambda item: (finished_last(item[1]), as_text(item[0]) or ""))[0]


def cited_run(rows: pd.DataFrame) -> Any:
    """The run a headline quotes among those that measured its cell: the newest where a FORGE arm ran ok
    beside an ok AdamW baseline (``BASELINE_PREFERENCE``), else the newest with an ok FORGE arm, else
    the newest with an ok row, else the newest. The summary page's headline columns and the headline figures both take it, so that a
    figure draws the run its table quotes, one bar per arm."""
    ok = rows[rows["status"] == "ok"]
    forge = ok[ok["method_family"] == "forge"]
    compared = forge[forge["run_id"].isin(set(ok.loc[ok["method"].isin(BASELINE_PREFERENCE), "run_id"]))]
    return newest_run(next(chosen for chosen in (compared, forge, ok, rows) if not chosen.empty))


def finished_last(group: pd.DataFrame) -> str:
    """The latest ``finished_at`` of a group of rows (ISO text; "" when none is recorded)."""
    return max((as_text(t) or "" for t in group["finished_at"]), default="")


def across_runs(frame: pd.DataFrame, series_keys: list[str], part: str | list[str],
                rank: Callable[[pd.DataFrame], tuple] = lambda rows: (finished_last(rows),), *,
                group_only: Sequence[str] = (), min_runs: int = 1) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, rows) per ``series_keys`` (and ``group_only``, kept out of the keys) group with two or
    more ``part``s (a model, a shape) drawn from ``min_runs`` or more runs: each part's rows from the
    run ``rank`` puts highest (then the largest id). Why: a family or a grid is measured a few parts
    at a time, and a figure or table of the whole draws each part from one run, so that its ratios
    still compare cells measured side by side. ``keys["run_id"]`` names the runs, oldest first."""
    out = []
    for keys, group in frame.groupby([*series_keys, *group_only], sort=True, dropna=False):
        picked = []
        for _, part_rows in group.groupby(part, sort=True):
            best = max(part_rows.groupby("run_id", sort=False), key=lambda run: (*rank(run[1]), run[0]))[0]
            picked.append(part_rows[part_rows["run_id"] == best])
        if len(picked) < 2:
            continue
        rows = pd.concat(picked)
        runs = sorted(set(rows["run_id"]), key=lambda run: finished_last(rows[rows["run_id"] == run]))
        if len(runs) >= min_runs:
            out.append(({**dict(zip(series_keys, keys)), "run_id": " + ".join(run_label(run) for run in runs)}, rows))
    return out


def one_per_key(groups: list[tuple[dict[str, Any], pd.DataFrame]],
                rank: Callable[[pd.DataFrame], tuple] = lambda group: (finished_last(group),)
                ) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """Of groups whose keys differ only in ``run_id``, the one ``rank`` puts highest (default: the
    newest run), in the input order. Why: a figure per run repeats its table's numbers; the figures
    draw one run of each group and the tables keep every run."""
    def key_of(keys: dict[str, Any]) -> tuple:
        return tuple((k, str(v)) for k, v in keys.items() if k != "run_id")

    best: dict[tuple, tuple] = {}
    for keys, group in groups:
        candidate = (*rank(group), as_text(keys.get("run_id")) or "")
        if key_of(keys) not in best or candidate > best[key_of(keys)]:
            best[key_of(keys)] = candidate
    return [(keys, group) for keys, group in groups if best[key_of(keys)][-1] == (as_text(keys.get("run_id")) or "")]


def device_label(name: Any) -> str:
    """A short name for legends: the accelerator's model (H100, H200, B200 ...) or the name."""
    text = as_text(name) or "unknown device"
    match = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", text)
    if match and "NVIDIA" in text.upper():
        return match.group(1)
    return text if len(text) <= 32 else text[:31] + "…"


def method_sort_key(method: str, family: str = "") -> tuple:
    if method in KNOWN_METHOD_ORDER:
        return (0, KNOWN_METHOD_ORDER.index(method), method)
    return (1, FAMILY_ORDER.get(family or "", 3), method)


def ordered_methods(frame: pd.DataFrame) -> list[str]:
    """The distinct methods present in ``frame``, in reading order."""
    families: dict[str, str] = {}
    for method, family in zip(frame["method"], frame["method_family"]):
        families.setdefault(method, family or "")
    return sorted(families, key=lambda m: method_sort_key(m, families[m]))


def is_forge(method: str, family: str = "") -> bool:
    return family == "forge" or method.startswith("forge_")


# A FORGE arm on a model with no weight it may fuse (n_fused_params = 0) runs every update in
# opt.step(): its row is FORGE's unfused path, and a reader comparing it with the baseline must know.
NOTHING_FUSED = "nothing fused"
NOTHING_FUSED_NOTE = ("nothing fused: the FORGE arm found no weight of this model to fuse (n_fused_params = 0), "
                      "so every update ran in opt.step(): the row measures FORGE's unfused path, not a fused "
                      "weight update.")


def nothing_fused(row: Mapping[str, Any]) -> bool:
    """A FORGE row that measured a step in which no weight was fused (``n_fused_params`` is 0)."""
    return (is_forge(str(row.get("method")), as_text(row.get("method_family")) or "")
            and as_number(row.get("n_fused_params")) == 0)


def method_cell(method: str, rows: Iterable[Mapping[str, Any]] = ()) -> str:
    """A table's method cell: the name, marked "(nothing fused)" when a row of it among ``rows`` is."""
    mark = any(r.get("method") == method and nothing_fused(r) for r in rows)
    return f"`{method}`" + (f" ({NOTHING_FUSED})" if mark else "")


# Memory columns read in GiB (2^30 bytes); a table whose values are all under 1 GiB (the CPU smoke
# suite's tiny models: 1.8 MiB of weights) reads in MiB, where two decimals of GiB would say 0.00.
MIB_PER_GIB = 1024.0


def memory_unit(values_gib: Iterable[Any]) -> str:
    """'MiB' when every known value is below 1 GiB, else 'GiB' (also when none is known)."""
    known = [abs(v) for v in (as_number(x) for x in values_gib) if v is not None]
    return "MiB" if known and max(known) < 1.0 else "GiB"


def fmt_memory(value_gib: Any, unit: str) -> str:
    """A memory value given in GiB, printed in ``unit`` with two decimals (— when unknown)."""
    number = as_number(value_gib)
    if number is None:
        return "—"
    return fmt_number(number * MIB_PER_GIB if unit == "MiB" else number)


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return frame.to_dict("records")


def ok_rows(rows: Iterable[Mapping[str, Any]], method: str) -> list[Mapping[str, Any]]:
    return [r for r in rows if r["method"] == method and as_text(r.get("status")) == "ok"]


def choose_baseline(rows: list[Mapping[str, Any]]) -> tuple[str | None, str]:
    """The baseline method of a group of rows and a caption sentence saying which and why."""
    preferred = BASELINE_PREFERENCE[0]
    for method in BASELINE_PREFERENCE:
        if ok_rows(rows, method):
            if method == preferred:
                return method, f"Ratios are against torch fused AdamW (`{preferred}`)."
            missing = [r for r in rows if r["method"] == preferred]
            why = (f"it has status {as_text(missing[0].get('status'))}: "
                   f"{as_text(missing[0].get('reason')) or 'no reason recorded'}"
                   if missing else "it was not part of this run")
            return method, (f"Ratios are against `{method}` because `{preferred}` has no ok row "
                            f"here ({why}).")
    return None, "No AdamW baseline row ran ok here: no ratios."


def find_baseline_row(candidate: Mapping[str, Any], rows: list[Mapping[str, Any]],
                      baseline_method: str | None) -> Mapping[str, Any] | None:
    """The baseline row to divide ``candidate`` by: an ok one of the same run if there is one.

    When the only baseline rows come from another run (or machine state), one of them is still
    returned so that the shared ratio rule can refuse it visibly ("n/a (different run)") rather
    than the cell silently saying "no baseline".
    """
    if baseline_method is None:
        return None
    same_method = [r for r in rows if r["method"] == baseline_method]
    ok = [r for r in same_method if as_text(r.get("status")) == "ok"]
    for row in ok:
        if comparable(candidate, row):
            return row
    for row in same_method:
        if comparable(candidate, row):
            return row
    # Same run but clocks or host apart: its memory ratio still holds, its time ratio is refused.
    for row in ok:
        if incomparable_reason(candidate, row) is None:
            return row
    if ok:
        return ok[0]
    return same_method[0] if same_method else None


def group_title(keys: Mapping[str, Any]) -> str:
    """A human title for a group key mapping (device, model, dtype, batch, seq, run...)."""
    parts = []
    if "device_name" in keys:
        parts.append(str(keys["device_name"]))
    if "model" in keys:
        parts.append(str(keys["model"]))
    if "dtype" in keys:
        parts.append(str(keys["dtype"]))
    if "batch" in keys and "seq" in keys:
        parts.append(f"batch {int(keys['batch'])} × seq {int(keys['seq'])}")
    if keys.get("timing") == GRAPH_TIMING:
        parts.append("CUDA-graph replay")
    if keys.get("activations") == "lean":
        parts.append("lean activations")
    elif keys.get("activations") == CHECKPOINTED:
        parts.append("activation checkpointing")
    if "run_id" in keys:
        parts.append(f"run {run_label(keys['run_id'])}")
    return " · ".join(parts)


def timing_slug(keys: Mapping[str, Any]) -> str | None:
    """The file-name part that keeps a CUDA-graph (or lean-activations) group's outputs apart from
    the eager ones (None for eager hf groups, whose file names carry no mark)."""
    parts = (["graph"] if keys.get("timing") == GRAPH_TIMING else []) + \
        (["lean"] if keys.get("activations") == "lean" else []) + \
        (["ckpt"] if keys.get("activations") == CHECKPOINTED else [])
    return "-".join(parts) or None


def key_parts(keys: Mapping[str, Any]) -> list[Any]:
    """A group's key values for a file name: ``activations`` only when lean (hf names carry no mark)."""
    return [(value if value != "hf" else None) if name == "activations" else value for name, value in keys.items()]


def slug(*parts: Any) -> str:
    """A file-name-safe identifier built from group keys."""
    text = "_".join(str(p) for p in parts if p is not None and str(p) != "")
    text = re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()
    return text[:120] or "all"


def fmt_number(value: Any, digits: int = 2) -> str:
    number = as_number(value)
    return "—" if number is None else f"{number:.{digits}f}"


def fmt_measured(value: Any, digits: int) -> str:
    """``fmt_number`` for a measured quantity that may be far below one (a CPU cell's TF/s, its first
    step in seconds): under 1 it keeps two significant digits (0.019, not 0.0), so a small measurement
    never prints as a zero one."""
    number = as_number(value)
    if number is None:
        return "—"
    return f"{number:.{digits}f}" if number == 0 or abs(number) >= 1 else f"{number:.2g}"


def fmt_ms(value: Any) -> str:
    """Step times: three significant-ish digits whatever the magnitude."""
    number = as_number(value)
    if number is None:
        return "—"
    if number >= 100:
        return f"{number:.1f}"
    if number >= 10:
        return f"{number:.2f}"
    return f"{number:.3f}"
