"""``forge-bench pack FOLDER...``: a finished results folder's row files become one ``rows.parquet``.

Why: a parquet file of one row is mostly its footer (the schema, and each column's statistics and
offsets): ~18 KB of a sweep row's ~26 KB, ~12 KB of a convergence run's ~44 KB. A folder of 82
one-row files takes 2.4 MB; the same rows in one file take 0.1 MB, and the committed results stay
within their budget (``tests/test_architecture.py``) only so.

The rows are unchanged: every column and value, in the order of their files' names (the order
every reader reads a folder in); a column some files lack is null in their rows, as
``forge_bench.results.load_table`` reads them anyway. The packed file is read back and compared
with the rows before a single row file is removed. A packed folder is a finished record: a sweep
(``runner.plan_run``) and a convergence study (``convergence.check_folder``) refuse to add to it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from forge_bench.results import PACKED_ROWS, ResultsError, read_parquet, write_table_atomically
from forge_bench.run_rows import file_kind


class PackError(ResultsError):
    """A folder that cannot be packed (the message names it and why)."""


@dataclass(frozen=True)
class Packed:
    """What packing one folder did: its packed file, the rows in it and the files it replaced."""
    path: Path
    rows: int
    files: int
    bytes_before: int
    bytes_after: int


def row_kind(path: Path) -> str | None:
    """"sweep", "convergence" or "fidelity" for a parquet file of result rows; None for any other."""
    kind = file_kind(path)
    if kind is not None:
        return kind
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid):
        return None
    return "sweep" if {"cell_id", "run_id", "status"} <= set(names) else None


def _row_texts(table: pa.Table) -> list[str]:
    """Each row as one comparable text (its columns sorted; a NaN compares equal to a NaN)."""
    return [json.dumps(row, sort_keys=True, default=str) for row in table.to_pylist()]


def _finish_cut_short(folder: Path, files: list[Path]) -> None:
    """A pack killed between writing ``rows.parquet`` and removing the row files: remove each row
    file whose rows are all in ``rows.parquet``; refuse (naming it) one that holds a row it lacks."""
    packed = read_parquet(folder / PACKED_ROWS)
    for path in files:
        table = read_parquet(path)
        have = set(_row_texts(packed.select([c for c in table.column_names if c in packed.column_names])))
        if table.num_rows and not set(_row_texts(table)) <= have:
            raise PackError(f"{path}: holds rows that {folder / PACKED_ROWS} lacks; move one of them out of "
                            f"{folder} before packing it")
    for path in files:
        path.unlink()


def pack_folder(folder: Path) -> Packed | None:
    """Pack the row files directly in ``folder`` into ``folder/rows.parquet`` (None: nothing to pack,
    or packed already). All of one kind; any other parquet file there is an error naming it."""
    files = sorted(p for p in folder.glob("*.parquet") if p.name != PACKED_ROWS and not p.name.startswith(".tmp-"))
    if not files:
        return None
    kinds = {path: row_kind(path) for path in files}
    other = next((path for path, kind in kinds.items() if kind is None), None)
    if other is not None:
        raise PackError(f"{other}: not a forge-bench row file; {folder} is packed only when it holds rows alone")
    if len(set(kinds.values())) > 1:
        raise PackError(f"{folder}: holds rows of several kinds ({', '.join(sorted(set(kinds.values())))}); "
                        "pack a folder of one kind")
    if (folder / PACKED_ROWS).exists():
        _finish_cut_short(folder, files)
        return None
    before = sum(path.stat().st_size for path in files)
    try:
        table = pa.concat_tables([read_parquet(path) for path in files], promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise PackError(f"{folder}: its row files do not share column types ({str(exc).splitlines()[0]})") from None
    target = write_table_atomically(table, folder / PACKED_ROWS, compression="zstd")
    if not read_parquet(target).equals(table):
        target.unlink()
        raise PackError(f"{target}: read back different from the rows written; nothing removed")
    for path in files:
        path.unlink()
    return Packed(target, table.num_rows, len(files), before, target.stat().st_size)


def pack_tree(root: Path) -> list[Packed]:
    """Pack every folder under ``root`` (``root`` too) whose parquet files are rows of one kind; a
    folder of other parquet files (the kernel benchmark's) is left as it is."""
    if not root.is_dir():
        raise PackError(f"{root}: not a folder")
    done = []
    for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        files = [p for p in folder.glob("*.parquet") if p.name != PACKED_ROWS]
        if files and all(row_kind(p) is None for p in files):
            continue
        packed = pack_folder(folder)
        if packed is not None:
            done.append(packed)
    return done


__all__ = ["PackError", "Packed", "pack_folder", "pack_tree", "row_kind"]
