"""Reading the report's inputs and outputs in its tests: the fixture folders of real runs, their rows
straight from the parquet files with pyarrow (independently of the report's own pandas path), and the
generated Markdown tables."""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
SMOKE = FIXTURES / "smoke"
GRID = FIXTURES / "grid"
RERUN_PARTIAL = FIXTURES / "smoke_rerun_partial"
H100 = FIXTURES / "h100"
H200 = FIXTURES / "h200"
H100_HEADLINE_RUNS = FIXTURES / "h100_headline_runs"
H100_GRID_OOM = FIXTURES / "h100_grid_oom"


def has_parquet(folder: Path) -> bool:
    return folder.is_dir() and any(folder.rglob("*.parquet"))


def raw_rows(folder: Path) -> list[dict]:
    """Every row under ``folder`` as plain Python values (None for nulls)."""
    rows = []
    for path in sorted(folder.rglob("*.parquet")):
        if not path.name.startswith(".tmp-"):
            rows += pq.read_table(path).to_pylist()
    return rows


def parse_markdown_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """{### title: [ {header: cell} ... ]} for every table in a generated Markdown file."""
    tables: dict[str, list[dict[str, str]]] = {}
    title, header = None, None
    for line in text.splitlines():
        if line.startswith("### "):
            title, header = line[4:].strip(), None
            tables[title] = []
        elif line.startswith("|") and title is not None:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if header is None:
                header = cells
            elif not all(set(c) <= set(":-") for c in cells):
                tables[title].append(dict(zip(header, cells)))
        elif not line.strip().startswith("|"):
            header = None if not line.strip() == "" else header
    return tables


def close_to_printed(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to the digits it shows."""
    number = float(printed.lstrip("~≥≤").rstrip("×%"))
    decimals = len(printed.split(".")[1].rstrip("×%")) if "." in printed else 0
    return abs(number - value) <= 0.5 * 10 ** -decimals + 1e-12


def activations_of(row: dict) -> str:
    """hf or lean (rows written before the column existed are hf)."""
    return row.get("activations") or "hf"
