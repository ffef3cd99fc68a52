"""One process per cell: crash, hang, OOM retry, kill -9 of the sweep then --resume.

Every wait here is bounded by work, not by the clock: a cell's timeout is long enough for any load
(the hang cell's 8 s ends in a timeout row whatever the machine does), and a test that must act
while a cell runs waits for a gated arm to say so; pytest's per-test timeout catches a hang.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from forge_bench import methods, results, runner
from forge_bench.suite import load_suite

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

BROKEN = """
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 1
timeout_s: 1800
parity: {enabled: false}
grids:
  - {name: hang, models: [tiny-llama], batch: [1], seq: [8], methods: [test_hang], timeout_s: 8}
  - {name: rest, models: [tiny-llama], batch: [1], seq: [8],
     methods: [test_crash, test_oom_once, test_oom_always, test_unavailable, sgd]}
"""

FAST = """
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 1
timeout_s: 1800
parity: {enabled: false}
models: [tiny-llama]
batch: [1]
seq: [8]
methods: [no_optimizer, sgd, adamw_foreach, test_forge_like]
"""


@pytest.fixture()
def plugin_env(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(methods.PLUGINS_ENV, "forge_bench_test_arms")
    # prepend, never replace: packages installed on PYTHONPATH (the GPU machine's carried wheels) must stay importable
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(TESTS), *inherited]))
    monkeypatch.setenv("FORGE_BENCH_TEST_OOM_FLAG", str(tmp_path / "oom-once.flag"))
    monkeypatch.setenv("FORGE_BENCH_TEST_GATE", str(tmp_path / "gate"))
    return tmp_path


@pytest.mark.slow
def test_every_misbehaving_cell_gets_its_row_and_the_sweep_goes_on(plugin_env):
    path = plugin_env / "broken.yaml"
    path.write_text(BROKEN)
    suite = load_suite(path)
    out = plugin_env / "out"
    run_id, outcomes = runner.run_sweep(suite, list(suite.cells), out)
    status = {o.cell.method: o.status for o in outcomes}
    assert status == {"test_hang": "timeout", "test_crash": "crashed", "test_oom_once": "ok",
                      "test_oom_always": "oom", "test_unavailable": "unavailable", "sgd": "ok"}
    df = results.load_results(out).set_index("method")
    assert len(df) == 6 and set(df.run_id) == {run_id}
    assert "boom: simulated crash" in df.loc["test_crash", "stderr_tail"]
    assert "exit code 1" in df.loc["test_crash", "reason"]
    assert "8 s" in df.loc["test_hang", "reason"]
    assert df.loc["test_oom_once", "attempts"] == 2
    assert df.loc["test_oom_always", "attempts"] == 2 and "out of memory" in df.loc["test_oom_always", "reason"]
    # where a cell process's time went: from its spawn to run_cell, then the measurement
    phases = json.loads(df.loc["sgd", "extra"])["phase_s"]
    assert set(phases) == {"startup", "prepare", "timing", "finish"} and phases["startup"] > 0.1
    assert 0 < phases["prepare"] + phases["timing"] + phases["finish"] < df.loc["sgd", "wall_s"]
    # unavailable cells are decided without a process
    assert not list((out / runner.LOG_DIR).glob("*test_unavailable*"))
    assert not _cell_processes(suite_path=suite.path), "no cell process may outlive its sweep"


def _cell_processes(parent_pid: int | None = None, suite_path: Path | None = None) -> list[int]:
    """The running cell processes this test started: those of the sweep ``parent_pid``, or of the suite
    file ``suite_path`` (another `make test` beside this one runs the same tests on other paths)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"forge_bench.cell" not in cmd:
            continue
        args = dict(zip(cmd, cmd[1:]))
        if parent_pid is not None and args.get(b"--parent-pid") != str(parent_pid).encode():
            continue
        if suite_path is not None and args.get(b"--suite") != str(suite_path).encode():
            continue
        pids.append(int(proc.name))
    return pids


def _sweep_cmd(suite_path: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "forge_bench.cli", "sweep", str(suite_path), "--out", str(out), *extra]


GATED = FAST.replace("methods: [no_optimizer, sgd, adamw_foreach, test_forge_like]",
                     "methods: [no_optimizer, test_gated, sgd]")


@pytest.mark.slow
def test_kill_9_of_a_running_sweep_then_resume_loses_and_duplicates_nothing(plugin_env):
    suite_path = plugin_env / "gated.yaml"
    suite_path.write_text(GATED)
    out = plugin_env / "out"
    gate = plugin_env / "gate"
    sweep = subprocess.Popen(_sweep_cmd(suite_path, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # the first cell has written its row and the second one is running: it waits at the gate
    while not gate.with_name("gate.waiting").exists():
        assert sweep.poll() is None, "the sweep ended before its gated cell ran"
        time.sleep(0.1)
    assert len(results.completed_cell_ids(out)) == 1 and _cell_processes(sweep.pid)
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    before = results.load_results(out)
    # the running cell dies with its sweep (parent-death signal): nothing keeps writing. SIGKILL ends it
    # at once; the bound (a minute, whatever the load) only turns a survivor into a failure, not a hang.
    for _ in range(600):
        if not _cell_processes(sweep.pid):
            break
        time.sleep(0.1)
    assert not _cell_processes(sweep.pid), "a cell process survived kill -9 of its sweep"
    assert len(before) == 1 and set(before.method) == {"no_optimizer"}

    refused = subprocess.run(_sweep_cmd(suite_path, out), capture_output=True, text=True)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    gate.write_text("open")
    done = subprocess.run(_sweep_cmd(suite_path, out, "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    after = results.load_results(out)
    assert len(after) == 3 and after.cell_id.is_unique
    assert set(after.cell_id) == {c.cell_id for c in load_suite(suite_path).cells}
    assert after.run_id.nunique() == 1 and set(after.run_id) == set(before.run_id)
    kept = after.set_index("cell_id").loc[before.cell_id, "finished_at"]
    assert list(kept) == list(before.finished_at), "rows written before the kill must not be rerun"
    assert (after.status == "ok").all()


def test_plan_refuses_to_mix_suites_or_restart_a_folder(plugin_env):
    a = plugin_env / "a.yaml"
    a.write_text(FAST)
    b = plugin_env / "b.yaml"
    b.write_text(FAST.replace("timed_steps: 2", "timed_steps: 3"))
    sa, sb = load_suite(a), load_suite(b)
    out = plugin_env / "out"
    run_id, manifest, done = runner.plan_run(out, sa, resume=False, allow_mixed=False)
    assert done == set() and manifest["runs"][0]["suite_hash"] == sa.sha256
    out.mkdir()
    runner._write_manifest(out, manifest)
    results.write_row(out, {"cell_id": sa.cells[0].cell_id, "status": "ok", "run_id": run_id})
    with pytest.raises(runner.RunnerError, match="--resume"):
        runner.plan_run(out, sa, resume=False, allow_mixed=False)
    again, _, done = runner.plan_run(out, sa, resume=True, allow_mixed=False)
    assert again == run_id and done == {sa.cells[0].cell_id}
    with pytest.raises(runner.RunnerError, match="--allow-mixed"):
        runner.plan_run(out, sb, resume=True, allow_mixed=False)
    other, manifest2, _ = runner.plan_run(out, sb, resume=False, allow_mixed=True)
    assert other != run_id and len(manifest2["runs"]) == 2
    stray = plugin_env / "stray"
    results.write_row(stray, {"cell_id": "x", "status": "ok"})
    with pytest.raises(runner.RunnerError, match="no manifest"):
        runner.plan_run(stray, sa, resume=True, allow_mixed=False)


def _rows(**overrides):
    base = {"device_name": "NVIDIA H100 80GB HBM3", "model": "llama-3.1-8b", "batch": 1, "seq": 512,
            "dtype": "bfloat16", "method": "forge_bf16", "method_family": "forge", "status": "ok",
            "step_ms_median": 100.0, "reason": None, "timing_method": "cuda_events"}
    return pd.DataFrame([{**base, **overrides}])


def test_check_against_baseline():
    base = pd.concat([_rows(), _rows(method="adamw_fused", method_family="baseline", step_ms_median=130.0)])
    fails, notes = runner.check_against_baseline(_rows(step_ms_median=109.0), base, 0.10)
    assert not fails and "+9.0%" in notes[0]
    fails, _ = runner.check_against_baseline(_rows(step_ms_median=111.0), base, 0.10)
    assert len(fails) == 1 and "forge_bf16" in fails[0] and "+11.0%" in fails[0]
    # an eager row may get a wider allowance than graph replays (host-bound steps vary by process)
    fails, notes = runner.check_against_baseline(_rows(step_ms_median=130.0), base, 0.05, eager_tolerance=0.35)
    assert not fails and "+30.0%" in notes[0]
    fails, _ = runner.check_against_baseline(_rows(step_ms_median=136.0), base, 0.05, eager_tolerance=0.35)
    assert "> +35%" in fails[0]
    fails, _ = runner.check_against_baseline(_rows(timing_method="cuda_graph_replay", step_ms_median=106.0),
                                             pd.concat([base, _rows(timing_method="cuda_graph_replay")]), 0.05,
                                             eager_tolerance=0.35)
    assert "> +5%" in fails[0], "graph replays keep --tolerance"
    fails, _ = runner.check_against_baseline(_rows(status="crashed", step_ms_median=None, reason="x"), base, 0.10)
    assert "status crashed" in fails[0]
    fails, _ = runner.check_against_baseline(_rows(device_name="NVIDIA H200"), base, 0.10)
    assert "nothing to compare" in fails[0]
    # a graph-replay row is compared with graph-replay baseline rows only
    fails, _ = runner.check_against_baseline(_rows(timing_method="cuda_graph_replay", step_ms_median=50.0), base, 0.10)
    assert "nothing to compare" in fails[0]
    fails, notes = runner.check_against_baseline(_rows(timing_method="cuda_graph_replay", step_ms_median=50.0),
                                                 pd.concat([base, _rows(timing_method="cuda_graph_replay",
                                                                        step_ms_median=49.0)]), 0.10)
    assert not fails and "cuda_graph_replay" in notes[0] and "+2.0%" in notes[0]
    # a lean-activations row only against lean baseline rows; rows without the column are hf
    fails, _ = runner.check_against_baseline(_rows(activations="lean", step_ms_median=90.0), base, 0.10)
    assert "nothing to compare" in fails[0]
    fails, notes = runner.check_against_baseline(_rows(activations="lean", step_ms_median=90.0),
                                                 pd.concat([base, _rows(activations="lean", step_ms_median=88.0)]), 0.10)
    assert not fails and "+2.3%" in notes[0]
    fails, _ = runner.check_against_baseline(_rows(activations="hf", step_ms_median=105.0), base, 0.10)
    assert not fails
    # baseline arms never fail the check, only FORGE ones
    fails, _ = runner.check_against_baseline(
        pd.concat([_rows(), _rows(method="adamw_fused", method_family="baseline", step_ms_median=999.0)]), base, 0.10)
    assert not fails


def test_check_names_the_weight_shapes_that_ran_other_tiles_than_the_baseline():
    """A cell whose tune cache missed tunes again; --check must say its time compares other tiles."""
    def with_tiles(gate: str, q: str, ms: float = 100.0):
        extra = json.dumps({"kernel_configs": {"14336x4096/bt512/adamw/bf16": gate, "4096x4096/bt512/adamw/bf16": q}})
        return _rows(step_ms_median=ms, extra=extra)
    base = with_tiles("64x128x64 w8 s4 g8 split2", "64x64x32 w4 s6 g8 split1")
    same = with_tiles("64x128x64 w8 s4 g8 split2 (tune cache)", "64x64x32 w4 s6 g8 split1 (tune cache)", 101.0)
    fails, notes = runner.check_against_baseline(same, base, 0.05)
    assert not fails and len(notes) == 1, "the same tiles, read from the cache, are no news"
    retuned = with_tiles("64x128x64 w8 s4 g8 split2", "128x128x64 w8 s4 g8 split2", 102.0)
    fails, notes = runner.check_against_baseline(retuned, base, 0.05)
    assert not fails and len(notes) == 2
    assert "other tiles than the baseline's for 4096x4096/bt512/adamw/bf16:" in notes[1]
    assert "14336x4096" not in notes[1] and "--tune-cache" in notes[1]
    fails, notes = runner.check_against_baseline(retuned, _rows(), 0.05)
    assert len(notes) == 1, "a baseline row without tiles (older rows) says nothing about them"


def test_stop_after_starts_no_new_cell_then_resume_finishes_the_same_run(plugin_env):
    suite_path = plugin_env / "two.yaml"
    suite_path.write_text(FAST.replace("methods: [no_optimizer, sgd, adamw_foreach, test_forge_like]",
                                       "methods: [no_optimizer, sgd]"))
    out = plugin_env / "out"
    # a 1-second budget: the first cell starts (budget not spent yet: the check comes before it),
    # the one after it does not (a cell process takes longer than a second to start on any machine)
    first = subprocess.run(_sweep_cmd(suite_path, out, "--stop-after", "1"), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "not started" in first.stderr and "--resume" in first.stderr
    before = results.load_results(out)
    assert len(before) == 1
    done = subprocess.run(_sweep_cmd(suite_path, out, "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    after = results.load_results(out)
    assert len(after) == 2 and after.cell_id.is_unique and after.run_id.nunique() == 1


def test_graph_cells_get_expandable_segments_unless_the_user_chose(monkeypatch):
    from forge_bench.suite import Cell

    def cell(graph: bool) -> Cell:
        return Cell(cell_id="c", grid="g", model="llama-tiny", batch=1, seq=8, method="adamw_fused",
                    dtype="bfloat16", device="cuda", timeout_s=60.0, cuda_graph=graph)

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert runner._child_env(cell(True))["PYTORCH_CUDA_ALLOC_CONF"] == runner.GRAPH_CELL_ALLOC_CONF
    assert "PYTORCH_CUDA_ALLOC_CONF" not in runner._child_env(cell(False))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert runner._child_env(cell(True))["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_cells_share_a_tune_cache_in_the_results_folder_unless_told_otherwise(monkeypatch, tmp_path):
    """Default: OUT/tune_cache.json; an exported FORGE_TUNE_CACHE wins over it; --tune-cache PATH
    wins over both; 'off' gives the cells an empty variable (each tunes on its own)."""
    monkeypatch.delenv(runner.TUNE_CACHE_ENV, raising=False)
    out = tmp_path / "out"
    assert runner.default_tune_cache(out, None) == str((out / "tune_cache.json").resolve())
    monkeypatch.setenv(runner.TUNE_CACHE_ENV, "/shared/tiles.json")
    assert runner.default_tune_cache(out, None) == "/shared/tiles.json"
    assert runner.default_tune_cache(out, str(tmp_path / "mine.json")) == str((tmp_path / "mine.json").resolve())
    assert runner.default_tune_cache(out, "OFF") == ""
    assert runner._child_env(None, "")[runner.TUNE_CACHE_ENV] == ""
    assert runner._child_env(None, "/x.json")[runner.TUNE_CACHE_ENV] == "/x.json"
    assert runner._child_env(None, None)[runner.TUNE_CACHE_ENV] == "/shared/tiles.json", "None: as inherited"


THREE_CELLS = FAST.replace("methods: [no_optimizer, sgd, adamw_foreach, test_forge_like]", "methods: [sgd, no_optimizer, test_forge_like]")


def _planted_folder(plugin_env, statuses: dict[str, str]):
    """A results folder as a sweep of THREE_CELLS leaves it, with a row of the given status for each
    method named (written here, not run: only the cells a test re-runs start a process)."""
    suite_path = plugin_env / "three.yaml"
    suite_path.write_text(THREE_CELLS)
    suite = load_suite(suite_path)
    out = plugin_env / "out"
    run_id, manifest, _ = runner.plan_run(out, suite, resume=False, allow_mixed=False)
    out.mkdir()
    runner._write_manifest(out, manifest)
    by_method = {c.method: c for c in suite.cells}
    for method, status in statuses.items():
        cell = by_method[method]
        results.write_row(out, {**runner._runner_row(suite, cell, run_id, 1, status, f"planted {status}", None, 1.0),
                                "finished_at": "2000-01-01T00:00:00+00:00"})
    return suite_path, suite, out, run_id, by_method


def test_resume_keeps_failed_rows_and_retry_failed_plans_them_again(plugin_env):
    suite_path, suite, out, run_id, cells = _planted_folder(
        plugin_env, {"sgd": "crashed", "no_optimizer": "timeout", "test_forge_like": "parity_fail"})
    _, _, done = runner.plan_run(out, suite, resume=True, allow_mixed=False)
    assert done == {c.cell_id for c in suite.cells}, "--resume keeps every row, failed ones included"
    again, _, done = runner.plan_run(out, suite, resume=False, allow_mixed=False, retry_failed=True)
    assert again == run_id and done == {cells["test_forge_like"].cell_id}, "crashed and timeout run again"
    assert set(runner.RETRY_STATUSES) == {"crashed", "timeout", "oom"}


def test_a_corrupt_row_is_set_aside_and_rerun_and_retry_failed_replaces_a_crashed_row(plugin_env):
    """A folder with a crashed row, a truncated row file and an ok row. `sweep --resume`: the truncated
    file is named and moved aside and its cell runs again, the crashed row stays; `--retry-failed`: the
    crashed cell runs again under the same run id, the ok row stays as it was."""
    suite_path, suite, out, run_id, cells = _planted_folder(
        plugin_env, {"sgd": "crashed", "no_optimizer": "ok", "test_forge_like": "ok"})
    corrupt = results.row_path(out, cells["test_forge_like"].cell_id)
    half = corrupt.read_bytes()[:300]
    corrupt.write_bytes(half)
    done = subprocess.run(_sweep_cmd(suite_path, out, "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    message = " ".join(done.stderr.split())
    assert f"{corrupt}: not a readable parquet file (" in message
    assert f"moved to {corrupt.name}.corrupt, its cell runs again" in message
    assert (out / f"{corrupt.name}.corrupt").read_bytes() == half, "the unreadable bytes are kept"
    rows = results.load_results(out).set_index("method")
    assert rows.loc["test_forge_like", "status"] == "ok" and rows.loc["test_forge_like", "run_id"] == run_id
    assert rows.loc["sgd", "status"] == "crashed", "--resume alone keeps a crashed row"

    retried = subprocess.run(_sweep_cmd(suite_path, out, "--retry-failed"), capture_output=True, text=True)
    assert retried.returncode == 0, retried.stderr[-2000:]
    rows = results.load_results(out).set_index("method")
    assert len(rows) == 3 and set(rows.run_id) == {run_id}
    assert rows.loc["sgd", "status"] == "ok" and pd.isna(rows.loc["sgd", "reason"])
    assert rows.loc["no_optimizer", "finished_at"] == "2000-01-01T00:00:00+00:00", "an ok row is not re-run"
    assert rows.loc["sgd", "torch_threads"] == 1, "a CPU cell runs one torch thread unless told otherwise"
