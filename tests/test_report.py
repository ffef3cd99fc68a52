"""Tests of ``forge-bench report`` on committed parquet rows from real runs (``tests/fixtures``).

The fixture folders are listed in ``report_fixture_folders``: CPU smoke and grid runs, and rows
copied unedited from H100 and H200 runs (eager, CUDA-graph and lean-activation cells, the peers,
floor terms and energy); more can be named with ``FORGE_REPORT_FIXTURES`` (paths separated by
``os.pathsep``), e.g. a whole results folder. Expected values are computed here straight from the
parquet files with pyarrow, independently of the report's own pandas path.

Figures: a folder of up to ``FULL_FORMATS_MAX_ROWS`` rows is reported as users get it, PNG + PDF; a
larger one (a whole results folder) with ``formats=("png",)``, which runs every figure builder and
renders every figure as PNG but skips the PDF twins (about 30% of that build's time).
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forge_bench import results
from forge_bench.report import NoResultsError, build_report, ratios
from forge_bench.report.data import run_label
from forge_bench.zoo import model_family
from report_rows import (GRID, H100, H200, REPO, RERUN_PARTIAL, SMOKE, activations_of, close_to_printed,
                         has_parquet, parse_markdown_tables, raw_rows)


def report_fixture_folders() -> list[Path]:
    folders = [SMOKE, GRID, H100, H200]
    folders += [Path(p) for p in os.environ.get("FORGE_REPORT_FIXTURES", "").split(os.pathsep) if p]
    return [f for f in folders if has_parquet(f)]


FOLDERS = report_fixture_folders()
FOLDER_IDS = [str(f.relative_to(REPO)) if REPO in f.parents else str(f) for f in FOLDERS]


FULL_FORMATS_MAX_ROWS = 200


def fixture_formats(rows: list[dict]) -> tuple[str, ...]:
    """The figure formats the ``built`` fixture asks for: the default for a small folder, PNG only
    for a large one (see the module docstring)."""
    return ("png", "pdf") if len(rows) <= FULL_FORMATS_MAX_ROWS else ("png",)


@pytest.fixture(scope="module", params=FOLDERS, ids=FOLDER_IDS)
def built(request, tmp_path_factory):
    """(folder, rows, out_dir, index) of one report built from one fixture folder (figures in
    ``fixture_formats(rows)``); ``index`` is the details page, ``out_dir / "README.md"`` the summary."""
    folder = request.param
    rows = raw_rows(folder)
    out = tmp_path_factory.mktemp("report")
    summary = build_report(folder, out, formats=fixture_formats(rows))
    assert summary == out / "README.md"
    return folder, rows, out, out / "index.md"


def _group_key(row: dict) -> tuple:
    # eager steps and CUDA-graph replays are separate tables, and so are lean activations: a ratio
    # never mixes them
    return (row["device_name"], row["model"], row["dtype"], row["batch"], row["seq"],
            row.get("timing_method") == "cuda_graph_replay", activations_of(row))


def _timing(row: dict) -> str:
    """The report's timing column for a row (its tables never mix the two)."""
    return "CUDA graph" if row.get("timing_method") == "cuda_graph_replay" else "eager"


def _title(key: tuple) -> str:
    device, model, dtype, batch, seq, graph, activations = key
    return (f"{device} · {model} · {dtype} · batch {batch} × seq {seq}" + (" · CUDA-graph replay" if graph else "")
            + (" · lean activations" if activations == "lean" else ""))


# --- the headline table equals a hand computation from the parquet rows ---------------------------

def test_fixture_folders_exist():
    assert has_parquet(SMOKE), f"committed fixture {SMOKE} is missing"
    assert has_parquet(GRID), f"committed fixture {GRID} is missing"
    assert has_parquet(RERUN_PARTIAL), f"committed fixture {RERUN_PARTIAL} is missing"
    assert has_parquet(H100) and has_parquet(H200), "committed GPU fixtures are missing"


def test_headline_values_equal_hand_computation(built):
    folder, rows, out, _ = built
    tables = parse_markdown_tables((out / "tables" / "headline.md").read_text())
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_group_key(row), []).append(row)
    assert set(tables) == {_title(k) for k in groups}
    checked_ratios = 0
    for key, group in groups.items():
        table = tables[_title(key)]
        assert len(table) == len(group)
        ok = {m for m in ("adamw_fused", "adamw_foreach")
              if any(r["method"] == m and r["status"] == "ok" for r in group)}
        base_method = "adamw_fused" if "adamw_fused" in ok else ("adamw_foreach" if ok else None)
        several_runs = len({r["run_id"] for r in group}) > 1
        peaks = [r["peak_allocated_gib"] for r in group if r["peak_allocated_gib"] is not None]
        unit, scale = ("MiB", 1024.0) if peaks and max(peaks) < 1.0 else ("GiB", 1.0)
        for row in group:
            # a FORGE row that fused nothing says so beside its name
            fused_nothing = row["method"].startswith("forge_") and row.get("n_fused_params") == 0
            name = f"`{row['method']}`" + (" (nothing fused)" if fused_nothing else "")
            [line] = [t for t in table if t["Method"] == name
                      and (not several_runs or t["Run"] == run_label(row["run_id"]))]
            assert line["Status"] == row["status"]
            peak = row["peak_allocated_gib"]
            assert line[f"Peak {unit}"] == ("—" if peak is None else f"{peak * scale:.2f}")
            if row["step_ms_median"] is None:
                assert line["Step ms"] == "—"
            else:
                assert close_to_printed(line["Step ms"], row["step_ms_median"])
            if row["step_ms_spread_max"] is not None:
                assert line["Spread"] == f"{row['step_ms_spread_max'] * 100:.1f}%"
            extra = json.loads(row.get("extra") or "{}")
            energy, power = extra.get("energy_j_per_step"), extra.get("power_w_mean")
            assert line["J/step"] == ("—" if energy is None else f"{energy:.2f}")
            assert line["Mean W"] == ("—" if power is None else f"{power:.0f}")
            bases = [r for r in group if r["method"] == base_method and r["status"] == "ok"
                     and r["run_id"] == row["run_id"]]
            if base_method is None:
                assert line["Speed-up"].startswith("n/a")
            elif bases and bases[0] is row:
                assert line["Speed-up"] == "baseline" and line["Δ peak"] == "baseline"
            elif bases and row["status"] == "ok":
                refused = ratios.time_incomparable_reason(row, bases[0]) is not None   # clocks or host apart
                if refused and not ratios.speedup(row, bases[0]).bound:
                    assert line["Speed-up"] == ratios.DIFFERENT_RUN
                else:
                    expected = bases[0]["step_ms_median"] / row["step_ms_median"]
                    assert line["Speed-up"].endswith("×") and close_to_printed(line["Speed-up"], expected)
                    checked_ratios += 1
                if peak is not None and bases[0]["peak_allocated_gib"] is not None:
                    change = (peak - bases[0]["peak_allocated_gib"]) / bases[0]["peak_allocated_gib"] * 100
                    assert close_to_printed(line["Δ peak"], change)
                else:
                    assert line["Δ peak"] == "n/a (no peak)"
            elif not bases:
                assert line["Speed-up"] == ratios.DIFFERENT_RUN
    assert checked_ratios > 0, "the fixture should hold at least one ratio against a baseline"


def test_headline_csv_holds_exact_ratios(built):
    folder, rows, out, _ = built
    with (out / "tables" / "headline.csv").open() as fh:
        records = list(csv.DictReader(fh))
    assert len(records) == len(rows)
    by_run_method = {(r["run_id"], r["device_name"], r["model"], r["batch"], r["seq"], _timing(r), activations_of(r),
                      r["method"]): r for r in rows}
    for rec in records:
        if rec["speedup"] in ("", "None"):
            continue
        row = by_run_method[(rec["run_id"], rec["device_name"], rec["model"], int(rec["batch"]),
                             int(rec["seq"]), rec["timing"], rec["activations"], rec["method"])]
        base = by_run_method[(rec["run_id"], rec["device_name"], rec["model"], int(rec["batch"]),
                              int(rec["seq"]), rec["timing"], rec["activations"], rec["baseline_method"])]
        assert float(rec["speedup"]) == pytest.approx(base["step_ms_median"] / row["step_ms_median"], rel=1e-12)


def test_baseline_choice_and_caption(built):
    """adamw_fused where it ran ok in a group, else adamw_foreach, and the caption says which."""
    _, rows, out, _ = built
    with (out / "tables" / "headline.csv").open() as fh:
        records = list(csv.DictReader(fh))
    text = (out / "tables" / "headline.md").read_text()
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_group_key(row), []).append(row)
    for key, group in groups.items():
        ok = {r["method"] for r in group if r["status"] == "ok"}
        expected = next((m for m in ("adamw_fused", "adamw_foreach") if m in ok), "")
        got = {r["baseline_method"] for r in records
               if (r["device_name"], r["model"], r["dtype"], int(r["batch"]), int(r["seq"]),
                   r["timing"] == "CUDA graph", r["activations"]) == key}
        assert got == {expected}
        if expected == "adamw_fused":
            assert "Ratios are against torch fused AdamW (`adamw_fused`)." in text
        elif expected == "adamw_foreach":
            assert "Ratios are against `adamw_foreach` because `adamw_fused` has no ok row here" in text


def test_latex_is_booktabs_and_escaped(built):
    _, _, out, _ = built
    for tex in (out / "tables").glob("*.tex"):
        text = tex.read_text()
        assert text.count(r"\begin{table}") == text.count(r"\end{table}") >= 1
        assert text.count(r"\toprule") == text.count(r"\midrule") == text.count(r"\bottomrule")
        body = re.sub(r"\\label\{[^}]*\}", "", text).split("\n", 1)[1].replace(" & ", " ")
        assert not re.search(r"(?<!\\)[_%&#]", body), f"unescaped character in {tex.name}"
        assert "×" not in text and "~" not in text.replace(r"$\sim$", "") and "`" not in text.replace("``", "")


def test_not_run_table_lists_every_non_ok_row(built):
    _, rows, out, index = built
    bad = [r for r in rows if r["status"] != "ok"]
    if not bad:
        assert "_Skipped: every row ran ok._" in index.read_text()
        return
    with (out / "tables" / "not-run.csv").open() as fh:
        records = list(csv.DictReader(fh))
    assert sorted((r["method"], r["model"], r["status"]) for r in records) == \
        sorted((r["method"], r["model"], r["status"]) for r in bad)
    for rec in records:
        assert rec["reason"] and rec["reason"] != "no reason recorded"


# --- figures -----------------------------------------------------------------------------------------

def test_every_figure_written_and_linked(built):
    _, rows, out, index = built
    text = index.read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links, "index.md links nothing"
    for link in links:
        target = out / link
        assert target.is_file() and target.stat().st_size > 0, f"index.md links a missing or empty {link}"
    pngs = sorted((out / "figures").glob("*.png"))
    with_pdf = "pdf" in fixture_formats(rows)
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pdf = png.with_suffix(".pdf")
        if with_pdf:
            assert pdf.read_bytes()[:5] == b"%PDF-", f"{pdf.name} missing or not a PDF"
        else:
            assert not pdf.exists() and f"figures/{pdf.name}" not in links
        assert f"figures/{png.name}" in links
    assert len(list((out / "figures").glob("*.pdf"))) == (len(pngs) if with_pdf else 0)
    ok = [r for r in rows if r["status"] == "ok"]
    expected_headline = len({_group_key(r) for r in ok})
    # the memory, grid and scaling figures draw one run of each group (the tables keep every run)
    expected_memory = len({_group_key(r) for r in ok})
    expected_fidelity = len({r["device_name"] for r in rows if r["status"] in ("ok", "parity_fail")
                             and r["parity_rms_rel"] is not None and r["parity_steps"] != 0})
    by_run_model = {}
    for r in rows:
        by_run_model.setdefault((r["run_id"], r["device_name"], r["model"], r["dtype"], _timing(r), activations_of(r)),
                                set()).add((r["batch"], r["seq"]))
    expected_grid = len({key[1:] for key, shapes in by_run_model.items() if len(shapes) >= 2})
    by_run_shape = {}   # scaling compares the sizes of one model family (forge_bench/zoo.py)
    for r in rows:
        by_run_shape.setdefault((r["run_id"], r["device_name"], model_family(r["model"]), r["dtype"], r["batch"],
                                 r["seq"], _timing(r), activations_of(r)),
                                set()).add(r["model"])
    expected_scaling = len({key[1:] for key, models in by_run_shape.items() if len(models) >= 2})
    names = [p.name for p in pngs]
    assert sum(n.startswith("headline-") for n in names) == expected_headline
    assert sum(n.startswith("memory-") for n in names) == expected_memory
    assert sum(n.startswith("fidelity-") for n in names) == expected_fidelity
    assert sum(n.startswith("scaling-") for n in names) == expected_scaling
    assert sum(n.startswith("grid-") and n.endswith("-lines.png") for n in names) == expected_grid
    devices = {r["device_name"] for r in rows}
    if len(devices) == 1:
        assert f"_Skipped: only one device in these results ({devices.pop()})._" in text
    if expected_grid == 0:
        assert "_Skipped: no run measured one model at two or more batch × seq shapes._" in text


def test_formats_write_only_the_file_types_asked_for(tmp_path):
    """``formats`` picks the figure files (PNG or PDF here; both, the default, in ``built``): index.md
    embeds and links only what exists, the tables do not change, a re-run in another format removes
    the last run's files, and an unknown format is refused before anything is written."""
    out = tmp_path / "out"
    stems: list[str] = []
    headline = ""
    for formats, kept, gone in ((["png"], ".png", ".pdf"), (("pdf",), ".pdf", ".png")):
        build_report(SMOKE, out, formats=formats)
        text = (out / "index.md").read_text()
        stems = stems or sorted(p.stem for p in (out / "figures").glob(f"*{kept}"))
        headline = headline or (out / "tables" / "headline.md").read_text()
        assert stems and sorted(p.stem for p in (out / "figures").glob(f"*{kept}")) == stems
        assert not list((out / "figures").glob(f"*{gone}")), f"{formats}: a {gone} figure was written or survived"
        for stem in stems:
            assert f"(figures/{stem}{kept})" in text and f"(figures/{stem}{gone})" not in text
        assert ("![" in text) == (kept == ".png")
        assert (out / "tables" / "headline.md").read_text() == headline
    for bad in (["svg"], [], "png"):
        with pytest.raises(ValueError, match="png, pdf"):
            build_report(SMOKE, tmp_path / "bad", formats=bad)
    assert not (tmp_path / "bad").exists()


def test_grid_fixture_draws_heatmaps():
    rows = raw_rows(GRID)
    assert len({(r["batch"], r["seq"]) for r in rows}) >= 2, "the grid fixture must span shapes"


def test_rebuild_removes_stale_outputs(tmp_path):
    """Re-running into one folder deletes what the last report wrote for vanished groups."""
    rows = tmp_path / "rows"
    shutil.copytree(SMOKE, rows / "a")
    shutil.copytree(RERUN_PARTIAL, rows / "b")
    out = tmp_path / "out"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "mine.png").write_bytes(b"not the report's")
    build_report(rows, out)
    run_b = run_label(raw_rows(RERUN_PARTIAL)[0]["run_id"]).lower()
    assert list((out / "figures").glob(f"memory-*{run_b}*.png"))
    shutil.rmtree(rows / "b")
    build_report(rows, out)
    assert not list((out / "figures").glob(f"memory-*{run_b}*.png")), "a figure of a vanished run survived"
    assert (out / "figures" / "mine.png").exists(), "a file the report did not write was deleted"


# --- the ratio rule on every fixture's ratios (the rule itself: test_report_ratios.py) -------------


def test_noise_flag_on_real_rows(built):
    """Every ratio marked ~ in the CSV has |difference| inside the sum of the two noise bands."""
    _, rows, out, _ = built
    with (out / "tables" / "headline.csv").open() as fh:
        records = [r for r in csv.DictReader(fh) if r["speedup"] not in ("", "None")]
    index = {(r["run_id"], r["device_name"], r["model"], r["batch"], r["seq"], _timing(r), r["method"]): r for r in rows}

    def band(row):
        widths = [0.0]
        if row["step_ms_spread_max"] is not None:
            widths.append(row["step_ms_spread_max"] * row["step_ms_median"] / 2)
        if row["step_ms_run_medians"] and len(row["step_ms_run_medians"]) >= 2:
            widths.append((max(row["step_ms_run_medians"]) - min(row["step_ms_run_medians"])) / 2)
        return max(widths)

    for rec in records:
        key = (rec["run_id"], rec["device_name"], rec["model"], int(rec["batch"]), int(rec["seq"]), rec["timing"])
        row, base = index[key + (rec["method"],)], index[key + (rec["baseline_method"],)]
        inside = abs(row["step_ms_median"] - base["step_ms_median"]) <= band(row) + band(base)
        assert (rec["speedup_within_noise"] == "True") == inside
        assert rec["speedup_text"].startswith("~") == inside


# --- bad input -----------------------------------------------------------------------------------

def test_folder_without_parquet_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no rows here")
    with pytest.raises(NoResultsError) as err:
        build_report(tmp_path, tmp_path / "out")
    message = str(err.value)
    assert str(tmp_path) in message and "\n" not in message and "parquet" in message
    missing = tmp_path / "does-not-exist"
    with pytest.raises(NoResultsError, match=re.escape(str(missing))):
        build_report(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists(), "no output folder for a failed report"


def test_several_folders_make_one_report_and_a_repeated_folder_is_refused(tmp_path):
    """One run per GPU lives in its own folder: the report takes them together (the hardware
    comparison needs both), and the same rows twice would double-count, so that is an error."""
    out = tmp_path / "out"
    build_report([SMOKE, RERUN_PARTIAL], out)
    header = (out / "index.md").read_text()
    rows = len(raw_rows(SMOKE)) + len(raw_rows(RERUN_PARTIAL))
    assert f"from {rows} rows under `{SMOKE}`, `{RERUN_PARTIAL}`" in header
    for run in (raw_rows(SMOKE)[0]["run_id"], raw_rows(RERUN_PARTIAL)[0]["run_id"]):
        assert f"| {run_label(run)} |" in header
    with pytest.raises(NoResultsError, match="under two of the given folders"):
        build_report([SMOKE, SMOKE], tmp_path / "twice")
    with pytest.raises(NoResultsError, match=re.escape(str(tmp_path / "nope"))):
        build_report([SMOKE, tmp_path / "nope"], tmp_path / "missing")


def test_floor_table_matches_the_formula_on_the_rows(built):
    """Every FORGE arm's floor = no_optimizer step - wgrad + max(wgrad, traffic) of its own run,
    recomputed here from the raw rows; folders without floor terms (CPU) get no floor table."""
    import json

    folder, rows, out, index = built
    floor_csv = out / "tables" / "floor.csv"
    expected = {}
    for row in rows:
        if row["method"] != "no_optimizer" or row["status"] != "ok":
            continue
        terms = json.loads(row.get("extra") or "{}").get("floor_terms")
        if not terms:
            continue
        for other in rows:
            same = all(other[k] == row[k] for k in ("run_id", "device_name", "model", "dtype", "batch", "seq")) \
                and _timing(other) == _timing(row)
            if same and other["method_family"] == "forge" and other["status"] == "ok":
                state = json.loads(other["method_settings"])["state_dtype"]
                wgrad, traffic = terms["wgrad_ms"], terms["traffic_ms"][state]
                floor = row["step_ms_median"] - wgrad + max(wgrad, traffic)
                expected[(other["run_id"], _timing(other), other["batch"], other["seq"], other["method"])] = (
                    floor, other["step_ms_median"] / floor)
    if not expected:
        assert not floor_csv.exists()
        assert "## FORGE against its floor" in index.read_text()
        return
    with floor_csv.open() as fh:
        got = {(r["run_id"], r["timing"], int(r["batch"]), int(r["seq"]), r["method"]):
               (float(r["floor_ms"]), float(r["step_over_floor"]))
               for r in csv.DictReader(fh)}
    assert got.keys() == expected.keys()
    for key, (floor, ratio) in expected.items():
        assert got[key][0] == pytest.approx(floor, rel=1e-9)
        assert got[key][1] == pytest.approx(ratio, rel=1e-9)


def test_lean_rows_are_grouped_apart_from_hf_rows(tmp_path):
    """The same cells measured with lean activations get their own tables and baseline, never a
    ratio against an hf row (here a copy of a real smoke run, marked lean)."""
    rows_dir = tmp_path / "rows"
    shutil.copytree(SMOKE, rows_dir / "hf")
    (rows_dir / "lean").mkdir()
    for path in sorted(SMOKE.rglob("*.parquet")):
        table = pq.read_table(path)
        if "activations" in table.column_names:    # the committed fixtures predate the column
            table = table.drop_columns(["activations"])
        table = table.append_column("activations", pa.array(["lean"] * table.num_rows, pa.string()))
        table = table.set_column(table.column_names.index("cell_id"), "cell_id",
                                 pa.array([c + "_lean" for c in table.column("cell_id").to_pylist()]))
        pq.write_table(table, rows_dir / "lean" / path.name)
    out = tmp_path / "out"
    build_report(rows_dir, out)
    text = (out / "tables" / "headline.md").read_text()
    tables = parse_markdown_tables(text)
    lean_titles = [t for t in tables if "lean activations" in t]
    assert lean_titles and len(lean_titles) * 2 == len(tables)
    for title in lean_titles:
        assert any(line["Speed-up"] == "baseline" for line in tables[title])
    assert any("lean" in p.name for p in (out / "figures").iterdir())


def test_report_pngs_are_palette_images_of_the_same_picture(tmp_path):
    """figures.save writes the PNG with a 256-colour palette when that is smaller (committed reports
    travel to the GPU machine, whose copy is capped): same size, nearly the same pixels; a PNG with
    transparency is left alone."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from forge_bench.report import figures

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1, 2], [0, 1, 4], label="a line")
    ax.imshow([[0.0, 0.5], [0.7, 1.0]], extent=(0, 2, 0, 4), cmap="RdYlGn", alpha=0.5)
    ax.legend()
    path = figures.save(fig, tmp_path, "chart", ("png",))[0]
    plt.close(fig)
    with Image.open(path) as image:
        assert image.mode == "P"
        palette_rgb = image.convert("RGB")
    fig2, ax2 = plt.subplots(figsize=(4, 3))
    ax2.plot([0, 1, 2], [0, 1, 4], label="a line")
    ax2.imshow([[0.0, 0.5], [0.7, 1.0]], extent=(0, 2, 0, 4), cmap="RdYlGn", alpha=0.5)
    ax2.legend()
    raw = tmp_path / "raw.png"
    fig2.savefig(raw, dpi=figures.PNG_DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig2)
    with Image.open(raw) as original:
        assert original.size == palette_rgb.size
        difference = [abs(a - b) for a, b in zip(original.convert("RGB").tobytes(), palette_rgb.tobytes())]
    assert max(difference) <= 48 and sum(difference) / len(difference) < 1.0
    assert path.stat().st_size < raw.stat().st_size
    transparent = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    transparent.save(tmp_path / "clear.png")
    before = (tmp_path / "clear.png").read_bytes()
    figures.compact_png(tmp_path / "clear.png")
    assert (tmp_path / "clear.png").read_bytes() == before


# --- the summary page on every fixture (its values: test_report_summary.py) -----------------------

def test_summary_page_leads_and_links_the_details(built):
    """README.md: one section per device, the headline cell, the peers, the grid; every link resolves;
    the details page links back."""
    _, rows, out, index = built
    text = (out / "README.md").read_text()
    assert text.startswith("# FORGE benchmark summary") and "[index.md](index.md)" in text
    assert "(README.md)" in index.read_text()
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (out / link).is_file(), f"README.md links a missing {link}"
    devices = {r["device_name"] for r in rows}
    assert text.count("\n## ") == len(devices) + 1          # one section per device, then the details
    assert text.count("### Headline: ") == len({r["device_name"] for r in rows if r["status"] == "ok"
                                                 and r["method_family"] in ("baseline", "forge")})
    assert text.count("### Peers") == len(devices)
    assert len(text.splitlines()) < 120, "the summary is one page"


# --- a results folder holding other parquet files -----------------------------------------------------

def test_a_parquet_of_another_kind_is_named_and_skipped(tmp_path, capsys):
    """A results folder may hold the kernel benchmark's parquet beside the sweep rows: the report
    names it in one line on stderr and goes on; a folder with nothing else is a one-line error."""
    import pandas as pd

    rows = tmp_path / "results"
    shutil.copytree(SMOKE, rows / "smoke")
    (rows / "kernels").mkdir()
    foreign = rows / "kernels" / "kernel_bench.parquet"
    pd.DataFrame({"shape": ["q"], "tokens": [512], "fused_ms": [0.1]}).to_parquet(foreign, index=False)
    build_report(rows, tmp_path / "out", formats=("png",))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"forge-bench report: skipping {foreign}: not a forge-bench v1 result file "
                   "(missing ['schema_version', 'run_id', 'suite_name', 'suite_hash', 'cell_id'])"]
    assert f"from {len(raw_rows(SMOKE))} rows" in (tmp_path / "out" / "index.md").read_text()
    seen = []
    build_report(rows, tmp_path / "quiet", formats=("png",), on_foreign=lambda path, why: seen.append(path))
    assert seen == [foreign] and not capsys.readouterr().err
    with pytest.raises(NoResultsError, match=re.escape(str(rows / "kernels"))):
        build_report(rows / "kernels", tmp_path / "none")
    assert not (tmp_path / "none").exists()


# --- units, model families, arms that fused nothing ----------------------------------------------

def test_memory_reads_in_mib_where_gib_would_round_to_zero(built):
    """A table whose values are all under 1 GiB (the CPU smoke rows: 1.6-1.9 MiB of weights) reads in
    MiB, its unit in every memory header; the GPU tables stay in GiB. The CSV keeps GiB numbers."""
    folder, rows, out, _ = built
    tables = parse_markdown_tables((out / "tables" / "memory.md").read_text())
    ok = [r for r in rows if r["status"] == "ok"]
    for title, lines in tables.items():
        members = [r for r in ok if f"· {r['model']} ·" in title and f"run {run_label(r['run_id'])}" in title
                   and r["device_name"] in title]
        values = [v for r in members for v in (r["mem_weights_gib"], r["peak_allocated_gib"]) if v is not None]
        unit = "MiB" if max(values) < 1.0 else "GiB"
        assert all(h.endswith(f" {unit}") for h in list(lines[0])[1:]), (title, list(lines[0]))
        for line in lines:
            method = line["Method"].split("`")[1]
            weights = {r["mem_weights_gib"] for r in members if r["method"] == method}
            assert any(close_to_printed(line[f"Weights {unit}"], w * (1024 if unit == "MiB" else 1))
                       for w in weights), (title, line)
    if folder == SMOKE:
        assert all("MiB" in list(lines[0])[1] for lines in tables.values())
        assert "0.00" not in " ".join(line["Weights MiB"] for lines in tables.values() for line in lines)
    if folder == H100:
        assert all("GiB" in list(lines[0])[1] for lines in tables.values())


def _rows_of_models(tmp_path: Path, models: dict[str, int], activations: str = "hf",
                    run_id: str = "20260101T000000Z-x-abcdef", finished_at: str = "2026-01-01T00:00:00+00:00",
                    step_ms: float = 10.0) -> Path:
    """A results folder with one ok adamw_foreach and one forge_bf16 row per model (one run, one shape)."""
    folder = tmp_path / "rows"
    for model, n_params in models.items():
        for method, family in (("adamw_foreach", "baseline"), ("forge_bf16", "forge")):
            results.write_row(folder, {
                "cell_id": f"{model}-{method}", "run_id": run_id, "status": "ok",
                "model": model, "method": method, "method_family": family, "batch": 1, "seq": 8,
                "dtype": "float32", "device_name": "CPU X", "device_type": "cpu", "n_params": n_params,
                "n_fused_params": (0 if model == "tiny-gpt2" else n_params // 2) if family == "forge" else 0,
                "step_ms_median": step_ms, "step_ms_p10": step_ms - 1, "step_ms_p90": step_ms + 1,
                "mem_weights_gib": n_params * 4 / 2**30, "timing_method": "wall_clock", "activations": activations,
                "finished_at": finished_at})
    return folder


def test_a_headline_measured_only_with_checkpointing_has_its_column(tmp_path):
    """A folder whose largest model ran only with activation checkpointing (a capability cell) gets a
    headline column for it, not an empty table."""
    out = tmp_path / "out"
    build_report(_rows_of_models(tmp_path, {"llama-3.2-1b": 1235814400}, activations="checkpointed"), out,
                 formats=("png",))
    tables = parse_markdown_tables((out / "README.md").read_text())
    [headline] = [t for t in tables if t.startswith("Headline")]
    [column] = list(tables[headline][0])[1:]
    assert column.startswith("eager, activation checkpointing (run ")
    assert [line[column].split(" (")[1] for line in tables[headline]] == ["baseline)", "~1.00×)"]


def test_model_scaling_compares_sizes_within_one_family_only(tmp_path):
    """tiny-llama and llama-3.2-1b are one family (forge_bench/zoo.py), tiny-gpt2 another: one scaling
    table and figure, of the Llama family; none for a family measured at one size."""
    from forge_bench.zoo import MODEL_ZOO, model_family

    assert model_family("tiny-llama") == model_family("llama-3.2-1b") == "llama" != model_family("tiny-gpt2")
    assert all(spec.family for spec in MODEL_ZOO.values()) and model_family("not-in-zoo") == "not-in-zoo"
    out = tmp_path / "out"
    build_report(_rows_of_models(tmp_path, {"tiny-llama": 426624, "llama-3.2-1b": 1235814400,
                                            "tiny-gpt2": 495104}), out, formats=("png",))
    tables = parse_markdown_tables((out / "tables" / "scaling.md").read_text())
    [(title, lines)] = tables.items()
    assert title.startswith("Model scaling, llama family · ")
    assert list(lines[0]) == ["Method", "tiny-llama (426.6K)", "llama-3.2-1b (1.24B)"]
    figures = [p.name for p in (out / "figures").glob("scaling-*.png")]
    assert len(figures) == 1 and "llama" in figures[0] and "gpt2" not in figures[0]
    out2 = tmp_path / "out2"
    build_report(_rows_of_models(tmp_path / "b", {"tiny-llama": 426624, "tiny-gpt2": 495104}), out2, formats=("png",))
    assert not (out2 / "tables" / "scaling.md").exists() and not list((out2 / "figures").glob("scaling-*"))
    assert ("_Skipped: no run measured two or more models of one family at one shape (scaling compares sizes "
            "within a family; families here: gpt2 (tiny-gpt2); llama (tiny-llama))._") in (out2 / "index.md").read_text()


def test_a_family_measured_over_two_runs_is_one_scaling_figure(tmp_path):
    """The small models in one run, the larger ones (and one small one again) in a later run: each run
    keeps its table, and the family's figure draws every model, each from its newest run."""
    from forge_bench.report.data import load_rows
    from forge_bench.report.scaling import scaling_series

    first = _rows_of_models(tmp_path / "a", {"tiny-llama": 426624, "llama-3.2-1b": 1235814400},
                            run_id="20260101T000000Z-x-aaaaaa", finished_at="2026-01-01T00:00:00+00:00")
    later = _rows_of_models(tmp_path / "b", {"llama-3.2-1b": 1235814400, "llama-3.2-3b": 3212749824},
                            run_id="20260102T000000Z-x-bbbbbb", finished_at="2026-01-02T00:00:00+00:00", step_ms=20.0)
    out = tmp_path / "out"
    build_report([first, later], out, formats=("png",))
    assert len(parse_markdown_tables((out / "tables" / "scaling.md").read_text())) == 2, "one table per run"
    figures = [p.name for p in (out / "figures").glob("scaling-*.png")]
    assert len(figures) == 1 and "aaaaaa" in figures[0] and "bbbbbb" in figures[0]
    [(keys, rows)] = scaling_series(load_rows([first, later]))
    assert keys["run_id"] == "aaaaaa + bbbbbb"
    newest = {model: set(zip(group["run_id"], group["step_ms_median"])) for model, group in rows.groupby("model")}
    assert newest == {"tiny-llama": {("20260101T000000Z-x-aaaaaa", 10.0)},
                      "llama-3.2-1b": {("20260102T000000Z-x-bbbbbb", 20.0)},
                      "llama-3.2-3b": {("20260102T000000Z-x-bbbbbb", 20.0)}}


def test_a_grid_measured_over_runs_is_one_table_each_shape_from_its_newest_comparison(tmp_path):
    """Shapes of one suite's grid measured in two runs make one more grid table and the figure: each
    shape from the newest run with FORGE beside its baseline there (a later re-run of the baseline
    alone does not displace it), never from another suite's run of the same model and shape."""
    from forge_bench.report.data import load_rows
    from forge_bench.report.tables import grid_series

    folder = tmp_path / "rows"

    def row(run: str, suite: str, batch: int, seq: int, method: str, day: int, step_ms: float) -> None:
        results.write_row(folder, {
            "cell_id": f"{run}-{batch}-{seq}-{method}", "run_id": f"2026010{day}T000000Z-{suite}-{run}",
            "suite_name": suite, "status": "ok", "model": "llama-3.2-1b", "method": method,
            "method_family": "forge" if method.startswith("forge") else "baseline", "batch": batch, "seq": seq,
            "dtype": "bfloat16", "device_name": "GPU X", "device_type": "cuda", "n_params": 1235814400,
            "n_fused_params": 1000000000 if method.startswith("forge") else 0, "step_ms_median": step_ms,
            "peak_allocated_gib": 10.0, "timing_method": "cuda_graph_replay", "activations": "hf",
            "finished_at": f"2026-01-0{day}T00:00:00+00:00"})

    for shape in ((1, 512), (1, 1024)):
        for method in ("adamw_fused", "forge_bf16"):
            row("aaaaaa", "grid", *shape, method, 1, 10.0)
    for method in ("adamw_fused", "forge_bf16"):
        row("bbbbbb", "grid", 2, 512, method, 2, 20.0)
    row("bbbbbb", "grid", 1, 512, "adamw_fused", 2, 30.0)
    for method in ("adamw_fused", "forge_bf16", "forge_int8", "sgd"):
        row("cccccc", "families", 1, 512, method, 3, 40.0)
    [(keys, rows)] = grid_series(load_rows(folder))
    assert keys["run_id"] == "aaaaaa + bbbbbb"
    picked = {(int(b), int(q)): set(group["run_id"].str[-6:]) for (b, q), group in rows.groupby(["batch", "seq"])}
    assert picked == {(1, 512): {"aaaaaa"}, (1, 1024): {"aaaaaa"}, (2, 512): {"bbbbbb"}}
    out = tmp_path / "out"
    build_report(folder, out, formats=("png",))
    titles = list(parse_markdown_tables((out / "tables" / "grid.md").read_text()))
    assert len([t for t in titles if t.endswith("· run aaaaaa + bbbbbb")]) == 3     # peak, step, ratios
    assert any("aaaaaa-bbbbbb" in p.name for p in (out / "figures").glob("grid-*.png"))


def test_eager_int8_is_held_to_no_slower_than_bf16_within_each_run():
    """A headline note per run with both arms: bf16's step over int8's, met when at least 1 or inside
    the two cells' noise, not met when measurably slower; the cce pair likewise; no line without a pair."""
    from forge_bench.report.tables import int8_against_bf16

    def row(method: str, run: str, step_ms: float, spread: float = 0.01) -> dict:
        return {"method": method, "run_id": f"20260101T000000Z-x-{run}", "status": "ok", "step_ms_median": step_ms,
                "step_ms_spread_max": spread, "device_name": "GPU X"}

    lines = int8_against_bf16([row("forge_bf16", "aaaaaa", 100.0), row("forge_int8", "aaaaaa", 104.0),
                               row("forge_bf16", "bbbbbb", 100.0), row("forge_int8", "bbbbbb", 101.0, spread=0.05),
                               row("forge_bf16_cce", "aaaaaa", 100.0), row("forge_int8_cce", "aaaaaa", 95.0),
                               row("forge_int8", "cccccc", 90.0)])
    assert lines == [
        "`forge_int8` against `forge_bf16` (run aaaaaa): 0.962×, not met (target: an eager int8 step no slower than bf16's).",
        "`forge_int8` against `forge_bf16` (run bbbbbb): ~0.990×, met (target: an eager int8 step no slower than bf16's).",
        "`forge_int8_cce` against `forge_bf16_cce` (run aaaaaa): 1.053×, met (target: an eager int8 step no slower "
        "than bf16's)."]


def test_a_forge_row_that_fused_nothing_is_labelled_so(tmp_path):
    """n_fused_params = 0 (tiny-GPT-2: Conv1D layers, a tied head): its FORGE rows say "nothing fused"
    wherever FORGE is compared, with the reason; a row that fused weights carries no such mark."""
    out = tmp_path / "out"
    build_report(_rows_of_models(tmp_path, {"tiny-llama": 426624, "tiny-gpt2": 495104}), out, formats=("png",))
    headline = parse_markdown_tables((out / "tables" / "headline.md").read_text())
    methods = {title.split(" · ")[1]: [line["Method"] for line in lines] for title, lines in headline.items()}
    assert methods == {"tiny-gpt2": ["`adamw_foreach`", "`forge_bf16` (nothing fused)"],
                       "tiny-llama": ["`adamw_foreach`", "`forge_bf16`"]}
    text = (out / "tables" / "headline.md").read_text()
    assert text.count("- nothing fused: the FORGE arm found no weight of this model to fuse (n_fused_params = 0") == 1
    with (out / "tables" / "headline.csv").open() as fh:
        marks = {(r["model"], r["method"]): r["nothing_fused"] for r in csv.DictReader(fh)}
    assert marks[("tiny-gpt2", "forge_bf16")] == "True" and marks[("tiny-llama", "forge_bf16")] == "False"
    assert "(nothing fused)" not in (out / "README.md").read_text(), "the first page leads with a model FORGE fused"
    assert "### Headline: tiny-llama" in (out / "README.md").read_text()
    only_gpt2 = tmp_path / "gpt2"
    build_report(_rows_of_models(tmp_path / "g", {"tiny-gpt2": 495104}), only_gpt2, formats=("png",))
    summary = (only_gpt2 / "README.md").read_text()
    assert "| `forge_bf16` (nothing fused) |" in summary and "_nothing fused: the FORGE arm" in summary


def test_a_report_that_fails_half_way_leaves_the_previous_one_as_it_was(tmp_path, monkeypatch):
    """The report is drawn in a staging folder and swapped in whole: a build that dies in the middle
    leaves the previous report byte for byte, and no staging folder beside it."""
    from forge_bench.report import figures as figures_mod

    out = tmp_path / "reports" / "smoke"
    build_report(SMOKE, out, formats=("png",))
    (out / "notes.md").write_text("the user's notes")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed half-way")

    monkeypatch.setattr(figures_mod, "memory_figures", dies)
    with pytest.raises(KeyboardInterrupt):
        build_report(RERUN_PARTIAL, out, formats=("png",))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["smoke"], "no staging folder is left behind"
    monkeypatch.undo()
    build_report(RERUN_PARTIAL, out, formats=("png",))
    assert "smoke_rerun_partial" in (out / "index.md").read_text()
    assert (out / "notes.md").read_text() == "the user's notes", "a file the report did not write moves along"
    assert sorted(p.name for p in out.parent.iterdir()) == ["smoke"]


def test_headline_shows_the_process_peak_and_the_margin_check():
    """The whole-process peak beside the window's, and per FORGE arm pass / miss against
    MARGIN_TARGET_GIB (0.5 GiB); rows without the column (the committed fixtures) print —."""
    from forge_bench.report import tables as report_tables
    from forge_bench.report.data import load_rows

    frame = load_rows([H100], on_foreign=None)
    lean = frame[(frame["activations"] == "lean") & (frame["timing_method"] == "cuda_graph_replay")].copy()
    assert lean["peak_process_gib"].isna().all()
    process = {"forge_bf16": 0.25, "forge_int8": 2.0, "adamw_fused": 1.0}     # above each window peak, GiB
    lean["peak_process_gib"] = [row.peak_allocated_gib + process[row.method] if row.method in process else None
                                for row in lean.itertuples()]
    [table] = report_tables.headline_tables(lean)
    assert table.header[1:4] == ["Peak GiB", "Process peak GiB", "Margin"]
    by_method = {rec["method"]: rec for rec in table.records}
    lines = {rec["method"]: line for rec, line in zip(table.records, table.rows)}
    bf16 = by_method["forge_bf16"]
    assert bf16["peak_process_gib"] == pytest.approx(bf16["peak_gib"] + 0.25)
    assert bf16["process_margin_gib"] == pytest.approx(0.25) and bf16["margin_ok"] is True
    assert lines["forge_bf16"][3] == "+0.25 GiB pass"
    assert by_method["forge_int8"]["margin_ok"] is False and lines["forge_int8"][3] == "+2.00 GiB miss"
    # a baseline's margin is shown with no verdict: the target is FORGE's
    assert lines["adamw_fused"][3] == "+1.00 GiB" and by_method["adamw_fused"]["margin_ok"] is None
    assert lines["forge_bf16_cce"][2:4] == ["—", "—"] and by_method["forge_bf16_cce"]["margin_ok"] is None
