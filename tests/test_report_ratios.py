"""The report's ratio rule on real rows (``forge_bench.report.ratios``): a ratio only within one sweep
run on one device, versions and machine boot; SM clocks apart give a bound only in the direction that
narrows the gap; a difference inside the two cells' noise is marked."""
from __future__ import annotations

import copy
import csv
import json
import shutil

import pytest

from forge_bench.report import build_report, ratios
from forge_bench.report.data import run_label
from report_rows import RERUN_PARTIAL, SMOKE, parse_markdown_tables, raw_rows


def test_cross_run_ratios_are_refused(tmp_path):
    """Run B (a second real smoke run of forge_bf16 alone, no baseline row) against run A's baseline."""
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
    base["extra"] = json.dumps({**extra, "boot_id": "1111-machine-a"})
    cand["extra"] = json.dumps({**ratios.json_field(cand.get("extra")), "boot_id": "1111-machine-a"})
    assert ratios.speedup(cand, base).is_number
    cand["extra"] = json.dumps({**ratios.json_field(cand.get("extra")), "boot_id": "2222-machine-b"})
    refused = ratios.speedup(cand, base)
    assert refused.text == ratios.DIFFERENT_RUN and "different machine boots" in refused.refusal
    cand["peak_allocated_gib"], base["peak_allocated_gib"] = 30.0, 40.0   # CPU smoke rows record no peak
    assert ratios.peak_change(cand, base).value == pytest.approx(-0.25)   # memory does not depend on the host
    cand["extra"] = None                                   # unrecorded on one side: no evidence
    assert ratios.speedup(cand, base).is_number


def test_time_ratio_needs_the_same_cpus_where_both_rows_recorded_them():
    cand, base = _real_pair()
    base["extra"] = json.dumps({**ratios.json_field(base.get("extra")), "cpus": [30, 31]})
    cand["extra"] = json.dumps({**ratios.json_field(cand.get("extra")), "cpus": [31, 30]})
    assert ratios.speedup(cand, base).is_number
    cand["extra"] = json.dumps({**ratios.json_field(cand.get("extra")), "cpus": [28, 29]})
    refused = ratios.speedup(cand, base)
    assert refused.text == ratios.DIFFERENT_RUN
    assert refused.refusal == "timed on different CPUs (28,29 vs 30,31): a virtual machine's CPUs do not run alike"
    cand["extra"] = json.dumps({k: v for k, v in ratios.json_field(cand.get("extra")).items() if k != "cpus"})
    assert ratios.speedup(cand, base).is_number         # unpinned on one side (an older row): no evidence


def test_noise_flag():
    cand, base = _real_pair()
    for row, ms in ((cand, 100.0), (base, 101.0)):
        row.update(step_ms_median=ms, step_ms_spread_max=0.02, step_ms_run_medians=[ms - 1, ms, ms + 1])
    inside = ratios.speedup(cand, base)
    assert inside.within_noise and inside.text == f"~{101 / 100:.2f}×"
    base.update(step_ms_median=110.0, step_ms_run_medians=[109.5, 110.0, 110.5])
    clean = ratios.speedup(cand, base)
    assert not clean.within_noise and clean.text == f"{110 / 100:.2f}×"
