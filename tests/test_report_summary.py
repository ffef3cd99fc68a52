"""The report's summary page (``README.md`` of a report) against the rows of the runs it names."""
from __future__ import annotations

import shutil

from forge_bench import results
from forge_bench.report import build_report, ratios
from forge_bench.report.data import run_label
from report_rows import (GRID, H100, H100_GRID_OOM, H100_HEADLINE_RUNS, H200, REPO, SMOKE, activations_of,
                         close_to_printed, parse_markdown_tables, raw_rows)


def test_summary_headline_equals_the_rows_of_the_runs_it_names(tmp_path):
    """On the H100 rows: the eager column is the peers run, the CUDA-graph columns the graph run;
    each cell is peak / step (speed-up against adamw_fused of the same run), recomputed here."""
    rows = raw_rows(H100)
    build_report(H100, tmp_path, formats=("png",))
    tables = parse_markdown_tables((tmp_path / "README.md").read_text())
    [headline] = [t for t in tables if t.startswith("Headline")]
    table = tables[headline]
    assert "llama-3.1-8b" in headline and "batch 1 × seq 512" in headline
    header = list(table[0])
    columns = header[1:]
    assert [c.split(" (run ")[0] for c in columns] == ["eager", "CUDA graph", "CUDA graph, lean activations"]
    checked = 0
    for column in columns:
        run = column.split(" (run ")[1].rstrip(")")
        graph = column.startswith("CUDA graph")
        lean = "lean" in column
        chosen = [r for r in rows if run_label(r["run_id"]) == run and (r.get("timing_method") == "cuda_graph_replay") == graph
                  and activations_of(r) == ("lean" if lean else "hf") and r["method_family"] in ("baseline", "forge")]
        base = next(r for r in chosen if r["method"] == "adamw_fused")
        for line in table:
            method = line["Method"].strip("`")
            row = next((r for r in chosen if r["method"] == method), None)
            if row is None:
                assert line[column] == "—"
                continue
            peak, rest = line[column].split(" / ")
            step, speed = rest.split(" (", 1)
            assert peak == f"{row['peak_allocated_gib']:.2f}"
            assert close_to_printed(step, row["step_ms_median"])
            if row is base:
                assert speed == "baseline)"
            elif ratios.speedup(row, base).is_number:
                assert close_to_printed(speed.rstrip(")"), base["step_ms_median"] / row["step_ms_median"])
                checked += 1
    assert checked >= 5
    peers = tables[next(t for t in tables if t.startswith("Peers"))]
    assert {line["Method"].strip("`") for line in peers} == {r["method"] for r in rows
                                                              if r["run_id"].endswith("82e611")}


def test_summary_says_what_a_device_lacks(tmp_path):
    build_report([SMOKE, H200], tmp_path, formats=("png",))
    text = (tmp_path / "README.md").read_text()
    assert "## H200" in text and "_No peer arm was measured on this device._" in text
    assert "_No model was measured at two or more batch × seq shapes on this device._" in text


def test_summary_grid_takes_each_shape_from_its_own_run(tmp_path):
    """The grid fixture: tiny-llama at four shapes; each cell is FORGE's saving / speed-up against the
    baseline of its own run and shape (adamw_foreach: adamw_fused cannot run on a CPU)."""
    rows = raw_rows(GRID)
    build_report(GRID, tmp_path, formats=("png",))
    tables = parse_markdown_tables((tmp_path / "README.md").read_text())
    [title] = [t for t in tables if t.startswith("Batch × sequence grid")]
    assert "tiny-llama" in title
    [line] = tables[title]
    assert line["Method"] == "`forge_bf16`"
    shapes = sorted({(r["batch"], r["seq"]) for r in rows}, key=lambda s: (s[0] * s[1], s))
    assert list(line)[1:] == [f"b{b}×s{q}" for b, q in shapes]
    for batch, seq in shapes:
        at = [r for r in rows if (r["batch"], r["seq"]) == (batch, seq)]
        row = next(r for r in at if r["method"] == "forge_bf16")
        base = next(r for r in at if r["method"] == "adamw_foreach")
        assert line[f"b{batch}×s{seq}"] == f"{ratios.memory_saving(row, base).text} / {ratios.speedup(row, base).text}"


def test_summary_grid_passes_over_a_newer_run_without_the_baseline(tmp_path):
    """A FORGE-only run at a shape (a margin check, say), newer than the grid's run there, would leave
    that shape without a ratio: the summary takes the newest run with the baseline beside FORGE."""
    rows = raw_rows(GRID)
    folder = tmp_path / "rows"
    shutil.copytree(GRID, folder)
    forge_only = dict(next(r for r in rows if r["method"] == "forge_bf16" and (r["batch"], r["seq"]) == (1, 32)))
    forge_only.update(run_id="20991231T000000Z-margin-abcdef", cell_id=forge_only["cell_id"] + "_margin",
                      finished_at="2099-12-31T00:00:00+00:00")
    results.write_row(folder / "margin", forge_only)
    build_report(folder, tmp_path / "out", formats=("png",))
    tables = parse_markdown_tables((tmp_path / "out" / "README.md").read_text())
    [title] = [t for t in tables if t.startswith("Batch × sequence grid")]
    [line] = tables[title]
    at = [r for r in rows if (r["batch"], r["seq"]) == (1, 32)]
    row, base = (next(r for r in at if r["method"] == m) for m in ("forge_bf16", "adamw_foreach"))
    assert line["b1×s32"] == f"{ratios.memory_saving(row, base).text} / {ratios.speedup(row, base).text}"


def test_the_headline_is_the_cell_every_arm_ran_not_the_largest_capability_cell():
    """A larger model that only one FORGE arm ran (no baseline), and another run by fewer arms, do
    not take the headline from the cell where the baseline and the most arms ran; among equals the
    larger model, then the fewest tokens per step."""
    import pandas as pd

    from forge_bench.report.summary import headline_cell

    def rows(model, n_params, batch, seq, methods):
        return [{"model": model, "n_params": n_params, "batch": batch, "seq": seq, "method": m, "status": "ok",
                 "method_family": "baseline" if m.startswith(("adamw", "no_")) else "forge",
                 "n_fused_params": n_params // 2 if m.startswith("forge") else 0} for m in methods]

    every = ["no_optimizer", "adamw_fused", "forge_bf16", "forge_int8"]
    frame = pd.DataFrame(rows("llama-3.1-8b", 8_000_000_000, 1, 512, every)
                         + rows("llama-3.1-8b", 8_000_000_000, 2, 1024, ["adamw_fused", "forge_bf16"])
                         + rows("qwen3-14b", 14_000_000_000, 1, 512, ["forge_muon_bf16"])
                         + rows("qwen3-32b", 32_000_000_000, 1, 512, ["adamw_fused", "forge_bf16"]))
    assert headline_cell(frame) == ("llama-3.1-8b", 1, 512)
    frame = pd.concat([frame, pd.DataFrame(rows("qwen3-14b", 14_000_000_000, 2, 512, every))])
    assert headline_cell(frame) == ("qwen3-14b", 2, 512)        # as many arms, a larger model
    frame = pd.concat([frame, pd.DataFrame(rows("qwen3-14b", 14_000_000_000, 1, 512, every[:3]))])
    assert headline_cell(frame) == ("qwen3-14b", 1, 512)        # as many again, fewer tokens


def test_a_timing_no_run_compared_with_adamw_is_left_out_of_the_headline(tmp_path):
    """An eager run with the baseline beside FORGE, and a newer CUDA-graph run of FORGE alone (a
    first-use check, say): the headline has the eager column only, from the run with the baseline."""
    folder = tmp_path / "rows"
    for run, timing, methods in (("20260101T000000Z-a-aaaaaa", "wall_clock", ("adamw_foreach", "forge_bf16")),
                                 ("20260102T000000Z-b-bbbbbb", "cuda_graph_replay", ("forge_bf16",))):
        for method in methods:
            results.write_row(folder, {
                "cell_id": f"{run}-{method}", "run_id": run, "status": "ok", "model": "llama-3.2-1b",
                "method": method, "method_family": "forge" if method.startswith("forge") else "baseline",
                "batch": 1, "seq": 8, "dtype": "float32", "device_name": "CPU X", "device_type": "cpu",
                "n_params": 1000, "n_fused_params": 500 if method.startswith("forge") else 0,
                "step_ms_median": 10.0, "step_ms_p10": 9.0, "step_ms_p90": 11.0, "timing_method": timing,
                "activations": "hf", "finished_at": run[:8]})
    build_report(folder, tmp_path / "out", formats=("png",))
    tables = parse_markdown_tables((tmp_path / "out" / "README.md").read_text())
    [headline] = [t for t in tables if t.startswith("Headline")]
    assert list(tables[headline][0])[1:] == ["eager (run aaaaaa)"]


def test_a_cpu_summary_says_its_timings_show_the_harness_works_and_captions_what_its_cells_hold(tmp_path):
    """CPU rows (the smoke fixture): the device's section says that its timings show the harness works,
    not FORGE's speed, and the headline's caption promises median step ms only (no peak was measured);
    a GPU device's section says neither."""
    from forge_bench.report.summary import CPU_NOTE

    build_report([SMOKE, H200], tmp_path, formats=("png",))
    text = (tmp_path / "README.md").read_text()
    cpu, gpu = text.split("\n## H200")
    assert CPU_NOTE in cpu and CPU_NOTE not in gpu
    assert ("Median step ms (no peak memory: CPU run: torch keeps no peak-memory counter for CPU tensors) "
            "(speed-up against torch fused AdamW") in cpu
    assert "Peak GiB / median step ms" not in cpu and "Peak GiB / median step ms (speed-up" in gpu


def test_the_summary_quotes_one_run_and_embeds_its_figure_with_one_bar_per_arm(tmp_path):
    """Three H100 runs of the lean CUDA-graph headline (two with the baseline, the newest FORGE alone):
    the summary quotes the newer run with the baseline, embeds that cell's figure, and the figure draws
    that run's four arms, not every run's."""
    from forge_bench.report import figures
    from forge_bench.report.data import load_rows

    build_report(H100_HEADLINE_RUNS, tmp_path, formats=("png",))
    text = (tmp_path / "README.md").read_text()
    tables = parse_markdown_tables(text)
    [headline] = [t for t in tables if t.startswith("Headline")]
    assert list(tables[headline][0])[1:] == ["CUDA graph, lean activations (run 500471)"]
    stem = "headline-nvidia-h100-80gb-hbm3-llama-3.1-8b-bfloat16-1-512-cuda-graph-lean"
    assert f"![CUDA graph, lean activations: peak and step per arm](figures/{stem}.png)" in text
    assert (tmp_path / "figures" / f"{stem}.png").is_file()
    frame = load_rows(H100_HEADLINE_RUNS)
    assert frame["run_id"].nunique() == 3
    run, drawn = figures.headline_run_rows(frame)
    assert run_label(run) == "500471"
    assert sorted(r["method"] for r in drawn) == ["adamw_fused", "forge_bf16_cce", "forge_int8_cce", "no_optimizer"]


def test_the_readme_headline_quotes_the_run_and_numbers_the_report_does(tmp_path):
    """The repository README's H100 table is the run the report's summary quotes from the committed runs
    of that cell (tests/fixtures/h100_headline_runs): its folder's commit, and every arm's peak, step and
    speed-up as the summary prints them."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("**H100 80GB HBM3** (`results/h100/", 1)[1]
    folder = section.split("`", 1)[0]
    lines = [line for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("| `")]
    build_report(H100_HEADLINE_RUNS, tmp_path, formats=("png",))
    tables = parse_markdown_tables((tmp_path / "README.md").read_text())
    [headline] = [t for t in tables if t.startswith("Headline")]
    [column] = list(tables[headline][0])[1:]
    run = column.split(" (run ")[1].rstrip(")")
    rows = [r for r in raw_rows(H100_HEADLINE_RUNS) if run_label(r["run_id"]) == run]
    assert folder == f"headline_lean_{rows[0]['git_commit']}"
    quoted = {line["Method"].strip("`"): line[column] for line in tables[headline]}
    assert len(lines) == len(quoted) == 4
    for line in lines:
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        method = cells[0].split("`")[1]
        peak, rest = quoted[method].split(" / ")
        step, speed = rest.rstrip(")").split(" (")
        assert cells[1] == peak
        assert close_to_printed(step, float(cells[2].split(" (")[0].strip("*")))
        assert cells[3] == "-" and method == "no_optimizer" or cells[3].replace("x", "×") == speed


def test_every_grid_view_says_oom_where_the_arm_ran_out_and_fits_where_only_it_ran(tmp_path):
    """At b4×s2048 on the H100 (tests/fixtures/h100_grid_oom): fused AdamW predicted out of memory,
    FORGE bf16 out of memory, FORGE int8 ran. The summary's grid, the report's ratio table and the
    heatmap's cells all read "oom" for bf16 and "fits (baseline oom_predicted)" for int8."""
    from forge_bench.report import figures, tables as report_tables
    from forge_bench.report.data import load_rows

    build_report(H100_GRID_OOM, tmp_path, formats=("png",))
    summary = parse_markdown_tables((tmp_path / "README.md").read_text())
    [grid] = [summary[t] for t in summary if t.startswith("Batch × sequence grid")]
    by_method = {line["Method"].strip("`"): line for line in grid}
    assert by_method["forge_bf16_cce"]["b4×s2048"] == "oom"
    assert by_method["forge_int8_cce"]["b4×s2048"] == "fits (baseline oom_predicted)"
    assert by_method["forge_int8_cce"]["b4×s1024"].count(" / ") == 1
    details = parse_markdown_tables((tmp_path / "tables" / "grid.md").read_text())
    [ratios_table] = [details[t] for t in details if t.startswith("FORGE saving / speed-up")]
    assert {line["Method"].strip("`"): line["b4×s2048"] for line in ratios_table} == {
        "forge_bf16_cce": "oom", "forge_int8_cce": "fits (baseline oom_predicted)"}
    frame = load_rows(H100_GRID_OOM)
    drawn = {method: [figures.short_na(ratio) for ratio in report_tables.grid_ratio_cells(frame, method)[(4, 2048)]]
             for method in ("forge_bf16_cce", "forge_int8_cce")}
    assert drawn == {"forge_bf16_cce": ["oom", "oom"],
                     "forge_int8_cce": ["fits\n(baseline oom_predicted)", "fits\n(baseline oom_predicted)"]}
