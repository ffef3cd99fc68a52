"""The floor's arithmetic (the GPU measurements themselves run in the sweep on CUDA)."""
import pytest
import torch
from torch import nn

from forge_bench.floor import floor_ms, state_traffic_bytes
from forge_bench.gpu_measure import fused_linear_shapes

LLAMA8B_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
LLAMA8B = LLAMA8B_LAYER * 32 + [(128256, 4096)]


def test_llama8b_traffic_at_the_h100_copy_rate():
    # at 3.018 TB/s copy (the H100's do_bench rate): 29.8 ms (bf16 states) and 20.5 ms (int8) of traffic
    bw = 3.018e12
    assert state_traffic_bytes(LLAMA8B, 2, "bf16") / bw * 1e3 == pytest.approx(29.84, abs=0.01)
    assert state_traffic_bytes(LLAMA8B, 2, "int8") / bw * 1e3 == pytest.approx(20.51, abs=0.01)
    # per element: bf16 W r+w (4 B) + 2 moments r+w (8 B) = 12 B
    assert state_traffic_bytes([(10, 10)], 2, "bf16") == 100 * 12
    assert state_traffic_bytes([(10, 64)], 4, "fp32") == 640 * (8 + 16)
    assert state_traffic_bytes([(1, 64)], 2, "int8") == pytest.approx(64 * (4 + 2 * (2 + 8 / 64)))


def test_unknown_state_dtype_is_named():
    with pytest.raises(ValueError, match="state_dtype 'fp8'"):
        state_traffic_bytes([(1, 1)], 2, "fp8")


def test_shapes_skip_tied_and_frozen_weights():
    emb = nn.Embedding(11, 8)
    head = nn.Linear(8, 11, bias=False)
    head.weight = emb.weight  # tied
    frozen = nn.Linear(8, 8)
    frozen.weight.requires_grad_(False)
    model = nn.ModuleDict({"emb": emb, "up": nn.Linear(8, 32), "down": nn.Linear(32, 8), "head": head, "frozen": frozen})
    assert sorted(fused_linear_shapes(model)) == [(8, 32), (32, 8)]


def test_floor_formula():
    terms = {"wgrad_ms": 14.6, "traffic_ms": {"bf16": 29.9, "int8": 20.6, "fp32": 50.0}}
    assert floor_ms(120.0, terms, "bf16") == pytest.approx(120.0 - 14.6 + 29.9)
    terms_gemm_bound = {"wgrad_ms": 40.0, "traffic_ms": {"bf16": 29.9}}
    assert floor_ms(120.0, terms_gemm_bound, "bf16") == pytest.approx(120.0)


def _power_terms(**overrides):
    terms = {"wgrad_ms": 14.6, "traffic_ms": {"bf16": 30.0, "int8": 20.6}, "copy_bytes_per_s": 3.0e12,
             "state_bytes": {"bf16": 90.0e9, "int8": 61.8e9}, "grad_bytes": 15.0e9,
             "copy_j_per_byte": 0.2e-9, "copy_w": 600.0, "idle_w": 150.0, "power_limit_w": 700.0}
    terms.update(overrides)
    return terms


def test_power_floor_adds_the_extra_traffic_energy_at_the_power_limit():
    from forge_bench.floor import power_floor_ms

    terms = _power_terms()
    # dynamic J/byte = 0.2e-9 * (1 - 150 / 600) = 0.15e-9 (the copy's own window, not do_bench's rate);
    # extra bytes = 90e9 - 15e9 = 75e9 -> 11.25 J; no_optimizer at 700 W for 50 ms: (700 - 150) * 0.05
    # = 27.5 J; (27.5 + 11.25) / 550 W = 70.45 ms
    assert power_floor_ms(50.0, 700.0, terms, "bf16") == pytest.approx((27.5 + 11.25) / 550 * 1e3)
    assert power_floor_ms(50.0, 700.0, _power_terms(copy_bytes_per_s=1.0e12), "bf16") == pytest.approx(
        (27.5 + 11.25) / 550 * 1e3)
    # a step far below the limit leaves room: the time floor (50 - 14.6 + 30) is the larger one
    assert power_floor_ms(50.0, 300.0, terms, "bf16") == pytest.approx(floor_ms(50.0, terms, "bf16"))


def test_power_floor_is_none_without_energy_terms():
    from forge_bench.floor import power_floor_ms

    assert power_floor_ms(50.0, None, _power_terms(), "bf16") is None
    assert power_floor_ms(50.0, 700.0, {"wgrad_ms": 14.6, "traffic_ms": {"bf16": 30.0}}, "bf16") is None
    assert power_floor_ms(50.0, 700.0, _power_terms(idle_w=None), "bf16") is None
    assert power_floor_ms(50.0, 700.0, _power_terms(power_limit_w=100.0), "bf16") is None
    assert power_floor_ms(50.0, 700.0, _power_terms(copy_w=None), "bf16") is None


def test_floor_table_shows_the_power_floor_when_the_run_measured_energy():
    import json

    import pandas as pd

    from forge_bench.floor import power_floor_ms
    from forge_bench.report.tables import floor_tables

    terms = _power_terms()
    base = dict(run_id="r1", device_name="GPU", model="m", dtype="bfloat16", batch=1, seq=512, timing="graph",
                activations="lean", status="ok")
    rows = [dict(base, method="no_optimizer", method_family="baseline", method_settings="{}", step_ms_median=50.0,
                 extra=json.dumps({"floor_terms": terms, "power_w_mean": 700.0})),
            dict(base, method="adamw_fused", method_family="baseline", method_settings="{}", step_ms_median=100.0,
                 extra="{}"),
            dict(base, method="forge_bf16", method_family="forge", method_settings=json.dumps({"state_dtype": "bf16"}),
                 step_ms_median=80.0, extra="{}")]
    (table,) = floor_tables(pd.DataFrame(rows))
    assert "Power floor ms" in table.header and "Step / power floor" in table.header
    assert len(table.header) == len(table.rows[0]) == len(table.align)
    (record,) = table.records
    assert record["power_floor_ms"] == pytest.approx(power_floor_ms(50.0, 700.0, terms, "bf16"))
    assert record["step_over_power_floor"] == pytest.approx(80.0 / record["power_floor_ms"])
    # the target: within 1.05x of the power floor
    met = record["step_over_power_floor"] <= 1.05
    assert record["power_floor_target_met"] is met and table.rows[0][8] == ("met" if met else "missed")
    for factor, expected in ((1.04, True), (1.06, False)):
        rows[2]["step_ms_median"] = record["power_floor_ms"] * factor
        (at_factor,) = floor_tables(pd.DataFrame(rows))
        assert at_factor.records[0]["power_floor_target_met"] is expected
        assert at_factor.rows[0][8] == ("met" if expected else "missed")
    rows[2]["step_ms_median"] = 80.0
    # another family's FORGE row has no AdamW floor: left out
    muon = dict(rows[2], method="forge_muon_bf16",
                method_settings=json.dumps({"state_dtype": "bf16", "family": "muon", "optimizer": "forge_core.fuse(muon)"}))
    (with_muon,) = floor_tables(pd.DataFrame(rows + [muon]))
    assert [r["method"] for r in with_muon.records] == ["forge_bf16"]
    # the same run without energy terms: the time floor's columns only
    rows[0]["extra"] = json.dumps({"floor_terms": {k: terms[k] for k in ("wgrad_ms", "traffic_ms", "copy_bytes_per_s")}})
    (table,) = floor_tables(pd.DataFrame(rows))
    assert "Power floor ms" not in table.header and len(table.header) == len(table.rows[0]) == len(table.align)
