"""``forge-bench profile graph``'s trace analysis, on a hand-made trace whose answers are known."""
import pytest

from forge_bench.profile import graph as gp


def _kernel(name, ts, dur, stream, grid="[1, 1, 1]"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "grid": grid, "registers per thread": 128, "blocks per SM": 2.0}}


def _replay(t0):
    # main stream: GEMM 0-100, norm 100-120, GEMM 150-250; side stream: fused 50-130 (grid A), fused 300-340 (grid B)
    return [
        _kernel("nvjet_tst_128x256_h", t0 + 0, 100, 7),
        _kernel("_rms_norm_backward_kernel", t0 + 100, 20, 7),
        _kernel("nvjet_tst_128x256_h", t0 + 150, 100, 7),
        _kernel("_fused_wgrad_update_kernel", t0 + 50, 80, 20, grid="[8, 2, 1]"),
        _kernel("_fused_wgrad_update_kernel", t0 + 300, 40, 20, grid="[4, 2, 1]"),
    ]


def test_replays_are_split_at_pauses_and_measured():
    trace = {"traceEvents": _replay(0.0) + _replay(50_000.0) + [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 5}]}
    replays = gp.analyse_trace(trace)
    assert len(replays) == 2
    rep = replays[1]
    assert rep["span_ms"] == pytest.approx(0.340)
    # busy: 0-130, 150-250, 300-340 = 130 + 100 + 40 us
    assert rep["busy_ms"] == pytest.approx(0.270)
    assert rep["idle_ms"] == pytest.approx(0.070)
    assert rep["kernel_ms"] == pytest.approx(0.340)
    fused = rep["classes"]["fused update"]
    assert fused["launches"] == 2 and fused["ms"] == pytest.approx(0.120)
    assert fused["beside_other_ms"] == pytest.approx(0.070)        # 50-120 beside the GEMM and the norm
    assert rep["classes"]["GEMM"]["beside_other_ms"] == pytest.approx(0.050)
    assert rep["classes"]["norm"]["beside_other_ms"] == pytest.approx(0.020)
    assert rep["stream_busy_ms"] == {"7": pytest.approx(0.220), "20": pytest.approx(0.120)}
    by_grid = {g["grid"]: g for g in rep["fused_by_grid"]}
    assert by_grid["[8, 2, 1]"]["us_median"] == 80 and by_grid["[8, 2, 1]"]["alone"] == 0
    assert by_grid["[4, 2, 1]"]["us_median_alone"] == 40 and by_grid["[4, 2, 1]"]["alone"] == 1
    assert [(k["kernel"], k["launches"]) for k in rep["top_kernels"]] == [
        ("nvjet_tst_128x256_h", 2), ("_fused_wgrad_update_kernel", 2), ("_rms_norm_backward_kernel", 1)]
    assert rep["top_kernels"][0]["ms"] == pytest.approx(0.200)


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no kernel events"):
        gp.analyse_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})


def test_kernel_classes():
    assert gp.kernel_class("_fused_wgrad_update_kernel") == "fused update"
    assert gp.kernel_class("_ws_fused_kernel") == "fused update"          # the Gluon kernel (hopper_ws)
    assert gp.kernel_class("_row_update_kernel") == "fused update"        # the embedding's row update
    assert gp.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMM"
    assert gp.kernel_class("flash_bwd_kernel") == "attention"
    assert gp.kernel_class("void at::native::vectorized_elementwise_kernel") == "other"


def test_markdown_names_every_arm():
    res = {"method": "forge_bf16", "step_ms_median": 1.0, "timed": 20,
           "replays": gp.analyse_trace({"traceEvents": _replay(0.0)})}
    text = gp.to_markdown([res], "toy")
    assert "| forge_bf16 | 1.00 | 0.34 | 0.27 | 0.07 |" in text
    assert "| [8, 2, 1] | 1 | 0.08 | 80.0 | - (0) | 128 | 2.0 |" in text
    assert "| `nvjet_tst_128x256_h` | GEMM | 0.20 | 2 |" in text
