"""The report's Composability table (``forge_bench.report.composability``) and ``suites/composability.yaml``,
on rows made here from one real H100 row."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq

from forge_bench.report import build_report
from forge_bench.report.composability import composability_tables
from forge_bench.report.data import load_rows
from forge_bench.results import write_row
from forge_bench.suite import load_suite

REPO = Path(__file__).resolve().parents[1]
H100_ROW = REPO / "tests" / "fixtures" / "h100" / "llama-3.1-8b_b1_s512_adamw_fused_9a3c76cb2a.parquet"
# (method, checkpointed, peak GiB, step ms, status)
ARMS = [("adamw_fused", False, 59.9, 133.0, "ok"), ("forge_bf16", False, 48.7, 120.0, "ok"),
        ("adamw_fused", True, 57.0, 160.0, "ok"), ("forge_bf16", True, 44.0, 150.0, "ok"),
        ("bnb_adamw8bit", False, 45.2, 350.0, "ok"), ("forge_int8", False, 35.6, 140.0, "ok"),
        ("adafactor_unfused", False, 31.1, 243.0, "ok"), ("forge_adafactor_bf16", False, None, None, "oom"),
        ("galore_adamw_rsvd", False, 37.0, 160.0, "ok"), ("forge_galore_bf16", False, 24.5, 170.0, "ok")]


def _rows(folder: Path) -> None:
    template = pq.read_table(H100_ROW).to_pylist()[0]
    for method, checkpointed, peak, step, status in ARMS:
        row = copy.deepcopy(template)
        row.update(method=method, peak_allocated_gib=peak, step_ms_median=step, status=status,
                   cell_id=f"{method}{'_ckpt' if checkpointed else ''}",
                   extra=json.dumps({"activation_checkpointing": True} if checkpointed else {}))
        write_row(folder, row)


def test_each_technique_alone_forge_alone_and_composed(tmp_path: Path) -> None:
    _rows(tmp_path / "rows")
    [table] = composability_tables(load_rows(tmp_path / "rows"))
    lines = {line[0]: line for line in table.rows}
    assert lines["activation checkpointing"][1:] == ["59.90 / 133.0", "57.00 / 160.0", "48.70 / 120.0",
                                                     "44.00 / 150.0", "4.70"]
    assert lines["8-bit states"][2:] == ["45.20 / 350.0", "48.70 / 120.0", "35.60 / 140.0", "9.60"]
    assert lines["factored moments (Adafactor)"][4:] == ["oom", "—"]
    assert lines["low-rank projection (GaLore)"][4:] == ["24.50 / 170.0", "12.50"]
    record = next(r for r in table.records if r["technique"] == "8-bit states")
    assert abs(record["composed_below_best_alone_gib"] - (min(45.2, 48.7) - 35.6)) < 1e-9
    build_report(tmp_path / "rows", tmp_path / "out", formats=("png",))
    index = (tmp_path / "out" / "index.md").read_text()
    assert "## Composability" in index and "· activation checkpointing" in index    # its headline group


def test_the_suite_runs_every_arm_of_the_table_in_one_run() -> None:
    suite = load_suite(REPO / "suites" / "composability.yaml")
    arms = {(c.method, c.activation_checkpointing) for c in suite.cells}
    assert {("adamw_fused", False), ("forge_bf16", False), ("adamw_fused", True), ("forge_bf16", True),
            ("bnb_adamw8bit", False), ("forge_int8", False), ("adafactor_unfused", False),
            ("forge_adafactor_bf16", False), ("galore_adamw_rsvd", False), ("forge_galore_bf16", False)} <= arms
