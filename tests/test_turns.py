"""``forge-bench sweep --interleave``: the cells of one model and shape stay resident together and their
timed repeats take turns (forge_bench/turns.py, runner.run_group)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from forge_bench import results, runner, turns
from forge_bench.suite import load_suite
from test_runner import plugin_env  # noqa: F401  (the plugin arms on the cells' path)

TURNS = """
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 3
timeout_s: 600
parity: {enabled: false}
grids:
  - {name: pair, models: [tiny-llama], batch: [1], seq: [8], methods: [sgd, test_oom_once, test_unavailable, adamw_foreach]}
  - {name: alone, models: [tiny-llama], batch: [1], seq: [12], methods: [sgd]}
"""


def test_a_groups_repeats_alternate_and_a_cell_out_of_memory_beside_others_runs_again_alone(plugin_env):
    path = plugin_env / "turns.yaml"
    path.write_text(TURNS)
    suite = load_suite(path)
    assert [[c.method for c in g] for g in runner.turn_groups(list(suite.cells))] == [
        ["sgd", "test_oom_once", "test_unavailable", "adamw_foreach"], ["sgd"]]
    out = plugin_env / "out"
    _run_id, outcomes = runner.run_sweep(suite, list(suite.cells), out, interleave=True)
    assert [o.status for o in outcomes] == ["ok", "ok", "unavailable", "ok", "ok"]
    df = results.load_results(out).set_index("cell_id")
    extra = {cell_id: json.loads(text) for cell_id, text in df["extra"].items()}
    sgd, oom, unavailable, adamw, alone = (c.cell_id for c in suite.cells)
    # the two cells that fit took turns: each names the whole group, 3 windows each, A B A B A B, none overlapping
    assert extra[sgd]["turns"]["peers"] == [oom, adamw] and extra[adamw]["turns"]["peers"] == [sgd, oom]
    windows = sorted([(a, b, sgd) for a, b in extra[sgd]["turns"]["windows"]]
                     + [(a, b, adamw) for a, b in extra[adamw]["turns"]["windows"]])
    assert [owner for _, _, owner in windows] == [sgd, adamw] * 3
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(windows, windows[1:]))
    # out of memory beside the others (attempt 1), then alone (attempt 2): no turns
    assert df.loc[oom, "attempts"] == 2 and "turns" not in extra[oom]
    assert df.loc[sgd, "attempts"] == 1 and "turns" not in extra[alone]
    # an arm that cannot run here takes no turn and starts no process
    assert not list((out / runner.LOG_DIR).glob(f"{unavailable}*"))
    assert len(df.loc[sgd, "step_ms_run_medians"]) == 3


def test_a_gate_refuses_a_malformed_descriptor_pair_in_one_line(monkeypatch):
    monkeypatch.setenv(turns.TURN_FDS_ENV, "7")
    with pytest.raises(ValueError, match=r"^FORGE_BENCH_TURN_FDS='7': expected '<read fd>,<write fd>'$"):
        turns.TurnGate.from_env()
    monkeypatch.delenv(turns.TURN_FDS_ENV)
    assert turns.TurnGate.from_env() is None


def test_the_sweeps_end_sees_a_cell_that_died_after_saying_ready():
    """A cell process that writes READY and exits: the sweep's ``until`` reads the token, then ``give`` reports
    the closed pipe instead of raising, and waiting for DONE ends at the pipe's EOF."""
    pipe = turns.TurnPipe()
    read_fd, write_fd = pipe.child_fds
    proc = subprocess.Popen([sys.executable, "-c", f"import os; os.write({write_fd}, {turns.READY!r})"],
                            pass_fds=pipe.child_fds)
    pipe.close_child_ends()
    try:
        assert pipe.until(turns.READY, lambda: True)
        proc.wait(timeout=60)
        assert pipe.give() is False
        assert pipe.until(turns.DONE, lambda: proc.poll() is None) is False
    finally:
        pipe.close()
