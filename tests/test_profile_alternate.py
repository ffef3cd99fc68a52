"""``forge-bench profile alternate``: the turns its blocks take, its report, and its refusals."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from forge_bench.cli import app
from forge_bench.profile import alternate, common
from forge_bench.profile.common import StepOptions

RESULT = {
    "methods": ["adamw_fused_compile", "forge_bf16_compile"], "blocks": 4, "steps": 20,
    "synced_ms": {"adamw_fused_compile": {"forward": 6.07, "backward": 9.29, "optimizer": 2.29, "wall": 23.83},
                  "forge_bf16_compile": {"forward": 6.23, "backward": 9.72, "optimizer": 1.61, "wall": 19.39}},
    "back_to_back_ms": {"adamw_fused_compile": [20.0, 22.0, 24.0, 21.0],
                        "forge_bf16_compile": [25.0, 20.0, 24.0, 20.0]},
}


def test_blocks_take_turns_so_no_arm_always_goes_first() -> None:
    assert alternate.block_orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert alternate.block_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["c", "b", "a"]]


def test_the_report_gives_the_synced_phases_and_the_back_to_back_speed_up_per_block() -> None:
    text = alternate.to_markdown(RESULT, StepOptions(model="llama-3.2-1b"), "NVIDIA H200")
    lines = text.splitlines()
    assert lines[0] == "# Arms taking turns in one process: llama-3.2-1b, batch 1, seq 512 (NVIDIA H200)"
    assert "| adamw_fused_compile | 23.83 | 6.07 | 9.29 | 2.29 | 17.65 | 21.50 | 1.00x | 1.00x (1.00x-1.00x) |" in lines
    # medians 21.5 and 22.0; per block 20/25, 22/20, 24/24, 21/20 (median of 0.8, 1.0, 1.05, 1.1: 1.025)
    assert "| forge_bf16_compile | 19.39 | 6.23 | 9.72 | 1.61 | 17.56 | 22.00 | 0.98x | 1.02x (0.80x-1.10x) |" in lines


def test_it_needs_two_arms_and_a_gpu_and_writes_nothing_otherwise(tmp_path) -> None:
    out = tmp_path / "alternate.md"
    result = CliRunner().invoke(app, ["profile", "alternate", "--methods", "forge_bf16_compile", "--out", str(out)])
    assert result.exit_code != 0 and "needs at least two arms to take turns" in str(result.exception)
    assert not out.exists()
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit, match="profile alternate: needs a CUDA device"):
        alternate.run(StepOptions(model="gpt2"), ["adamw_fused", "forge_bf16"], out, blocks=2)
    assert not out.exists()


class _Arm:
    """A stand-in arm that logs what it is asked to do (the order in which the arms take their turns)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def loss_of(self, batch: dict) -> torch.Tensor:
        self.log.append(self.name)
        return torch.ones((), requires_grad=True) * 2.0

    def finish_step(self) -> None:
        pass

    def step(self, batch: dict) -> torch.Tensor:
        self.log.append(self.name.upper())
        return torch.ones(())


class _Event:
    """``torch.cuda.Event`` on the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        import time
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_Event") -> float:
        return 1e3 * (end.at - self.at)


def test_the_arms_share_one_process_and_take_turns_synced_then_back_to_back(tmp_path, monkeypatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(common, "warmed_up_arm", lambda tool, options, method: (_Arm(method, log), [{}]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a stand-in GPU")
    out = tmp_path / "reports" / "alternate.md"
    assert alternate.run(StepOptions(model="llama-3.2-1b", steps=2), ["a", "b"], out, blocks=3) == 0
    synced, back_to_back = log[:12], log[12:]
    assert synced == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert back_to_back == ["A", "A", "B", "B", "B", "B", "A", "A", "A", "A", "B", "B"]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["methods"] == ["a", "b"] and result["blocks"] == 3 and result["steps"] == 2
    assert set(result["synced_ms"]["b"]) == {"forward", "backward", "optimizer", "wall"}
    assert [len(result["back_to_back_ms"][m]) for m in ("a", "b")] == [3, 3]
    assert out.read_text().startswith("# Arms taking turns in one process: llama-3.2-1b, batch 1, seq 512 (a stand-in GPU)")


def test_an_arm_whose_step_is_not_split_is_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(common, "warmed_up_arm", lambda tool, options, method: (object(), [{}]))
    with pytest.raises(SystemExit, match="^profile alternate: galore does not split its step into loss_of and finish_step$"):
        alternate.profile_arms(StepOptions(), ["galore", "forge_bf16"], blocks=2)
