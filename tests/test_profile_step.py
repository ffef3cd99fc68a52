"""``forge-bench profile step``: the table it writes, its refusal without a GPU, and the per-arm
child processes every profiler shares (``forge_bench.profile.common``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_bench.profile import common
from forge_bench.profile import step as profile_step
from forge_bench.profile.common import StepOptions


def test_markdown_names_the_activations_and_shares():
    result = {"method": "forge_bf16", "step_ms_profiled": 90.0, "kernel_ms_total": 80.0,
              "top": [{"kernel": "fused_wgrad_update_kernel", "ms_per_step": 20.0, "calls_per_step": 225}]}
    text = profile_step.to_markdown([result], "llama-3.1-8b", 1, 512, "NVIDIA H100", "lean")
    assert text.startswith("# Where the time goes: llama-3.1-8b, batch 1, seq 512, lean activations (NVIDIA H100)")
    assert "| `fused_wgrad_update_kernel` | 20.000 | 25.0 | 225 |" in text
    assert "lean" not in profile_step.to_markdown([result], "m", 1, 8, "d").splitlines()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_child_refuses_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="profile step: needs a CUDA device"):
        profile_step.run_one(StepOptions(activations="lean"), "adamw_fused", tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_each_method_writes_into_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch):
    """The per-method children write their JSON beside ``out``; a new output folder must not fail them."""
    commands = []

    def fake_child(cmd, **_):
        commands.append(cmd)
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"method": cmd[cmd.index("--methods") + 1]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(common.subprocess, "run", fake_child)
    out = tmp_path / "new" / "deeper" / "profile.md"
    results = common.run_each_method(["profile", "graph"], ["a", "b"], [], out)
    assert [r["method"] for r in results] == ["a", "b"]
    assert not list(out.parent.glob("*.json"))            # the per-method files are consumed
    # each child is this CLI's own subcommand in a fresh interpreter, one arm each
    assert commands[0][:6] == [sys.executable, "-m", "forge_bench.cli", "profile", "graph", "--one"]


def test_a_failed_child_is_reported_and_skipped(tmp_path, monkeypatch, capsys):
    def fake_child(cmd, **_):
        method = cmd[cmd.index("--methods") + 1]
        if method == "bad":
            return subprocess.CompletedProcess(cmd, 3)
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"method": method}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(common.subprocess, "run", fake_child)
    results = common.run_each_method(["profile", "step"], ["bad", "good"], [], tmp_path / "p.md")
    assert [r["method"] for r in results] == ["good"]
    assert "profile step: bad failed (exit 3)" in capsys.readouterr().err


def test_child_arguments_carry_every_option():
    options = StepOptions(model="tiny-llama", batch=2, seq=16, dtype="float32", activations="lean", steps=4, warmup=1)
    assert options.child_arguments() == ["--model", "tiny-llama", "--batch", "2", "--seq", "16", "--dtype", "float32",
                                         "--activations", "lean", "--steps", "4", "--warmup", "1"]
    assert options.title() == "tiny-llama, batch 2, seq 16, lean activations"


def test_union_of_intervals_merges_overlaps_and_touching_ends():
    assert common.union_intervals([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 7.0)]
    assert common.union_intervals([]) == []


@pytest.mark.parametrize("name", ["timeline", "graph"])
def test_timeline_and_graph_write_their_report_and_json_or_nothing(name, tmp_path, monkeypatch, capsys):
    """Both reports go through ``common.run_and_report``: the Markdown and its JSON, or exit 1 with nothing written."""
    import importlib

    module = importlib.import_module(f"forge_bench.profile.{name}")
    monkeypatch.setattr(module, "to_markdown", lambda results, title: f"# {title}: {len(results)} arms\n")
    out = tmp_path / "report" / f"{name}.md"

    def run() -> int:
        if name == "timeline":
            return module.run(StepOptions(), ["a"], out, None)
        return module.run(StepOptions(), ["a"], 20, out, None)

    monkeypatch.setattr(common, "run_each_method", lambda *args, **kwargs: [])
    assert run() == 1 and not out.parent.exists()
    assert f"forge-bench profile {name}: no arm could be" in capsys.readouterr().err
    monkeypatch.setattr(common, "run_each_method", lambda *args, **kwargs: [{"method": "a"}])
    assert run() == 0
    assert out.read_text().endswith(": 1 arms\n")
    assert json.loads(out.with_suffix(".json").read_text()) == [{"method": "a"}]
