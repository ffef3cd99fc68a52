"""``forge-bench``: sweep suites one process per cell, inspect the set-up, build reports.

Runs installed (``forge-bench ...``) or from a source tree (``python3 -m forge_bench.cli ...``
with the repository root on PYTHONPATH). Bad input is a one-line error and exit code 2;
nothing already written is touched by a refused command.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from forge_bench import folder_lock
from forge_bench.profile.cli import profile_app
from forge_bench.training_cli import convergence, fidelity
from forge_bench.units import GIB

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="FORGE benchmark harness: measure training-step time and peak memory of FORGE against "
         "every alternative, one process per cell, into atomic parquet rows.",
)
app.add_typer(profile_app, name="profile")
app.command("convergence")(convergence)
app.command("fidelity")(fidelity)
tune_cache_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                             help="Check a FORGE_TUNE_CACHE file against this tree's kernel, or re-key its tile "
                                  "choices to it (for old-vs-new A/Bs on the same tiles).")
app.add_typer(tune_cache_app, name="tune-cache")
out_console = Console()
err_console = Console(stderr=True)

EXIT_BAD_INPUT = 2
EXIT_CHECK_FAILED = 1


def flag(*names: str, help: str) -> Any:
    """A boolean option that is a flag: given or not, it takes no value (``--resume``, never
    ``--resume true``), and the help shows no ``<bool>`` type for it."""
    return typer.Option(*names, help=help, metavar="")


# what a user may write after a flag, taking it for an option with a value (`--resume true`)
BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}
SWEEP_FLAGS = "--resume, --retry-failed, --dry-run, --allow-mixed and --interleave"


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_BAD_INPUT)


def _user_errors() -> tuple[type[BaseException], ...]:
    from forge_bench.folder_lock import FolderLockError
    from forge_bench.lanes import LaneError
    from forge_bench.methods import PluginError
    from forge_bench.models import ModelError
    from forge_bench.results import ResultsError
    from forge_bench.runner import RunnerError
    from forge_bench.suite import SuiteError

    return SuiteError, RunnerError, PluginError, ResultsError, ModelError, LaneError, FolderLockError


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    try:
        if value != value:   # NaN
            return "-"
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


_STATUS_STYLE = {"ok": "green", "parity_fail": "red", "crashed": "red", "diverged": "red", "timeout": "red",
                 "oom": "yellow", "oom_predicted": "yellow", "unavailable": "dim"}


def _summary_table(outcomes, title: str) -> Table:
    table = Table(title=title, show_lines=False)
    for name, justify in (("cell", "left"), ("status", "left"), ("step ms", "right"), ("spread", "right"),
                          ("peak GiB", "right"), ("tok/s", "right"), ("note", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for o in outcomes:
        r = o.row
        style = _STATUS_STYLE.get(o.status, "")
        note = (r.get("reason") or "") if o.status != "ok" else ""
        if o.skipped:
            note = ("(from an earlier run) " + note).strip()
        table.add_row(o.cell.label, f"[{style}]{o.status}[/]" if style else o.status,
                      _fmt(r.get("step_ms_median")), _fmt(r.get("step_ms_spread_max"), ".1%"),
                      _fmt(r.get("peak_allocated_gib")), _fmt(r.get("tokens_per_s"), ",.0f"), note[:160])
    return table


def _selected_cells(loaded: Any, only: str | None) -> list[Any]:
    """The suite's cells that ``--only`` selects; a one-line refusal when it selects none."""
    cells = loaded.select(only)
    if not cells:
        raise _fail(f"--only {only!r} matches none of the {len(loaded.cells)} cells of {loaded.path} "
                    f"(labels look like {loaded.cells[0].label!r})")
    return cells


@app.command()
def sweep(
    suite: Annotated[Optional[Path], typer.Argument(help="suite YAML; default: the CPU smoke suite shipped in the package")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="results folder (default results/<suite name>)")] = None,
    resume: Annotated[bool, flag("--resume", help="run only the cells that have no readable row yet, under the same run id (a row file that does not read is moved aside to <file>.corrupt and its cell runs again)")] = False,
    retry_failed: Annotated[bool, flag("--retry-failed", help="as --resume, and also run again the cells whose row is crashed, timeout or oom, replacing those rows")] = False,
    only: Annotated[Optional[str], typer.Option("--only", help="comma-separated patterns on grid/model/bB/sS/method labels; a plain word matches a substring, e.g. 'headline' or '*/b1/s512/forge_*'")] = None,
    dry_run: Annotated[bool, flag("--dry-run", help="list the cells and what would happen, run nothing, write nothing")] = False,
    check: Annotated[Optional[Path], typer.Option("--check", help="baseline parquet (file or folder): exit 1 when a FORGE arm's median step time regresses by more than --tolerance vs its rows of the same device, model, shape and method")] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="allowed slow-down for --check, as a fraction", min=0.0)] = 0.10,
    eager_tolerance: Annotated[Optional[float], typer.Option("--eager-tolerance", help="allowed slow-down for --check of rows not timed as CUDA-graph replays (host-bound eager steps vary more between processes); default: --tolerance", min=0.0)] = None,
    allow_mixed: Annotated[bool, flag("--allow-mixed", help="allow a different suite's rows in the same --out")] = False,
    stop_after: Annotated[Optional[float], typer.Option("--stop-after", help="seconds: start no new cell after this long (a time-boxed GPU); finish later with --resume", min=0.0)] = None,
    tune_cache: Annotated[Optional[str], typer.Option("--tune-cache", help="file where the cells share the fused kernel's tile choices (default: OUT/tune_cache.json, or an exported FORGE_TUNE_CACHE); 'off': every cell tunes on its own")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads of each CPU cell (default: the suite's cpu_threads, 1); recorded in each row's torch_threads")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="run cells side by side on these GPUs, e.g. 0,1,2,3: each cell (its own process) gets world-size of them as CUDA_VISIBLE_DEVICES, in the suite's order; rows record extra.gpus and extra.cells_beside (default: one cell at a time)")] = None,
    interleave: Annotated[bool, flag("--interleave", help="the cells of one model and shape (grid, model, batch, seq, dtype, activations) stay resident together, each in its own process, and their timed repeats take turns on one GPU, so host drift falls on every arm alike; rows record extra.turns")] = False,
    cpus_per_cell: Annotated[int, typer.Option("--cpus-per-cell", min=0, help="CUDA cells run their timed windows on this many CPUs of their lane's own (the highest-numbered; disjoint per GPU with --gpus), so compared cells run on the same CPUs; rows record extra.cpus; 0: wherever the OS puts them")] = 2,
) -> None:
    """Run a suite: one process per cell, one parquet row per cell, a summary table at the end."""
    from forge_bench import lanes
    from forge_bench import results as results_mod
    from forge_bench import runner
    from forge_bench.suite import load_suite

    if suite is not None and suite.name.lower() in BOOLEAN_WORDS and not suite.exists():
        raise _fail(f"{suite}: no such suite file; {SWEEP_FLAGS} are flags and take no value "
                    f"(write --resume, not --resume {suite})")
    resume = resume or retry_failed
    try:
        gpu_list = lanes.parse_gpus(gpus) if gpus is not None else None
        loaded = load_suite(suite)
        runner.check_gpus(loaded, gpu_list)
        cells = _selected_cells(loaded, only)
        out_dir = out or Path("results") / loaded.name
        baseline = results_mod.load_results(check) if check is not None else None
        # the folder is this sweep's from its plan to its last row (a dry run writes nothing: no lock)
        lock = None if dry_run else folder_lock.acquire(out_dir)
    except _user_errors() as exc:
        raise _fail(str(exc)) from None
    try:
        _sweep_planned(loaded, cells, out_dir, baseline, resume=resume, retry_failed=retry_failed,
                       allow_mixed=allow_mixed, dry_run=dry_run, stop_after=stop_after, tune_cache=tune_cache,
                       threads=threads, gpu_list=gpu_list, tolerance=tolerance, eager_tolerance=eager_tolerance,
                       interleave=interleave, cpus_per_cell=cpus_per_cell)
    finally:
        if lock is not None:
            lock.release()


def _sweep_planned(loaded, cells, out_dir: Path, baseline, *, resume: bool, retry_failed: bool, allow_mixed: bool,
                   dry_run: bool, stop_after: Optional[float], tune_cache: Optional[str], threads: Optional[int],
                   gpu_list: Optional[list[str]], tolerance: float, eager_tolerance: Optional[float],
                   interleave: bool = False, cpus_per_cell: int = 0) -> None:
    """``sweep`` once its input is checked (and its folder locked): plan, run, summarise, check."""
    from forge_bench import lanes
    from forge_bench import results as results_mod
    from forge_bench import runner

    try:
        plan = runner.plan_run(out_dir, loaded, resume=resume, allow_mixed=allow_mixed, retry_failed=retry_failed)
        run_id, _manifest, done = plan
        unreadable = results_mod.scan_rows(out_dir).unreadable
    except _user_errors() as exc:
        raise _fail(str(exc)) from None

    todo = [c for c in cells if c.cell_id not in done]
    err_console.print(f"suite [bold]{loaded.name}[/] ({loaded.path}, hash {loaded.sha256}): {len(cells)} of "
                      f"{len(loaded.cells)} cells selected, {len(cells) - len(todo)} already done; "
                      f"out {out_dir}; run {run_id}", highlight=False)
    if cpus_per_cell and loaded.spec.device_type == "cuda":
        sets = lanes.cpu_sets(len(gpu_list) if gpu_list else 1, cpus_per_cell)
        err_console.print("timed windows on CPUs " + " | ".join(",".join(map(str, cpus)) for cpus in sets)
                          if sets else f"--cpus-per-cell {cpus_per_cell}: this host has too few CPUs for "
                          f"{cpus_per_cell} per lane and one over; timed windows run unpinned", highlight=False)
    if dry_run:
        for path, why in unreadable.items():
            err_console.print(f"{path}: {why}; a run moves it to {path.name}{results_mod.CORRUPT_SUFFIX} "
                              f"and runs its cell again", highlight=False, soft_wrap=True)
        _print_plan(loaded, cells, done, _median_wall_s(out_dir), interleave)
        return

    def on_set_aside(path: Path, moved: Path, why: str) -> None:
        err_console.print(f"[yellow]{path}[/]: {why}; moved to {moved.name}, its cell runs again",
                          highlight=False, soft_wrap=True)

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err_console,
                  transient=False) as progress:
        task = progress.add_task("starting", total=len(todo))

        def on_start(cell, index, total):
            progress.update(task, description=f"{cell.label}")

        def on_done(outcome):
            if not outcome.skipped:
                progress.advance(task)
                progress.console.print(f"  {outcome.cell.label}: {outcome.status}"
                                       + (f" {outcome.row.get('step_ms_median'):.2f} ms"
                                          if outcome.status == "ok" and outcome.row.get('step_ms_median') else ""),
                                       highlight=False)

        try:
            run_id, outcomes = runner.run_sweep(loaded, cells, out_dir, resume=resume, allow_mixed=allow_mixed,
                                                on_start=on_start, on_done=on_done, tick=progress.refresh,
                                                plan=plan, stop_after_s=stop_after,
                                                tune_cache=runner.default_tune_cache(out_dir, tune_cache),
                                                retry_failed=retry_failed, threads=threads, on_set_aside=on_set_aside,
                                                gpus=gpu_list, interleave=interleave, cpus_per_cell=cpus_per_cell)
        except _user_errors() as exc:
            raise _fail(str(exc)) from None
        progress.update(task, description="done")

    out_console.print(_summary_table(outcomes, f"{loaded.name}: run {run_id}"))
    left = len(cells) - len(outcomes)
    if left:
        err_console.print(f"stopped after --stop-after {stop_after:g} s: {left} cell(s) not started; "
                          f"run the same command with --resume to finish run {run_id}", highlight=False)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    out_console.print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())) + f"  rows in {out_dir}",
                      highlight=False)

    if baseline is not None:
        current = results_mod.load_results(out_dir)
        current = current[current["cell_id"].isin({c.cell_id for c in cells})]
        failures, notes = runner.check_against_baseline(current, baseline, tolerance, eager_tolerance=eager_tolerance)
        for line in notes:
            out_console.print(f"  check: {line}", highlight=False)
        for line in failures:
            err_console.print(f"[bold red]REGRESSION[/] {line}", highlight=False)
        if failures:
            raise typer.Exit(EXIT_CHECK_FAILED)
        eager = "" if eager_tolerance is None else f" ({eager_tolerance:.0%} for eager steps)"
        out_console.print(f"check passed: no FORGE arm slower than baseline by more than {tolerance:.0%}{eager}")


def _median_wall_s(out_dir: Path) -> Optional[tuple[float, int]]:
    """(median seconds, count) of the ok rows already in ``out_dir`` (None without any): what a cell
    of this folder took so far, for a dry run's estimate."""
    from forge_bench import results as results_mod

    try:
        frame = results_mod.load_results(out_dir) if Path(out_dir).is_dir() else None
    except _user_errors():
        return None
    if frame is None or frame.empty or "wall_s" not in frame:
        return None
    walls = frame.loc[frame["status"] == "ok", "wall_s"].dropna()
    return (float(walls.median()), len(walls)) if len(walls) else None


def _duration(seconds: float) -> str:
    """``45 s``, ``12.5 min``, ``3.2 h``, ``41.5 days``: a plan's time at a glance."""
    for limit, unit, size in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / size:.{0 if unit == 's' else 1}f} {unit}"
    return f"{seconds / 86400:.1f} days"


def _print_plan(loaded, cells, done, wall: Optional[tuple[float, int]] = None, interleave: bool = False) -> None:
    """One line per cell, with ``interleave`` one per group of cells to run that take turns (resident together),
    then the run settings, then the plan's size and time: how many cells run, the bound their timeouts put on
    the sweep, and the estimate from the folder's rows where it has some."""
    from forge_bench.methods import METHODS
    from forge_bench.runner import turn_groups

    # plain lines, one per cell (greppable, and the ids can be pasted into `forge-bench cell`)
    out_console.print(f"{loaded.name}: plan (dry run): label  cell_id  plan", highlight=False)
    to_run: list[Any] = []
    unavailable = 0
    for c in cells:
        reason = METHODS[c.method].unavailable_reason(loaded.spec.device, c.cuda_graph, c.world_size)
        plan = "done (kept)" if c.cell_id in done else (f"unavailable: {reason}" if reason else "run")
        if plan == "run":
            to_run.append(c)
        unavailable += plan.startswith("unavailable")
        out_console.print(f"{c.label}  {c.cell_id}  {plan}", highlight=False, soft_wrap=True)
    for group in (turn_groups(to_run) if interleave else []):
        if len(group) > 1:
            first = group[0]
            out_console.print(f"turns: {first.grid}/{first.model}/b{first.batch}/s{first.seq}: "
                              f"{', '.join(c.method for c in group)} (resident together, repeats alternating)",
                              highlight=False, soft_wrap=True)
    s = loaded.spec
    own_repeats = "".join(f" (grid {g.name}: {g.repeats})" for g in s.grids or [] if g.repeats is not None)
    out_console.print(f"device {s.device}, dtype {s.dtype}, warm-up {s.warmup_steps}, {s.repeats}{own_repeats} x "
                      f"{s.timed_steps} timed steps, parity {'on' if s.parity.enabled else 'off'} ({s.parity.steps} "
                      f"steps, tolerance {s.parity.tolerance}), timeout {s.timeout_s:g} s per cell", highlight=False)
    kept = sum(c.cell_id in done for c in cells)
    bound = sum(c.timeout_s for c in to_run)
    estimate = (f"; at the median {wall[0]:.0f} s of the {wall[1]:,} ok cells in the folder, about "
                f"{_duration(wall[0] * len(to_run))}" if wall and to_run else "")
    out_console.print(f"plan: {len(cells):,} cells, {len(to_run):,} to run, {kept:,} kept, {unavailable:,} unavailable; "
                      f"at most {_duration(bound)} one after the other (each cell's timeout){estimate}",
                      highlight=False, soft_wrap=True)


@app.command()
def cell(
    suite: Annotated[Path, typer.Option("--suite", help="suite YAML")],
    cell_id: Annotated[str, typer.Option("--cell-id", help="the cell's id (see sweep --dry-run)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="results folder")],
    run_id: Annotated[str, typer.Option("--run-id", help="run id to record")] = "manual",
    attempt: Annotated[int, typer.Option("--attempt", help="attempt number (OOM retry)")] = 1,
    threads: Annotated[Optional[int], typer.Option("--threads", min=1, help="torch threads on a CPU device (default: the suite's cpu_threads, 1)")] = None,
) -> None:
    """(internal) Run ONE cell in this process and write its row, as the sweep's per-cell process does."""
    from forge_bench.cell import run_cell_process
    from forge_bench.suite import load_suite

    try:
        loaded = load_suite(suite)
        target = loaded.cell(cell_id)
        lock = folder_lock.acquire(out)
    except _user_errors() as exc:
        raise _fail(str(exc)) from None
    try:
        code = run_cell_process(loaded, target, out, run_id, attempt, threads)
    finally:
        lock.release()
    raise typer.Exit(code)


@app.command("list")
def list_(
    device: Annotated[Optional[str], typer.Option("--device", help="cpu or cuda (default: cuda when visible)")] = None,
) -> None:
    """List the models and methods, and why any method cannot run on this machine."""
    import torch

    from forge_bench import methods as methods_mod
    from forge_bench import models as models_mod

    try:
        methods_mod.load_plugins()
    except _user_errors() as exc:
        raise _fail(str(exc)) from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    models_table = Table(title="models (forge_bench/configs)")
    for col in ("name", "params", "layers", "max seq", "mirrors", "about"):
        models_table.add_column(col, overflow="fold")
    for spec in models_mod.MODEL_ZOO.values():
        models_table.add_row(spec.name, f"{models_mod.param_count(spec.name) / 1e9:.3f} B",
                             str(models_mod.num_layers(spec.name)), str(models_mod.max_seq_len(spec.name)),
                             spec.source, spec.description)
    out_console.print(models_table)
    methods_table = Table(title=f"methods (on {device})")
    for col in ("name", "family", "parity ref", "cuda graph", "available", "about"):
        methods_table.add_column(col, overflow="fold")
    for m in methods_mod.METHODS.values():
        reason = m.unavailable_reason(device)
        methods_table.add_row(m.name, m.family, m.parity_reference or "-", "yes" if m.graphable else "no",
                              "[green]yes[/]" if reason is None else f"[red]no[/]: {reason}", m.description)
    out_console.print(methods_table)


@app.command()
def env() -> None:
    """Show the device, library versions, source identity and an NVML snapshot."""
    import torch

    from forge_bench import telemetry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {**telemetry.environment(device), "driver_version": telemetry.driver_version()}
    table = Table(title="environment")
    table.add_column("what")
    table.add_column("value", overflow="fold")
    for key, value in info.items():
        table.add_row(key, str(value))
    if device == "cuda":
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            table.add_row(f"cuda:{i} memory", f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB")
    snap = telemetry.nvml_snapshot(0)
    for key, value in snap.items():
        table.add_row(f"nvml {key}", "-" if value is None else str(value))
    out_console.print(table)


@app.command()
def report(
    results_dirs: Annotated[list[Path], typer.Argument(
        help="results folders (or parquet files) of one or more sweeps; several folders (e.g. one run per GPU) "
             "make one report with the hardware comparison", metavar="RESULTS...")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="report folder (default reports/<first results folder name>)")] = None,
    formats: Annotated[str, typer.Option("--formats", help="comma-separated figure file types: png,pdf (default both; "
                                         "png alone skips the PDF twins, a faster draft)")] = "png,pdf",
) -> None:
    """Build tables (Markdown + LaTeX) and figures from sweep results."""
    for results_dir in results_dirs:
        if not results_dir.exists():
            raise _fail(f"{results_dir}: no such results folder or file")
    try:
        from forge_bench import report as report_mod
        build_report = report_mod.build_report
    except (ImportError, AttributeError) as exc:
        raise _fail(f"the report builder is not available in this checkout ({exc})") from None
    try:
        figure_formats = report_mod.figures.check_formats([f.strip().lower() for f in formats.split(",") if f.strip()])
    except ValueError as exc:
        raise _fail(f"--formats {formats!r}: {exc}") from None
    out_dir = out or Path("reports") / results_dirs[0].resolve().name
    no_results = getattr(report_mod, "NoResultsError", None)
    try:
        written = build_report(results_dirs, out_dir, formats=figure_formats)
    except _user_errors() + ((no_results,) if isinstance(no_results, type) else ()) as exc:
        raise _fail(str(exc)) from None
    out_console.print(f"report written to {out_dir}" + (f": {written}" if isinstance(written, (str, Path)) else ""),
                      highlight=False)


@app.command()
def pack(
    folders: Annotated[list[Path], typer.Argument(help="finished results folders; every folder under each "
                                                  "whose parquet files are result rows is packed", metavar="FOLDER...")],
) -> None:
    """Move a finished folder's row files into one rows.parquet (the same rows, a fraction of the
    bytes); a sweep or convergence study then refuses to add to it. For committed results."""
    from forge_bench.pack import pack_tree
    from forge_bench.results import ResultsError

    for folder in folders:
        try:
            done = pack_tree(folder)
        except ResultsError as exc:
            raise _fail(str(exc)) from None
        for packed in done:
            out_console.print(f"{packed.path}: {packed.rows} rows from {packed.files} files, {packed.bytes_before:,} -> "
                              f"{packed.bytes_after:,} bytes", highlight=False, soft_wrap=True)
        if not done:
            out_console.print(f"{folder}: nothing to pack", highlight=False, soft_wrap=True)


def _csv_list(value: Optional[str]) -> list[str] | None:
    return None if value is None else [item.strip() for item in value.split(",") if item.strip()]


@app.command()
def capability(
    family: Annotated[str, typer.Option("--family", help="comma-separated zoo families whose sized models are "
                                        "compared (qwen3: 0.6b ... 32b; llama: 3.2-1b, 3.2-3b, 3.1-8b)")] = "qwen3,llama",
    models: Annotated[Optional[str], typer.Option("--models", help="comma-separated zoo models instead of the "
                                                  "families' (one group)")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="comma-separated GPUs (default: A100-40, A100-80, "
                                                "H100, H200, B200, B300)")] = None,
    arms: Annotated[Optional[str], typer.Option("--arms", help="comma-separated arms (default: adamw_foreach, "
                                                "adamw_fused, forge_bf16, forge_int8, forge_fp8, no_optimizer)")] = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="sequences per step")] = 1,
    seq: Annotated[int, typer.Option("--seq", min=1, help="tokens per sequence")] = 512,
    dtype: Annotated[str, typer.Option("--dtype", help="weight dtype")] = "bfloat16",
    activations: Annotated[str, typer.Option("--activations", help="hf | lean (forge_core.lean_activations)")] = "hf",
    checkpointing: Annotated[bool, flag("--checkpointing", help="activation checkpointing of every decoder layer")] = False,
    usable_fraction: Annotated[Optional[float], typer.Option("--usable-fraction", help="share of the nominal HBM a "
                                                             "step may take (default: capability.USABLE_FRACTION, 0.95)")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="also write the table: .csv or .parquet")] = None,
) -> None:
    """The largest model of a family each arm can train per GPU, from the analytic memory model (paper App. O)."""
    from forge_bench import capability as cap

    if out is not None and out.suffix not in (".csv", ".parquet"):
        raise _fail(f"--out {out}: the file must end in .csv or .parquet")
    try:
        found = cap.boundaries(gpus=_csv_list(gpus) or tuple(cap.GPUS), arms=_csv_list(arms) or cap.CAPABILITY_ARMS,
                               families=_csv_list(family) or cap.DEFAULT_FAMILIES, models=_csv_list(models),
                               batch=batch, seq=seq, dtype=dtype, activations=activations, checkpointed=checkpointing,
                               usable_fraction=cap.USABLE_FRACTION if usable_fraction is None else usable_fraction)
    except (cap.CapabilityError,) + _user_errors() as exc:
        raise _fail(str(exc)) from None
    if not found:
        raise _fail("nothing to compute: give at least one GPU, arm and family")
    first = found[0]
    setting = (f"batch {batch} x seq {seq}, {dtype}, {activations} activations" + (", checkpointed" if checkpointing else "")
               + f"; usable: {first.usable_gib / first.hbm_gib:.0%} of the nominal HBM")
    for family_name in dict.fromkeys(b.family for b in found):
        table = Table(title=f"Largest {family_name} model each arm trains ({setting})", box=box.SIMPLE_HEAD,
                      caption="fits / does not: the largest model predicted to fit and the next one (predicted GiB); "
                              "B params: weights, states and gradients alone filling the usable memory")
        for name, justify in (("GPU", "left"), ("arm", "left"), ("fits", "left"), ("does not", "left"),
                              ("B params", "right")):
            table.add_column(name, justify=justify, no_wrap=True)
        for b in (b for b in found if b.family == family_name):
            table.add_row(f"{b.gpu} {b.hbm_gib:g}", b.method,
                          "none" if b.largest_fit is None else f"{b.largest_fit} ({cap.fmt_gib(b.largest_fit_gib)})",
                          "—" if b.first_miss is None else f"{b.first_miss} ({cap.fmt_gib(b.first_miss_gib)})",
                          f"{b.params_bound_b:.1f}")
        out_console.print(table)
    if out is not None:
        import pandas as pd

        frame = pd.DataFrame([b.as_record() for b in found])
        out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(out, index=False) if out.suffix == ".csv" else frame.to_parquet(out, index=False)
        out_console.print(f"written to {out}", highlight=False)


@app.command()
def kernel(
    out: Annotated[Path, typer.Option("--out", "-o", help="results folder for the kernel benchmark")] = Path("results/kernel"),
    quick: Annotated[bool, flag("--quick", help="a few shapes and token counts only (CI)")] = False,
    shapes: Annotated[Optional[str], typer.Option("--shapes", help="comma-separated Llama-3.1-8B Linear names (q,k,v,o,gate,up,down,lm_head)")] = None,
    bts: Annotated[Optional[str], typer.Option("--bts", help="comma-separated token counts (batch x seq), e.g. 512,2048,8192")] = None,
    state_dtypes: Annotated[Optional[str], typer.Option("--state-dtypes", help="comma-separated: fp32,bf16,int8,fp8")] = None,
) -> None:
    """Time the fused wgrad+update kernel per Llama-3.1-8B Linear shape (needs a GPU).

    Against cuBLAS dY^T X + torch fused AdamW and against its roofline; writes parquet + a figure
    under --out."""
    from forge_bench.profile import kernel as kernel_bench

    split = lambda text: [x.strip() for x in text.split(",") if x.strip()] if text else None
    try:
        bt_list = [int(x) for x in split(bts)] if bts else None
    except ValueError:
        raise _fail(f"--bts expects comma-separated integers, got {bts!r}") from None
    try:
        lock = folder_lock.acquire(out)
    except folder_lock.FolderLockError as exc:
        raise _fail(str(exc)) from None
    try:
        frame = kernel_bench.run(out, shapes=split(shapes), bts=bt_list, state_dtypes=split(state_dtypes), quick=quick)
    except (RuntimeError, ValueError) as exc:
        if "\n" in str(exc) or not str(exc):
            raise
        raise _fail(str(exc)) from None
    finally:
        lock.release()
    if frame is not None and len(frame):
        table = Table(title=f"kernel benchmark -> {out}")
        cols = list(frame.columns)[:10]
        for c in cols:
            table.add_column(str(c), overflow="fold")
        for _, row in frame.head(60).iterrows():
            table.add_row(*[_fmt(row[c], ".3g") if isinstance(row[c], float) else str(row[c]) for c in cols])
        out_console.print(table)


@tune_cache_app.command("check")
def tune_cache_check(
    file: Annotated[Path, typer.Argument(help="a FORGE_TUNE_CACHE JSON file")],
) -> None:
    """Print how many entries this tree's kernel accepts; exit 1 when any entry would tune again."""
    from forge_bench import tune_cache

    try:
        current, total = tune_cache.check(file)
    except tune_cache.TuneCacheError as exc:
        raise _fail(str(exc)) from None
    out_console.print(f"{current} of {total} entries match this tree's kernel ({file})", highlight=False)
    if current < total:
        raise typer.Exit(EXIT_CHECK_FAILED)


@tune_cache_app.command("rekey")
def tune_cache_rekey(
    source: Annotated[Path, typer.Argument(help="the tune cache to read")],
    target: Annotated[Path, typer.Argument(help="the file to write (the same choices under this tree's fingerprints)")],
) -> None:
    """Write SOURCE's tile choices under this tree's kernel fingerprints to TARGET."""
    from forge_bench import tune_cache

    try:
        written, changed = tune_cache.rekey(source, target)
    except tune_cache.TuneCacheError as exc:
        raise _fail(str(exc)) from None
    out_console.print(f"{written - changed} of {written} entries match this tree's kernel as they are; "
                      f"wrote {written} entries to {target}", highlight=False)


@tune_cache_app.command("ship")
def tune_cache_ship(
    sources: Annotated[list[Path], typer.Argument(help="tune caches whose choices ship with the package")],
) -> None:
    """Add SOURCES' choices (re-keyed to this tree) to the package's per-GPU-model files, which a
    first step reads after FORGE_TUNE_CACHE."""
    from forge_bench import tune_cache

    try:
        written = tune_cache.ship(sources)
    except tune_cache.TuneCacheError as exc:
        raise _fail(str(exc)) from None
    for target, (added, total) in sorted(written.items()):
        out_console.print(f"{target}: {added} entries added or replaced, {total} in the file", highlight=False)


@tune_cache_app.command("warm")
def tune_cache_warm(
    suite: Annotated[Path, typer.Argument(help="suite YAML whose FORGE cells' weight shapes are tuned")],
    out: Annotated[Path, typer.Option("--out", "-o", help="the tune cache to write (new choices are added to it)")],
    only: Annotated[Optional[str], typer.Option("--only", help="comma-separated patterns on the cells' labels, as for sweep")] = None,
) -> None:
    """Tune the fused kernel for every weight shape of the suite's FORGE cells (their reduced-depth
    twins, in this process), measuring nothing; `ship` then adds OUT to the package."""
    from forge_bench import warm as warm_mod
    from forge_bench.suite import load_suite

    try:
        loaded = load_suite(suite)
        cells = _selected_cells(loaded, only)
        warm_mod.cache_entries(out)
    except (*_user_errors(), warm_mod.WarmError) as exc:
        raise _fail(str(exc)) from None
    if not loaded.spec.device.startswith("cuda"):
        err_console.print(f"{loaded.spec.device}: the kernels run one fixed tile off the GPU, so nothing is tuned",
                          highlight=False)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=False) as progress:
        task = progress.add_task("warming", total=len(cells))

        def on_done(outcome: "warm_mod.WarmOutcome") -> None:
            progress.advance(task)
            detail = f"{outcome.added} new choices" if outcome.status == "warmed" else outcome.reason
            progress.console.print(f"  {outcome.cell.label}: {outcome.status} ({detail})", highlight=False)

        try:
            outcomes = warm_mod.warm(loaded, cells, out, on_done=on_done)
        except warm_mod.WarmError as exc:
            raise _fail(str(exc)) from None
    counts = {s: sum(o.status == s for o in outcomes) for s in ("warmed", "skipped", "failed")}
    out_console.print(f"{counts['warmed']} cells warmed, {counts['skipped']} skipped, {counts['failed']} failed; "
                      f"{sum(o.added for o in outcomes)} choices added to {out}", highlight=False)
    if counts["failed"]:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
