"""The kernel benchmark's figure and energy columns, and the graph timing it shares with the cells
(the timing itself needs a GPU: tests/test_kernels.py)."""
import pandas as pd
import pytest

from forge_bench.profile.kernel import energy_columns, plot


def _row(shape, tokens, state_dtype, ratio):
    return dict(shape=shape, tokens=tokens, state_dtype=state_dtype, ratio_to_roofline=ratio,
                speedup_vs_baseline=1.0 / ratio, device="test GPU")


def test_plot_takes_a_frame_where_state_dtypes_cover_different_shapes(tmp_path):
    """A frame merged from runs with different --state-dtypes / --bts (int8 at every BT, bf16 at
    one) gets one slot per (shape, BT), not a bar-count mismatch."""
    frame = pd.DataFrame([_row("q", 512, "bf16", 1.5), _row("down", 512, "bf16", 1.4)]
                         + [_row(shape, tokens, "int8", 2.0) for tokens in (512, 2048) for shape in ("q", "down")])
    path = tmp_path / "bench.png"
    plot(frame, path)
    assert path.stat().st_size > 0


def test_plot_places_each_bar_at_its_own_shape(tmp_path, monkeypatch):
    import matplotlib.axes
    bars = []
    original = matplotlib.axes.Axes.bar

    def recording_bar(self, xs, heights, *args, **kwargs):
        bars.append((kwargs.get("label"), list(xs), list(heights)))
        return original(self, xs, heights, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    frame = pd.DataFrame([_row("q", 512, "int8", 2.0), _row("down", 512, "int8", 3.0), _row("down", 512, "bf16", 1.5)])
    plot(frame, tmp_path / "bench.png")
    ratio_bars = {label: (xs, heights) for label, xs, heights in bars[::2]}
    assert ratio_bars["int8 states"] == ([0, 1], [2.0, 3.0])
    xs, heights = ratio_bars["bf16 states"]
    assert heights == [1.5] and xs[0] == pytest.approx(1.4)        # the "down 512" slot, second bar


def test_energy_columns_add_the_gemm_and_the_copy_of_the_state_bytes():
    fused = {"ms": 0.3, "j": 0.12, "w": 400.0, "sm_mhz": 1980.0}
    gemm = {"ms": 0.1, "j": 0.05, "w": 500.0, "sm_mhz": 1980.0}
    other = {"ms": 0.2, "j": 0.07, "w": 350.0, "sm_mhz": 1980.0}
    copy = {"copy_j_per_byte": 5e-11, "copy_w": 400.0, "idle_w": 100.0}
    columns = energy_columns(fused, gemm, other, other, state_bytes=1e9, copy=copy)
    assert columns["traffic_j"] == pytest.approx(0.05)
    assert columns["energy_roofline_j"] == pytest.approx(0.10)
    assert columns["energy_ratio_to_roofline"] == pytest.approx(1.2)
    assert columns["fused_w"] == 400.0 and columns["baseline_j"] == 0.07
    # no counter: no energy columns; a counter without a copy measurement: joules, no roofline
    assert energy_columns({"ms": 0.3}, {"ms": 0.1}, {"ms": 0.2}, {"ms": 0.2}, 1e9, None) == {}
    assert "energy_ratio_to_roofline" not in energy_columns(fused, gemm, other, other, 1e9, None)
    assert energy_columns(fused, {"ms": 0.1, "energy_error": "lost"}, other, other, 1e9, copy) == {}


def test_plot_adds_the_energy_panel_when_the_frame_has_energy(tmp_path, monkeypatch):
    import matplotlib.axes
    heights = []
    original = matplotlib.axes.Axes.bar

    def recording_bar(self, xs, values, *args, **kwargs):
        heights.append(list(values))
        return original(self, xs, values, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    frame = pd.DataFrame([dict(_row("q", 512, "bf16", 1.5), energy_ratio_to_roofline=1.7),
                          dict(_row("down", 512, "bf16", 1.4), energy_ratio_to_roofline=1.3)])
    plot(frame, tmp_path / "bench.png")
    assert heights[2] == [1.7, 1.3]


def test_energy_counter_says_why_it_is_missing(monkeypatch):
    import builtins

    from forge_bench.telemetry import open_energy_counter

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    counter, reason = open_energy_counter(0)
    assert counter is None and reason.startswith("NVML energy counter unavailable: ImportError")


def test_dynamic_ratio_takes_idle_power_out_of_every_operation():
    copy = {"idle_w": 100.0, "copy_j_per_byte": 0.2e-9, "copy_w": 400.0}       # 0.15 J/GB above idle
    fused = {"j": 0.5, "ms": 1.0, "w": 500.0, "sm_mhz": 1800.0}
    gemm = {"j": 0.3, "ms": 1.0, "w": 300.0, "sm_mhz": 1800.0}
    # fused 0.5 - 0.1 = 0.4 J; work = (0.3 - 0.1) + 2 GB x 0.15 J/GB = 0.5 J
    assert energy_columns(fused, gemm, gemm, gemm, 2e9, copy)["dynamic_energy_ratio"] == pytest.approx(0.8)
    assert energy_columns({"ms": 1.0}, gemm, gemm, gemm, 2e9, copy) == {}
    assert "dynamic_energy_ratio" not in energy_columns(fused, gemm, gemm, gemm, 2e9, None)


class _FakeBoard:
    """An energy counter and a graph whose replays each spend a known number of joules."""

    def __init__(self, joules_per_replay: float):
        self.joules = 1000.0
        self.joules_per_replay = joules_per_replay
        self.replays = 0

    def read_j(self) -> float:
        return self.joules

    def sm_clock_mhz(self) -> float:
        return 1755.0

    def replay(self) -> None:
        self.replays += 1
        self.joules += self.joules_per_replay


class _DoneAfterOnePoll:
    def __init__(self):
        self.polls = 0

    def record(self):
        pass

    def query(self) -> bool:
        self.polls += 1
        return self.polls > 1

    def synchronize(self):
        pass


def test_graph_energy_divides_the_window_by_replays_and_calls(monkeypatch):
    import torch

    from forge_bench import gpu_measure

    monkeypatch.setattr(torch.cuda, "Event", _DoneAfterOnePoll)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    board = _FakeBoard(joules_per_replay=0.3)
    # 2 ms per call x 3 calls per replay: 0.06 s of replays needs 10 of them
    measured = gpu_measure.graph_energy(board, calls_per_replay=3, ms_per_call=2.0, counter=board, seconds=0.06)
    assert board.replays == 10
    assert measured["j"] == pytest.approx(0.1)             # 3 J over 10 replays of 3 calls
    assert measured["sm_mhz"] == 1755.0 and measured["w"] > 0


def test_measure_graph_keeps_the_time_when_the_counter_fails(monkeypatch):
    from forge_bench import gpu_measure

    class Broken:
        def read_j(self):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    monkeypatch.setattr(gpu_measure, "captured", lambda call, sets: object())
    monkeypatch.setattr(gpu_measure, "replay_ms", lambda graph, calls, replays: 0.25)
    monkeypatch.setattr(gpu_measure.torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(gpu_measure.torch.cuda, "Event", _DoneAfterOnePoll)
    measured = gpu_measure.measure_graph(lambda s: None, [None], Broken())
    assert measured["ms"] == 0.25 and "NVML_ERROR_GPU_IS_LOST" in measured["energy_error"] and "j" not in measured


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only error")
def test_kernel_benchmark_fails_clearly_without_cuda(tmp_path):
    from forge_bench.profile import kernel

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        kernel.run(tmp_path)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        kernel.run(tmp_path, quick=True)
    assert not list(tmp_path.iterdir())
