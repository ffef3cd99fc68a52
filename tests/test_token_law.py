"""The constant-token law (``forge_bench.report.token_law``): peaks along each anti-diagonal of the
batch x seq grid, on rows measured on the H100 (``tests/fixtures/h100_grid``) and on rows made here."""
from __future__ import annotations

import copy
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from forge_bench.report import build_report
from forge_bench.report.data import load_rows
from forge_bench.report.token_law import TOLERANCE, token_law_points, token_law_tables
from forge_bench.results import write_row

GRID = Path(__file__).resolve().parent / "fixtures" / "h100_grid"


def _measured() -> dict[tuple[str, int], list[tuple[int, int, float]]]:
    """(method, tokens) -> [(batch, seq, peak)] straight from the fixture files."""
    out: dict[tuple[str, int], list[tuple[int, int, float]]] = {}
    for path in sorted(GRID.glob("*.parquet")):
        row = pq.read_table(path).to_pylist()[0]
        out.setdefault((row["method"], row["batch"] * row["seq"]), []).append(
            (row["batch"], row["seq"], row["peak_allocated_gib"]))
    return {key: sorted(shapes) for key, shapes in out.items() if len(shapes) >= 2}


def test_the_law_holds_within_one_percent_on_the_h100_grid() -> None:
    """Llama-3.1-8B, lean activations, CUDA graphs: FORGE int8 at 2048 and 4096 tokens and fused AdamW at
    2048 tokens, each anti-diagonal's cells from separate runs of the grid."""
    points = token_law_points(load_rows(GRID))
    measured = _measured()
    assert {(p.method, p.tokens) for p in points} == set(measured) == {
        ("forge_int8_cce", 2048), ("forge_int8_cce", 4096), ("adamw_fused", 2048)}
    for point in points:
        peaks = [peak for _, _, peak in measured[(point.method, point.tokens)]]
        assert [(b, s, p) for b, s, p, _ in point.shapes] == measured[(point.method, point.tokens)]
        assert point.spread == pytest.approx((max(peaks) - min(peaks)) / min(peaks), rel=1e-12)
        assert point.holds, f"{point.method} at {point.tokens} tokens: spread {point.spread:.4f}"


def _row(template: dict, batch: int, seq: int, peak: float, status: str = "ok") -> dict:
    row = copy.deepcopy(template)
    row.update(batch=batch, seq=seq, peak_allocated_gib=peak, status=status,
               cell_id=f"{row['method']}_b{batch}_s{seq}", run_id=f"run-b{batch}s{seq}")
    return row


def test_a_spread_over_one_percent_is_reported_as_not_holding(tmp_path: Path) -> None:
    template = pq.read_table(sorted(GRID.glob("*forge_int8_cce*"))[0]).to_pylist()[0]
    for batch, seq, peak, status in ((1, 1024, 40.0, "ok"), (2, 512, 40.5, "ok"), (1, 2048, 50.0, "ok"),
                                     (2, 1024, 50.2, "ok"), (4, 512, 99.0, "oom"), (1, 512, 30.0, "ok")):
        write_row(tmp_path / "rows", _row(template, batch, seq, peak if status == "ok" else None, status))
    points = {p.tokens: p for p in token_law_points(load_rows(tmp_path / "rows"))}
    assert set(points) == {1024, 2048}                 # 512 tokens: one shape; the oom cell carries no peak
    assert points[1024].spread == pytest.approx(0.0125) and not points[1024].holds
    assert points[2048].spread == pytest.approx(0.004) and points[2048].holds
    assert [(b, s) for b, s, _, _ in points[2048].shapes] == [(1, 2048), (2, 1024)]
    table = token_law_tables(load_rows(tmp_path / "rows"))[0]
    assert f"1 of 2 hold" in table.caption and TOLERANCE == 0.01
    assert [line[3:5] for line in table.rows] == [["1.25%", "no"], ["0.40%", "yes"]]


def test_the_report_has_the_law_section(tmp_path: Path) -> None:
    build_report(GRID, tmp_path / "out", formats=("png",))
    index = (tmp_path / "out" / "index.md").read_text()
    section = index.split("## Constant-token law", 1)[1].split("\n## ", 1)[0]
    assert "3 of 3 hold" in section and "| `forge_int8_cce` | 4096 |" in section
