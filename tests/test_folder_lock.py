"""One command per results folder (``forge_bench.folder_lock``): a second sweep (or convergence study)
into a folder another holds exits 2 in one line naming the holder; a killed holder leaves nothing
stuck; a folder that cannot be written is a one-line error, not a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_bench import folder_lock, results
from forge_bench.cli import app

REPO = Path(__file__).resolve().parent.parent
GRID_SUITE = REPO / "tests" / "fixtures" / "grid_suite.yaml"
# adamw_fused is unavailable on a CPU: its cells write their rows in the sweep's own process, at once
UNAVAILABLE_CELLS = ["--only", "adamw_fused"]
cli = CliRunner()

HOLDER = """
import sys
folder = sys.argv[1]
sys.argv = ["forge-bench", "sweep", "--out", folder, "--resume"]
from forge_bench import folder_lock
folder_lock.acquire(folder)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """A process that holds ``tmp_path / "out"`` as a running sweep would, until the test ends."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env)
    assert process.stdout.readline().strip() == "held"
    yield out, process
    process.kill()
    process.wait()


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_a_second_sweep_into_a_held_folder_exits_2_naming_the_first(holder):
    out, process = holder
    res = cli.invoke(app, ["sweep", str(GRID_SUITE), "--out", str(out), "--resume", *UNAVAILABLE_CELLS])
    assert res.exit_code == 2, res.output
    line = one_line(res.stderr)
    assert line.startswith("error:") and f"{out} is in use by pid {process.pid} on " in line
    assert f"forge-bench sweep --out {out} --resume; wait for it to end or use another folder" in line
    assert results.scan_rows(out).statuses == {}          # the refused sweep wrote no row
    assert sorted(p.name for p in out.iterdir()) == [folder_lock.LOCK_NAME]


def test_a_killed_holder_leaves_no_stuck_lock(holder):
    out, process = holder
    process.kill()
    process.wait()
    res = cli.invoke(app, ["sweep", str(GRID_SUITE), "--out", str(out), *UNAVAILABLE_CELLS])
    assert res.exit_code == 0, res.stderr
    assert set(results.scan_rows(out).statuses.values()) == {"unavailable"}
    assert not (out / folder_lock.LOCK_NAME).exists()       # let go and removed at the end


def test_a_convergence_study_into_a_held_folder_exits_2(holder):
    out, process = holder
    res = cli.invoke(app, ["convergence", "--out", str(out), "--arms", "no_such_arm", "--steps", "2"])
    assert res.exit_code == 2
    assert f"is in use by pid {process.pid} on " in " ".join(res.stderr.split())


def test_a_run_of_a_study_writes_under_its_parents_lock(holder):
    out, process = holder
    assert folder_lock.held_by(out, process.pid)
    assert not folder_lock.held_by(out, os.getpid())
    process.kill()
    process.wait()
    assert not folder_lock.held_by(out, process.pid)      # a dead owner's line holds nothing


def test_a_lock_is_let_go_and_taken_again_in_one_process(tmp_path):
    out = tmp_path / "new"
    with folder_lock.holding(out) as lock:
        assert folder_lock.read_owner(out)["pid"] == os.getpid()
        with pytest.raises(folder_lock.FolderLockError, match="is in use by pid"):
            folder_lock.acquire(out)          # a second open file of the same process is refused too
        assert lock.path.exists()
    assert not out.exists()                   # created here, left empty: removed again
    with folder_lock.holding(out):
        (out / "row.parquet").write_bytes(b"")
    assert sorted(p.name for p in out.iterdir()) == ["row.parquet"]


def test_an_out_that_cannot_be_created_is_one_line_exit_2(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    res = cli.invoke(app, ["sweep", str(GRID_SUITE), "--out", str(a_file / "out"), *UNAVAILABLE_CELLS])
    assert res.exit_code == 2
    assert " ".join(res.stderr.split()) == (f"error: {a_file / 'out'}: cannot write into this results folder "
                                            "(Not a directory)")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_out_is_one_line_exit_2(tmp_path):
    out = tmp_path / "read_only"
    out.mkdir()
    out.chmod(0o555)
    try:
        res = cli.invoke(app, ["sweep", str(GRID_SUITE), "--out", str(out), *UNAVAILABLE_CELLS])
    finally:
        out.chmod(0o755)
    assert res.exit_code == 2
    assert " ".join(res.stderr.split()) == f"error: {out}: cannot write into this results folder (Permission denied)"
