"""The report's folder: built whole in a staging folder beside it, then swapped in.

A report takes seconds to minutes to draw; a report killed half-way must leave the previous one
as it was. So ``build_report`` writes every file into a hidden staging folder next to the target
(``.<name>.building-<random>``, on the same file system) and only then swaps it in with two
renames: the previous folder to ``.<name>.previous-<random>``, the staging folder to the target.
Files in the previous folder that its report did not write (listed in its manifest) are the
user's: they move into the new folder, and the previous report's own files are deleted with it.

A target that is a file, or a folder holding things no report writes and no manifest (``-o .``,
``-o results``), is refused before anything is drawn: the swap would move the user's folder.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterable

from forge_bench.results import ResultsError

MANIFEST = ".forge-report-manifest.json"          # the files a report wrote, relative to its folder
REPORT_ENTRIES = ("README.md", "index.md", "tables", "figures", MANIFEST)   # what a report writes at its top


class ReportFolderError(ResultsError):
    """The report's output folder cannot be used (one line naming it)."""


def check_target(out_dir: Path) -> None:
    """Refuse (``ReportFolderError``) an output path the swap must not replace."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise ReportFolderError(f"{out_dir}: exists and is not a folder; -o names the folder the report is written to")
    if (out_dir / MANIFEST).exists():
        return
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in REPORT_ENTRIES)
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ReportFolderError(f"{out_dir}: not a report folder (it holds {shown} and no {MANIFEST}); "
                                "name a new or empty folder with -o")


def staging_folder(out_dir: Path) -> Path:
    """A new, empty hidden folder beside ``out_dir`` to build the report in; ``ReportFolderError`` (one
    line) where it cannot be made (a read-only place, a file in the way)."""
    staging = out_dir.parent / f".{out_dir.name}.building-{secrets.token_hex(4)}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise ReportFolderError(f"{out_dir}: cannot write the report there ({exc.strerror or exc})") from None
    return staging


def write_manifest(folder: Path, written: Iterable[Path]) -> None:
    """List the report's files (relative to ``folder``) in its manifest."""
    (folder / MANIFEST).write_text(json.dumps(sorted(p.relative_to(folder).as_posix() for p in written), indent=0))


def report_files(folder: Path) -> set[str]:
    """The files the report in ``folder`` wrote, from its manifest (empty without one)."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return set()
    return {str(p) for p in listed} | {MANIFEST} if isinstance(listed, list) else set()


def swap_in(staging: Path, out_dir: Path, on_replaced: Callable[[Path], None] | None = None) -> None:
    """Make ``staging`` the folder ``out_dir``: the previous folder's own report goes, the files its
    report did not write move into the new one. A user file at a path the new report writes is
    replaced by the report's and named to ``on_replaced``."""
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    ours = report_files(out_dir)
    previous = out_dir.parent / f".{out_dir.name}.previous-{secrets.token_hex(4)}"
    os.replace(out_dir, previous)
    os.replace(staging, out_dir)
    for path in sorted(p for p in previous.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(previous)
        if rel.as_posix() in ours:
            continue
        target = out_dir / rel
        if target.exists():
            if on_replaced:
                on_replaced(target)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(previous)


def remove_staging(staging: Path) -> None:
    """Delete a staging folder whose report failed: it holds only what that report drew."""
    shutil.rmtree(staging, ignore_errors=True)
