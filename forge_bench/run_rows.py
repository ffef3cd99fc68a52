"""Result rows of the kinds beside the sweep's: fidelity measurements and convergence runs.

A sweep row (``forge_bench.results``) describes one timed cell. ``forge-bench fidelity`` and
``forge-bench convergence`` measure other things (a weight's distance from an fp32 reference, a
loss curve) and write their own parquet files, each with a ``row_kind`` column naming the kind and
the schema its module documents (``forge_bench.fidelity.SCHEMA``,
``forge_bench.convergence.SCHEMA``; docs/training_results_schema.md lists both). Files are written the
sweep's way: a temporary name in the same folder, fsync, ``os.replace``, so a kill never leaves a
half-written ``*.parquet``. ``forge-bench report`` finds them by their ``row_kind`` and draws their
tables and figures beside the sweep's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from forge_bench.results import write_table_atomically

KIND_COLUMN = "row_kind"
KINDS = ("fidelity", "convergence")


def write_rows(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> Path:
    """Write ``rows`` (every column of ``schema``, missing ones null) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = schema.names
    unknown = sorted({key for row in rows for key in row} - set(names))
    if unknown:
        raise ValueError(f"{path.name}: columns not in the schema: {unknown}")
    table = pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows], schema=schema)
    return write_table_atomically(table, path)


def file_kind(path: str | os.PathLike) -> str | None:
    """The ``row_kind`` of a parquet file written here, or None for any other parquet file."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowInvalid):
        return None
    if KIND_COLUMN not in schema.names:
        return None
    kinds = set(pq.read_table(path, columns=[KIND_COLUMN]).column(KIND_COLUMN).to_pylist())
    return kinds.pop() if len(kinds) == 1 and next(iter(kinds), None) in KINDS else None


def kind_files(folders: Iterable[str | os.PathLike], kind: str) -> list[Path]:
    """Every parquet file of ``kind`` under ``folders`` (folders searched recursively)."""
    found = []
    for folder in folders:
        folder = Path(folder)
        files = [folder] if folder.is_file() else sorted(folder.rglob("*.parquet")) if folder.exists() else []
        found += [f for f in files if not f.name.startswith(".tmp-") and file_kind(f) == kind]
    return found


def load_kind(folders: Iterable[str | os.PathLike], kind: str) -> pd.DataFrame | None:
    """The rows of ``kind`` under ``folders`` as one frame, or None when there are none."""
    files = kind_files(folders, kind)
    if not files:
        return None
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def schema_markdown(title: str, columns: Sequence[tuple[str, pa.DataType, str]]) -> str:
    """A Markdown table of one kind's columns, for docs/results_schema.md."""
    lines = [f"## {title}", "", "| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {typ} | {doc} |" for name, typ, doc in columns]
    return "\n".join(lines) + "\n"


__all__ = ["KINDS", "KIND_COLUMN", "file_kind", "kind_files", "load_kind", "schema_markdown", "write_rows"]
