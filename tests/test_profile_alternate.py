"""``forge-bench profile alternate``: the turns its blocks take, its report, and its refusals."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from forge_bench.cli import app
from forge_bench.profile import alternate
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
    assert "| adamw_fused_compile | 23.83 | 6.07 | 9.29 | 2.29 | 17.65 | 21.50 | 1.00x | 1.00x-1.00x |" in lines
    # medians 21.5 and 22.0; per block 20/25, 22/20, 24/24, 21/20
    assert "| forge_bf16_compile | 19.39 | 6.23 | 9.72 | 1.61 | 17.56 | 22.00 | 0.98x | 0.80x-1.10x |" in lines


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
