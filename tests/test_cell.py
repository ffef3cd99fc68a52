"""One cell in-process: the row it writes for each outcome, the timing statistics, the gate."""
from __future__ import annotations

import json

import pytest
import torch

from forge_bench import telemetry, cell as cell_mod
from forge_bench import methods, results
from forge_bench.methods import METHODS
from forge_bench.suite import load_suite

SUITE = """
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 3
repeats: 2
optimizer: {lr: 1.0e-3}
parity: {steps: 4, tolerance: 0.02}
models: [tiny-llama]
batch: [2]
seq: [16]
methods: [adamw_foreach, no_optimizer, test_diverge, test_oom_always, test_unavailable, test_wrong_adamw,
          test_no_lm_head]
"""


@pytest.fixture()
def suite(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(methods.PLUGINS_ENV, "forge_bench_test_arms")
    path = tmp_path / "cell_suite.yaml"
    path.write_text(SUITE)
    return load_suite(path)


def run(suite, method, out, attempt=1):
    c = next(c for c in suite.cells if c.method == method)
    code = cell_mod.run_cell(suite, c, out, "run-x", attempt)
    path = results.row_path(out, c.cell_id)
    return code, (results.load_results(path).iloc[0] if path.exists() else None)


def test_ok_row_is_complete(suite, tmp_path):
    code, row = run(suite, "adamw_foreach", tmp_path / "r")
    assert code == 0 and row.status == "ok"
    assert row.run_id == "run-x" and row.suite_hash == suite.sha256 and row.schema_version == results.SCHEMA_VERSION
    assert row.timing_method == "wall_clock" and len(row.step_ms_all) == 6
    assert len(row.step_ms_run_medians) == 2 and row.step_ms_median > 0
    assert row.tokens_per_s == pytest.approx(32 / (row.step_ms_median / 1000))
    assert row.peak_allocated_gib != row.peak_allocated_gib and "CPU" in row.peak_reason  # null (NaN in pandas)
    assert row.peak_process_gib != row.peak_process_gib                                 # null on a CPU too
    assert row.nvml_reason and row.sm_clock_mhz_before != row.sm_clock_mhz_before
    assert row.parity_steps == 4 and row.parity_rms_rel < 1e-5 and row.parity_model == "tiny-llama"
    assert row.mem_optimizer_states_gib == pytest.approx(2 * row.mem_weights_gib, rel=1e-3)
    assert row.n_params == 426624 and row.torch_version and row.source_hash and row.device_name
    assert json.loads(row.method_settings)["foreach"] is True
    assert row.warmup_steps == 1 and row.attempts == 1
    # the machine boot travels with the row, so the report can refuse time ratios across hosts
    extra = json.loads(row.extra or "{}")
    assert extra.get("boot_id") == telemetry.boot_id()
    # the preparation, the gate, the measurement and the row each timed (no startup in-process: no
    # sweep spawned it), adding up to no more than the cell's wall time
    assert set(extra["phase_s"]) == {"prepare", "parity", "timing", "finish"}
    assert all(seconds > 0 for seconds in extra["phase_s"].values())
    assert sum(extra["phase_s"].values()) <= row.wall_s


def test_no_gate_for_arms_without_a_reference(suite, tmp_path):
    _, row = run(suite, "no_optimizer", tmp_path / "r")
    assert row.status == "ok" and row.parity_steps == 0 and row.parity_rms_rel != row.parity_rms_rel  # NaN
    assert row.mem_optimizer_states_gib == 0


def test_parity_gate_failure_gives_no_timing(suite, tmp_path):
    _, row = run(suite, "test_wrong_adamw", tmp_path / "r")
    assert row.status == "parity_fail"
    assert row.parity_rms_rel > 0.02 and "tolerance" in row.reason
    assert row.step_ms_median != row.step_ms_median  # NaN: no timing


def test_diverged(suite, tmp_path):
    _, row = run(suite, "test_diverge", tmp_path / "r")
    assert row.status == "diverged" and "non-finite loss" in row.reason


def test_unavailable(suite, tmp_path):
    _, row = run(suite, "test_unavailable", tmp_path / "r")
    assert row.status == "unavailable" and "does not exist" in row.reason


def test_unavailable_on_the_model_is_a_row_not_a_crash(suite, tmp_path):
    """A build that cannot run on the cell's model (ArmUnavailable) writes an unavailable row."""
    code, row = run(suite, "test_no_lm_head", tmp_path / "r")
    assert code == 0 and row.status == "unavailable" and "no nn.Linear LM head" in row.reason


def test_oom_asks_for_one_retry_then_records(suite, tmp_path):
    code, row = run(suite, "test_oom_always", tmp_path / "r", attempt=1)
    assert code == cell_mod.EXIT_OOM_RETRY and row is None
    code, row = run(suite, "test_oom_always", tmp_path / "r", attempt=2)
    assert code == 0 and row.status == "oom" and row.attempts == 2 and "simulated" in row.reason


def _capture_that_ran_out_of_memory():
    """The exception a CUDA graph capture raises when an allocation inside it fails: capture_end's
    'unjoined work' error while handling the OOM, wrapped by GraphedStep (as on the H100, b4 s2048)."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB.")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: capturing stream has unjoined work")
    except RuntimeError as exc:
        try:
            raise RuntimeError(f"CUDA graph capture of the step failed: {cell_mod.capture_failure(exc)}") from exc
        except RuntimeError as wrapped:
            return wrapped


def test_an_oom_inside_a_graph_capture_is_an_oom_with_its_own_message():
    wrapped = _capture_that_ran_out_of_memory()
    assert cell_mod.is_oom(wrapped), "the OOM row and its fresh-process retry, not a 'crashed' row"
    assert str(wrapped) == ("CUDA graph capture of the step failed: OutOfMemoryError: CUDA out of memory. Tried to "
                            "allocate 224.00 MiB. (then RuntimeError: CUDA error: capturing stream has unjoined work)")
    assert not cell_mod.is_oom(RuntimeError("CUDA error: capturing stream has unjoined work"))
    assert cell_mod.capture_failure(ValueError("bad shape")) == "ValueError: bad shape"


def test_timing_statistics():
    cols = cell_mod.timing_columns([[1.0, 2.0, 3.0, 4.0, 100.0], [2.0, 2.0, 2.0, 2.0, 2.0]], tokens_per_step=1000)
    assert cols["step_ms_run_medians"] == [3.0, 2.0]
    assert cols["step_ms_median"] == 2.5
    assert cols["step_ms_run_spreads"] == [pytest.approx(2.0 / 3.0), 0.0]
    assert cols["step_ms_spread_max"] == pytest.approx(2.0 / 3.0)
    assert cols["tokens_per_s"] == pytest.approx(400_000)
    assert cols["step_ms_p10"] == pytest.approx(1.9) and len(cols["step_ms_all"]) == 10


def test_predicted_memory_of_the_headline_cell():
    s = load_suite("suites/h100_llama8b.yaml")
    c = next(c for c in s.cells if c.method == "adamw_fused" and c.batch == 1 and c.seq == 512)
    need = cell_mod.predicted_bytes(c, METHODS["adamw_fused"])
    n = 8_030_261_248
    assert need["weights"] == 2 * n and need["optimizer_states"] == 4 * n and need["gradients"] == 2 * n
    assert 55 * 2**30 < need["total"] < 70 * 2**30            # ~60 GiB measured
    forge = cell_mod.predicted_bytes(next(x for x in s.cells if x.method == "forge_int8"), METHODS["forge_int8"])
    assert forge["total"] < need["total"] and forge["gradients"] == 0
    fp32 = cell_mod.predicted_bytes(next(x for x in s.cells if x.method == "forge_fp32"), METHODS["forge_fp32"])
    assert fp32["total"] > 75 * 2**30                          # at the edge of one H100 (80 GB)


GRAPH_SUITE = """
device: cuda
dtype: bfloat16
warmup_steps: 5
timed_steps: 4
repeats: 2
optimizer: {lr: 1.0e-3}
parity: {steps: 4, tolerance: 0.05}
grids:
  - {name: graph, models: [tiny-llama], batch: [2], seq: [64], cuda_graph: true,
     methods: [no_optimizer, adamw_fused, forge_bf16, forge_int8, bnb_adamw8bit, forge_bf16_cce, forge_int8_cce,
               adamw_fused_cce]}
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("method", ["no_optimizer", "adamw_fused", "forge_bf16", "forge_int8", "forge_bf16_cce",
                                    "forge_int8_cce", "adamw_fused_cce"])
def test_graph_cell_replays_the_captured_step(tmp_path, method):
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH_SUITE)
    suite = load_suite(path)
    code, row = run(suite, method, tmp_path / "r")
    assert code == 0 and row.status == "ok", row.reason
    assert row.timing_method == "cuda_graph_replay" and len(row.step_ms_all) == 8
    assert row.peak_allocated_gib > row.mem_weights_gib        # the capture's activations are counted
    # the process peak covers the eager warm-up and the tile tuning before the capture, and the window
    assert row.peak_process_gib >= row.peak_allocated_gib
    assert row.loss_last == row.loss_last and row.loss_last != row.loss_first   # the replays train
    if method.startswith("forge") or method.startswith("adamw_fused"):
        assert json.loads(row.method_settings)["capturable"] is True
    if method.endswith("_cce"):
        assert json.loads(row.method_settings)["chunk_size"] == 512     # tiny-llama's whole vocabulary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the process peak is read from the CUDA allocator")
def test_eager_cell_process_peak_covers_the_steps_before_the_window(tmp_path):
    path = tmp_path / "eager.yaml"
    path.write_text(GRAPH_SUITE.replace("cuda_graph: true", "cuda_graph: false"))
    code, row = run(load_suite(path), "forge_bf16", tmp_path / "r")
    assert code == 0 and row.status == "ok", row.reason
    assert row.peak_process_gib >= row.peak_allocated_gib > row.mem_weights_gib


def test_graph_cell_of_an_arm_that_cannot_be_captured_is_unavailable(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("a cuda suite's cells need a CUDA device to be planned as unavailable for the graph reason")
    path = tmp_path / "graph.yaml"
    path.write_text(GRAPH_SUITE)
    code, row = run(load_suite(path), "bnb_adamw8bit", tmp_path / "r")
    assert code == 0 and row.status == "unavailable" and "CUDA graph" in row.reason


@pytest.mark.slow
def test_lean_cell_row_says_so_and_passes_the_parity_gate(tmp_path):
    """activations: lean goes on the arm (timed and gated); the gate's fp32 reference stays plain."""
    path = tmp_path / "lean.yaml"
    path.write_text(SUITE.split("models:")[0] + "grids:\n  - {name: lean, models: [tiny-llama], batch: [2], "
                    "seq: [16], activations: lean, methods: [adamw_foreach]}\n")
    suite = load_suite(path)
    assert [c.activations for c in suite.cells] == ["lean"]
    code, row = run(suite, "adamw_foreach", tmp_path / "r")
    assert code == 0 and row.status == "ok", row.reason
    assert row.activations == "lean" and row.parity_rms_rel < 1e-5


def test_a_grid_that_sets_its_repeats_times_that_many(tmp_path):
    """A grid's ``repeats`` replaces the suite's for its cells: the window's runs and the row say so."""
    path = tmp_path / "repeats.yaml"
    path.write_text(SUITE.split("models:")[0] + "grids:\n  - {name: more, models: [tiny-llama], batch: [2], "
                    "seq: [16], repeats: 4, methods: [no_optimizer]}\n")
    suite = load_suite(path)
    code, row = run(suite, "no_optimizer", tmp_path / "r")
    assert code == 0 and row.status == "ok", row.reason
    assert row.repeats == 4 and len(row.step_ms_run_medians) == 4 and len(row.step_ms_all) == 4 * 3


def test_hf_cell_row_says_hf(suite, tmp_path):
    code, row = run(suite, "no_optimizer", tmp_path / "r")
    assert code == 0 and row.activations == "hf"



def test_a_row_records_the_forge_switches_it_ran_with_but_not_the_harness_own(suite, tmp_path, monkeypatch):
    """A fixed tile or the Python hook changes a row's speed: the row says so (``extra.forge_env``)."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    monkeypatch.setenv("FORGE_NATIVE_HOOKS", "0")
    monkeypatch.setenv("FORGE_BENCH_GIT_COMMIT", "abc")
    _, row = run(suite, "adamw_foreach", tmp_path / "r")
    extra = json.loads(row.extra)
    assert {k: v for k, v in extra["forge_env"].items() if k in ("FORGE_AUTOTUNE", "FORGE_NATIVE_HOOKS")} == \
        {"FORGE_AUTOTUNE": "0", "FORGE_NATIVE_HOOKS": "0"}
    assert not any(name.startswith("FORGE_BENCH_") for name in extra["forge_env"])
