"""The capability arithmetic (paper App. O): the analytic memory model's bytes against a hand
computation, the largest model per arm and GPU, the CLI command and the report's section."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from forge_bench import capability, memory_model
from forge_bench.cli import app
from forge_bench.methods import METHODS
from forge_bench.models import param_count

H100_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "h100"

# tiny-llama (forge_bench/configs/tiny-llama.json): hidden 128, intermediate 256, 2 layers, 4 heads of 32,
# 2 kv heads, vocabulary 512, untied head
TINY_PARAMS = (512 * 128                                          # embedding
               + 2 * (128 * 128 * 2 + 128 * 64 * 2               # q, o; k, v
                      + 3 * 128 * 256 + 2 * 128)                 # gate, up, down; two norms
               + 128 + 512 * 128)                                 # final norm, LM head


def test_predicted_bytes_of_a_tiny_model_equal_a_hand_computation():
    assert param_count("tiny-llama") == TINY_PARAMS == 426624
    # batch 2 x seq 16 in bf16, hf activations: per layer and token 10 hidden + 3 intermediate widths,
    # and the logits in bf16 with their fp32 upcast and gradient
    activations = 2 * (32 * (10 * 128 + 3 * 256) * 2) + 32 * 512 * (2 + 4 + 4)
    int8 = memory_model.predicted_bytes("tiny-llama", METHODS["forge_int8"].bytes_per_param, 2, 16)
    assert int8 == {"weights": 2 * TINY_PARAMS, "optimizer_states": int(TINY_PARAMS * (2 + 8 / 64)),
                    "gradients": 0, "activations": activations,
                    "total": 2 * TINY_PARAMS + int(TINY_PARAMS * (2 + 8 / 64)) + activations}
    assert int8["total"] == 2185808
    fused = memory_model.predicted_bytes("tiny-llama", METHODS["adamw_fused"].bytes_per_param, 2, 16)
    assert fused["total"] == 2 * TINY_PARAMS + 4 * TINY_PARAMS + 2 * TINY_PARAMS + activations == 3838976
    # fp8 codes take the bytes int8 codes do: one byte per moment and a scale per 64
    fp8 = memory_model.predicted_bytes("tiny-llama", capability.arm_bytes_per_param("forge_fp8"), 2, 16)
    assert fp8 == int8


def test_a_boundary_is_the_largest_model_under_the_usable_memory():
    for b in capability.boundaries(families=["qwen3"], arms=["adamw_fused", "forge_int8"]):
        members = capability.family_models("qwen3")
        need = {m: memory_model.predicted_bytes(m, capability.arm_bytes_per_param(b.method), 1, 512)["total"]
                for m in members}
        usable = b.hbm_gib * 2 ** 30 * capability.USABLE_FRACTION
        fitting = [m for m in members if need[m] <= usable]
        assert b.largest_fit == (fitting[-1] if fitting else None)
        assert b.first_miss == next((m for m in members if need[m] > usable), None)
    assert members == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]


def test_a_bigger_gpu_trains_at_least_as_large_a_model():
    found = capability.boundaries()
    by_capacity = sorted(capability.GPUS, key=capability.GPUS.get)
    for family in capability.DEFAULT_FAMILIES:
        for arm in capability.CAPABILITY_ARMS:
            sizes = [next(b.largest_fit_params or 0 for b in found
                          if (b.gpu, b.family, b.method) == (gpu, family, arm)) for gpu in by_capacity]
            assert sizes == sorted(sizes), (family, arm, sizes)
    # and the FORGE states train at least what fused AdamW does on every GPU
    for gpu in capability.GPUS:
        size = {b.method: b.largest_fit_params or 0 for b in found if b.gpu == gpu and b.family == "qwen3"}
        assert size["adamw_fused"] <= size["forge_bf16"] <= size["forge_int8"] == size["forge_fp8"]


def test_device_names_map_to_gpus():
    assert capability.gpu_of_device("NVIDIA H100 80GB HBM3") == "H100"
    assert capability.gpu_of_device("NVIDIA H200") == "H200"
    assert capability.gpu_of_device("NVIDIA A100-SXM4-40GB") == "A100-40"
    assert capability.gpu_of_device("NVIDIA A100 80GB PCIe") == "A100-80"
    assert capability.gpu_of_device("Intel(R) Xeon(R) CPU") is None


@pytest.mark.parametrize("args, message", [
    (["--gpus", "H800"], "unknown GPU 'H800'"),
    (["--models", "qwen3-9b"], "unknown model 'qwen3-9b'"),
    (["--arms", "adamw_magic"], "unknown arm 'adamw_magic'"),
    (["--family", "gpt5"], "no sized models of family 'gpt5'"),
    (["--usable-fraction", "1.5"], "usable fraction must be in (0, 1]"),
    (["--out", "table.xlsx"], "must end in .csv or .parquet"),
])
def test_bad_input_is_a_one_line_error(args, message):
    result = CliRunner().invoke(app, ["capability", *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def test_the_command_prints_the_table_and_writes_it(tmp_path):
    out = tmp_path / "capability.csv"
    result = CliRunner().invoke(app, ["capability", "--family", "llama", "--gpus", "A100-40,H100",
                                      "--arms", "adamw_fused,forge_int8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Largest llama model each arm trains" in result.output
    frame = pd.read_csv(out)
    assert len(frame) == 4 and set(frame["gpu"]) == {"A100-40", "H100"}
    row = frame[(frame["gpu"] == "A100-40") & (frame["method"] == "adamw_fused")].iloc[0]
    assert row["largest_fit"] == "llama-3.2-3b" and row["first_miss"] == "llama-3.1-8b"


def test_the_report_sets_predicted_beside_measured_boundaries():
    """A qwen3 family measured on an H100 (rows made from the committed H100 fixture): each arm's
    largest model that ran ok beside the predicted one."""
    from forge_bench.report import app_o
    from forge_bench.report.data import load_rows

    frame = load_rows([H100_FIXTURE], on_foreign=None)
    eager = frame[(frame["timing_method"] == "cuda_events")]
    outcomes = {"adamw_fused": {"qwen3-4b": "ok", "qwen3-8b": "ok", "qwen3-14b": "oom"},
                "forge_int8": {"qwen3-8b": "ok", "qwen3-14b": "oom", "qwen3-32b": "oom_predicted"}}
    rows = []
    for method, by_model in outcomes.items():
        template = eager[eager["method"] == method].iloc[0]
        for model, status in by_model.items():
            rows.append(template.copy())
            rows[-1]["model"], rows[-1]["status"], rows[-1]["n_params"] = model, status, None
            rows[-1]["cell_id"] = f"{model}-{method}"
    family = pd.DataFrame(rows).reset_index(drop=True)
    tables = app_o.app_o_tables(family)
    [compared] = [t for t in tables if t.name.startswith("capability-qwen3")]
    recs = {r["method"]: r for r in compared.records}
    assert recs["adamw_fused"]["measured_largest"] == recs["adamw_fused"]["predicted_largest"] == "qwen3-8b"
    assert recs["adamw_fused"]["agree"] is True and recs["adamw_fused"]["gpu"] == "H100"
    # forge_int8: measured to stop at 8B, predicted to fit 14B: shown as a disagreement
    assert recs["forge_int8"]["measured_largest"] == "qwen3-8b"
    assert recs["forge_int8"]["predicted_largest"] == "qwen3-14b" and recs["forge_int8"]["agree"] is False
    assert tables[-1].name == "capability-predicted-1-512" and len(tables[-1].records) == (
        len(capability.GPUS) * len(capability.CAPABILITY_ARMS) * len(capability.DEFAULT_FAMILIES))


@pytest.mark.parametrize("measured, miss, predicted, expected", [
    ("qwen3-8b", "qwen3-14b", "qwen3-8b", True),
    ("qwen3-8b", "qwen3-14b", "qwen3-14b", False),      # predicted to fit a model that did not
    ("qwen3-14b", None, "qwen3-8b", False),             # ran a model predicted not to fit
    ("qwen3-0.6b", None, "qwen3-8b", None),             # nothing larger than 0.6B was run
    (None, None, "qwen3-8b", None),                     # nothing ran (e.g. an arm that cannot be captured)
    (None, "qwen3-0.6b", "qwen3-8b", False),
])
def test_a_boundary_nothing_larger_was_run_to_is_not_a_disagreement(measured, miss, predicted, expected):
    from forge_bench.report import app_o

    members = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"]
    assert app_o.agreement(members, measured, miss, predicted) is expected


def test_no_gpu_rows_no_section():
    from forge_bench.report import app_o

    assert app_o.app_o_tables(pd.DataFrame({"device_name": ["Intel(R) Xeon(R) CPU"]})) == []
