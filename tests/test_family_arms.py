"""The optimizer-family arms (``forge_bench.families``), ``suites/families.yaml``, the App. I report
table and the Muon capability choice.

* A CPU version of the suite's grid runs in-process on tiny-Llama: every family's unfused and FORGE
  arm passes the parity gate against the unfused algorithm in fp32 and writes an ok row; a family
  whose rule forge_core lacks writes an ``unavailable`` row naming it.
* The App. I table equals a hand computation on fixture rows (copies of a real H100 row with the
  family arms' methods, settings, peaks and times).
* The capability cells are the largest Qwen3 whose fused Muon fits the card by the harness's
  analytic bound while torch.optim.Muon's does not.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from forge_bench import cell as cell_mod
from forge_bench import families, models, results
from forge_bench.arm import TrainConfig
from forge_bench.family_table import FAMILIES
from forge_bench.methods import METHODS
from forge_bench.report import app_i, build_report
from forge_bench.report.data import load_rows
from forge_bench.suite import Cell, load_suite

REPO = Path(__file__).resolve().parents[1]
LAYER_FAMILIES = ["muon", "adafactor", "adalomo", "sm3", "adam_mini", "lars"]
TEMPLATE = REPO / "tests" / "fixtures" / "h100" / "llama-3.1-8b_b1_s512_adamw_fused_9a3c76cb2a.parquet"

CPU_GRID = """
device: cpu
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 1
optimizer: {{lr: 1.0e-3}}
parity: {{steps: 3, tolerance: 0.02}}
grids:
  - name: app_i
    models: [tiny-llama]
    batch: [1]
    seq: [16]
    methods: [{methods}]
"""


@pytest.fixture(autouse=True)
def one_torch_thread():
    """CPU cells on one thread, as a sweep pins them (a shared 2-core machine runs a tiny-Llama cell
    7x slower on two threads when other processes compete for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_grid(tmp_path: Path, method_names: list[str]) -> dict[str, dict]:
    path = tmp_path / "families_cpu.yaml"
    path.write_text(CPU_GRID.format(methods=", ".join(method_names)))
    suite = load_suite(path)
    rows = {}
    for cell in suite.cells:
        assert cell_mod.run_cell(suite, cell, tmp_path / "rows", "run-cpu") == 0
        rows[cell.method] = results.load_results(results.row_path(tmp_path / "rows", cell.cell_id)).iloc[0]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("family", LAYER_FAMILIES)
def test_cpu_grid_of_a_family_runs_both_arms_through_the_gate(tmp_path, family):
    rows = _run_grid(tmp_path, [f"{family}_unfused", f"forge_{family}_fp32"])
    for method, row in rows.items():
        assert row.status == "ok", (method, row.reason)
        assert row.parity_steps == 3 and row.parity_rms_rel < 1e-3, method
        settings = json.loads(row.method_settings)
        assert settings["family"] == family and settings["fused"] == method.startswith("forge_")
    assert rows[f"forge_{family}_fp32"].n_fused_params > 0
    assert rows[f"forge_{family}_fp32"].mem_gradients_gib < rows[f"{family}_unfused"].mem_gradients_gib


def test_bf16_states_and_a_missing_rule(tmp_path):
    rows = _run_grid(tmp_path, ["forge_muon_bf16", "rmsprop_unfused"])
    assert rows["forge_muon_bf16"].status == "ok" and json.loads(rows["forge_muon_bf16"].method_settings)[
        "state_dtype"] == "bf16"
    if "rmsprop" not in __import__("forge_core").RULES:
        assert rows["rmsprop_unfused"].status == "unavailable"
        assert "no rule 'rmsprop'" in rows["rmsprop_unfused"].reason


def test_every_family_has_three_arms_and_the_suite_lists_them():
    for family in FAMILIES:
        for name in (f"{family}_unfused", f"forge_{family}_fp32", f"forge_{family}_bf16"):
            method = METHODS[name]
            assert method.parity_reference == family and method.settings["family"] == family
    suite = load_suite(REPO / "suites" / "families.yaml")
    by_grid: dict[str, list[Cell]] = {}
    for cell in suite.cells:
        by_grid.setdefault(cell.grid, []).append(cell)
    assert {c.dtype for c in by_grid["app_i"]} == {"float32"} and {c.dtype for c in by_grid["bf16"]} == {"bfloat16"}
    assert all(c.cuda_graph for c in by_grid["app_i_graph"] + by_grid["bf16_graph"])
    for grid, states in (("app_i", "fp32"), ("bf16", "bf16")):
        assert {c.method for c in by_grid[grid]} == {"no_optimizer"} | {
            name for family in FAMILIES for name in (f"{family}_unfused", f"forge_{family}_{states}")}
    for grid, model in (("muon_capability_h100", "qwen3-14b"), ("muon_capability_h200", "qwen3-32b")):
        assert {(c.model, c.method, c.activation_checkpointing) for c in by_grid[grid]} == {
            (model, "muon_unfused", True), (model, "forge_muon_bf16", True)}
        assert all(c.cell_id.endswith(c.cell_id[-10:]) and "_ckpt_" in c.cell_id for c in by_grid[grid])


def test_hyperparameters_follow_the_sweep_where_the_family_has_the_name():
    model = models.build_model("tiny-llama", "float32", "cpu")
    cfg = TrainConfig(lr=3e-4, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05, momentum=0.85, device="cpu")
    assert families.family_hyperparameters("adafactor", cfg, model) == {"lr": 3e-4, "weight_decay": 0.05}
    assert families.family_hyperparameters("lars", cfg, model) == {"lr": 3e-4, "weight_decay": 0.05, "eps": 1e-7,
                                                                   "momentum": 0.85}
    assert families.family_hyperparameters("adam_mini", cfg, model)["head_dim"] == 32
    muon = families.family_hyperparameters("muon", cfg, model)
    assert muon["adamw_betas"] == (0.8, 0.9) and muon["lr"] == 3e-4 and "momentum" not in muon
    chain = families.unfused_optimizer("muon", model, cfg)
    assert [type(o).__name__ for o in chain.optimizers] == ["Muon", "AdamW"]
    assert chain.optimizers[1].param_groups[0]["lr"] == 3e-4


def test_fused_muon_with_activation_checkpointing_steps_as_without(tmp_path):
    cfg = TrainConfig(lr=1e-3, device="cpu")
    batch = models.make_batch("tiny-llama", 2, 16, "cpu", seed=3)
    trained = []
    for checkpointing in (False, True):
        model = models.build_model("tiny-llama", "float32", "cpu", seed=0)
        models.apply_activation_checkpointing(model, checkpointing)
        arm = families.forge_builder("muon", "fp32")(model, cfg)
        for _ in range(2):
            arm.step(batch)
        trained.append([p.detach().clone() for p in model.parameters()])
    for plain, recomputed in zip(*trained):
        torch.testing.assert_close(plain, recomputed, rtol=1e-6, atol=1e-7)


def test_capability_cells_are_the_largest_qwen3_at_the_boundary():
    """fused Muon fits and torch.optim.Muon does not, by cell.predicted_bytes (a lower bound), on
    80 GB (79 GiB usable) and 141 GB (139 GiB) cards; the next larger Qwen3 fused does not fit."""
    def need(model: str, method: str) -> float:
        cell = Cell("x", "g", model, 1, 512, method, "bfloat16", "cuda", 1.0, False, "hf", True)
        return cell_mod.predicted_bytes(cell, METHODS[method])["total"] / 2 ** 30

    sizes = ["qwen3-8b", "qwen3-14b", "qwen3-32b"]
    for card_gib, chosen in ((79.0, "qwen3-14b"), (139.0, "qwen3-32b")):
        boundary = [m for m in sizes if need(m, "forge_muon_bf16") <= card_gib < need(m, "muon_unfused")]
        assert boundary[-1] == chosen
        larger = sizes[sizes.index(chosen) + 1:]
        assert all(need(m, "forge_muon_bf16") > card_gib for m in larger)


# --- the App. I table from fixture rows -----------------------------------------------------------

def _fixture_rows(folder: Path) -> list[dict]:
    """Copies of a real H100 row as family rows: (method, settings, dtype, peak GiB, step ms)."""
    template = pq.read_table(TEMPLATE).to_pylist()[0]
    specs = [
        ("adafactor_unfused", {"family": "adafactor", "fused": False}, "float32", 61.0, 400.0),
        ("forge_adafactor_fp32", {"family": "adafactor", "fused": True, "state_dtype": "fp32"}, "float32", 35.5, 125.0),
        ("adafactor_unfused", {"family": "adafactor", "fused": False}, "bfloat16", 31.0, 180.0),
        ("forge_adafactor_bf16", {"family": "adafactor", "fused": True, "state_dtype": "bf16"}, "bfloat16", 19.25, 90.0),
        ("muon_unfused", {"family": "muon", "fused": False}, "float32", None, None),
        ("forge_muon_fp32", {"family": "muon", "fused": True, "state_dtype": "fp32"}, "float32", 70.0, 300.0),
    ]
    rows = []
    for index, (method, settings, dtype, peak, step) in enumerate(specs):
        row = copy.deepcopy(template)
        row.update(method=method, method_settings=json.dumps(settings), dtype=dtype,
                   method_family="forge" if settings["fused"] else "baseline",
                   cell_id=f"llama-3.1-8b_b1_s512_{method}_{dtype}_{index:04d}",
                   peak_allocated_gib=peak, step_ms_median=step,
                   step_ms_run_medians=[step] * 3 if step else None, step_ms_run_spreads=[0.01] * 3 if step else None,
                   step_ms_all=[step] * 60 if step else None)
        if peak is None:
            row.update(status="oom_predicted", reason="needs at least 96.0 GiB but 79.1 GiB is free",
                       step_ms_p10=None, step_ms_p90=None, step_ms_spread_max=None, tokens_per_s=None)
        rows.append(row)
        pq.write_table(pa.Table.from_pylist([row], schema=pq.read_schema(TEMPLATE)),
                       folder / f"{row['cell_id']}.parquet")
    return rows


def test_app_i_table_from_fixture_rows(tmp_path):
    folder = tmp_path / "rows"
    folder.mkdir()
    rows = _fixture_rows(folder)
    out = tmp_path / "report"
    build_report(folder, out, formats=("png",))
    csv_rows = list(__import__("csv").DictReader((out / "tables" / "app-i.csv").open()))
    by_key = {(r["family"], r["states"]): r for r in csv_rows}
    fp32 = by_key[("adafactor", "fp32")]
    assert float(fp32["saved_gib"]) == pytest.approx(61.0 - 35.5)
    assert float(fp32["peak_change"]) == pytest.approx((35.5 - 61.0) / 61.0)
    assert float(fp32["speedup"]) == pytest.approx(400.0 / 125.0)
    assert float(fp32["paper_speedup"]) == 3.4
    bf16 = by_key[("adafactor", "bf16")]
    assert float(bf16["speedup"]) == pytest.approx(2.0) and bf16["paper_speedup"] == ""
    assert by_key[("muon", "fp32")]["speedup"] == ""          # the unfused arm did not fit: no ratio
    markdown = (out / "tables" / "app-i.md").read_text()
    pool = 2 * float(fp32["fused_peak_gib"] and next(r for r in rows if r["method"] == "adafactor_unfused"
                                                      and r["dtype"] == "float32")["n_params"]) / 2 ** 30
    assert float(fp32["pool_share"]) == pytest.approx((61.0 - 35.5) / pool) and fp32["target_met"] == "True"
    assert by_key[("muon", "fp32")]["target_met"] == ""      # no unfused row to hold it to
    share = f"{(61.0 - 35.5) / pool:.0%}"
    assert f"| Adafactor | fp32 | torch.optim.Adafactor | 61.00 | 35.50 | 25.50 | {share} | -41.8% |" in markdown
    assert "3.20×" in markdown and "peak −27%…−54%, step −32%…−71%, 3.4× faster" in markdown
    assert "| Muon | fp32 |" in markdown and "oom_predicted" in markdown
    assert "Optimizer families (App. I)" in (out / "index.md").read_text()


def test_app_i_rows_are_found_by_their_settings():
    row = {"method_settings": json.dumps({"family": "sm3", "fused": False}), "dtype": "bfloat16"}
    assert app_i.family_key(row) == ("sm3", False, "bf16")
    assert app_i.family_key({"method_settings": json.dumps({"optimizer": "x"})}) is None
    assert app_i.paper_text("sm3", "bf16") == "—"


def test_app_i_names_why_a_pair_has_no_speedup(tmp_path):
    """Two rows of one run at SM clocks more than 5% apart: no speed-up, and a footnote says why."""
    folder = tmp_path / "rows"
    folder.mkdir()
    rows = _fixture_rows(folder)
    fused = next(r for r in rows if r["method"] == "forge_adafactor_bf16")
    fused.update(sm_clock_mhz_before=1545.0, sm_clock_mhz_after=1545.0, step_ms_median=200.0)   # slower at lower clocks
    pq.write_table(pa.Table.from_pylist([fused], schema=pq.read_schema(TEMPLATE)), folder / f"{fused['cell_id']}.parquet")
    table = next(t for t in app_i.app_i_tables(load_rows(folder)))
    line = next(r for r in table.rows if r[:2] == ["Adafactor", "bf16"])
    assert line[10] == "n/a (different run)" and line[11].endswith("of the pool)")   # the saving decides it
    assert any(note.startswith("Adafactor (bf16): n/a (different run): SM clocks differ") for note in table.footnotes)


def test_app_i_takes_an_unfused_row_without_its_fused_twin(tmp_path):
    """A sweep of an unfused arm alone (or a FORGE arm at other states) leaves a family's line with
    the unfused numbers and no ratio, rather than failing the report."""
    folder = tmp_path / "rows"
    folder.mkdir()
    rows = _fixture_rows(folder)
    fused = next(r for r in rows if r["method"] == "forge_adafactor_bf16")
    (folder / f"{fused['cell_id']}.parquet").unlink()
    table = next(t for t in app_i.app_i_tables(load_rows(folder)))
    line = next(r for r in table.rows if r[:2] == ["Adafactor", "bf16"])
    assert line[3] == "31.00" and line[4] == "not run" and line[6] == line[7] == line[10] == line[11] == "—"
