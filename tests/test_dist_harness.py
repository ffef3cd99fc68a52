"""The harness's parallel axis: suites with world sizes and bucket sizes, a distributed cell as one
torchrun process tree (gloo ranks on the CPU) that writes one row, its failures as one row each, and
the report's distributed section."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from forge_bench import methods, results, runner
from forge_bench.report import build_report
from forge_bench.suite import SuiteError, load_suite

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

AXES = """
device: cpu
dtype: float32
parity: {enabled: false}
grids:
  - name: g
    models: [tiny-llama]
    batch: [2]
    seq: [16]
    methods: [sgd, forge_dp_bf16, forge_tp_bf16]
    world_size: [1, 2]
    bucket_cap_mb: [1, 25]
"""

SWEEP = """
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 1
timeout_s: 300
parity: {enabled: false}
grids:
  - {name: ok, models: [tiny-llama], batch: [2], seq: [16], world_size: [2],
     methods: [forge_dp_bf16, forge_fsdp2_bf16, forge_tp_bf16, test_dist_crash, test_dist_oom_once]}
  - {name: hang, models: [tiny-llama], batch: [2], seq: [16], world_size: [2], methods: [test_dist_hang], timeout_s: 20}
  - {name: one, models: [tiny-llama], batch: [2], seq: [16], world_size: [2], methods: [sgd]}
"""


def write_suite(tmp_path: Path, text: str, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_world_size_and_bucket_axes_expand_only_where_they_apply(tmp_path):
    suite = load_suite(write_suite(tmp_path, AXES, "axes"))
    labels = [cell.label for cell in suite.cells]
    # a one-process arm: a cell per world size (the one at 2 is unavailable), no bucket
    assert "g/tiny-llama/b2/s16/sgd" in labels and "g/tiny-llama/b2/s16/sgd/w2" in labels
    # data parallel: world size x bucket; tensor parallel: world size only
    for world in (1, 2):
        for bucket in (1, 25):
            assert f"g/tiny-llama/b2/s16/forge_dp_bf16/w{world}/bucket{bucket}" in labels
        assert f"g/tiny-llama/b2/s16/forge_tp_bf16/w{world}" in labels
    assert len(suite.cells) == 2 + 4 + 2
    assert len({cell.cell_id for cell in suite.cells}) == len(suite.cells)
    assert all(c.world_size == int(c.label.split("/w")[1].split("/")[0]) for c in suite.cells if "/w" in c.label)
    assert [c.cell_id for c in suite.select("*/w2*")] == [c.cell_id for c in suite.cells if c.world_size == 2]


@pytest.mark.parametrize("field, value, message", [
    ("world_size", "[0]", "expected positive integers"),
    ("world_size", "[true]", "world_size"),
    ("bucket_cap_mb", "[0]", "expected sizes > 0 MB"),
])
def test_bad_parallel_axes_are_one_line_errors(tmp_path, field, value, message):
    text = AXES.replace("    world_size: [1, 2]\n    bucket_cap_mb: [1, 25]\n", f"    {field}: {value}\n")
    with pytest.raises(SuiteError, match=message) as error:
        load_suite(write_suite(tmp_path, text, "bad"))
    assert "\n" not in str(error.value)


def test_availability_names_what_a_distributed_cell_lacks():
    sgd, dp = methods.get_method("sgd"), methods.get_method("forge_dp_bf16")
    assert "runs in one process; world_size must be 1" in sgd.unavailable_reason("cpu", world_size=2)
    assert dp.unavailable_reason("cpu", world_size=2) is None
    cuda_reason = dp.unavailable_reason("cuda", world_size=64)
    assert cuda_reason is not None and ("needs 64 CUDA devices" in cuda_reason or "NCCL" in cuda_reason)


@pytest.fixture()
def plugin_env(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(methods.PLUGINS_ENV, "forge_bench_test_arms")
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(TESTS), *inherited]))
    monkeypatch.setenv("FORGE_BENCH_TEST_OOM_FLAG", str(tmp_path / "oom-once.flag"))
    methods.load_plugins()
    return tmp_path


@pytest.mark.slow
def test_distributed_cells_are_torchrun_trees_with_one_row_each(plugin_env):
    tmp_path = plugin_env
    suite = load_suite(write_suite(tmp_path, SWEEP, "dist_sweep"))
    out = tmp_path / "results"
    run_id, outcomes = runner.run_sweep(suite, list(suite.cells), out)
    frame = results.load_results(out).set_index("method")
    assert len(frame) == len(suite.cells) == 7

    for method, strategy in (("forge_dp_bf16", "dp"), ("forge_fsdp2_bf16", "fsdp2"), ("forge_tp_bf16", "tp")):
        row = frame.loc[method]
        assert row["status"] == "ok", row["stderr_tail"]
        assert (row["world_size"], row["strategy"]) == (2, strategy)
        extra = json.loads(row["extra"])
        assert len(extra["step_ms_median_per_rank"]) == 2
        assert extra["tokens_per_step"] == (2 * 2 * 16 if strategy != "tp" else 2 * 16)
        assert row["n_fused_params"] > 0
    assert frame.loc["forge_dp_bf16", "bucket_cap_mb"] == 25.0
    assert pd.isna(frame.loc["forge_tp_bf16", "bucket_cap_mb"])

    crashed = frame.loc["test_dist_crash"]
    assert crashed["status"] == "crashed" and "boom: simulated crash on rank 1" in crashed["stderr_tail"]
    retried = frame.loc["test_dist_oom_once"]
    assert (retried["status"], retried["attempts"]) == ("ok", 2)
    assert frame.loc["test_dist_hang", "status"] == "timeout"
    assert frame.loc["sgd", "status"] == "unavailable"

    report = build_report(out, tmp_path / "report", formats=("png",))
    details = (report.parent / "index.md").read_text()
    assert "## Across GPUs" in details and "`forge_tp_bf16`" in details
    table = pd.read_csv(report.parent / "tables" / "distributed.csv")
    assert set(table["method"]) == {"forge_dp_bf16", "forge_fsdp2_bf16", "forge_tp_bf16", "test_dist_oom_once"}


def test_a_distributed_row_takes_the_largest_ranks_peaks(plugin_env):
    """Rank 0's row: the window peak and the whole-process peak are each the largest rank's (a run fits
    only where its fullest rank fits), every rank's window peak kept in extra."""
    import time

    from forge_bench import dist_cell, telemetry

    suite = load_suite(write_suite(plugin_env, SWEEP, "dist_row"))
    cell = next(c for c in suite.cells if c.method == "forge_dp_bf16")
    rank = {"run_ms": [[10.0, 11.0, 12.0]], "host_ms": [1.0], "losses": [2.0, 1.9, 1.8], "finite": True,
            "peak_reserved_gib": 9.0, "breakdown": {"weights": 1 << 30}, "n_params": 10, "n_fused_params": 8,
            "settings": {}}
    gathered = [{**rank, "rank": 0, "peak_allocated_gib": 5.0, "peak_process_gib": 5.5},
                {**rank, "rank": 1, "peak_allocated_gib": 6.0, "peak_process_gib": 6.25}]
    row = dist_cell.cell_row(suite, cell, methods.get_method(cell.method), "run", 1, gathered,
                             telemetry.cpu_nvml_columns(), "start", time.time())
    assert row["peak_allocated_gib"] == 6.0 and row["peak_process_gib"] == 6.25
    assert row["extra"]["peak_allocated_gib_per_rank"] == [5.0, 6.0]


def _dist_row(method: str, peak: float, ms: float, spread: float = 0.01, **extra) -> dict:
    """A measured distributed row with what the target table reads (one run, one device, one clock)."""
    return {"run_id": "r1", "device_name": "NVIDIA H200", "torch_version": "2.11", "triton_version": "3.6",
            "cuda_version": "13.0", "status": "ok", "method": method, "world_size": 2, "bucket_cap_mb": None,
            "peak_allocated_gib": peak, "step_ms_median": ms, "step_ms_spread_max": spread,
            "sm_clock_mhz_after": 1500.0, "n_params": 2 ** 30, **extra}


@pytest.mark.parametrize("forge_ms, spread, fsdp_delta, dp_verdict, fsdp_verdict, speed_text", [
    (95.0, 0.01, -0.5, "met", "met", "1.05×"),
    (103.0, 0.08, 0.002, "met", "met (parity)", "~0.97×"),   # 3% slower inside both cells' noise; a 2 MiB peak gap
    (120.0, 0.01, 0.5, "not met", "not met", "0.83×"),      # 20% slower, outside the noise; FSDP2 0.5 GiB above
])
def test_distributed_targets_read_noise_and_parity_as_the_report_does(forge_ms, spread, fsdp_delta, dp_verdict,
                                                                         fsdp_verdict, speed_text):
    from forge_bench.report.distributed import target_table
    rows = [_dist_row("ddp_adamw_fused", 40.0, 100.0, spread, bucket_cap_mb=25.0),
            _dist_row("forge_dp_bf16", 38.0, forge_ms, spread, bucket_cap_mb=25.0),   # saves the whole 2 GiB pool
            _dist_row("fsdp2_adamw", 30.0, 100.0), _dist_row("forge_fsdp2_bf16", 30.0 + fsdp_delta, 100.0)]
    keys = {"run_id": "r1", "device_name": "NVIDIA H200", "model": "m", "dtype": "bfloat16", "batch": 2, "seq": 16,
            "timing": "eager", "activations": "hf"}
    table = target_table(keys, rows, [2])
    (line,) = table.rows
    assert (line[6], line[8]) == (dp_verdict, fsdp_verdict)
    assert (line[4], line[5]) == ("100%", speed_text)


def test_the_first_page_counts_a_distributed_folder_and_points_to_its_section(tmp_path):
    from forge_bench.report.summary import summary_markdown
    dist = pd.DataFrame([_dist_row("forge_dp_bf16", 38.0, 100.0), _dist_row("ddp_adamw_fused", 40.0, 100.0)])
    page = summary_markdown(dist.iloc[0:0], "`x`", "index.md", dist)
    assert "2 rows (2 ok) from `x`: 1 run on H200" in page
    assert "2 of them are distributed cells (world sizes 2)" in page and "index.md#across-gpus" in page
