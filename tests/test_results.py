"""The result schema as the harness writes it: every row matches schema v1, writes are atomic."""
from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest

from forge_bench import results


def test_schema_columns_are_unique_and_documented():
    assert len(results.COLUMN_NAMES) == len(set(results.COLUMN_NAMES))
    assert all(doc for _, _, doc in results.COLUMNS)
    md = results.schema_markdown()
    assert all(f"`{name}`" in md for name in results.COLUMN_NAMES)


def test_row_roundtrip_and_unknown_input_rejected(tmp_path):
    row = {"cell_id": "c1", "status": "ok", "run_id": "r", "step_ms_run_medians": [1.0, 2.0],
           "method_settings": {"lr": 1e-4}, "batch": 2}
    path = results.write_row(tmp_path, row)
    assert path.name == "c1.parquet"
    table = pq.read_table(path)
    assert table.schema.equals(results.SCHEMA)
    got = results.load_results(tmp_path).iloc[0]
    assert list(got.step_ms_run_medians) == [1.0, 2.0] and got.method_settings == '{"lr": 0.0001}'
    assert got.schema_version == results.SCHEMA_VERSION
    with pytest.raises(results.ResultsError, match="not in schema"):
        results.write_row(tmp_path, {"cell_id": "c2", "status": "ok", "bogus": 1})
    with pytest.raises(results.ResultsError, match="status"):
        results.write_row(tmp_path, {"cell_id": "c2", "status": "fine"})
    assert results.completed_cell_ids(tmp_path) == {"c1"}


def test_partial_writes_are_invisible(tmp_path):
    results.write_row(tmp_path, {"cell_id": "c1", "status": "ok"})
    (tmp_path / ".tmp-abc.parquet.part").write_bytes(b"half a parquet file")   # what a kill -9 can leave
    (tmp_path / ".tmp-def.parquet").write_bytes(b"garbage")
    assert results.completed_cell_ids(tmp_path) == {"c1"}
    assert len(results.load_results(tmp_path)) == 1


def test_rows_the_cell_writes_match_the_schema(tmp_path, monkeypatch):
    """A real cell row (CPU) holds exactly the schema's columns with the schema's types."""
    from forge_bench.cell import run_cell
    from forge_bench.suite import load_suite

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    suite_path = tmp_path / "s.yaml"
    suite_path.write_text("device: cpu\ndtype: float32\nwarmup_steps: 0\ntimed_steps: 2\nrepeats: 1\n"
                          "parity: {steps: 2}\nmodels: [tiny-gpt2]\nbatch: [1]\nseq: [8]\nmethods: [sgd]\n")
    suite = load_suite(suite_path)
    run_cell(suite, suite.cells[0], tmp_path / "out", "r1")
    table = pq.read_table(results.row_path(tmp_path / "out", suite.cells[0].cell_id))
    assert table.schema.equals(results.SCHEMA) and table.num_rows == 1
    row = table.to_pylist()[0]
    filled = {k for k, v in row.items() if v is not None}
    assert {"run_id", "suite_hash", "cell_id", "status", "step_ms_median", "step_ms_all", "torch_version",
            "transformers_version", "source_hash", "device_name", "started_at", "finished_at", "wall_s",
            "mem_weights_gib", "parity_rms_rel", "nvml_reason", "peak_reason"} <= filled


def test_schema_doc_is_current():
    """docs/results_schema.md is generated: regenerate it with
    python -c "from forge_bench.results import schema_markdown; open('docs/results_schema.md','w').write(schema_markdown())"."""
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "results_schema.md"
    assert doc.read_text() == results.schema_markdown()


def test_rows_written_before_a_later_column_load_with_it_null(tmp_path):
    import pyarrow as pa

    results.write_row(tmp_path, {"cell_id": "new", "status": "ok", "activations": "lean"})
    table = pq.read_table(tmp_path / "new.parquet")
    old = table.drop_columns(list(results.LATER_COLUMNS))
    old = old.set_column(old.column_names.index("cell_id"), "cell_id", pa.array(["old"]))
    pq.write_table(old, tmp_path / "old.parquet")
    frame = results.load_results(tmp_path).set_index("cell_id")
    assert frame.loc["new", "activations"] == "lean" and pd.isna(frame.loc["old", "activations"])


def test_an_unreadable_row_file_is_never_done_and_is_named(tmp_path):
    """A truncated row (a full disk, a copy cut short) or a file that is not parquet: not a finished
    cell, named in one line by every reader, and moved aside rather than deleted."""
    good = results.write_row(tmp_path, {"cell_id": "c1", "status": "crashed"})
    whole = results.write_row(tmp_path, {"cell_id": "c2", "status": "ok"}).read_bytes()
    (tmp_path / "c2.parquet").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "c3.parquet").write_bytes(b"these bytes are not parquet")
    scan = results.scan_rows(tmp_path)
    assert scan.statuses == {"c1": "crashed"}
    assert sorted(p.name for p in scan.unreadable) == ["c2.parquet", "c3.parquet"]
    assert all(why.startswith("not a readable parquet file (") for why in scan.unreadable.values())
    assert results.completed_cell_ids(tmp_path) == {"c1"}
    with pytest.raises(results.ResultsError) as err:
        results.load_table(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'c2.parquet'}: not a readable parquet file (")
    assert "\n" not in str(err.value)
    skipped = []
    assert len(results.load_results(tmp_path, on_foreign=lambda path, why: skipped.append(path))) == 1
    assert skipped == [tmp_path / "c2.parquet", tmp_path / "c3.parquet"]
    moved = results.set_aside(tmp_path / "c3.parquet")
    assert moved.name == "c3.parquet.corrupt" and moved.read_bytes() == b"these bytes are not parquet"
    (tmp_path / "c3.parquet").write_bytes(b"garbage again")
    assert results.set_aside(tmp_path / "c3.parquet").name == "c3.parquet.corrupt.1"
    assert moved.read_bytes() == b"these bytes are not parquet", "a file set aside before is kept"
    assert good.exists() and set(results.scan_rows(tmp_path).unreadable) == {tmp_path / "c2.parquet"}


def test_the_process_peak_round_trips_and_old_rows_read_it_as_null(tmp_path):
    """``peak_process_gib`` is written and read back as given; a row file without the column (written
    by a harness without it) loads with the column null."""
    import pyarrow as pa

    results.write_row(tmp_path, {"cell_id": "with", "status": "ok", "peak_allocated_gib": 47.25,
                                 "peak_process_gib": 49.5})
    table = pq.read_table(tmp_path / "with.parquet")
    assert table.schema.field("peak_process_gib").type == pa.float64()
    old = table.drop_columns(["peak_process_gib"])
    old = old.set_column(old.column_names.index("cell_id"), "cell_id", pa.array(["without"]))
    pq.write_table(old, tmp_path / "without.parquet")
    frame = results.load_results(tmp_path).set_index("cell_id")
    assert frame.loc["with", "peak_process_gib"] == 49.5 and frame.loc["with", "peak_allocated_gib"] == 47.25
    assert pd.isna(frame.loc["without", "peak_process_gib"])


def test_a_checkpointed_grids_rows_are_their_own_activations():
    """A row whose grid ran activation checkpointing compares only with checkpointed rows: the report
    reads its activations as 'checkpointed' (lean and hf rows, and rows without the column, unchanged)."""
    frame = pd.DataFrame({
        "activations": ["hf", "lean", "hf", None],
        "extra": ['{"activation_checkpointing": true}', "{}", None, '{"activation_checkpointing": false}']})
    assert list(results.with_activations(frame)["activations"]) == [results.CHECKPOINTED, "lean", "hf", "hf"]
    assert list(results.with_activations(pd.DataFrame({"extra": ['{"activation_checkpointing": true}', "{}"]}))
                ["activations"]) == [results.CHECKPOINTED, "hf"]


def test_a_cell_records_its_first_step_time(tmp_path, monkeypatch):
    """The first training step is timed on its own (what a user waits for before training moves) and
    lies inside the time from the model's build; a cell without warm-up records neither."""
    import json

    from forge_bench.cell import run_cell
    from forge_bench.suite import load_suite

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for warmup in (2, 0):
        suite_path = tmp_path / f"s{warmup}.yaml"
        suite_path.write_text(f"device: cpu\ndtype: float32\nwarmup_steps: {warmup}\ntimed_steps: 2\nrepeats: 1\n"
                              "parity: {enabled: false}\nmodels: [tiny-gpt2]\nbatch: [1]\nseq: [8]\nmethods: [sgd]\n")
        suite = load_suite(suite_path)
        run_cell(suite, suite.cells[0], tmp_path / f"out{warmup}", "r1")
        row = pq.read_table(results.row_path(tmp_path / f"out{warmup}", suite.cells[0].cell_id)).to_pylist()[0]
        extra = json.loads(row["extra"])
        if warmup:
            assert 0 < extra["first_step_s"] <= extra["build_to_first_step_s"] <= row["wall_s"]
        else:
            assert "first_step_s" not in extra and "build_to_first_step_s" not in extra
