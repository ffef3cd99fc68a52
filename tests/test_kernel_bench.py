"""The kernel benchmark's figure (the timing itself needs a GPU: tests/test_kernels.py)."""
import pandas as pd
import pytest

from forge_bench.kernel_bench import plot


def _row(shape, tokens, state_dtype, ratio):
    return dict(shape=shape, tokens=tokens, state_dtype=state_dtype, ratio_to_roofline=ratio,
                speedup_vs_baseline=1.0 / ratio, device="test GPU")


def test_plot_takes_a_frame_where_state_dtypes_cover_different_shapes(tmp_path):
    """A frame merged from runs with different --state-dtypes / --bts (int8 at every BT, bf16 at
    one) used to fail on a bar-count mismatch."""
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
