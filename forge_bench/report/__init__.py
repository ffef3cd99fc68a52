"""``forge-bench report``: every parquet row under a folder -> the paper's tables and figures.

``build_report(results_dir, out_dir)`` writes into ``out_dir``:

* ``README.md``: the one page a reader takes in at a glance (``summary.py``): per device the
  headline cell, the peers and the batch x seq grid, linking the details;
* ``index.md``: the details, every run, table and figure (with a note for every section that has
  no data);
* ``tables/*.md``, ``*.tex`` (booktabs), ``*.csv``: headline, the paper's Table 1 (mean ± sd, TF/s;
  ``table1.py``) and beside it where users train (eager, torch.compile, reduce-overhead and the
  hand-captured graph per device and model a compile run measured; ``modes.py``), the optimizer
  families (App. I), composability (``composability.py``),
  batch x seq grid, the constant-token law (``token_law.py``), model scaling (``scaling.py``), where
  memory goes, hardware comparison, fidelity, coverage across the model zoo, across GPUs (the
  distributed arms: per-rank peak, step and tokens/s per world size, and the targets;
  ``distributed.py``), scaling within a model family, capability (App. O: the largest model per arm
  and GPU, measured beside predicted; ``app_o.py``), what did not run; and from the rows of
  ``forge-bench fidelity`` and ``forge-bench convergence`` (``forge_bench.run_rows``) the App. E
  fidelity table and the convergence table (``training.py``);
* ``figures/*.png`` and ``*.pdf`` (``formats=("png",)`` or ``("pdf",)`` writes one of the two:
  ``forge-bench report --formats png``),

and returns the path of ``README.md``. Ratios obey one rule (``ratios.py``): only within one
sweep run on one device, else "n/a (different run)". A parquet file of another kind under the
results folder (the kernel benchmark's), or one that does not read as parquet, is named on stderr
and skipped. The report is built in a staging folder and swapped in whole (``folder.py``): a
report killed half-way leaves the previous one as it was.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from forge_bench.results import ResultsError
from forge_bench.run_rows import file_kind, load_kind

from . import (app_i, app_o, composability, coverage, distributed, figures, folder, modes, ratios, render, scaling,
               summary, table1, tables, token_law, training)
from .data import NoResultsError, as_folders, load_rows, ordered_methods, run_label, skip_on_stderr
from .ratios import as_number, as_text

__all__ = ["build_report", "NoResultsError", "ReportFolderError"]

ReportFolderError = folder.ReportFolderError
SUMMARY = "README.md"
DETAILS = "index.md"


def build_report(results_dir: str | Path | Sequence[str | Path], out_dir: str | Path,
                 formats: Sequence[str] = figures.FORMATS,
                 on_foreign: Callable[[Path, str], None] | None = skip_on_stderr) -> Path:
    """Write the full report for every row under ``results_dir`` (a folder, or several: e.g. one
    run per GPU); return ``out_dir/README.md``, the summary page (the details: ``out_dir/index.md``).
    ``formats`` names the file types of every figure (default PNG and PDF; PNG alone skips the PDF
    twins, about 30% of a large report's time). ``on_foreign`` gets each parquet file of another
    kind, which is skipped (default: one line on stderr; None: such a file is an error).

    Raises ``NoResultsError`` (one line naming the folder) when there is nothing to report,
    ``ReportFolderError`` when ``out_dir`` is a file or a folder of something else (``folder.py``),
    and ValueError for a format other than png / pdf (all before anything is written).
    """
    formats = figures.check_formats(formats)
    folders = as_folders(results_dir)
    out_dir = Path(out_dir)
    folder.check_target(out_dir)
    convergence_rows = load_kind(folders, "convergence")
    fidelity_rows = load_kind(folders, "fidelity")

    def on_other_kind(path: Path, reason: str) -> None:
        if file_kind(path) is not None:       # a convergence or fidelity file: read by training.py
            return
        if on_foreign is None:
            raise ResultsError(f"{path}: {reason}")
        on_foreign(path, reason)

    try:
        frame = load_rows(folders, on_other_kind)
    except NoResultsError:
        if convergence_rows is None and fidelity_rows is None:
            raise
        frame = None                           # only training-quality rows here
    staging = folder.staging_folder(out_dir)
    try:
        _write_report(frame, folders, staging, formats, convergence_rows, fidelity_rows)
    except BaseException:
        folder.remove_staging(staging)
        raise
    folder.swap_in(staging, out_dir, on_replaced=lambda path: print(
        f"forge-bench report: {path} replaced by the report's file of that name", file=sys.stderr))
    return out_dir / SUMMARY


def _write_report(every_row: pd.DataFrame | None, folders: list[Path], out_dir: Path, formats: Sequence[str],
                  convergence_rows, fidelity_rows) -> None:
    """Every table, figure and page of the report into the empty folder ``out_dir``. The distributed
    arms' rows (a strategy) have a section of their own; every other section reads the one-process rows."""
    results_dir = ", ".join(f"`{f}`" for f in folders)
    frame = distributed_rows = None
    if every_row is not None:
        across_gpus = distributed.is_distributed(every_row)
        frame, distributed_rows = every_row[~across_gpus], every_row[across_gpus]
    table_dir, figure_dir = out_dir / "tables", out_dir / "figures"
    written: list[Path] = []
    sections: list[str] = []

    def link_files(paths: list[Path]) -> str:
        return " · ".join(f"[{p.suffix[1:]}]({p.relative_to(out_dir).as_posix()})" for p in paths)

    def figure_block(paths: list[Path]) -> list[str]:
        """Each figure shown inline (from its PNG, where one was written), then a link per file."""
        by_stem: dict[str, list[Path]] = {}
        for path in paths:
            by_stem.setdefault(path.stem, []).append(path)
        lines = []
        for stem, files in by_stem.items():
            pngs = [p for p in files if p.suffix == ".png"]
            lines += [f"![{stem}]({pngs[0].relative_to(out_dir).as_posix()})"] if pngs else [f"Figure `{stem}`"]
            lines += [f"({link_files(files)})", ""]
        return lines

    def table_section(heading: str, stem: str, built: list[render.Table], intro: str,
                      inline: bool, skip_note: str) -> list[str]:
        lines = [f"## {heading}", ""]
        if not built:
            lines += [f"_Skipped: {skip_note}._", ""]
            return lines
        paths = render.write_tables(built, table_dir, stem, heading, intro)
        written.extend(paths)
        lines += [f"Tables: {link_files(paths)}", ""]
        if inline:
            lines += [t.to_markdown(level=3) for t in built]
        else:
            lines += [f"- {t.title}" for t in built] + [""]
        return lines

    if frame is None:
        _training_only_report(out_dir, results_dir, convergence_rows, fidelity_rows, formats)
        return
    colors = figures.method_colors(ordered_methods(frame))

    # headline
    headline = tables.headline_tables(frame)
    sections += table_section("Headline", "headline", headline,
                              "Per device, model and shape; one row per method.", True, "no rows")
    head_figs = figures.headline_figures(frame, figure_dir, colors, formats)
    written += head_figs
    sections += figure_block(head_figs) or ["_No headline figure: no row ran ok._", ""]

    # the paper's Table 1: mean ± sd and TF/s per arm, the paper's figures beside
    sections += table_section("Table 1", "table1", table1.table1_tables(frame),
                              "Per device, model and shape: every arm's peak, median and mean ± sd step and model "
                              "TF/s, with the paper's row where it has one.", False, "no rows")

    # beside Table 1: each training mode (eager, torch.compile, reduce-overhead, hand-captured graph) side by side
    sections += table_section("Where users train", "modes", modes.modes_tables(frame),
                              "Per device and model that a compile run measured (suites/compile.yaml): fused AdamW and "
                              "FORGE bf16 eager, under torch.compile, reduce-overhead and the headline's hand-captured "
                              "CUDA graph, each speed-up within its mode and run.", True,
                              "no torch.compile run (suites/compile.yaml)")

    # App. I: every optimizer family fused against unfused
    sections += table_section("Optimizer families (App. I)", "app-i", app_i.app_i_tables(frame),
                              "Each optimizer family fused against unfused, per state format, with the paper's "
                              "App. I figures beside the fp32 lines.", True, "no optimizer-family rows")

    # composability: FORGE with another memory technique, against each alone (paper Fig. 5)
    sections += table_section("Composability", "composability", composability.composability_tables(frame),
                              "FORGE composed with activation checkpointing, 8-bit states, factored moments and GaLore, "
                              "against each alone, in one run (suites/composability.yaml).", True,
                              "no run holds FORGE alone beside another memory technique alone")

    # the floor
    sections += table_section("FORGE against its floor", "floor", tables.floor_tables(frame),
                              "Each FORGE arm's step against the floor measured in the same run.", True,
                              "no run has a no_optimizer row with floor terms (measured on CUDA only) "
                              "and a FORGE row")

    # grid
    grid_note = "no run measured one model at two or more batch × seq shapes"
    sections += table_section("Batch × sequence grid", "grid", tables.grid_tables(frame),
                              "Peak and step per method at every batch × seq of one run.", False, grid_note)
    grid_figs, _ = figures.grid_figures(frame, figure_dir, colors, formats)
    written += grid_figs
    sections += figure_block(grid_figs)

    sections += table_section("Constant-token law", "token_law", token_law.token_law_tables(frame),
                              "Peaks along each anti-diagonal of the batch × seq grid (equal tokens per step), "
                              "across the runs of one device and model.", True,
                              "no method measured ok at two shapes of one token count")

    # scaling
    sections += table_section("Model scaling", "scaling", scaling.scaling_tables(frame),
                              "Peak and step against parameter count, within one model family "
                              "(forge_bench/zoo.py).", False, scaling.scaling_skip_note(frame))
    scale_figs, _ = figures.scaling_figures(frame, figure_dir, colors, formats)
    written += scale_figs
    sections += figure_block(scale_figs)

    # memory
    sections += table_section("Where memory goes", "memory", tables.memory_tables(frame),
                              "Analytic weights, optimizer states and gradients; activations + rest "
                              "= measured peak minus them (each table's unit in its header).", False, "no row ran ok")
    mem_figs, _ = figures.memory_figures(frame, figure_dir, formats)
    written += mem_figs
    sections += figure_block(mem_figs)

    # hardware
    hw_figs, hw_note = figures.hardware_figures(frame, figure_dir, formats)
    sections += table_section("Hardware comparison", "hardware", tables.hardware_tables(frame),
                              "The same cells on each device, each device's ratios against its own "
                              "baseline in its own run, side by side.", False, hw_note or "no data")
    written += hw_figs
    sections += figure_block(hw_figs)

    # fidelity
    fid_figs, fid_note = figures.fidelity_figures(frame, figure_dir, colors, formats)
    sections += table_section("Fidelity", "fidelity", tables.fidelity_tables(frame),
                              "Parity rms-rel against an fp32 reference.", True,
                              fid_note or "no row ran the parity gate")
    written += fid_figs
    sections += figure_block(fid_figs) if fid_figs else ([f"_No fidelity figure: {fid_note}._", ""])

    # across GPUs
    sections += table_section("Across GPUs", "distributed", distributed.dist_tables(distributed_rows),
                              "The distributed arms (forge_bench/dist_arms.py) per world size, and the targets.",
                              True, "no distributed arm ran ok")
    dist_figs = distributed.dist_figures(distributed_rows, figure_dir, formats)
    written += dist_figs
    sections += figure_block(dist_figs)

    # coverage across the zoo, and scaling within a model family
    sections += table_section("Coverage across the model zoo", "coverage", coverage.coverage_tables(frame),
                              "What FORGE fuses in each model, and what it costs and saves there (paper App. P).",
                              True, "no FORGE row")
    family_figs, family_note = coverage.family_scaling_figures(frame, figure_dir, colors, formats)
    sections += table_section("Scaling within a model family", "family", coverage.largest_fit_tables(frame),
                              "The largest model of a family each arm fits on each GPU (paper Fig. 7).", True,
                              family_note or "no family measured at two sizes")
    written += family_figs
    sections += figure_block(family_figs)
    sections += table_section("Capability (App. O)", "capability", app_o.app_o_tables(frame),
                              "The largest model each arm trains per GPU: measured in the rows beside the analytic "
                              "memory model's prediction (`forge-bench capability`).", True,
                              "no row from a GPU the capability arithmetic knows (A100, H100, H200, B200, B300)")

    # training quality: App. E fidelity and convergence on real text
    sections += _training_sections(table_section, figure_block, written, figure_dir, convergence_rows,
                                   fidelity_rows, formats)

    # not run
    not_run = tables.not_run_table(every_row)
    sections += table_section("What did not run", "not-run", [not_run] if not_run else [],
                              "", True, "every row ran ok")

    index = out_dir / DETAILS
    header = _header(every_row, results_dir)
    index.write_text("\n".join(header + sections).rstrip() + "\n")
    written.append(index)
    first_page = out_dir / SUMMARY
    pngs = {p.stem: p.relative_to(out_dir).as_posix() for p in head_figs if p.suffix == ".png"}
    first_page.write_text(summary.summary_markdown(frame, results_dir, DETAILS, distributed_rows, pngs))
    written.append(first_page)
    folder.write_manifest(out_dir, written)


def _training_sections(table_section, figure_block, written: list[Path], figure_dir: Path, convergence_rows,
                       fidelity_rows, formats: Sequence[str]) -> list[str]:
    """The fidelity (App. E) and convergence sections, from their own rows (``training.py``)."""
    lines = table_section("Fidelity against fp32 (App. E)", "fidelity-app-e",
                          training.fidelity_run_tables(fidelity_rows) if fidelity_rows is not None else [],
                          "A head trained by each bf16 update path, against the same run in fp32.", True,
                          "no forge-bench fidelity rows")
    lines += table_section("Convergence on real text", "convergence",
                           training.convergence_tables(convergence_rows) if convergence_rows is not None else [],
                           "End-of-run losses of each arm against fused AdamW, paired by seed.", True,
                           "no completed forge-bench convergence run")
    if convergence_rows is not None:
        paths, note = training.convergence_figures(convergence_rows, figure_dir, formats)
        written += paths
        lines += figure_block(paths) if paths else [f"_No convergence figure: {note}._", ""]
    return lines


def _training_only_report(out_dir: Path, results_dir: str, convergence_rows, fidelity_rows,
                          formats: Sequence[str]) -> Path:
    """A folder with only convergence / fidelity rows: one page (README.md, index.md the same)."""
    written: list[Path] = []
    table_dir, figure_dir = out_dir / "tables", out_dir / "figures"

    def table_section(heading, stem, built, intro, inline, skip_note):
        lines = [f"## {heading}", ""]
        if not built:
            return lines + [f"_Skipped: {skip_note}._", ""]
        paths = render.write_tables(built, table_dir, stem, heading, intro)
        written.extend(paths)
        return lines + [" · ".join(f"[{p.suffix[1:]}]({p.relative_to(out_dir).as_posix()})" for p in paths), ""] + \
            [t.to_markdown(level=3) for t in built]

    def figure_block(paths):
        return [f"![{p.stem}]({p.relative_to(out_dir).as_posix()})" for p in paths if p.suffix == ".png"] + [""]

    body = _training_sections(table_section, figure_block, written, figure_dir, convergence_rows, fidelity_rows,
                              formats)
    text = "\n".join(["# FORGE training-quality report", "",
                       f"Generated by `forge-bench report` from the convergence and fidelity rows under {results_dir}.",
                       ""] + body).rstrip() + "\n"
    first_page = out_dir / SUMMARY
    for path in (first_page, out_dir / DETAILS):
        path.write_text(text)
        written.append(path)
    folder.write_manifest(out_dir, written)
    return first_page


def _header(frame: pd.DataFrame, results_dir: str) -> list[str]:
    lines = ["# FORGE benchmark report", "",
             f"Generated by `forge-bench report` from {len(frame)} rows under {results_dir} "
             f"({int((frame['status'] == 'ok').sum())} ok). Memory in GiB (2^30 bytes), or in MiB (2^20 bytes) "
             f"where a table's header says so; times in ms. "
             f"The summary page: [{SUMMARY}]({SUMMARY}).", "",
             "## Runs", "",
             "| Run | Suite | Device | torch | triton | CUDA | Commit | Rows (ok) | SM clock after, MHz |",
             "|:--|:--|:--|:--|:--|:--|:--|--:|:--|"]
    for run_id, group in frame.groupby("run_id", sort=True, dropna=False):
        first = group.iloc[0]
        clocks = [c for c in (as_number(v) for v in group["sm_clock_mhz_after"]) if c is not None]
        clock_text = "—" if not clocks else f"{min(clocks):.0f}–{max(clocks):.0f}"
        commit = (as_text(first.get("git_commit")) or "—")[:10]
        if group["source_dirty"].fillna(False).astype(bool).any():
            commit += " (dirty)"
        devices = ", ".join(sorted({str(d) for d in group["device_name"]}))
        lines.append(f"| {run_label(run_id)} | {as_text(first.get('suite_name')) or '—'} | {devices} | "
                     f"{as_text(first.get('torch_version')) or '—'} | {as_text(first.get('triton_version')) or '—'} | "
                     f"{as_text(first.get('cuda_version')) or '—'} | {commit} | "
                     f"{len(group)} ({int((group['status'] == 'ok').sum())}) | {clock_text} |")
    lines += ["", "## The rule for ratios", "",
              "A speed-up or memory change is computed only between rows of the same sweep run "
              "(`run_id`) on the same device with the same torch, triton and CUDA versions; a "
              f"speed-up also needs SM clocks (after the timed window) within {ratios.CLOCK_TOLERANCE:.0%} "
              "of each other and, where both rows recorded one, the same machine boot (a sweep "
              "resumed on another machine keeps its run id, but not its host's speed); "
              f"anything else reads “{ratios.DIFFERENT_RUN}”, except clocks that differ in the direction "
              "that can only narrow the gap (the faster cell at the lower clock), printed as a bound "
              "(≥ / ≤). The baseline is torch fused AdamW "
              "(`adamw_fused`), or `adamw_foreach` where the fused arm did not run (the caption says "
              f"so). {ratios.NOISE_FOOTNOTE}", ""]
    return lines
