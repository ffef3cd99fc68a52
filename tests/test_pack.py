"""forge-bench pack: a finished folder's row files become one rows.parquet holding the same rows,
on real rows (tests/fixtures); a packed folder is refused by a sweep and a convergence study."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_bench import convergence as conv
from forge_bench import results, runner
from forge_bench.cli import app
from forge_bench.pack import PackError, pack_folder, pack_tree
from forge_bench.report.training import convergence_tables
from forge_bench.run_rows import load_kind
from forge_bench.suite import load_suite

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _copy(name: str, to: Path) -> Path:
    shutil.copytree(FIXTURES / name, to)
    return to


def test_a_packed_folder_reads_the_same_rows_in_a_fraction_of_the_bytes(tmp_path: Path) -> None:
    """The H100 fixture's 30 rows of two runs (some without the later columns): one rows.parquet,
    the same table as the 30 files gave, smaller than a fifth of their bytes."""
    folder = _copy("h100", tmp_path / "h100")
    before = results.load_table(folder)
    [packed] = pack_tree(folder)
    assert packed.path == folder / results.PACKED_ROWS and (packed.rows, packed.files) == (30, 30)
    assert [p.name for p in folder.glob("*.parquet")] == [results.PACKED_ROWS]
    assert results.load_table(folder).equals(before)
    assert packed.bytes_after * 5 < packed.bytes_before
    assert pack_tree(folder) == []                                     # packed already: nothing to do


def test_packed_convergence_runs_give_the_same_table(tmp_path: Path) -> None:
    """The H200 convergence rows, each folder packed: the same deltas, floor and verdicts."""
    study = _copy("convergence_h200", tmp_path / "study")
    folders = [study / "first", study / "repeat"]
    before = convergence_tables(load_kind(folders, "convergence"))[0]
    assert len(pack_tree(study)) == 2
    after = convergence_tables(load_kind(folders, "convergence"))[0]
    assert after.rows == before.rows and after.records == before.records and after.header == before.header


def test_a_folder_with_other_parquet_files_is_refused_untouched(tmp_path: Path) -> None:
    folder = _copy("grid", tmp_path / "grid")
    (folder / "kernel_bench.parquet").write_bytes((FIXTURES / "convergence_h200" / "first" /
                                                   "convergence_forge_bf16_seed1.parquet").read_bytes())
    names = sorted(p.name for p in folder.iterdir())
    with pytest.raises(PackError, match="holds rows of several kinds"):
        pack_folder(folder)
    (folder / "kernel_bench.parquet").write_bytes(b"not parquet")
    with pytest.raises(PackError, match="kernel_bench.parquet: not a forge-bench row file"):
        pack_folder(folder)
    assert sorted(p.name for p in folder.iterdir()) == names
    (folder / "kernel_bench.parquet").unlink()
    result = CliRunner().invoke(app, ["pack", str(tmp_path)])
    assert result.exit_code == 0 and "12 rows from 12 files" in result.output, result.output


def test_a_pack_cut_short_is_finished_and_a_foreign_row_is_refused(tmp_path: Path) -> None:
    """Killed after writing rows.parquet: the row files left are removed once their rows are found
    in it; a row file holding a row it lacks is named and kept."""
    folder = _copy("grid", tmp_path / "grid")
    left = sorted(folder.glob("*.parquet"))[:3]
    kept = {p.name: p.read_bytes() for p in left}
    pack_folder(folder)
    for name, data in kept.items():
        (folder / name).write_bytes(data)
    assert pack_folder(folder) is None and [p.name for p in folder.glob("*.parquet")] == [results.PACKED_ROWS]
    stranger = FIXTURES / "smoke" / sorted(p.name for p in (FIXTURES / "smoke").glob("*.parquet"))[0]
    shutil.copy(stranger, folder / stranger.name)
    with pytest.raises(PackError, match=f"{stranger.name}: holds rows that .*rows.parquet lacks"):
        pack_folder(folder)
    assert (folder / stranger.name).exists()


def test_a_sweep_and_a_study_refuse_a_packed_folder(tmp_path: Path) -> None:
    folder = _copy("grid", tmp_path / "grid")
    pack_folder(folder)
    with pytest.raises(runner.RunnerError, match="packed into rows.parquet"):
        runner.plan_run(folder, load_suite(FIXTURES / "grid_suite.yaml"), resume=True, allow_mixed=False)
    result = CliRunner().invoke(app, ["sweep", str(FIXTURES / "grid_suite.yaml"), "--out", str(folder), "--resume",
                                      "--dry-run"])
    assert result.exit_code == 2 and "its rows are packed into rows.parquet" in result.output, result.output
    study = _copy("convergence_h200", tmp_path / "study") / "first"
    pack_folder(study)
    with pytest.raises(conv.ConvergenceError, match="packed into rows.parquet"):
        conv.plan(study, conv.ConvergenceSpec(), ["adamw_fused"], [1])
