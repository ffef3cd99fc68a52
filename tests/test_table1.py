"""The report's Table 1 (``forge_bench.report.table1``) on H100 rows (``tests/fixtures/h100``):
model FLOPs, TF/s, mean ± sd over the timed steps and the paper's figures beside ours."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from forge_bench import zoo
from forge_bench.report import build_report
from forge_bench.report.data import load_rows
from forge_bench.report.table1 import mean_sd, model_flops_per_step, paper_arm, table1_tables, tflops

H100 = Path(__file__).resolve().parent / "fixtures" / "h100"
ROW = H100 / "llama-3.1-8b_b1_s512_forge_bf16_cce_graph_lean_bde13ba965.parquet"


def test_model_flops_count_the_matrices_and_attention() -> None:
    config = json.loads(zoo.MODEL_ZOO["llama-3.1-8b"].config_path.read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (32, 4096)
    n = 8_030_261_248
    assert model_flops_per_step("llama-3.1-8b", n, 2, 512) == 6 * n * 1024 + 12 * 32 * 4096 * 512 * 1024
    gpt2 = 6 * 1_557_611_200 * 512 + 12 * 48 * 1600 * 512 * 512           # GPT-2's n_layer / n_embd
    assert model_flops_per_step("gpt2-xl", 1_557_611_200, 1, 512) == gpt2


@pytest.mark.parametrize("model", ["qwen3-30b-a3b-l8", "vit-base-16", "mamba2-1.3b", "no-such-model"])
def test_no_flops_where_six_n_t_would_be_wrong(model: str) -> None:
    """Experts (a token reaches a few), images, a model without attention, an unknown name: no count."""
    assert model_flops_per_step(model, 1e9, 1, 512) is None


def test_a_rows_tflops_and_mean_sd_come_from_its_own_numbers() -> None:
    row = pq.read_table(ROW).to_pylist()[0]
    flops = model_flops_per_step(row["model"], row["n_params"], row["batch"], row["seq"])
    assert tflops(row) == pytest.approx(flops / (row["step_ms_median"] / 1e3) / 1e12, rel=1e-12)
    assert mean_sd(row) == pytest.approx((statistics.fmean(row["step_ms_all"]), statistics.stdev(row["step_ms_all"])))
    assert tflops({**row, "status": "oom"}) is None and mean_sd({**row, "step_ms_all": [1.0]}) == (None, None)


def test_paper_arms() -> None:
    assert [paper_arm(m) for m in ("adamw_fused", "adamw_fused_cce", "forge_bf16_cce", "forge_int8", "forge_fp8_cce",
                                   "adamw_foreach")] == ["adamw_fused", "adamw_fused", "forge_bf16", "forge_int8",
                                                          None, None]


def test_the_table_on_h100_rows(tmp_path: Path) -> None:
    tables = {t.title: t for t in table1_tables(load_rows(H100))}
    graph = next(t for title, t in tables.items() if "CUDA-graph replay · lean activations" in title)
    line = next(r for r in graph.rows if r[0] == "`forge_bf16_cce`")
    row = pq.read_table(ROW).to_pylist()[0]
    mean, sd = mean_sd(row)
    assert line[1] == f"{row['peak_allocated_gib']:.2f}" and line[4] == f"{tflops(row):.0f}"
    assert line[3].startswith(f"{mean:.2f} ± ") and line[5] == "—" and line[6] == "48.36 GB / 110.2 ms"
    assert next(r for r in graph.rows if r[0] == "`adamw_fused`")[6] == "60.08 GB / 134.3 ms"
    build_report(H100, tmp_path / "out", formats=("png",))
    assert "## Table 1" in (tmp_path / "out" / "index.md").read_text()
    assert (tmp_path / "out" / "tables" / "table1.csv").exists()


def test_the_first_step_column_reads_the_rows_extra() -> None:
    row = pq.read_table(ROW).to_pylist()[0]
    row["extra"] = json.dumps({**json.loads(row["extra"] or "{}"), "first_step_s": 12.34})
    single = load_rows(H100)
    single = single[single["cell_id"] == row["cell_id"]].assign(extra=row["extra"])
    [table] = table1_tables(single)
    assert table.rows[0][5] == "12.3" and table.records[0]["first_step_s"] == 12.34


def test_a_cpu_cells_small_throughput_and_first_step_print_as_measured_not_as_zero() -> None:
    """A tiny model's CPU step (the smoke fixture) does 0.0x model TF/s and its first step takes a few
    hundredths of a second: printed with two significant digits ("0.019"), never "0" or "0.0"."""
    smoke = load_rows(Path(__file__).resolve().parent / "fixtures" / "smoke")
    llama = smoke[smoke["model"] == "tiny-llama"]
    first = llama.iloc[0]
    llama = llama.assign(extra=[json.dumps({**json.loads(first["extra"] or "{}"), "first_step_s": 0.018642})]
                         + list(llama["extra"].iloc[1:]))
    [table] = table1_tables(llama)
    values = {r["method"]: r for r in table.records}
    for line in table.rows:
        method = line[0].split("`")[1]
        throughput = values[method]["tflops"]
        assert 0 < throughput < 1 and line[4] == f"{throughput:.2g}" and line[4] not in ("0", "0.0")
    line = next(r for r in table.rows if r[0] == f"`{first['method']}`")
    assert line[5] == "0.019"
