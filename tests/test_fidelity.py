"""forge-bench fidelity (paper App. E): each bf16 update path against the same run in fp32.

The paper's claim, asserted at a tiny size on the CPU and at the paper's shape (V=1024, H=4096,
BT=2048, 20 steps) on a GPU: FORGE with bf16 moments ends no further from the fp32 weights than
the standard bf16 path (bf16 weights, the gradient stored in bf16, torch's AdamW with bf16
moments). Both sit near the distance the bf16 rounding of the weight itself sets at every step
(forge_fp32, with fp32 moments, is no closer); FORGE's gain is the one rounding of G it skips.
"""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from forge_bench import fidelity
from forge_bench.cli import app
from forge_bench.run_rows import file_kind, load_kind


def _by_arm(rows: list[dict]) -> dict[str, dict]:
    return {row["arm"]: row for row in rows}


def test_tiny_head_forge_bf16_is_no_further_from_fp32_than_the_standard_bf16_path() -> None:
    rows = _by_arm(fidelity.measure(64, 128, 64, steps=5, lr=1e-3, arm_names=["adamw_bf16", "forge_bf16", "forge_int8"]))
    for row in rows.values():
        assert 0 < row["rms_rel"] < 0.05 and row["max_abs_dw"] > 0 and row["fp32_update_rms"] > 0
    assert rows["forge_bf16"]["rms_rel"] <= rows["adamw_bf16"]["rms_rel"]
    assert rows["forge_bf16"]["gradient"] == "fp32 tile (fused)" and rows["adamw_bf16"]["state_dtype"] == "bf16"


def test_cli_writes_one_file_per_rate_and_refuses_an_unknown_arm(tmp_path) -> None:
    runner = CliRunner()
    common = ["fidelity", "--out", str(tmp_path), "--vocab", "32", "--hidden", "64", "--tokens", "16", "--steps", "2",
              "--device", "cpu"]
    result = runner.invoke(app, common + ["--lr", "1e-3,1e-4", "--arms", "adamw_bf16,forge_fp32"])
    assert result.exit_code == 0, result.output
    files = sorted(tmp_path.glob("fidelity_*.parquet"))
    assert len(files) == 2 and all(file_kind(f) == "fidelity" for f in files)
    assert sorted(load_kind([tmp_path], "fidelity")["arm"]) == ["adamw_bf16", "adamw_bf16", "forge_fp32", "forge_fp32"]
    result = runner.invoke(app, common + ["--arms", "forge_fp4"])
    assert result.exit_code == 2 and "unknown fidelity arm" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paper_shape_forge_bf16_is_no_further_from_fp32_than_the_standard_bf16_path(monkeypatch) -> None:
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")       # the default tile: no minute of tuning for one test
    vocab, hidden, tokens = fidelity.PAPER_SHAPE
    rows = _by_arm(fidelity.measure(vocab, hidden, tokens, steps=20, lr=1e-3, device="cuda",
                                    arm_names=["adamw_bf16", "forge_fp32", "forge_bf16", "forge_int8"]))
    print("\n[fidelity App. E] " + ", ".join(f"{arm} rms-rel {row['rms_rel']:.4e} max|dW| {row['max_abs_dw']:.3e}"
                                             for arm, row in rows.items()))
    assert rows["forge_bf16"]["rms_rel"] <= rows["adamw_bf16"]["rms_rel"]


def test_the_arms_run_the_kernel_untuned_and_leave_the_environment_as_it_was(monkeypatch):
    """Tuning times tiles for speed, which fidelity does not measure: inside an arm FORGE_AUTOTUNE is 0,
    after it unset again; a value the caller set stays untouched."""
    import os

    seen = []
    monkeypatch.delenv(fidelity.AUTOTUNE_ENV, raising=False)
    with fidelity.untuned_kernel():
        seen.append(os.environ.get(fidelity.AUTOTUNE_ENV))
    assert seen == ["0"] and fidelity.AUTOTUNE_ENV not in os.environ
    monkeypatch.setenv(fidelity.AUTOTUNE_ENV, "1")
    with fidelity.untuned_kernel():
        seen.append(os.environ.get(fidelity.AUTOTUNE_ENV))
    assert seen[-1] == "1" and os.environ[fidelity.AUTOTUNE_ENV] == "1"


def test_measure_runs_each_arm_inside_the_untuned_block(monkeypatch):
    import os

    real, seen = fidelity.run_arm, []

    def recording(arm, *args, **kwargs):
        seen.append((arm, os.environ.get(fidelity.AUTOTUNE_ENV)))
        return real(arm, *args, **kwargs)

    monkeypatch.delenv(fidelity.AUTOTUNE_ENV, raising=False)
    monkeypatch.setattr(fidelity, "run_arm", recording)
    fidelity.measure(8, 16, 4, steps=1, arm_names=["adamw_bf16"], device="cpu")
    assert seen == [("fp32", None), ("adamw_bf16", "0")]
