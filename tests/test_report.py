"""Tests of ``forge-bench report`` on committed parquet rows from real runs.

The fixture folders are listed in ``report_fixture_folders``; real GPU result sets
(``results/h100``, ``results/h200``, ``results/b200``) join the parametrized tests automatically
once they hold parquet files, and more can be named with ``FORGE_REPORT_FIXTURES`` (paths
separated by ``os.pathsep``). Expected values are computed here straight from the parquet
files with pyarrow, independently of the report's own pandas path.

Figures: a folder of up to ``FULL_FORMATS_MAX_ROWS`` rows (the committed fixtures, results/h200) is
reported as users get it, PNG + PDF; a larger one (results/h100: 300+ rows, 110 figures) with
``formats=("png",)``, which runs every figure builder and renders every figure as PNG but
skips the PDF twins (about 30% of that build's time). The PDF path itself is checked on the small folders.
"""
from __future__ import annotations

import copy
import json
import csv
import math
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from forge_bench.report import NoResultsError, build_report, ratios
from forge_bench.report.data import run_label

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
SMOKE = FIXTURES / "smoke"
GRID = FIXTURES / "grid"
RERUN_PARTIAL = FIXTURES / "smoke_rerun_partial"


def _has_parquet(folder: Path) -> bool:
    return folder.is_dir() and any(folder.rglob("*.parquet"))


def report_fixture_folders() -> list[Path]:
    folders = [SMOKE, GRID]
    folders += [REPO / "results" / name for name in ("h100", "h200", "b200")]
    folders += [Path(p) for p in os.environ.get("FORGE_REPORT_FIXTURES", "").split(os.pathsep) if p]
    return [f for f in folders if _has_parquet(f)]


FOLDERS = report_fixture_folders()
FOLDER_IDS = [str(f.relative_to(REPO)) if REPO in f.parents else str(f) for f in FOLDERS]


FULL_FORMATS_MAX_ROWS = 200


def fixture_formats(rows: list[dict]) -> tuple[str, ...]:
    """The figure formats the ``built`` fixture asks for: the default for a small folder, PNG only
    for a large one (see the module docstring)."""
    return ("png", "pdf") if len(rows) <= FULL_FORMATS_MAX_ROWS else ("png",)


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


@pytest.fixture(scope="module", params=FOLDERS, ids=FOLDER_IDS)
def built(request, tmp_path_factory):
    """(folder, rows, out_dir, index) of one report built from one fixture folder (figures in
    ``fixture_formats(rows)``)."""
    folder = request.param
    rows = raw_rows(folder)
    out = tmp_path_factory.mktemp("report")
    index = build_report(folder, out, formats=fixture_formats(rows))
    return folder, rows, out, index


def _activations(row: dict) -> str:
    """hf or lean (rows written before the column existed are hf)."""
    return row.get("activations") or "hf"


def _group_key(row: dict) -> tuple:
    # eager steps and CUDA-graph replays are separate tables, and so are lean activations: a ratio
    # never mixes them
    return (row["device_name"], row["model"], row["dtype"], row["batch"], row["seq"],
            row.get("timing_method") == "cuda_graph_replay", _activations(row))


def _timing(row: dict) -> str:
    """The report's timing column for a row (its tables never mix the two)."""
    return "CUDA graph" if row.get("timing_method") == "cuda_graph_replay" else "eager"


def _title(key: tuple) -> str:
    device, model, dtype, batch, seq, graph, activations = key
    return (f"{device} · {model} · {dtype} · batch {batch} × seq {seq}" + (" · CUDA-graph replay" if graph else "")
            + (" · lean activations" if activations == "lean" else ""))


def _close_to_printed(printed: str, value: float) -> bool:
    """``printed`` is ``value`` rounded to the digits it shows."""
    number = float(printed.lstrip("~≥≤").rstrip("×%"))
    decimals = len(printed.split(".")[1].rstrip("×%")) if "." in printed else 0
    return abs(number - value) <= 0.5 * 10 ** -decimals + 1e-12


# --- the headline table equals a hand computation from the parquet rows ---------------------------

def test_fixture_folders_exist():
    assert _has_parquet(SMOKE), f"committed fixture {SMOKE} is missing"
    assert _has_parquet(GRID), f"committed fixture {GRID} is missing"
    assert _has_parquet(RERUN_PARTIAL), f"committed fixture {RERUN_PARTIAL} is missing"


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
        for row in group:
            [line] = [t for t in table if t["Method"] == f"`{row['method']}`"
                      and (not several_runs or t["Run"] == run_label(row["run_id"]))]
            assert line["Status"] == row["status"]
            peak = row["peak_allocated_gib"]
            assert line["Peak GiB"] == ("—" if peak is None else f"{peak:.2f}")
            if row["step_ms_median"] is None:
                assert line["Step ms"] == "—"
            else:
                assert _close_to_printed(line["Step ms"], row["step_ms_median"])
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
                    assert line["Speed-up"].endswith("×") and _close_to_printed(line["Speed-up"], expected)
                    checked_ratios += 1
                if peak is not None and bases[0]["peak_allocated_gib"] is not None:
                    change = (peak - bases[0]["peak_allocated_gib"]) / bases[0]["peak_allocated_gib"] * 100
                    assert _close_to_printed(line["Δ peak"], change)
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
    by_run_method = {(r["run_id"], r["device_name"], r["model"], r["batch"], r["seq"], _timing(r), _activations(r),
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
    expected_memory = len({(r["run_id"],) + _group_key(r) for r in ok})
    expected_fidelity = len({r["device_name"] for r in rows if r["status"] in ("ok", "parity_fail")
                             and r["parity_rms_rel"] is not None and r["parity_steps"] != 0})
    by_run_model = {}
    for r in rows:
        by_run_model.setdefault((r["run_id"], r["device_name"], r["model"], r["dtype"], _timing(r), _activations(r)),
                                set()).add((r["batch"], r["seq"]))
    expected_grid = sum(len(s) >= 2 for s in by_run_model.values())
    by_run_shape = {}
    for r in rows:
        by_run_shape.setdefault((r["run_id"], r["device_name"], r["dtype"], r["batch"], r["seq"], _timing(r),
                                 _activations(r)),
                                set()).add(r["model"])
    expected_scaling = sum(len(s) >= 2 for s in by_run_shape.values())
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
        index = build_report(SMOKE, out, formats=formats)
        text = index.read_text()
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


# --- the ratio rule ------------------------------------------------------------------------------

def test_cross_run_ratios_are_refused(tmp_path):
    """Run B (a second real smoke run whose baseline rows were removed) against run A's baseline."""
    rows_a, rows_b = raw_rows(SMOKE), raw_rows(RERUN_PARTIAL)
    run_a = {r["run_id"] for r in rows_a}
    run_b = {r["run_id"] for r in rows_b}
    assert len(run_a) == len(run_b) == 1 and run_a != run_b
    assert not any(r["method"] == "adamw_foreach" for r in rows_b)
    shutil.copytree(SMOKE, tmp_path / "rows" / "a")
    shutil.copytree(RERUN_PARTIAL, tmp_path / "rows" / "b")
    out = tmp_path / "out"
    build_report(tmp_path / "rows", out)
    tables = parse_markdown_tables((out / "tables" / "headline.md").read_text())
    short_b = run_label(next(iter(run_b)))
    refused = numbers = 0
    for lines in tables.values():
        for line in lines:
            if line["Speed-up"] == "baseline":
                continue
            if line["Run"] == short_b:
                assert line["Speed-up"] == ratios.DIFFERENT_RUN
                assert line["Δ peak"] == ratios.DIFFERENT_RUN
                refused += 1
            elif line["Status"] == "ok":
                assert line["Speed-up"].endswith("×")
                numbers += 1
    assert refused == len(rows_b) and numbers > 0
    text = (out / "tables" / "headline.md").read_text()
    assert "run_id differs" in text
    with (out / "tables" / "headline.csv").open() as fh:
        for rec in csv.DictReader(fh):
            if rec["run_id"] in run_b:
                assert rec["speedup"] == "" and rec["peak_change"] == ""


def _real_pair() -> tuple[dict, dict]:
    """A real FORGE row and its real baseline row from one smoke run."""
    rows = raw_rows(SMOKE)
    base = next(r for r in rows if r["method"] == "adamw_foreach" and r["status"] == "ok")
    cand = next(r for r in rows if r["method"].startswith("forge_") and r["status"] == "ok"
                and r["model"] == base["model"])
    return copy.deepcopy(cand), copy.deepcopy(base)


@pytest.mark.parametrize("column, value", [("run_id", "another-run"), ("device_name", "NVIDIA H200"),
                                           ("torch_version", "2.11.0+cu130"), ("triton_version", "3.6.0"),
                                           ("cuda_version", "13.0")])
def test_ratio_refused_when_context_differs(column, value):
    cand, base = _real_pair()
    cand[column] = value
    for ratio in (ratios.speedup(cand, base), ratios.peak_change(cand, base), ratios.memory_saving(cand, base)):
        assert ratio.value is None and ratio.text == ratios.DIFFERENT_RUN
        assert column in ratio.refusal


def _set_time(row: dict, ms: float) -> None:
    row["step_ms_median"], row["step_ms_run_medians"], row["step_ms_spread_max"] = ms, [ms, ms, ms], 0.01


def test_clock_tolerance():
    cand, base = _real_pair()
    _set_time(base, 100.0)
    _set_time(cand, 80.0)                                  # the candidate is faster
    base["sm_clock_mhz_after"] = 1980.0
    cand["sm_clock_mhz_after"] = 1980.0 * (1 - ratios.CLOCK_TOLERANCE * 0.9)
    within = ratios.speedup(cand, base)
    assert within.value == pytest.approx(1.25) and within.bound is None and within.text == "1.25×"
    cand["sm_clock_mhz_after"] = None
    assert ratios.speedup(cand, base).text == ratios.DIFFERENT_RUN


@pytest.mark.parametrize("cand_ms, cand_clock, expected", [
    (80.0, 1700.0, "≥1.25×"),     # faster at a lower clock: the clock only narrowed the win
    (80.0, 2300.0, None),         # faster at a higher clock: the clock may be the win
    (125.0, 2300.0, "≤0.80×"),    # slower at a higher clock: the clock only narrowed the loss
    (125.0, 1700.0, None),        # slower at a lower clock: the clock may be the loss
])
def test_clocks_apart_give_a_bound_only_in_the_direction_that_narrows_the_gap(cand_ms, cand_clock, expected):
    cand, base = _real_pair()
    _set_time(base, 100.0)
    _set_time(cand, cand_ms)
    base["sm_clock_mhz_after"], cand["sm_clock_mhz_after"] = 1980.0, cand_clock
    ratio = ratios.speedup(cand, base)
    if expected is None:
        assert ratio.value is None and ratio.text == ratios.DIFFERENT_RUN and "SM clocks differ" in ratio.refusal
    else:
        assert ratio.text == expected and ratio.bound == expected[0] and ratio.value == pytest.approx(100.0 / cand_ms)


def test_time_ratio_needs_one_machine_boot_but_memory_does_not():
    cand, base = _real_pair()
    extra = ratios.json_field(base.get("extra"))
    base["extra"] = json.dumps({**extra, "boot_id": "1111-lease-a"})
    cand["extra"] = json.dumps({**ratios.json_field(cand.get("extra")), "boot_id": "1111-lease-a"})
    assert ratios.speedup(cand, base).is_number
    cand["extra"] = json.dumps({**ratios.json_field(cand.get("extra")), "boot_id": "2222-lease-b"})
    refused = ratios.speedup(cand, base)
    assert refused.text == ratios.DIFFERENT_RUN and "different machine boots" in refused.refusal
    cand["peak_allocated_gib"], base["peak_allocated_gib"] = 30.0, 40.0   # CPU smoke rows record no peak
    assert ratios.peak_change(cand, base).value == pytest.approx(-0.25)   # memory does not depend on the host
    cand["extra"] = None                                   # unrecorded on one side: no evidence
    assert ratios.speedup(cand, base).is_number


def test_noise_flag():
    cand, base = _real_pair()
    for row, ms in ((cand, 100.0), (base, 101.0)):
        row.update(step_ms_median=ms, step_ms_spread_max=0.02, step_ms_run_medians=[ms - 1, ms, ms + 1])
    inside = ratios.speedup(cand, base)
    assert inside.within_noise and inside.text == f"~{101 / 100:.2f}×"
    base.update(step_ms_median=110.0, step_ms_run_medians=[109.5, 110.0, 110.5])
    clean = ratios.speedup(cand, base)
    assert not clean.within_noise and clean.text == f"{110 / 100:.2f}×"


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
