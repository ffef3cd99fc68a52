"""The timeline analysis on a hand-built Chrome trace: busy/idle, gap owners, blocking calls."""
import pytest

from forge_bench.profile.timeline import analyse_trace, to_markdown


def _x(name, cat, ts, dur, tid=1, corr=None):
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        event["args"] = {"correlation": corr}
    return event


def _trace():
    return {"traceEvents": [
        _x("forge_step_0", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 10, 30),
        _x("cudaLaunchKernel", "cuda_runtime", 20, 5, corr=1),
        # the backward runs on another thread: its op launches the kernel that ends the long gap
        _x("autograd::engine::evaluate_function: FusedLinearFunctionBackward", "cpu_op", 300, 400, tid=2),
        _x("aten::add", "cpu_op", 590, 20, tid=2),
        _x("cudaLaunchKernel", "cuda_runtime", 600, 5, tid=2, corr=2),
        _x("cudaStreamSynchronize", "cuda_runtime", 700, 250, corr=3),
        _x("gemm", "kernel", 30, 100, tid=7, corr=1),
        _x("add", "kernel", 610, 50, tid=7, corr=2),
        _x("outside", "kernel", 2000, 50, tid=7, corr=99),
    ]}


def test_busy_idle_and_gap_owner():
    result = analyse_trace(_trace())
    step = result["steps"][0]
    assert step["gpu_busy_ms"] == pytest.approx(0.150)
    assert step["gpu_span_ms"] == pytest.approx(0.630)
    assert step["gpu_idle_ms"] == pytest.approx(0.480)
    assert step["launches"] == 2
    (gap,) = step["top_gaps"]
    assert gap["gap_us"] == pytest.approx(480)
    assert gap["owner"] == "backward: FusedLinearFunctionBackward"
    assert gap["innermost"] == "aten::add"
    assert step["blocking_calls"]["cudaStreamSynchronize"]["count"] == 1
    assert step["blocking_calls"]["cudaStreamSynchronize"]["max_ms"] == pytest.approx(0.25)
    # the host's last runtime call ends at 950 us, the GPU at 660 us
    assert step["host_enqueue_done_before_gpu_end_ms"] == pytest.approx(-0.29)
    text = to_markdown([{"method": "m", **result}], "t")
    assert "backward: FusedLinearFunctionBackward" in text and "| m |" in text


def test_trace_without_step_ranges_is_a_clear_error():
    with pytest.raises(ValueError, match="forge_step_"):
        analyse_trace({"traceEvents": [_x("k", "kernel", 0, 1)]})
