"""forge_bench.profile_step: the table it writes and its refusal without a GPU."""
from __future__ import annotations

import pytest
import torch

from forge_bench import profile_step


def test_markdown_names_the_activations_and_shares():
    result = {"method": "forge_bf16", "step_ms_profiled": 90.0, "kernel_ms_total": 80.0,
              "top": [{"kernel": "fused_wgrad_update_kernel", "ms_per_step": 20.0, "calls_per_step": 225}]}
    text = profile_step.to_markdown([result], "llama-3.1-8b", 1, 512, "NVIDIA H100", "lean")
    assert text.startswith("# Where the time goes: llama-3.1-8b, batch 1, seq 512, lean activations (NVIDIA H100)")
    assert "| `fused_wgrad_update_kernel` | 20.000 | 25.0 | 225 |" in text
    assert "lean" not in profile_step.to_markdown([result], "m", 1, 8, "d").splitlines()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_child_refuses_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="profile_step: needs a CUDA device"):
        profile_step.main(["--one", "--methods", "adamw_fused", "--activations", "lean", "--out",
                           str(tmp_path / "x.json")])


def test_each_method_writes_into_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch):
    """The per-method children write their JSON beside ``out``; a new output folder must not fail them."""
    import json
    import subprocess
    from pathlib import Path

    def fake_child(cmd, **_):
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"method": cmd[cmd.index("--methods") + 1]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(profile_step.subprocess, "run", fake_child)
    out = tmp_path / "new" / "deeper" / "profile.md"
    results = profile_step.each_method_in_its_own_process("forge_bench.graph_profile", ["a", "b"], [], out)
    assert [r["method"] for r in results] == ["a", "b"]
    assert not list(out.parent.glob("*.json"))            # the per-method files are consumed
