"""``forge-bench profile layers``: the per-layer slope, the report's ratio to torch, the variants' runs and their
one-line refusals (the timing itself needs a GPU and runs on the device)."""
from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from forge_bench.cli import app
from forge_bench.profile import common, layers

KEYS = ("backward_host_us", "backward_synced_us", "step_host_us", "whole_step_us")


def _result(name: str, low: float, high: float, step_low: float = 10.0, step_high: float = 26.0) -> dict:
    depths = [{"depth": 4, "backward_host_us": low, "backward_synced_us": low, "step_host_us": step_low,
               "whole_step_us": low * 2, "first_step_s": 0.5},
              {"depth": 36, "backward_host_us": high, "backward_synced_us": high, "step_host_us": step_high,
               "whole_step_us": high * 2, "first_step_s": 1.5}]
    return {"variant": name, "about": layers.VARIANTS[name].about, "depths": depths,
            "per_layer": {key: layers.per_layer(depths, key) for key in KEYS}, "device": "NVIDIA H200",
            "torch": "2.11.0"}


def test_one_layer_is_the_slope_between_the_two_depths():
    result = _result("forge", 400.0, 2000.0)
    assert result["per_layer"]["backward_host_us"] == pytest.approx(50.0)       # (2000 - 400) / 32
    assert result["per_layer"]["step_host_us"] == pytest.approx(0.5)


def test_the_report_holds_each_variant_against_torch_with_the_step_counted():
    options = layers.ChainOptions()
    text = layers.to_markdown([_result("torch", 400.0, 2000.0), _result("forge", 400.0, 2640.0)], options)
    torch_line = next(line for line in text.splitlines() if line.startswith("| torch "))
    forge_line = next(line for line in text.splitlines() if line.startswith("| forge "))
    assert "| 50.0 | 50.5 | 1.00 |" in torch_line
    assert "| 70.0 | 70.5 | 1.40 |" in forge_line                     # (70 + 0.5) / (50 + 0.5)
    assert "NVIDIA H200" in text and "Linear(2048, 2048)" in text


def test_fuse_defaults_are_the_forge_variant_and_the_side_stream_its_own():
    assert layers.VARIANTS["forge"].fused and not layers.VARIANTS["forge"].overlap
    assert layers.VARIANTS["forge_side_stream"].overlap
    assert layers.VARIANTS["forge_tile"].env == {"FORGE_WS_KERNEL": "0"}
    assert set(layers.DEFAULT_VARIANTS) <= set(layers.VARIANTS)


def test_each_variant_runs_in_its_own_process_with_its_environment(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, env):
        calls.append((cmd, env))
        out = cmd[cmd.index("--out") + 1]
        name = cmd[cmd.index("--variants") + 1]
        with open(out, "w") as fh:
            json.dump(_result(name, 400.0, 2000.0), fh)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(common.subprocess, "run", fake_run)
    out = tmp_path / "new" / "layers.md"
    assert layers.run(layers.ChainOptions(depths=(4, 36)), ["torch", "forge_tile"], out) == 0
    assert [cmd[cmd.index("--variants") + 1] for cmd, _ in calls] == ["torch", "forge_tile"]
    assert calls[1][1]["FORGE_WS_KERNEL"] == "0"
    assert calls[0][1].get("FORGE_WS_KERNEL") == os.environ.get("FORGE_WS_KERNEL")     # torch's is left alone
    assert calls[0][0][:3] == [sys.executable, "-m", "forge_bench.cli"]
    assert "--depths" in calls[0][0] and "4,36" in calls[0][0]
    assert out.exists() and json.loads(out.with_suffix(".json").read_text())["options"]["depths"] == [4, 36]
    assert not list(tmp_path.glob("new/*.torch.json"))           # the children's files are gone


def test_an_unknown_variant_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    assert layers.run(layers.ChainOptions(), ["torch", "forge_fast"], tmp_path / "layers.md") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "forge_fast" in err and "forge_side_stream" in err
    assert not (tmp_path / "layers.md").exists()


def test_without_cuda_the_child_refuses_in_one_line(tmp_path):
    if layers.torch.cuda.is_available():
        pytest.skip("the refusal is the CPU's")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        layers.measure("torch", layers.ChainOptions())


@pytest.mark.parametrize("depths", ["4", "4,4", "0,8", "a,b"])
def test_bad_depths_are_refused_by_the_command(tmp_path, depths):
    result = CliRunner().invoke(app, ["profile", "layers", "--out", str(tmp_path / "x.md"), "--depths", depths])
    assert result.exit_code == 2 and "--depths" in result.output
    assert not (tmp_path / "x.md").exists()
