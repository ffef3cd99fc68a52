"""The forge-bench CLI: help, one-line errors with exit code 2, dry run, list/env, and the
smoke suite end to end (the `make demo` path) with --resume and --check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_bench import results
from forge_bench.cli import app
from forge_bench.suite import load_suite

REPO = Path(__file__).resolve().parent.parent
cli = CliRunner()


@pytest.mark.parametrize("command", ["sweep", "cell", "list", "env", "report", "kernel", "profile step",
                                     "profile timeline", "profile graph", "tune-cache check", "tune-cache rekey"])
def test_help_explains_each_command(command):
    res = cli.invoke(app, [*command.split(), "--help"])
    assert res.exit_code == 0
    assert len(res.output) > 200


def test_top_level_help_lists_commands():
    res = cli.invoke(app, ["--help"])
    assert res.exit_code == 0
    assert all(c in res.output for c in ("sweep", "list", "env", "report", "kernel", "profile", "tune-cache"))
    res = cli.invoke(app, ["profile", "--help"])
    assert res.exit_code == 0 and all(c in res.output for c in ("step", "timeline", "graph"))


def test_bad_suite_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("device: cpu\nmodels: [nope]\nbatch: [1]\nseq: [8]\nmethods: [sgd]\n")
    res = cli.invoke(app, ["sweep", str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    err = res.stderr.strip()
    assert err.startswith("error:") and "unknown model 'nope'" in err and str(bad) in err.replace("\n", "")
    assert not (tmp_path / "o").exists()


def test_only_that_matches_nothing_is_exit_2(tmp_path):
    res = cli.invoke(app, ["sweep", "--only", "no-such-cell", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "matches none" in res.stderr


def test_dry_run_lists_cells_and_writes_nothing(tmp_path):
    out = tmp_path / "o"
    res = cli.invoke(app, ["sweep", str(REPO / "suites" / "h100_llama8b.yaml"), "--only", "headline/*",
                           "--dry-run", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "headline/llama-3.1-8b/b1/s512/forge_bf16" in res.output.replace("\n", "")
    assert "8 of" in " ".join(res.stderr.split())     # rich wraps at the console width
    assert not out.exists()


def test_a_dry_run_with_interleave_names_the_cells_that_take_turns(tmp_path):
    """Each group of cells to run that would stay resident together gets a line; a cell alone gets none."""
    suite = tmp_path / "pairs.yaml"
    suite.write_text("device: cpu\ndtype: float32\nmodels: [tiny-llama]\nbatch: [1]\nseq: [8, 12]\n"
                     "methods: [sgd, adamw_foreach]\n")
    res = cli.invoke(app, ["sweep", str(suite), "--dry-run", "--interleave", "--out", str(tmp_path / "o"),
                           "--only", "*/s8/*,*/s12/sgd"])
    assert res.exit_code == 0, res.stderr
    turns = [line for line in res.output.splitlines() if line.startswith("turns:")]
    assert turns == ["turns: main/tiny-llama/b1/s8: sgd, adamw_foreach (resident together, repeats alternating)"]
    res = cli.invoke(app, ["sweep", str(suite), "--dry-run", "--out", str(tmp_path / "o")])
    assert not [line for line in res.output.splitlines() if line.startswith("turns:")]


THOUSAND = """
name: thousand
device: cpu
dtype: float32
timeout_s: 90
models: [tiny-llama]
batch: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
seq: [{seqs}]
methods: [sgd, adamw_fused]
""".replace("{seqs}", ", ".join(str(n) for n in range(1, 101)))


def test_dry_run_ends_with_the_plans_size_and_time(tmp_path):
    """A dry run of 2,000 cells says how many run, are kept or cannot run, the bound their timeouts put
    on the sweep and, once the folder has ok rows, the estimate at their median wall time."""
    import shutil

    suite = tmp_path / "thousand.yaml"
    suite.write_text(THOUSAND)
    out = tmp_path / "o"
    res = cli.invoke(app, ["sweep", str(suite), "--dry-run", "--out", str(out)])
    assert res.exit_code == 0, res.stderr
    assert res.output.splitlines()[-1] == ("plan: 2,000 cells, 1,000 to run, 0 kept, 1,000 unavailable; at most 25.0 h "
                                           "one after the other (each cell's timeout)")
    res = cli.invoke(app, ["sweep", str(suite), "--out", str(out), "--only", "main/tiny-llama/b1/s1/adamw_fused"])
    assert res.exit_code == 0, res.stderr
    fixture = REPO / "tests" / "fixtures" / "grid"
    for row_file in fixture.glob("*.parquet"):
        shutil.copy(row_file, out / row_file.name)
    frame = results.load_results(fixture)
    median = float(frame.loc[frame.status == "ok", "wall_s"].median())
    ok_rows = int((frame.status == "ok").sum())
    res = cli.invoke(app, ["sweep", str(suite), "--dry-run", "--resume", "--out", str(out)])
    assert res.exit_code == 0, res.stderr
    hours = median * 1000 / 3600
    assert 2 <= hours < 48, "the fixture rows' wall times print in hours"
    assert res.output.splitlines()[-1] == (
        f"plan: 2,000 cells, 1,000 to run, 1 kept, 999 unavailable; at most 25.0 h one after the other (each cell's "
        f"timeout); at the median {median:.0f} s of the {ok_rows} ok cells in the folder, about {hours:.1f} h")


def test_torchaos_extension_load_failure_is_not_printed(caplog):
    """torchao's "Failed to load .../torchao/_C_mxfp8...so" (its CUDA extensions on a CPU torch) is
    dropped in a forge_bench process; its other warnings still reach the log."""
    import importlib.util
    import logging

    import forge_bench  # noqa: F401 - the filter is installed when the package is imported

    torchao_log = logging.getLogger("torchao")
    with caplog.at_level(logging.WARNING):
        torchao_log.warning("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                            "Could not load this library: /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so")
        torchao_log.warning("Failed to load /venv/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this library")
        torchao_log.warning("Skipping import of cpp extensions due to incompatible torch version.")
        logging.getLogger("somebody.else").warning("Failed to load /x/torchao/_C_mxfp8.so: theirs")
    assert [r.getMessage() for r in caplog.records] == [
        "Skipping import of cpp extensions due to incompatible torch version.",
        "Failed to load /x/torchao/_C_mxfp8.so: theirs"]
    if importlib.util.find_spec("torchao") is None:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    imported = subprocess.run([sys.executable, "-c", "import forge_bench, torchao"], capture_output=True, text=True,
                              env=env, cwd=REPO)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert "Failed to load" not in imported.stderr


def test_list_and_env_work_without_a_gpu():
    res = cli.invoke(app, ["list", "--device", "cpu"])
    assert res.exit_code == 0
    text = res.output.replace("\n", " ")
    assert "llama-3.1-8b" in text and "8.030 B" in text and "adamw_fused" in text and "CUDA" in text
    res = cli.invoke(app, ["env"])
    assert res.exit_code == 0 and "torch_version" in res.output and "nvml" in res.output


def test_report_of_a_missing_folder_is_exit_2(tmp_path):
    res = cli.invoke(app, ["report", str(tmp_path / "none")])
    assert res.exit_code == 2 and "no such" in res.stderr
    fixtures = Path(__file__).resolve().parent / "fixtures"
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), str(tmp_path / "none"), "-o", str(tmp_path / "r")])
    assert res.exit_code == 2 and str(tmp_path / "none") in res.stderr and not (tmp_path / "r").exists()


def test_report_takes_several_results_folders(tmp_path):
    fixtures = Path(__file__).resolve().parent / "fixtures"
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), str(fixtures / "smoke_rerun_partial"),
                           "-o", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "smoke_rerun_partial" in (tmp_path / "r" / "index.md").read_text()


def test_report_formats_option(tmp_path):
    """--formats png writes no PDF; an unknown format is a one-line error, exit 2, nothing written."""
    fixtures = Path(__file__).resolve().parent / "fixtures"
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), "-o", str(tmp_path / "r"), "--formats", "png"])
    assert res.exit_code == 0, res.output
    figures = {p.suffix for p in (tmp_path / "r" / "figures").iterdir()}
    assert figures == {".png"} and ".pdf)" not in (tmp_path / "r" / "index.md").read_text()
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), "-o", str(tmp_path / "bad"), "--formats", "png,svg"])
    assert res.exit_code == 2 and "svg" in res.stderr and "--formats" in res.stderr
    assert not (tmp_path / "bad").exists()


def test_report_skips_a_parquet_of_another_kind_in_one_line(tmp_path):
    """`forge-bench report results/` on a folder that also holds the kernel benchmark's parquet: the
    report is written, and the other file is named on stderr, not fatal."""
    import shutil

    import pandas as pd

    fixtures = Path(__file__).resolve().parent / "fixtures"
    rows = tmp_path / "results"
    shutil.copytree(fixtures / "smoke", rows / "smoke")
    (rows / "kernels").mkdir()
    pd.DataFrame({"shape": ["q"], "fused_ms": [0.1]}).to_parquet(rows / "kernels" / "kernel_bench.parquet")
    res = cli.invoke(app, ["report", str(rows), "-o", str(tmp_path / "r"), "--formats", "png"])
    assert res.exit_code == 0, res.output
    assert res.stderr.strip().splitlines() == [
        f"forge-bench report: skipping {rows / 'kernels' / 'kernel_bench.parquet'}: not a forge-bench v1 result "
        "file (missing ['schema_version', 'run_id', 'suite_name', 'suite_hash', 'cell_id'])"]
    assert (tmp_path / "r" / "README.md").is_file() and (tmp_path / "r" / "index.md").is_file()
    res = cli.invoke(app, ["report", str(rows / "kernels"), "-o", str(tmp_path / "none")])
    assert res.exit_code == 2 and "no forge-bench v1 result files" in res.stderr


def test_report_names_and_skips_a_row_file_that_is_not_parquet(tmp_path):
    """A truncated or garbage .parquet among the rows: one line naming it on stderr, the report of the others."""
    import shutil

    fixtures = Path(__file__).resolve().parent / "fixtures"
    rows = tmp_path / "rows"
    shutil.copytree(fixtures / "smoke", rows)
    victim = sorted(rows.glob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:200])
    (rows / "garbage.parquet").write_bytes(b"not parquet at all")
    res = cli.invoke(app, ["report", str(rows), "-o", str(tmp_path / "r"), "--formats", "png"])
    assert res.exit_code == 0, res.output
    lines = res.stderr.strip().splitlines()
    assert [line.split(": not a readable parquet file (")[0] for line in lines] == [
        f"forge-bench report: skipping {rows / 'garbage.parquet'}", f"forge-bench report: skipping {victim}"]
    assert f"from {len(list(fixtures.joinpath('smoke').glob('*.parquet'))) - 1} rows" in (tmp_path / "r" / "index.md").read_text()


def test_report_out_on_a_file_or_a_folder_of_something_else_is_one_line_exit_2(tmp_path):
    fixtures = Path(__file__).resolve().parent / "fixtures"
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), "-o", str(taken)])
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0
    assert f"{taken}: exists and is not a folder" in " ".join(res.stderr.split())
    assert taken.read_text() == "mine"
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), "-o", str(tmp_path)])
    assert res.exit_code == 2 and "not a report folder (it holds notes.txt" in " ".join(res.stderr.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "nothing written beside the user's file"
    res = cli.invoke(app, ["report", str(fixtures / "smoke"), "-o", str(taken / "report")])   # a place it cannot write
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0
    assert " ".join(res.stderr.split()) == f"error: {taken / 'report'}: cannot write the report there (File exists)"


@pytest.mark.parametrize("command", [["sweep"], ["kernel"]])
def test_boolean_options_are_flags_without_a_value_in_the_help(command):
    res = cli.invoke(app, [*command, "--help"])
    assert res.exit_code == 0

    def option_line(name: str) -> str:
        [line] = [line for line in res.output.splitlines() if line.lstrip("│ ").startswith(f"{name} ")]
        return line

    flags = {"sweep": ("--resume", "--retry-failed", "--dry-run", "--allow-mixed", "--interleave"),
             "kernel": ("--quick",)}[command[0]]
    for name in flags:
        assert "bool" not in option_line(name), option_line(name)
    if command == ["sweep"]:
        assert "<int range>" in option_line("--threads"), "an option with a value still shows its type"


def test_a_value_after_a_flag_is_not_taken_for_the_suite(tmp_path):
    """`--resume true` (as if --resume took a value): a one-line error saying the flags take none."""
    res = cli.invoke(app, ["sweep", "--resume", "true", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert ("true: no such suite file; --resume, --retry-failed, --dry-run, --allow-mixed and --interleave are flags "
            "and take no "
            "value (write --resume, not --resume true)") in " ".join(res.stderr.split())
    assert not (tmp_path / "o").exists()


def test_flags_parse_as_flags(tmp_path, monkeypatch):
    """Each flag sets its switch and consumes no argument: the suite after them is still the suite."""
    from forge_bench import runner

    suite = tmp_path / "s.yaml"
    suite.write_text("device: cpu\ndtype: float32\nmodels: [tiny-llama]\nbatch: [1]\nseq: [8]\nmethods: [sgd]\n")
    seen = {}

    def plan(out_dir, loaded, **kwargs):
        seen.update(kwargs, suite=loaded.path)
        return "run-x", None, set()

    monkeypatch.setattr(runner, "plan_run", plan)
    res = cli.invoke(app, ["sweep", "--resume", "--retry-failed", "--allow-mixed", "--dry-run", str(suite),
                           "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output + res.stderr
    assert seen == {"resume": True, "allow_mixed": True, "retry_failed": True, "suite": suite.resolve()}
    res = cli.invoke(app, ["sweep", str(suite), "--dry-run", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0 and seen["resume"] is False and seen["retry_failed"] is False


def _run(args, env):
    return subprocess.run([sys.executable, "-m", "forge_bench.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO)


def _baseline(src: Path, dst: Path, factor: float) -> None:
    """A baseline whose FORGE rows ran ``factor`` times the measured step time."""
    for row in results.load_table(src).to_pylist():
        if row["method_family"] == "forge" and row["step_ms_median"] is not None:
            row["step_ms_median"] *= factor
        results.write_row(dst, row)


# The `make demo` path on a suite written for the test: the smoke suite's settings, its torch baseline,
# a FORGE state dtype and its chunked-loss arm, on one small shape (three cells, not fourteen: the work
# a test does is bounded, whatever the machine's load; `make demo` runs the whole smoke suite).
DEMO_LIKE = """
name: demo-like
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 2
timeout_s: 1800
seed: 0
optimizer: {lr: 1.0e-3, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, momentum: 0.9}
parity: {enabled: true, steps: 4, tolerance: 0.02, max_layers: 2}
models: [tiny-llama]
batch: [1]
seq: [16]
methods: [adamw_foreach, forge_bf16, forge_int8_cce]
"""


@pytest.mark.slow
def test_sweep_end_to_end_then_resume_check_and_report(tmp_path):
    """What `make demo` runs (a sweep, then the report) on a three-cell suite; plus --resume and --check."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORGE_BENCH_PLUGINS")}
    # prepend, never replace: where packages live on PYTHONPATH (the GPU machine's carried wheels) they must stay
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    suite_path = tmp_path / "demo_like.yaml"
    suite_path.write_text(DEMO_LIKE)
    out = tmp_path / "demo"
    res = _run(["sweep", str(suite_path), "--out", str(out)], env)
    assert res.returncode == 0, res.stderr[-3000:]
    suite = load_suite(suite_path)
    df = results.load_results(out)
    assert len(df) == len(suite.cells) == 3 and df.cell_id.is_unique
    bad = df[df.status != "ok"][["cell_id", "status", "reason"]]
    assert bad.empty, bad.to_string()
    forge = df[df.method_family == "forge"]
    assert (forge.parity_rms_rel <= forge.parity_tolerance).all()
    assert (forge.n_fused_params > 0).all()
    assert (df.torch_threads == 1).all(), "a CPU cell pins one torch thread by default"
    assert "ok=3" in res.stdout

    # a regression against a baseline that ran FORGE twice as fast: exit 1, naming the arm
    fast = tmp_path / "baseline_fast"
    _baseline(out, fast, 0.5)
    res = _run(["sweep", str(suite_path), "--out", str(out), "--resume", "--check", str(fast), "--tolerance", "0.10"],
               env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "REGRESSION" in res.stderr and "forge_bf16" in res.stderr
    slow = tmp_path / "baseline_slow"
    _baseline(out, slow, 2.0)
    res = _run(["sweep", str(suite_path), "--out", str(out), "--resume", "--check", str(slow)], env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check passed" in res.stdout
    assert len(results.load_results(out)) == 3

    res = _run(["report", str(out), "-o", str(tmp_path / "report")], env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert any((tmp_path / "report").iterdir())


def test_the_demo_suite_plans_every_cell(tmp_path):
    """`make demo`'s suite (the packaged default): every cell planned to run, each FORGE state dtype and
    the chunked-loss arm among them, and nothing written by the dry run."""
    res = cli.invoke(app, ["sweep", "--dry-run", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    suite = load_suite(None)
    plans = [line for line in res.output.splitlines() if line.startswith("smoke/")]
    assert len(plans) == len(suite.cells) and all(line.endswith("  run") for line in plans)
    from forge_core.state import STATE_DTYPES

    assert {f"forge_{states}" for states in STATE_DTYPES} | {"forge_int8_cce"} <= {c.method for c in suite.cells}
    assert not (tmp_path / "o").exists()


def test_kernel_without_a_gpu_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    res = cli.invoke(app, ["kernel", "--quick", "--out", str(tmp_path / "k")])
    assert res.exit_code == 2 and "CUDA" in res.stderr
    assert not (tmp_path / "k").exists()          # its folder's lock is let go and the empty folder removed
    res = cli.invoke(app, ["kernel", "--bts", "5x", "--out", str(tmp_path / "k")])
    assert res.exit_code == 2 and "--bts" in res.stderr


# --- forge-bench profile -----------------------------------------------------------------------------

def test_profile_child_options_reach_the_profiler(monkeypatch, tmp_path):
    """The hidden --one flag runs one arm in this process with every option as given; --methods takes
    a comma-separated list (or repeats); a bad --activations is refused before any work."""
    from forge_bench.profile import step, timeline

    seen = []
    monkeypatch.setattr(step, "run_one", lambda options, method, out: seen.append((options, method, out)))
    res = cli.invoke(app, ["profile", "step", "--one", "--methods", "forge_bf16", "--model", "tiny-llama",
                           "--batch", "2", "--seq", "16", "--dtype", "float32", "--activations", "lean",
                           "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 0, res.output
    [(options, method, out)] = seen
    assert method == "forge_bf16" and out == tmp_path / "x.json"
    assert (options.model, options.batch, options.seq, options.dtype, options.activations, options.steps,
            options.warmup) == ("tiny-llama", 2, 16, "float32", "lean", 4, 1)
    runs = []
    monkeypatch.setattr(timeline, "run", lambda options, methods, out, trace_dir: runs.append((methods, trace_dir)) or 0)
    res = cli.invoke(app, ["profile", "timeline", "--methods", "a,b", "--methods", "c", "--trace-dir", str(tmp_path),
                           "--out", str(tmp_path / "t.md")])
    assert res.exit_code == 0, res.output
    assert runs == [(["a", "b", "c"], tmp_path)]
    res = cli.invoke(app, ["profile", "graph", "--activations", "fat", "--out", str(tmp_path / "g.md")])
    assert res.exit_code == 2 and "--activations" in res.output + res.stderr


# --- forge-bench tune-cache --------------------------------------------------------------------------

def _cache(path: Path, entries: dict) -> Path:
    import json

    path.write_text(json.dumps({"version": 1, "entries": entries}))
    return path


@pytest.fixture
def kernel_keys(monkeypatch):
    """Stand-ins for forge_core.kernels' re-keying (the fingerprints are forge_core's): an entry key is
    current when it starts with "new|"; re-keying swaps "old|" for "new|"."""
    import forge_core.kernels as kernels

    def count(entries):
        return sum(key.startswith("new|") for key in entries), len(entries)

    def rekey(entries):
        out = {"new|" + key.split("|", 1)[1]: value for key, value in entries.items()}
        return out, sum(not key.startswith("new|") for key in entries)

    monkeypatch.setattr(kernels, "count_current_tune_cache_entries", count, raising=False)
    monkeypatch.setattr(kernels, "rekey_tune_cache_entries", rekey, raising=False)


def test_tune_cache_check_counts_current_entries_and_fails_on_a_stale_one(tmp_path, kernel_keys):
    current = _cache(tmp_path / "current.json", {"new|a": {"tile": 1}, "new|b": {"tile": 2}})
    res = cli.invoke(app, ["tune-cache", "check", str(current)])
    assert res.exit_code == 0 and "2 of 2 entries match this tree's kernel" in res.output
    stale = _cache(tmp_path / "stale.json", {"new|a": {"tile": 1}, "old|b": {"tile": 2}})
    res = cli.invoke(app, ["tune-cache", "check", str(stale)])
    assert res.exit_code == 1 and "1 of 2 entries match" in res.output


def test_tune_cache_rekey_writes_the_same_choices_under_current_keys(tmp_path, kernel_keys):
    import json

    source = _cache(tmp_path / "old.json", {"old|a": {"tile": 1}, "new|b": {"tile": 2}})
    target = tmp_path / "deeper" / "rekeyed.json"
    res = cli.invoke(app, ["tune-cache", "rekey", str(source), str(target)])
    assert res.exit_code == 0, res.output
    assert "1 of 2 entries match this tree's kernel as they are; wrote 2 entries" in " ".join(res.output.split())
    written = json.loads(target.read_text())
    assert written == {"version": 1, "entries": {"new|a": {"tile": 1}, "new|b": {"tile": 2}}}
    assert not list(target.parent.glob(".*.tmp"))
    res = cli.invoke(app, ["tune-cache", "check", str(target)])
    assert res.exit_code == 0


def test_tune_cache_names_a_file_that_is_not_a_tune_cache(tmp_path, kernel_keys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for args in (["check", str(bad)], ["rekey", str(bad), str(tmp_path / "out.json")],
                 ["check", str(tmp_path / "missing.json")]):
        res = cli.invoke(app, ["tune-cache", *args])
        assert res.exit_code == 2 and "is not a tune cache" in res.stderr, args
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out.json").exists()
