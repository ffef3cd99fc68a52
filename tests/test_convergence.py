"""forge-bench convergence on a tiny GPT-2 and a slice of the standard library: rows, curves, resume."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import forge_core.backends
from forge_bench import convergence as conv
from forge_bench.cli import app
from forge_bench.corpus import build_corpus, is_validation_file, train_batch

SPEC = conv.ConvergenceSpec(model="tiny-gpt2", steps=4, batch=2, seq=32, warmup=1, eval_every=2, eval_batches=2,
                            checkpoint_every=2, corpus_max_bytes=2_000_000, dtype="float32")
ARMS = ["adamw_foreach", "forge_bf16"]


class Stop(Exception):
    """Stands in for a kill in the middle of a run."""


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch) -> None:
    """FORGE arms on the torch reference backend: what is under test here is the command (rows,
    checkpoints, resume); the kernel's equality with it is tests/test_kernels.py's, and the CPU
    interpreter would take minutes for these steps."""
    monkeypatch.setattr(forge_core.backends, "interpreting", lambda: False)


def test_corpus_is_the_standard_library_split_by_file_hash() -> None:
    corpus = build_corpus(max_bytes=2_000_000)
    assert corpus.train_files > corpus.val_files > 0 and corpus.vocab_size == 256
    assert int(corpus.train.max()) < 256 and corpus.train.numel() > 1_000_000
    assert is_validation_file("json/decoder.py") == is_validation_file("json/decoder.py")
    first, again = train_batch(corpus, 2, 16, 0, 5), train_batch(corpus, 2, 16, 0, 5)
    assert (first["input_ids"] == again["input_ids"]).all()
    assert not (train_batch(corpus, 2, 16, 1, 5)["input_ids"] == first["input_ids"]).all()


def test_runs_write_one_row_each_and_a_killed_run_resumes_to_the_same_curve(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    rows = conv.run_all(whole, SPEC, ARMS, [0], "cpu")
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["completed"] for r in rows)
    for row in rows:
        assert len(row["train_loss"]) == 4 and row["val_step"] == [2, 4] and math.isfinite(row["final_val_loss"])
    assert rows[1]["n_fused_params"] > 0 and rows[0]["n_fused_params"] == 0
    assert not any((whole / "checkpoints").glob("*.pt"))

    def stop_after_step_3(folder: Path, arm: str, seed: int, done: int):
        def on_step(step: int, loss):
            if step == 3:
                raise Stop
        return on_step

    with pytest.raises(Stop):
        conv.run_all(killed, SPEC, ["forge_bf16"], [0], "cpu", stop_after_step_3)
    partial = conv.read_row(conv.row_path(killed, "forge_bf16", 0))
    assert partial["completed"] is False and partial["steps_done"] == 2      # the checkpoint's row
    assert conv.checkpoint_path(killed, "forge_bf16", 0).exists()
    assert conv.plan(killed, SPEC, ["forge_bf16"], [0]) == [("forge_bf16", 0, 2)]
    conv.run_all(killed, SPEC, ["forge_bf16"], [0], "cpu")
    assert conv.plan(killed, SPEC, ["forge_bf16"], [0]) == []
    resumed = conv.read_row(conv.row_path(killed, "forge_bf16", 0))
    uninterrupted = conv.read_row(conv.row_path(whole, "forge_bf16", 0))
    for column in ("train_loss", "val_loss"):
        assert resumed[column] == pytest.approx(uninterrupted[column], rel=1e-5, abs=1e-6), column
    table = pq.read_table(conv.row_path(killed, "forge_bf16", 0))
    assert table.schema.equals(conv.SCHEMA)


def test_cli_runs_and_refuses_a_folder_of_other_settings(tmp_path: Path) -> None:
    runner = CliRunner()
    common = ["convergence", "--out", str(tmp_path), "--model", "tiny-gpt2", "--arms", "forge_int8,adamw_fused",
              "--seeds", "0", "--batch", "2", "--seq", "16", "--warmup", "1", "--eval-every", "2", "--eval-batches",
              "1", "--corpus-max-bytes", "2000000", "--device", "cpu"]
    result = runner.invoke(app, common + ["--steps", "2"])
    assert result.exit_code == 0, result.output
    assert conv.read_row(conv.row_path(tmp_path, "adamw_fused", 0))["status"] == "unavailable"   # needs CUDA
    assert conv.read_row(conv.row_path(tmp_path, "forge_int8", 0))["completed"]
    result = runner.invoke(app, common + ["--steps", "3"])
    assert result.exit_code == 2 and "other settings" in result.output
    result = runner.invoke(app, common + ["--steps", "2", "--arms", "no_such_arm"])
    assert result.exit_code == 2 and "unknown method" in result.output


def test_a_short_study_warms_up_for_a_tenth_of_its_steps_unless_told(tmp_path: Path) -> None:
    """`--steps 20` with the default warm-up runs (2 warm-up steps) instead of refusing its own
    default of 40; a run of 400 steps or more keeps 40; a warm-up given is kept as given."""
    common = ["convergence", "--model", "tiny-gpt2", "--arms", "adamw_fused", "--seeds", "0", "--batch", "2", "--seq",
              "16", "--steps", "20", "--corpus-max-bytes", "2000000", "--device", "cpu"]
    result = CliRunner().invoke(app, common + ["--out", str(tmp_path / "short")])
    assert result.exit_code == 0, result.output
    assert conv.read_row(conv.row_path(tmp_path / "short", "adamw_fused", 0))["warmup"] == 2
    assert [conv.default_warmup(n) for n in (1, 20, 399, 400, 4000)] == [0, 2, 39, 40, 40]
    result = CliRunner().invoke(app, common + ["--out", str(tmp_path / "given"), "--warmup", "40"])
    assert result.exit_code == 2 and "warmup must be in [0, steps), got 40 for 20 steps" in result.output


def test_runs_side_by_side_on_gpus_match_the_runs_in_one_process(tmp_path: Path, monkeypatch) -> None:
    """``--gpus a,b``: each run in a process of its own with one GPU (its log says which), the same
    rows as the runs one after the other in this process; a bad --gpus is a one-line error."""
    from forge_bench import lanes

    monkeypatch.setenv(lanes.LOCK_DIR, str(tmp_path / "locks"))
    runner = CliRunner()
    common = ["--model", "tiny-gpt2", "--arms", "adamw_foreach", "--seeds", "0,1", "--batch", "2", "--seq", "16",
              "--steps", "3", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "2",
              "--corpus-max-bytes", "2000000", "--device", "cpu"]
    beside, alone = tmp_path / "beside", tmp_path / "alone"
    result = runner.invoke(app, ["convergence", "--out", str(beside), "--gpus", "a,b", *common])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["convergence", "--out", str(alone), *common])
    assert result.exit_code == 0, result.output
    logs = {seed: (beside / "logs" / f"adamw_foreach_seed{seed}.log").read_text() for seed in (0, 1)}
    assert {log.splitlines()[0].split(",")[0] for log in logs.values()} == {"# GPU a", "# GPU b"}
    for seed in (0, 1):
        side, one = (conv.read_row(conv.row_path(folder, "adamw_foreach", seed)) for folder in (beside, alone))
        assert side["completed"] and side["status"] == "ok"
        assert side["train_loss"] == one["train_loss"] and side["val_loss"] == one["val_loss"]
        assert side["gpus"] in ("a", "b") and side["runs_beside"] in (0, 1)
        assert one["gpus"] is None and one["runs_beside"] is None
    result = runner.invoke(app, ["convergence", "--out", str(beside), "--gpus", "a,a", *common])
    assert result.exit_code == 2 and "named more than once" in result.output


def test_a_study_runs_again_into_its_repeat_folder_and_resumes_both(tmp_path: Path) -> None:
    """A repeat folder: every arm and seed runs once in each folder, seed by seed, from the same
    weights and batches (on the CPU: the same curve); a study stopped part-way continues both."""
    first, again = tmp_path / "first", tmp_path / "again"
    arms, seeds = ["adamw_foreach", "forge_bf16"], [0, 1]
    order = [(run.folder.name, run.arm, run.seed) for run in conv.plan_study([first, again], SPEC, arms, seeds)]
    assert order == [(folder, arm, seed) for seed in seeds for arm in arms for folder in ("first", "again")]

    def stop_at_the_third_run(folder: Path, arm: str, seed: int, done: int):
        if (folder, arm, seed) == (first, "forge_bf16", 0):
            raise Stop
        return lambda step, loss: None

    with pytest.raises(Stop):
        conv.run_all(first, SPEC, arms, seeds, "cpu", stop_at_the_third_run, repeat_into=again)
    assert conv.read_row(conv.row_path(again, "adamw_foreach", 0))["completed"]
    left = [(run.folder.name, run.arm, run.seed) for run in conv.plan_study([first, again], SPEC, arms, seeds)]
    assert left == order[2:]
    rows = conv.run_all(first, SPEC, arms, seeds, "cpu", repeat_into=again)
    assert len(rows) == 6 and conv.plan_study([first, again], SPEC, arms, seeds) == []
    for arm in arms:
        for seed in seeds:
            one, two = (conv.read_row(conv.row_path(folder, arm, seed)) for folder in (first, again))
            assert one["completed"] and two["completed"] and one["spec_hash"] == two["spec_hash"]
            assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-5), (arm, seed)


def test_cli_repeat_into_runs_each_run_in_both_folders(tmp_path: Path) -> None:
    """``--repeat-into DIR``: one command, each run in both folders (its table names the folder);
    the same folder given twice is a one-line error before anything runs."""
    first, again = tmp_path / "first", tmp_path / "again"
    common = ["convergence", "--model", "tiny-gpt2", "--arms", "adamw_foreach", "--seeds", "0", "--batch", "2",
              "--seq", "16", "--steps", "2", "--warmup", "1", "--eval-every", "2", "--eval-batches", "1",
              "--corpus-max-bytes", "2000000", "--device", "cpu"]
    runner = CliRunner()
    result = runner.invoke(app, common + ["--out", str(first), "--repeat-into", str(first)])
    assert result.exit_code == 2 and "a repeat needs a folder of its own" in result.output, result.output
    assert not first.exists()
    result = runner.invoke(app, common + ["--out", str(first), "--repeat-into", str(again)])
    assert result.exit_code == 0, result.output
    assert "0 of 2 runs done" in result.output and str(again) in result.output
    rows = [conv.read_row(conv.row_path(folder, "adamw_foreach", 0)) for folder in (first, again)]
    assert all(row["completed"] and row["status"] == "ok" for row in rows)
    result = runner.invoke(app, common + ["--out", str(first), "--repeat-into", str(again)])
    assert result.exit_code == 0 and "2 of 2 runs done" in result.output, result.output


def test_a_run_that_fails_beside_others_is_named_with_its_log(tmp_path: Path, monkeypatch) -> None:
    from forge_bench import convergence_lanes, lanes

    monkeypatch.setenv(lanes.LOCK_DIR, str(tmp_path / "locks"))
    [run] = convergence_lanes.run_side_by_side([(tmp_path, "adamw_foreach", 0)], ["--steps", "0"], ["g0"])
    assert run.returncode == 2 and run.gpus == "g0"
    line = convergence_lanes.failure_line(run)
    assert line.startswith("adamw_foreach seed 0 (GPU g0) exited 2: ") and str(run.log) in line
    assert "'--steps'" in line, line


def _study_runs(study_pid: int, out: Path) -> list[int]:
    """Pids of the run processes a study started (their command names its folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != study_pid:
                continue
            if str(out).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_a_run_dies_with_its_study(tmp_path: Path) -> None:
    """kill -9 of a study started with --gpus ends its runs too: none is left writing the files
    a study started again would run again."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from forge_bench import lanes

    out = tmp_path / "study"
    long_run = ["--model", "tiny-gpt2", "--batch", "2", "--seq", "16", "--steps", "1000000", "--warmup", "1",
                "--eval-every", "100000", "--eval-batches", "1", "--checkpoint-every", "100000",
                "--corpus-max-bytes", "2000000", "--device", "cpu"]
    script = ("import sys; from pathlib import Path; from forge_bench import convergence_lanes; "
              f"convergence_lanes.run_side_by_side([(Path({str(out)!r}), 'adamw_foreach', 0)], {long_run!r}, ['g0'])")
    study = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, lanes.LOCK_DIR: str(tmp_path / "locks")})
    try:
        for _ in range(600):
            runs = _study_runs(study.pid, out)
            if runs:
                break
            time.sleep(0.1)
        assert runs, "the study started no run"
        time.sleep(1.0)                                  # the run past its start, into its imports
    finally:
        os.kill(study.pid, signal.SIGKILL)
        study.wait()
    for _ in range(600):                  # SIGKILL ends it at once; the bound only turns a survivor into a failure
        alive = [pid for pid in runs if _running(pid)]
        if not alive:
            break
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "a run outlived kill -9 of its study"


def training_schema_markdown() -> str:
    """The text of docs/training_results_schema.md: both kinds' columns."""
    from forge_bench import fidelity
    from forge_bench.run_rows import schema_markdown

    return ("# Rows of forge-bench fidelity and forge-bench convergence\n\n"
            "Each file has a `row_kind` column naming its kind (forge_bench/run_rows.py); `forge-bench report` "
            "reads both beside the sweep's rows (docs/results_schema.md).\n\n"
            + schema_markdown("fidelity: one row per arm and shape", fidelity.COLUMNS) + "\n"
            + schema_markdown("convergence: one row per (arm, seed), the curves in list columns", conv.COLUMNS))


def test_training_schema_doc_is_current() -> None:
    """docs/training_results_schema.md is generated: regenerate it with
    python -c "import sys; sys.path.insert(0, 'tests'); import test_convergence as t; open('docs/training_results_schema.md', 'w').write(t.training_schema_markdown())"."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "training_results_schema.md"
    assert doc.read_text() == training_schema_markdown()


def test_the_command_defaults_are_the_spec_defaults() -> None:
    """`forge-bench convergence` with no settings runs ``ConvergenceSpec()``: the two lists of
    defaults cannot drift apart."""
    import inspect

    from forge_bench.training_cli import convergence

    spec = conv.ConvergenceSpec()
    defaults = {name: p.default for name, p in inspect.signature(convergence).parameters.items()}
    assert defaults.pop("warmup") is None and conv.default_warmup(spec.steps) == spec.warmup   # per --steps
    shared = [f.name for f in dataclasses.fields(spec) if f.name in defaults]
    assert {"steps", "eval_every", "checkpoint_every", "lr", "batch", "seq"} <= set(shared)
    assert {name: defaults[name] for name in shared} == {name: getattr(spec, name) for name in shared}
    assert spec.steps == 4000
    assert defaults["arms"].split(",") == list(conv.DEFAULT_ARMS)       # one arm per moment format, and the peer
    assert {"forge_fp8", "adamw_fused_fp32_states", "bnb_adamw8bit", "forge_bf16_compile"} <= set(conv.DEFAULT_ARMS)
