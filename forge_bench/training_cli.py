"""``forge-bench convergence`` and ``forge-bench fidelity``: training-quality evidence, as Typer commands.

The work lives in ``forge_bench.convergence`` and ``forge_bench.fidelity``; they load torch and
the model zoo only when a command runs, so ``forge-bench --help`` stays quick.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from forge_bench import folder_lock

EXIT_BAD_INPUT = 2


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _fail(console: Console, message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_BAD_INPUT)


def convergence(
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for the rows and checkpoints "
                                                          "(results/<gpu>/convergence_<commit>); a re-run continues there")],
    arms: Annotated[str, typer.Option("--arms", help="comma-separated registry arms")] =
        "adamw_fused,adamw_fused_fp32_states,forge_bf16,forge_int8,forge_fp8,bnb_adamw8bit,forge_bf16_compile",
    seeds: Annotated[str, typer.Option("--seeds", help="comma-separated seeds (initial weights and batch order)")] = "0,1,2",
    steps: Annotated[int, typer.Option("--steps", min=1, help="optimizer steps per run")] = 4000,
    batch: Annotated[int, typer.Option("--batch", min=1, help="sequences per step")] = 16,
    seq: Annotated[int, typer.Option("--seq", min=2, help="bytes per sequence")] = 512,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="peak learning rate")] = 6e-4,
    warmup: Annotated[Optional[int], typer.Option("--warmup", min=0, help="linear warm-up steps (default: 40, "
                                                  "or a tenth of a run shorter than 400 steps)")] = None,
    min_lr_ratio: Annotated[float, typer.Option("--min-lr-ratio", help="cosine decay's end, as a fraction of --lr")] = 0.1,
    weight_decay: Annotated[float, typer.Option("--weight-decay", min=0.0)] = 0.1,
    eval_every: Annotated[int, typer.Option("--eval-every", min=1, help="steps between validation losses")] = 100,
    eval_batches: Annotated[int, typer.Option("--eval-batches", min=1, help="validation batches per evaluation")] = 8,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", min=1, help="steps between checkpoints")] = 250,
    model: Annotated[str, typer.Option("--model", help="model zoo causal LM (its vocabulary becomes the 256 bytes)")] = "gpt2",
    corpus_max_bytes: Annotated[Optional[int], typer.Option("--corpus-max-bytes", min=1,
                                                            help="read at most this many corpus bytes (tests)")] = None,
    device: Annotated[str, typer.Option("--device", help="cuda or cpu (default: cuda where there is one)")] = "",
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="run the runs side by side on these GPUs, e.g. "
                                                "0,1,2,3: one process per run and GPU, its output in "
                                                "OUT/logs/ (default: one after the other in this process)")] = None,
    repeat_into: Annotated[Optional[Path], typer.Option("--repeat-into", help="run every arm x seed a second "
                                                        "time into this folder, beside the first: the report "
                                                        "reads how far the two ended apart as the run-to-run "
                                                        "floor of a delta")] = None,
) -> None:
    """GPT-2 from scratch on the Python standard library's sources (bytes), every arm x seed from the
    same initial weights and batches: one parquet row per run with its loss curves. Resumes (both
    folders, with --repeat-into)."""
    from forge_bench import convergence_lanes, lanes

    parent = os.environ.get(convergence_lanes.PARENT_PID)
    if parent:                                              # a run of a study started with --gpus
        lanes.die_with_parent(int(parent))
    import torch

    from forge_bench import convergence as conv

    console = Console(stderr=True)
    where = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        seed_list = [int(s) for s in _names(seeds)]
    except ValueError:
        raise _fail(console, f"--seeds {seeds!r} is not a comma-separated list of integers") from None
    arm_list = _names(arms)
    if not arm_list or not seed_list:
        raise _fail(console, "--arms and --seeds need at least one entry each")
    spec = conv.ConvergenceSpec(model=model, steps=steps, batch=batch, seq=seq, lr=lr, min_lr_ratio=min_lr_ratio,
                                warmup=conv.default_warmup(steps) if warmup is None else warmup,
                                weight_decay=weight_decay, eval_every=eval_every, eval_batches=eval_batches,
                                checkpoint_every=checkpoint_every, corpus_max_bytes=corpus_max_bytes)
    folders = [out] + ([repeat_into] if repeat_into is not None else [])
    locks: list[folder_lock.FolderLock] = []
    try:
        for folder in {folder.resolve(): folder for folder in folders}.values():     # a folder named twice: once
            # the folders are this study's; a run started by `--gpus` writes under its study's locks
            if not (parent and folder_lock.held_by(folder, int(parent))):
                locks.append(folder_lock.acquire(folder))
        _study(console, folders, spec, arm_list, seed_list, where, gpus, device)
    except folder_lock.FolderLockError as error:
        raise _fail(console, str(error)) from None
    finally:
        for lock in locks:
            lock.release()


def _study(console: Console, folders: list[Path], spec, arm_list: list[str], seed_list: list[int], where: str,
           gpus: Optional[str], device: str) -> None:
    """``convergence`` once its folders are held: plan the unfinished runs, run them here or side by side."""
    from forge_bench import convergence as conv
    from forge_bench import convergence_lanes, lanes
    from forge_bench.methods import PluginError

    steps, model, batch, seq = spec.steps, spec.model, spec.batch, spec.seq
    out, repeat_into = folders[0], (folders[1] if len(folders) > 1 else None)
    try:
        todo = conv.plan_study(folders, spec, arm_list, seed_list)
    except (conv.ConvergenceError, KeyError, PluginError, ValueError) as error:
        raise _fail(console, str(error).strip("'\"")) from None
    total = len(arm_list) * len(seed_list) * len(folders)
    console.print(f"convergence: {model}, {steps} steps of {batch} x {seq} bytes, arms {', '.join(arm_list)}, "
                  f"seeds {', '.join(map(str, seed_list))} on {where}: {total - len(todo)} of {total} runs done; "
                  f"out {' and '.join(map(str, folders))}; spec {spec.spec_hash}", highlight=False)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=console, transient=False)

    def label(folder: Path, arm: str, seed: int) -> str:
        return f"{arm} seed {seed}" + (" (repeat)" if len(folders) > 1 and folder == repeat_into else "")

    def on_run(folder: Path, arm: str, seed: int, done: int):
        task = progress.add_task(label(folder, arm, seed), total=steps, completed=done, loss="-")

        def on_step(step: int, loss: float | None) -> None:
            fields = {"loss": f"{loss:.3f}"} if loss is not None else {}
            progress.update(task, completed=step, **fields)
        return on_step

    if gpus is None:
        with progress:
            rows = conv.run_all(out, spec, arm_list, seed_list, where, on_run, repeat_into=repeat_into)
        Console().print(_runs_table(folders, [(run.folder, row) for run, row in zip(todo, rows)]))
        return
    try:
        gpu_list = lanes.parse_gpus(gpus)
    except lanes.LaneError as error:
        raise _fail(console, str(error)) from None
    options = ["--steps", str(steps), "--batch", str(batch), "--seq", str(seq), "--lr", repr(spec.lr),
               "--warmup", str(spec.warmup), "--min-lr-ratio", repr(spec.min_lr_ratio), "--weight-decay",
               repr(spec.weight_decay), "--eval-every", str(spec.eval_every), "--eval-batches", str(spec.eval_batches),
               "--checkpoint-every", str(spec.checkpoint_every), "--model", model,
               *(["--corpus-max-bytes", str(spec.corpus_max_bytes)] if spec.corpus_max_bytes is not None else []),
               *(["--device", device] if device else [])]
    tasks = {(run.folder, run.arm, run.seed): progress.add_task(label(run.folder, run.arm, run.seed), total=steps,
                                                                completed=run.done, loss="-") for run in todo}

    finished_tasks: set[tuple[Path, str, int]] = set()

    def read_back() -> None:        # a run's row is rewritten at each checkpoint (atomically); a finished one no more
        for (folder, arm, seed), task in tasks.items():
            if (folder, arm, seed) in finished_tasks:
                continue
            try:
                row = conv.read_row(conv.row_path(folder, arm, seed))
            except (OSError, ValueError):           # a row file that is not (yet) readable: next poll
                row = None
            if row is not None:
                if row.get("completed"):
                    finished_tasks.add((folder, arm, seed))
                loss = row["val_loss"][-1] if row.get("val_loss") else None
                progress.update(task, completed=int(row["steps_done"]), **({"loss": f"{loss:.3f}"} if loss else {}))

    with progress:
        finished = convergence_lanes.run_side_by_side([(run.folder, run.arm, run.seed) for run in todo], options,
                                                      gpu_list, read_back)
    rows = [(run.out, conv.read_row(conv.row_path(run.out, run.arm, run.seed))) for run in finished]
    Console().print(_runs_table(folders, [(folder, row) for folder, row in rows if row]))
    failed = [run for run in finished if run.returncode != 0]
    for run in failed:
        console.print(f"[bold red]failed:[/] {convergence_lanes.failure_line(run)}", highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(1)


def _runs_table(folders: list[Path], rows: list[tuple[Path, dict]]) -> Table:
    """The runs this command finished, one line each, with their folder when a repeat runs beside."""
    table = Table(title=f"convergence runs finished here ({' and '.join(map(str, folders))})")
    columns = (["folder"] if len(folders) > 1 else []) + ["arm", "seed", "status", "final val loss",
                                                          "smoothed train loss", "tokens/s"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("folder", "arm", "status") else "right")
    for folder, row in rows:
        number = lambda v, spec=".4f": "-" if v is None else format(v, spec)  # noqa: E731
        status = row["status"] if not row["reason"] else f"{row['status']}: {row['reason'][:80]}"
        table.add_row(*([folder.name] if len(folders) > 1 else []), row["arm"], str(row["seed"]), status,
                      number(row["final_val_loss"]), number(row["final_train_loss_smoothed"]),
                      number(row["tokens_per_s"], ",.0f"))
    return table


def fidelity(
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for the rows (results/<gpu>/fidelity_<commit>)")],
    vocab: Annotated[int, typer.Option("--vocab", min=1, help="V: rows of the head")] = 1024,
    hidden: Annotated[int, typer.Option("--hidden", min=1, help="H: its input width")] = 4096,
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="BT: tokens per step")] = 2048,
    steps: Annotated[int, typer.Option("--steps", min=1, help="AdamW steps")] = 20,
    lr: Annotated[str, typer.Option("--lr", help="comma-separated learning rates; one file per rate")] = "1e-3,1e-4",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    arms: Annotated[Optional[str], typer.Option("--arms", help="comma-separated arms (default: every one this tree has)")] = None,
    device: Annotated[str, typer.Option("--device", help="cuda or cpu (default: cuda where there is one)")] = "",
) -> None:
    """Paper App. E: a V x H head trained STEPS AdamW steps by each bf16 path against fp32: rms-rel and
    max |dW| per arm (the standard bf16 AdamW path, FORGE with each moment format), one file per rate."""
    import torch

    console = Console(stderr=True)
    where = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        rates = [float(v) for v in _names(lr)]
    except ValueError:
        raise _fail(console, f"--lr {lr!r} is not a comma-separated list of numbers") from None
    if not rates or any(rate <= 0 for rate in rates):
        raise _fail(console, f"--lr {lr!r}: give one or more positive learning rates")
    chosen = _names(arms) if arms else None
    try:
        lock = folder_lock.acquire(out)
    except folder_lock.FolderLockError as error:
        raise _fail(console, str(error)) from None
    try:
        _fidelity_files(console, out, vocab, hidden, tokens, steps, rates, seed, chosen, where)
    finally:
        lock.release()


def _fidelity_files(console: Console, out: Path, vocab: int, hidden: int, tokens: int, steps: int, rates: list[float],
                    seed: int, chosen: Optional[list[str]], where: str) -> None:
    """``fidelity`` once its folder is held: one file of rows per learning rate, and the table."""
    from forge_bench import fidelity as fid
    from forge_bench.run_rows import write_rows

    table = Table(title=f"fidelity: {vocab} x {hidden} head, {tokens} tokens, {steps} steps, on {where}")
    for column in ("lr", "arm", "rms-rel", "max |dW|", "rms-rel of the update"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for rate in rates:
        try:
            rows = fid.measure(vocab, hidden, tokens, steps=steps, lr=rate, seed=seed, device=where, arm_names=chosen,
                               on_arm=lambda name: console.print(f"lr {rate:g}: {name}", highlight=False))
        except ValueError as error:
            raise _fail(console, str(error)) from None
        path = write_rows(out / fid.file_name(vocab, hidden, tokens, rate), rows, fid.SCHEMA)
        console.print(f"wrote {path}", highlight=False)
        for row in rows:
            table.add_row(f"{rate:g}", row["arm"], f"{row['rms_rel']:.4e}", f"{row['max_abs_dw']:.3e}",
                          f"{row['rms_rel_update']:.4e}")
    Console().print(table)


__all__ = ["convergence", "fidelity"]
