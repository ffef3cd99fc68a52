"""``forge-bench sweep --gpus``: cells side by side on disjoint GPUs, in the suite's order, each
recording its lane; bad values and CPU suites refused in one line; a stopped sweep stops its lanes;
each lane's CUDA cells (and each profiled arm) timed on CPUs of its own (``--cpus-per-cell``, D114).

The scheduling tests replace ``runner.run_one`` (which would start a CUDA cell process) with a
recorder: the CPU machine has no GPU, and what is pinned here is which GPUs each cell is given
and when, not the cell itself (tests/test_runner.py runs real cell processes)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_bench import lanes, runner
from forge_bench.cli import app
from forge_bench.suite import load_suite

CUDA_SUITE = """
device: cuda
dtype: bfloat16
warmup_steps: 1
timed_steps: 2
repeats: 1
parity: {enabled: false}
grids:
  - {name: one, models: [tiny-llama], batch: [1], seq: [8], methods: [sgd, adamw_fused, no_optimizer, adamw_foreach]}
  - {name: two, models: [tiny-llama], batch: [2], seq: [8], methods: [forge_dp_bf16], world_size: [2]}
  - {name: last, models: [tiny-llama], batch: [1], seq: [16], methods: [sgd]}
"""


def cuda_suite(tmp_path: Path):
    path = tmp_path / "lanes.yaml"
    path.write_text(CUDA_SUITE)
    return load_suite(path)


class Recorder:
    """Stands in for run_one: notes each cell's lane and its start / end, holds the cell a while."""

    def __init__(self, hold_s: float = 0.3):
        self.hold_s = hold_s
        self.calls: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, suite, cell, out_dir, run_id, tick=None, tune_cache=None, threads=None, lane=None):
        record = {"cell": cell.cell_id, "world": cell.world_size, "lane": dict(lane or {}), "start": time.monotonic()}
        with self.lock:
            self.calls.append(record)
        end = time.monotonic() + self.hold_s
        while time.monotonic() < end:
            if tick:
                tick()
            time.sleep(0.02)
        record["end"] = time.monotonic()
        return {"status": "ok", "cell_id": cell.cell_id}


def test_cells_run_side_by_side_on_disjoint_gpus_in_the_suites_order(tmp_path, monkeypatch):
    suite = cuda_suite(tmp_path)
    recorder = Recorder()
    monkeypatch.setattr(runner, "run_one", recorder)
    run_id, outcomes = runner.run_sweep(suite, suite.cells, tmp_path / "out", gpus=["0", "1", "2"])

    assert [o.cell.cell_id for o in outcomes] == [c.cell_id for c in suite.cells], "outcomes in the suite's order"
    assert sorted(c["cell"] for c in recorder.calls) == sorted(c.cell_id for c in suite.cells), "each cell once"
    order = [c.cell_id for c in suite.cells]
    starts = sorted(recorder.calls, key=lambda c: c["start"])
    assert [c["cell"] for c in starts] == order, "no cell starts before one listed earlier"
    for call in recorder.calls:
        gpus = call["lane"][lanes.VISIBLE].split(",")
        assert len(gpus) == call["world"] and set(gpus) <= {"0", "1", "2"}
        assert int(call["lane"][lanes.CELLS_BESIDE]) <= 2
    for a in recorder.calls:          # cells that overlapped in time never shared a GPU
        for b in recorder.calls:
            if a is not b and a["start"] < b["end"] and b["start"] < a["end"]:
                assert not set(a["lane"][lanes.VISIBLE].split(",")) & set(b["lane"][lanes.VISIBLE].split(","))
    first_three = starts[:3]
    assert max(c["start"] for c in first_three) < min(c["end"] for c in first_three), "three one-GPU cells at once"
    assert (tmp_path / "out" / runner.MANIFEST).is_file() and run_id


def test_a_cell_wider_than_the_pool_gets_every_gpu(tmp_path, monkeypatch):
    suite = cuda_suite(tmp_path)
    recorder = Recorder(hold_s=0.05)
    monkeypatch.setattr(runner, "run_one", recorder)
    wide = [c for c in suite.cells if c.world_size == 2]
    runner.run_sweep(suite, wide, tmp_path / "out", gpus=["5"])
    (call,) = recorder.calls
    assert call["lane"] == {lanes.VISIBLE: "5", lanes.ORDER: "PCI_BUS_ID", lanes.CELLS_BESIDE: "0"}


def test_stop_after_starts_no_cell_once_the_time_is_up(tmp_path, monkeypatch):
    suite = cuda_suite(tmp_path)
    recorder = Recorder(hold_s=0.4)
    monkeypatch.setattr(runner, "run_one", recorder)
    _, outcomes = runner.run_sweep(suite, suite.cells, tmp_path / "out", gpus=["0", "1"], stop_after_s=0.2)
    assert len(outcomes) == len(recorder.calls) == 2, "the two cells started at once finish; no later one starts"


def test_a_stopped_sweep_stops_the_cells_beside(tmp_path, monkeypatch):
    suite = cuda_suite(tmp_path)
    recorder = Recorder(hold_s=30.0)
    monkeypatch.setattr(runner, "run_one", recorder)

    def on_start(cell, index, total):
        if index == 2:
            raise KeyboardInterrupt

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        runner.run_sweep(suite, suite.cells, tmp_path / "out", gpus=["0", "1", "2"], on_start=on_start)
    assert time.monotonic() - t0 < 10.0, "the running cells were stopped, not waited for"
    assert len(recorder.calls) == 2 and all("end" not in c for c in recorder.calls)


def test_a_cell_records_its_lane_and_a_lone_cell_records_none(monkeypatch):
    monkeypatch.delenv(lanes.CELLS_BESIDE, raising=False)
    assert lanes.lane_extra() == {}
    monkeypatch.setenv(lanes.VISIBLE, "2,3")
    monkeypatch.setenv(lanes.CELLS_BESIDE, "1")
    assert lanes.lane_extra() == {"gpus": "2,3", "cells_beside": 1}
    env = runner._child_env(None, None, None)
    assert lanes.CELLS_BESIDE not in env, "a cell run alone does not inherit a lane mark"
    env = runner._child_env(None, None, lanes.child_env(["1"], 0))
    assert (env[lanes.VISIBLE], env[lanes.CELLS_BESIDE]) == ("1", "0")


@pytest.mark.parametrize("value, message", [
    ("", "name at least one GPU"),
    ("0,1,0", "GPU 0 named more than once"),
])
def test_bad_gpu_lists_are_refused_in_one_line(value, message):
    with pytest.raises(lanes.LaneError, match=message):
        lanes.parse_gpus(value)


def test_the_cli_refuses_gpus_for_a_cpu_suite_and_a_repeated_gpu(tmp_path):
    cli = CliRunner()
    result = cli.invoke(app, ["sweep", "--out", str(tmp_path / "out"), "--gpus", "0,1"])
    assert result.exit_code != 0 and "--gpus runs CUDA cells side by side" in result.output
    suite = tmp_path / "lanes.yaml"
    suite.write_text(CUDA_SUITE)
    result = cli.invoke(app, ["sweep", str(suite), "--out", str(tmp_path / "out"), "--gpus", "1,1"])
    assert result.exit_code != 0 and "GPU 1 named more than once" in result.output
    assert not (tmp_path / "out").exists(), "a refused sweep writes nothing"


class FakeNvml:
    def nvmlDeviceGetHandleByIndex(self, index):
        return ("index", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("uuid", uuid)


@pytest.mark.parametrize("visible, cuda_index, handle", [
    (None, 1, ("index", 1)),                       # every GPU visible: CUDA's index is the host's
    ("2,3", 0, ("index", 2)),                      # a lane on GPUs 2 and 3: rank 0 reads GPU 2, not GPU 0
    ("2,3", 1, ("index", 3)),
    ("GPU-7f1c", 0, ("uuid", "GPU-7f1c")),
])
def test_telemetry_reads_the_gpu_the_cell_runs_on(monkeypatch, visible, cuda_index, handle):
    from forge_bench import telemetry
    if visible is None:
        monkeypatch.delenv(lanes.VISIBLE, raising=False)
    else:
        monkeypatch.setenv(lanes.VISIBLE, visible)
    assert telemetry.nvml_handle(FakeNvml(), cuda_index) == handle


def test_real_cell_processes_beside_each_other_write_their_rows_with_their_lane(tmp_path, monkeypatch):
    """End to end with cell processes: the sweep's own availability check is skipped so that each
    CUDA cell really starts; on this GPU-less machine each process then writes its `unavailable`
    row itself, with the lane it was given."""
    import json

    from forge_bench import methods, results
    path = tmp_path / "one_gpu.yaml"
    path.write_text(CUDA_SUITE.split("  - {name: two")[0])
    suite = load_suite(path)
    monkeypatch.setattr(methods.Method, "unavailable_reason", lambda self, *args, **kwargs: None)
    _, outcomes = runner.run_sweep(suite, suite.cells, tmp_path / "out", gpus=["0", "1"])
    frame = results.load_results(tmp_path / "out")
    assert len(frame) == len(suite.cells) == len(outcomes) == 4
    assert set(frame["status"]) == {"unavailable"}
    assert frame["reason"].str.contains("no CUDA device is visible").all()
    lanes_seen = [json.loads(e) for e in frame["extra"]]
    assert {e["gpus"] for e in lanes_seen} <= {"0", "1"} and all(e["cells_beside"] in (0, 1) for e in lanes_seen)


def test_two_sweeps_of_one_host_never_share_a_gpu(tmp_path):
    """Two pools over the same GPUs (two sweep processes: separate lock files' descriptors conflict
    as across processes): the second takes what the first does not hold, counts the first's cell
    beside it, and waits for a GPU the first holds until it is given back."""
    first = lanes.GpuPool(["0", "1"], lanes.GpuClaims(str(tmp_path)))
    second = lanes.GpuPool(["0", "1"], lanes.GpuClaims(str(tmp_path)))
    assert first.take(1) == (["0"], 0)
    assert second.take(1) == (["1"], 1)
    waited: dict = {}
    thread = threading.Thread(target=lambda: waited.setdefault("lane", second.take(1)))
    thread.start()
    time.sleep(0.7)
    assert "lane" not in waited             # GPU 0 is the first sweep's, GPU 1 its own: it waits
    first.give_back(["0"])
    thread.join(timeout=5)
    assert waited["lane"] == (["0"], 1)


def test_a_waiting_take_gives_up_when_told(tmp_path):
    holder = lanes.GpuPool(["3"], lanes.GpuClaims(str(tmp_path)))
    waiting = lanes.GpuPool(["3"], lanes.GpuClaims(str(tmp_path)))
    assert holder.take(1) == (["3"], 0)
    deadline = time.monotonic() + 0.3
    assert waiting.take(1, give_up=lambda: time.monotonic() > deadline) is None
    holder.give_back(["3"])
    assert waiting.take(1) == (["3"], 0)


def test_gpu_names_become_lock_file_names(tmp_path):
    claims = lanes.GpuClaims(str(tmp_path))
    assert claims.claim("GPU-1a2b/3c")
    assert [p.name for p in tmp_path.iterdir()] == ["GPU-1a2b_3c.lock"]
    claims.release("GPU-1a2b/3c")


@pytest.mark.parametrize("lane_count, per_cell, available, expected", [
    (1, 2, list(range(16)), [[14, 15]]),
    (4, 2, list(range(16)), [[14, 15], [12, 13], [10, 11], [8, 9]]),
    (2, 3, [9, 1, 5, 3, 7, 11, 13], [[9, 11, 13], [3, 5, 7]]),   # the sweep's own CPUs, in order
    (1, 2, [0, 1], []),              # no CPU would be left over for the sweep and the system
    (2, 2, [0, 1, 2, 3], []),
    (1, 0, list(range(16)), []),     # --cpus-per-cell 0: unpinned
])
def test_each_lane_gets_cpus_of_its_own_the_highest_first(lane_count, per_cell, available, expected):
    assert lanes.cpu_sets(lane_count, per_cell, available) == expected


def test_every_thread_of_the_process_moves_onto_the_given_cpus():
    if not hasattr(lanes.os, "sched_setaffinity"):
        pytest.skip("this OS has no per-thread CPU affinity")
    before = sorted(lanes.os.sched_getaffinity(0))
    waiting = threading.Event()
    worker = threading.Thread(target=waiting.wait, daemon=True)
    worker.start()
    try:
        assert lanes.pin_threads([before[-1]]) == [before[-1]]
        tids = [int(name) for name in lanes.os.listdir("/proc/self/task")]
        assert len(tids) >= 2
        assert all(lanes.os.sched_getaffinity(tid) == {before[-1]} for tid in tids)
    finally:
        for name in lanes.os.listdir("/proc/self/task"):
            lanes.os.sched_setaffinity(int(name), before)
        waiting.set()
        worker.join()
    assert lanes.pin_threads([]) == []


def test_a_malformed_cpu_list_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(lanes.CPUS, "14,x")
    with pytest.raises(lanes.LaneError, match=r"FORGE_BENCH_CPUS='14,x': expected comma-separated CPU numbers"):
        lanes.cpus_from_env()
    monkeypatch.setenv(lanes.CPUS, "14, 15")
    assert lanes.cpus_from_env() == [14, 15]
    monkeypatch.delenv(lanes.CPUS)
    assert lanes.cpus_from_env() == []


def test_the_cells_of_a_lane_share_its_cpus_and_lanes_never_share(tmp_path, monkeypatch):
    suite = cuda_suite(tmp_path)
    monkeypatch.setattr(lanes, "cpu_sets", lambda count, per_cell, available=None:
                        [[15 - 2 * i - 1, 15 - 2 * i] for i in range(count)] if per_cell else [])
    recorder = Recorder(hold_s=0.05)
    monkeypatch.setattr(runner, "run_one", recorder)
    runner.run_sweep(suite, suite.cells, tmp_path / "out", gpus=["0", "1"], cpus_per_cell=2)
    by_gpu = {call["lane"][lanes.VISIBLE].split(",")[0]: call["lane"][lanes.CPUS] for call in recorder.calls}
    assert by_gpu == {"0": "14,15", "1": "12,13"}
    recorder.calls.clear()
    runner.run_sweep(suite, suite.cells[:1], tmp_path / "alone", cpus_per_cell=2)     # one lane: no --gpus
    assert recorder.calls[0]["lane"] == {lanes.CPUS: "14,15"}
    recorder.calls.clear()
    runner.run_sweep(suite, suite.cells[:1], tmp_path / "unpinned", cpus_per_cell=0)
    assert recorder.calls[0]["lane"] == {}


def test_a_cpu_suite_is_never_pinned_and_an_inherited_cpu_list_does_not_leak(tmp_path, monkeypatch):
    path = tmp_path / "cpu.yaml"
    path.write_text(CUDA_SUITE.replace("device: cuda", "device: cpu").replace("dtype: bfloat16", "dtype: float32")
                    .split("  - {name: two")[0])
    suite = load_suite(path)
    recorder = Recorder(hold_s=0.0)
    monkeypatch.setattr(runner, "run_one", recorder)
    runner.run_sweep(suite, suite.cells[:1], tmp_path / "out", cpus_per_cell=2)
    assert recorder.calls[0]["lane"] == {}
    monkeypatch.setenv(lanes.CPUS, "3")
    assert lanes.CPUS not in runner._child_env(suite.cells[0])


def test_a_profiled_arm_measures_on_the_cpus_every_arm_gets_and_none_are_spared_on_a_small_host(monkeypatch):
    from forge_bench.profile import common

    if not hasattr(lanes.os, "sched_setaffinity"):
        pytest.skip("this OS has no per-thread CPU affinity")
    before = sorted(lanes.os.sched_getaffinity(0))
    monkeypatch.setattr(lanes, "cpu_sets", lambda count, per_cell, available=None: [])
    assert common.pin_measured_threads() == []
    assert sorted(lanes.os.sched_getaffinity(0)) == before, "a host without CPUs to spare is left as it is"
    monkeypatch.setattr(lanes, "cpu_sets", lambda count, per_cell, available=None: [[before[0]]])
    try:
        assert common.pin_measured_threads() == [before[0]]
        assert all(lanes.os.sched_getaffinity(int(t)) == {before[0]} for t in lanes.os.listdir("/proc/self/task"))
    finally:
        for name in lanes.os.listdir("/proc/self/task"):
            lanes.os.sched_setaffinity(int(name), before)


def test_cpus_the_os_refuses_leave_the_window_unpinned_with_a_warning(monkeypatch):
    if not hasattr(lanes.os, "sched_setaffinity"):
        pytest.skip("this OS has no per-thread CPU affinity")
    before = lanes.os.sched_getaffinity(0)
    real = lanes.os.sched_setaffinity
    calls = []

    def refuse_once(tid, cpus):
        calls.append(set(cpus))
        if len(calls) == 1:
            raise OSError(22, "Invalid argument")
        real(tid, cpus)

    monkeypatch.setattr(lanes.os, "sched_setaffinity", refuse_once)
    with pytest.warns(UserWarning, match=r"timed window left unpinned: CPUs 999 refused"):
        assert lanes.pin_threads([999]) == []
    assert lanes.os.sched_getaffinity(0) == before and all(c == set(before) for c in calls[1:])
