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
