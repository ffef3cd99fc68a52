"""The report's "Where users train" table (``forge_bench.report.modes``) on the committed H200 rows of the
compile suite and the hand-captured headline graph (``tests/fixtures/h200_modes``): each mode's rows, their
values as printed, the reduce-overhead peak, and the one ratio rule's refusal of a pair across runs."""
from __future__ import annotations

import csv

import pytest

from forge_bench.report import build_report, ratios
from forge_bench.report.data import load_rows, run_label
from forge_bench.report.modes import NO_COMPILE_NOTE, compile_s, modes_tables, peak_gib
from report_rows import FIXTURES, H100_HEADLINE_RUNS, REPO, close_to_printed, parse_markdown_tables, raw_rows

MODES = FIXTURES / "h200_modes"
LLAMA8B = "Where users train, NVIDIA H200 · llama-3.1-8b · bfloat16 · batch 1 × seq 512"
LLAMA1B = "Where users train, NVIDIA H200 · llama-3.2-1b · bfloat16 · batch 1 × seq 512"
COMPILE_RUN, LEAN_RUN, EAGER_RUN, GRAPH_RUN = "0945e6", "4473b0", "cdf67b", "88edbb"
TURNS_RUN = "5929b8"
PINNED_RUN = "a6e8e6"
"""3a2f7f7's Llama-3.2-1B group: its six cells taking turns on the same two CPUs (D114)."""
TUPLE_RUN = "c45fca"
"""cdb7620's Llama-3.2-1B torch.compile pair (the traced arguments of D115), taking turns on the same CPUs: the
newest 1B run, quoted for torch.compile; 3a2f7f7's for the other modes."""
EVERY_TARGET = ('e91d21d',)
"""e91d21d's compile run (36edb3): every compiled pair of both models at one commit after D126 and D127, each pair
taking turns on its lane's CPUs: the newest, quoted for every compiled mode."""
EVERY_TARGET_RUN = "36edb3"
LATEST_1B = ('33fe8ce', *EVERY_TARGET)
"""33fe8ce's Llama-3.2-1B torch.compile pair (de62d6: the fallback's AdamW replayed, D127), nine turns taking turns,
and the run after it: the 1B runs quoted for torch.compile since D127."""
LATEST_1B_RUN = "de62d6"
STAGED = ('1536594', *LATEST_1B)
"""The runs with staged inputs (D121): 1536594's compile pairs of both models taking turns (8bc8e3, the 8B's quoted
for torch.compile before e91d21d's) and its six 1B cells taking turns (51185b, quoted for the 1B's eager mode), and the
later ones."""
STAGED_RUN, STAGED_1B_RUN = "8bc8e3", "51185b"
NINE_TURNS = ('7887f58', '8475a28', *STAGED)
"""The 1B runs of nine turns (D116), all six cells taking turns: 7887f58's (65959f, with the state arena of D117),
8475a28's (5ca1f7, on the same CPUs as the pinned runs before them) and 1536594's."""
NINE_TURNS_RUN, ARENA_RUN = "5ca1f7", "65959f"
PINNED = ('3a2f7f7', 'cdb7620', *NINE_TURNS)
"""The commits of the pinned 1B runs, left out to read the tables before them."""
"""7f3cdbe's compile pairs of both models, each pair's repeats taking turns (``sweep --interleave``): the
newest, quoted for torch.compile and reduce-overhead."""
FIRST_COMPILE_RUN = "9c9ba9"
"""The first 8B compile run (35228bc, before the update operators went to the dispatcher: D103); the
2d597bf runs (0945e6, and 4473b0 with the lean pair) are newer, and the table quotes them."""
HEADER = ["Mode", "Arms (AdamW / FORGE)", "Run", "AdamW ms", "AdamW peak GiB", "FORGE ms", "FORGE peak GiB",
          "Speed-up", "Compile s (AdamW / FORGE)"]


def _tables(frame=None) -> dict:
    return {t.title: t for t in modes_tables(load_rows(MODES) if frame is None else frame)}


def _row(method: str, run: str, lean: bool = False, graph: bool = False) -> dict:
    return next(r for r in raw_rows(MODES) if r["method"] == method and run_label(r["run_id"]) == run
                and (r["activations"] == "lean") == lean and (r["timing_method"] == "cuda_graph_replay") == graph)


def test_llama8b_every_mode_side_by_side() -> None:
    table = _tables()[LLAMA8B]
    assert table.header == HEADER
    assert [line[2] for line in table.rows] == [EAGER_RUN, *[EVERY_TARGET_RUN] * 3, GRAPH_RUN]
    assert [line[3:] for line in table.rows] == [
        ["122.2", "59.90", "92.64", "48.75", "~1.32×", "—"],
        ["88.04", "61.85", "67.00", "47.39", "≥1.31×", "70.0 / 88.8"],
        ["86.98", "61.82", "65.89", "47.35", "≥1.32×", "68.5 / 82.0"],
        ["86.41", "61.82", "66.31", "47.31†", "1.30×", "60.6 / 79.1"],
        ["90.35", "60.09", "67.22", "46.90", "≥1.34×", "—"]]
    # the printed numbers are the rows' own
    compiled = {arm: _row(method, EVERY_TARGET_RUN) for arm, method in (("adamw", "adamw_fused_compile"),
                                                                     ("forge", "forge_bf16_compile"))}
    record = table.records[1]
    assert record["adamw_step_ms"] == compiled["adamw"]["step_ms_median"]
    assert record["forge_peak_gib"] == compiled["forge"]["peak_allocated_gib"]
    assert record["speedup"] == pytest.approx(compiled["adamw"]["step_ms_median"] / compiled["forge"]["step_ms_median"])
    assert close_to_printed(table.rows[1][8].split(" / ")[1], compile_s(compiled["forge"]))
    table = _tables(load_rows(MODES).query(f"git_commit not in {EVERY_TARGET}"))[LLAMA8B]
    assert [line[:3] for line in table.rows] == [
        ["eager", "`adamw_fused` / `forge_bf16`", EAGER_RUN],
        ["torch.compile", "`adamw_fused_compile` / `forge_bf16_compile`", STAGED_RUN],
        ["torch.compile reduce-overhead", "`adamw_fused_compile_ro` / `forge_bf16_compile_ro`", TURNS_RUN],
        ["torch.compile reduce-overhead, lean + chunked loss", "`adamw_fused_compile_ro` / `forge_bf16_cce_compile_ro`",
         LEAN_RUN],
        ["hand-captured CUDA graph, lean + chunked loss", "`adamw_fused` / `forge_bf16_cce`", GRAPH_RUN]]
    assert [line[3:] for line in table.rows] == [
        ["122.2", "59.90", "92.64", "48.75", "~1.32×", "—"],
        ["88.68", "61.85", "67.47", "47.39", "≥1.31×", "69.9 / 92.5"],
        ["86.31", "61.82", "62.83", "47.35", "≥1.37×", "67.8 / 90.8"],
        ["86.95", "61.82", "64.53", "49.66†", "≥1.35×", "51.7 / 75.7"],
        ["90.35", "60.09", "67.22", "46.90", "≥1.34×", "—"]]
    turns = _tables(load_rows(MODES).query(f"git_commit not in {STAGED}"))[LLAMA8B]
    assert turns.rows[1][2:9] == [TURNS_RUN, "87.81", "61.85", "64.63", "47.39", "1.36×", "76.6 / 100.9"]
    before = _tables(load_rows(MODES).query(f"git_commit not in {('7f3cdbe', *STAGED)}"))[LLAMA8B]
    assert [line[2:8] for line in before.rows[1:3]] == [
        [COMPILE_RUN, "87.76", "61.85", "66.29", "47.38", "≥1.32×"], [COMPILE_RUN, "86.74", "61.82", "63.80", "49.66†", "≥1.36×"]]
    first = _tables(load_rows(MODES).query(f"git_commit not in {('2d597bf', '7f3cdbe', *STAGED)}"))[LLAMA8B]
    assert [line[2] for line in first.rows[1:4]] == [FIRST_COMPILE_RUN, FIRST_COMPILE_RUN, EAGER_RUN]
    assert [line[5] for line in first.rows[1:4]] == ["64.64", "63.62", "64.30"]


def test_llama1b_compile_is_a_miss_and_reduce_overhead_a_win() -> None:
    """Each mode quotes the newest run that paired both its arms: torch.compile cdb7620's pair (c45fca), the other
    modes 3a2f7f7's (a6e8e6, six cells taking turns on the same CPUs, every mode before cdb7620); before it, the compiled pairs of 7f3cdbe (5929b8, taking turns), eager of 74ca3d5
    (9e172b); before 7f3cdbe, the torch.compile pair of 1e0f3b4 (d128a5) and the rest of 74ca3d5, after the
    compiled updates replayed from C++ (D110); before those, 7bde30a's (636d74) and 85b1088's (cdf67b)."""
    table = _tables(load_rows(MODES).query(f"git_commit not in {NINE_TURNS}"))[LLAMA1B]
    assert [line[0] for line in table.rows] == ["eager", "torch.compile", "torch.compile reduce-overhead"]
    assert [line[2] for line in table.rows] == [PINNED_RUN, TUPLE_RUN, PINNED_RUN]
    assert [line[7] for line in table.rows] == ["~1.08×", "~0.87×", "1.22×"]
    assert [line[3] for line in table.rows] == ["62.76", "22.99", "16.03"]
    assert [line[5] for line in table.rows] == ["58.26", "26.46", "13.19"]
    pinned = _tables(load_rows(MODES).query(f"git_commit not in {('cdb7620', *NINE_TURNS)}"))[LLAMA1B]
    assert [line[2] for line in pinned.rows] == [PINNED_RUN] * 3
    assert [line[7] for line in pinned.rows] == ["~1.08×", "~0.94×", "1.22×"]
    assert [line[3] for line in pinned.rows] == ["62.76", "24.89", "16.03"]
    assert [line[5] for line in pinned.rows] == ["58.26", "26.59", "13.19"]
    turns = _tables(load_rows(MODES).query(f"git_commit not in {PINNED}"))[LLAMA1B]
    assert [line[2] for line in turns.rows] == ["9e172b", TURNS_RUN, TURNS_RUN]
    assert [line[7] for line in turns.rows] == ["~1.05×", "~0.88×", "1.23×"]
    assert [line[3] for line in turns.rows] == ["55.66", "16.96", "16.12"]
    assert [line[5] for line in turns.rows] == ["52.82", "19.29", "13.15"]
    earlier = _tables(load_rows(MODES).query(f"git_commit not in {('7f3cdbe', *PINNED)}"))[LLAMA1B]
    assert [line[2] for line in earlier.rows] == ["9e172b", "d128a5", "9e172b"]
    assert [line[7] for line in earlier.rows] == ["~1.05×", "~0.91×", "1.22×"]
    assert [line[3] for line in earlier.rows] == ["55.66", "30.50", "16.27"]
    assert [line[5] for line in earlier.rows] == ["52.82", "33.52", "13.36"]
    before = _tables(load_rows(MODES).query(f"git_commit not in {('74ca3d5', '1e0f3b4', '7f3cdbe', *PINNED)}"))[LLAMA1B]
    assert before.rows[0][2:] == ["not measured", "—", "—", "—", "—", "—", "—"]
    assert [line[2] for line in before.rows[1:]] == ["636d74", "636d74"]
    assert [line[7] for line in before.rows[1:]] == ["0.66×", "1.23×"]
    assert [line[3] for line in before.rows[1:]] == ["22.57", "16.24"]
    assert [line[5] for line in before.rows[1:]] == ["34.10", "13.22"]
    older = _tables(load_rows(MODES).query(
        f"git_commit not in {('74ca3d5', '1e0f3b4', '7bde30a', '7f3cdbe', *PINNED)}"))[LLAMA1B]
    assert [line[7] for line in older.rows[1:]] == ["0.52×", "1.23×"]


def test_llama1b_quotes_the_newest_run_of_nine_turns() -> None:
    """e91d21d's run (36edb3) is quoted for both compiled modes, 1536594's for eager; without it, 33fe8ce's pair
    (de62d6, D127) for torch.compile and 1536594's for the others.
    The nine-turn runs pair every mode's arms in one run: without 33fe8ce's the table quotes 1536594's (51185b,
    staged inputs: D121), whose compiled pair lies inside its spread; without it, 8475a28's (5ca1f7), whose compiled pair is a miss; without
    both, 7887f58's (65959f), inside its spread."""
    every = _tables()[LLAMA1B]
    assert [line[2] for line in every.rows] == [STAGED_1B_RUN, EVERY_TARGET_RUN, EVERY_TARGET_RUN]
    assert [line[7] for line in every.rows] == ["~1.20×", "~1.01×", "≥1.21×"]
    assert [line[3] for line in every.rows] == ["47.27", "23.93", "16.01"]
    assert [line[5] for line in every.rows] == ["39.28", "23.69", "13.20"]
    latest = _tables(load_rows(MODES).query(f"git_commit not in {EVERY_TARGET}"))[LLAMA1B]
    assert [line[2] for line in latest.rows] == [STAGED_1B_RUN, LATEST_1B_RUN, STAGED_1B_RUN]
    assert [line[7] for line in latest.rows] == ["~1.20×", "~1.11×", "≥1.21×"]
    assert [line[3] for line in latest.rows] == ["47.27", "19.56", "16.13"]
    assert [line[5] for line in latest.rows] == ["39.28", "17.58", "13.37"]
    staged = _tables(load_rows(MODES).query(f"git_commit not in {LATEST_1B}"))[LLAMA1B]
    assert [line[2] for line in staged.rows] == [STAGED_1B_RUN] * 3
    assert [line[7] for line in staged.rows] == ["~1.20×", "~0.98×", "≥1.21×"]
    assert [line[3] for line in staged.rows] == ["47.27", "23.13", "16.13"]
    assert [line[5] for line in staged.rows] == ["39.28", "23.50", "13.37"]
    table = _tables(load_rows(MODES).query(f"git_commit not in {STAGED}"))[LLAMA1B]
    assert [line[2] for line in table.rows] == [NINE_TURNS_RUN] * 3
    assert [line[7] for line in table.rows] == ["~1.19×", "~0.85×", "≥1.21×"]
    assert [line[3] for line in table.rows] == ["49.10", "20.62", "15.99"]
    assert [line[5] for line in table.rows] == ["41.22", "24.39", "13.23"]
    assert all(_row(m, NINE_TURNS_RUN)["repeats"] == 9 for m in ("adamw_fused_compile", "forge_bf16_compile"))
    arena = _tables(load_rows(MODES).query(f"git_commit not in {('8475a28', *STAGED)}"))[LLAMA1B]
    assert [line[2] for line in arena.rows] == [ARENA_RUN] * 3
    assert [line[7] for line in arena.rows] == ["~1.00×", "~1.06×", "1.22×"]
    assert [line[3] for line in arena.rows] == ["56.74", "25.31", "15.98"]
    assert [line[5] for line in arena.rows] == ["56.47", "23.92", "13.12"]


def test_a_step_that_launches_what_it_could_replay_says_so() -> None:
    """8475a28's compiled 1B step launched 19.4 of its 113 fused updates a step (its k and v projections' moving
    gradients): its table says so; the runs before it launched 2.2 (under ``LAUNCHED_SHARE_NOTED``) and say nothing,
    nor does 1536594's, whose staged inputs (D121) left 1.0 launched, nor a reduce-overhead step, which replays no
    recorded update (the whole step is torch.compile's graph)."""
    staged = _row("forge_bf16_compile", STAGED_1B_RUN)
    assert ratios.json_field(staged["extra"])["fused_launches_per_step"] == {"direct": 1.0, "graph": 112.0, "jit": 0.0}
    assert not any("fused updates a step" in note for table in _tables().values() for note in table.footnotes)
    launched = [note for note in _tables(load_rows(MODES).query(f"git_commit not in {STAGED}"))[LLAMA1B].footnotes
                if "fused updates a step" in note]
    assert launched == [f"FORGE's torch.compile step (run {NINE_TURNS_RUN}) launched 19.4 of its 113 fused updates a "
                        "step and replayed the rest from their recorded CUDA graphs (`extra.fused_launches_per_step`); "
                        "a launched update costs the host its Python."]
    before = _tables(load_rows(MODES).query(f"git_commit not in {NINE_TURNS}"))[LLAMA1B]
    assert not any("fused updates a step" in note for note in before.footnotes)
    ro = _row("forge_bf16_compile_ro", NINE_TURNS_RUN)
    assert ratios.json_field(ro["extra"])["fused_launches_per_step"]["graph"] == 0.0


def test_a_pair_that_took_turns_says_so_and_one_run_apart_does_not() -> None:
    """7f3cdbe's pairs ran with ``--interleave``: each row names the other's cell; the 2d597bf pairs ran one after
    the other. Only the tables quoting the former carry the note."""
    turns_note = ("The pairs of run 5929b8 took turns on one GPU (`forge-bench sweep --interleave`): both cells "
                  "resident, their timed repeats alternating, so the host's drift fell on both arms alike.")
    assert ratios.took_turns(_row("adamw_fused_compile", TURNS_RUN), _row("forge_bf16_compile", TURNS_RUN))
    assert not ratios.took_turns(_row("adamw_fused_compile", TURNS_RUN), _row("forge_bf16_compile_ro", TURNS_RUN))
    assert not ratios.took_turns(_row("adamw_fused_compile", COMPILE_RUN), _row("forge_bf16_compile", COMPILE_RUN))
    assert turns_note in _tables(load_rows(MODES).query(f"git_commit not in {STAGED}"))[LLAMA8B].footnotes
    assert turns_note in _tables(load_rows(MODES).query(f"git_commit not in {PINNED}"))[LLAMA1B].footnotes
    earlier = _tables(load_rows(MODES).query(f"git_commit not in {('7f3cdbe', *PINNED)}"))
    assert not any("took turns" in note for table in earlier.values() for note in table.footnotes)


def test_pairs_that_took_turns_on_the_same_cpus_say_so() -> None:
    """A row timed on its lane's CPUs records them (``extra.cpus``, D114); the turns note then names them."""
    assert all(ratios.json_field(_row(m, run)["extra"])["cpus"] == [14, 15]
               for m in ("adamw_fused_compile", "forge_bf16_compile") for run in (PINNED_RUN, TUPLE_RUN))
    assert ("The pairs of run a6e8e6, c45fca took turns on one GPU (`forge-bench sweep --interleave`): both cells "
            "resident, their timed repeats alternating, so the host's drift fell on both arms alike; those of run "
            "a6e8e6, c45fca on the same CPUs (`--cpus-per-cell`, D114).") in _tables(
                load_rows(MODES).query(f"git_commit not in {NINE_TURNS}"))[LLAMA1B].footnotes
    assert all(ratios.json_field(_row(m, NINE_TURNS_RUN)["extra"])["cpus"] == [14, 15]
               for m in ("adamw_fused_compile", "forge_bf16_compile"))


def test_a_reduce_overhead_peak_is_the_larger_of_window_and_process() -> None:
    """The 35228bc rows' window peak (44.87 GiB) misses the CUDA graphs' pool, recorded in the warm-up: the
    table quotes the process peak, marked, and says so; a default-mode row keeps its window peak."""
    ro = _row("adamw_fused_compile_ro", FIRST_COMPILE_RUN)
    assert f"{ro['peak_allocated_gib']:.2f}" == "44.87" and peak_gib(ro) == (ro["peak_process_gib"], True)
    default = _row("forge_bf16_compile", FIRST_COMPILE_RUN)
    assert peak_gib({**default, "peak_process_gib": 99.0}) == (default["peak_allocated_gib"], False)
    table = _tables()[LLAMA8B]
    assert "larger of that and its process peak (`peak_process_gib`)" in table.caption
    assert any(note.startswith("† the process peak") for note in table.footnotes)
    assert "& 47.31\\textdagger{} &" in table.to_latex()


def test_a_pair_across_runs_shows_both_steps_and_refuses_the_ratio() -> None:
    """Eager AdamW from the headline run (88edbb) alone, eager FORGE from the compile run (cdf67b) alone (each
    run's other eager row left out): both steps are printed, the ratio is "n/a (different run)"."""
    frame = load_rows(MODES)
    eager = (frame["timing"] == "eager") & (frame["activations"] == "hf")
    frame = frame[~(eager & (((frame["method"] == "adamw_fused") & (frame["run_short"] == EAGER_RUN))
                             | ((frame["method"] == "forge_bf16") & (frame["run_short"] == GRAPH_RUN))))]
    table = _tables(frame)[LLAMA8B]
    eager = table.rows[0]
    assert eager[2:8] == [f"{GRAPH_RUN} / {EAGER_RUN}", "122.3", "59.90", "92.64", "48.75", ratios.DIFFERENT_RUN]
    assert table.records[0]["speedup"] is None and table.records[0]["refusal"].startswith("run_id differs")
    assert any(note.startswith(f"{ratios.DIFFERENT_RUN} for eager: AdamW from run {GRAPH_RUN}, FORGE from run "
                               f"{EAGER_RUN}") for note in table.footnotes)


def test_of_two_runs_with_the_eager_pair_the_compile_run_is_quoted() -> None:
    """The headline run (88edbb) holds an eager pair too (122.3 / 111.2 ms): the table quotes the compile run's."""
    assert _row("forge_bf16", GRAPH_RUN)["step_ms_median"] == pytest.approx(111.1975326538086)
    assert _tables()[LLAMA8B].rows[0][2] == EAGER_RUN


def test_forge_alone_without_a_graph_row_has_no_target() -> None:
    """The lean reduce-overhead FORGE rows without their AdamW partner (4473b0's) and without the graph rows."""
    frame = load_rows(MODES)
    lean_adamw = (frame["method"] == "adamw_fused_compile_ro") & (frame["activations"] == "lean")
    table = _tables(frame[(frame["timing"] != "CUDA graph") & ~lean_adamw])[LLAMA8B]
    assert [line[0] for line in table.rows][-1] == "torch.compile reduce-overhead, lean + chunked loss"
    assert table.rows[-1][7] == "n/a (no AdamW row)"


def test_the_report_and_its_summary_carry_the_table(tmp_path) -> None:
    out = tmp_path / "report"
    build_report([H100_HEADLINE_RUNS / "headline_lean_d54da0b", MODES], out, formats=("png",))
    summary = (out / "README.md").read_text()
    h100, h200 = summary.split("## H200")
    assert NO_COMPILE_NOTE in h100 and NO_COMPILE_NOTE not in h200
    tables = parse_markdown_tables(h200)
    assert tables[LLAMA8B][2]["Speed-up"] == "≥1.32×" and tables[LLAMA1B][1]["Speed-up"] == "~1.01×"
    index = (out / "index.md").read_text()
    assert index.index("## Table 1") < index.index("## Where users train") < index.index("## Optimizer families")
    with (out / "tables" / "modes.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["model"], r["mode"]) for r in rows][:2] == [("llama-3.1-8b", "eager"), ("llama-3.1-8b", "torch.compile")]


def test_the_readme_quotes_the_table_the_report_prints() -> None:
    """The repository README's "Where users train" table: each mode's AdamW and FORGE step, speed-up and FORGE
    peak as the report prints them from the committed rows, the folders it names holding those rows' commits,
    and the lines on the lean reduce-overhead arm and on Llama-3.2-1B."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("**Where users train (H200, Llama-3.1-8B b1 x s512, bf16)**", 1)[1].split("**Training", 1)[0]
    intro, table, after = section.split("\n\n", 2)
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    modes = lines[0][1:]
    assert modes == ["eager", "torch.compile", "reduce-overhead", "hand-captured CUDA graph (lean, chunked loss)"]
    quoted = {line[0]: line[1:] for line in lines[1:]}
    report = {line[0]: line for line in _tables()[LLAMA8B].rows}
    shown = [report[m] for m in ("eager", "torch.compile", "torch.compile reduce-overhead",
                                 "hand-captured CUDA graph, lean + chunked loss")]
    assert quoted["fused AdamW ms"] == [line[3] for line in shown]
    assert quoted["FORGE bf16 ms"] == [line[5] for line in shown]
    assert quoted["speed-up"] == [line[7].replace("×", "x") for line in shown]
    assert quoted["FORGE peak GiB"] == [line[6].rstrip("†") for line in shown]
    for folder, method, run in (("compile_e91d21d", "forge_bf16_compile", EVERY_TARGET_RUN),
                                ("compile_e91d21d", "forge_bf16_compile_ro", EVERY_TARGET_RUN),
                                ("compile_85b1088", "forge_bf16", EAGER_RUN)):
        assert f"`results/h200/{folder}` (" in intro and folder.endswith(_row(method, run)["git_commit"])
    lean = report["torch.compile reduce-overhead, lean + chunked loss"]
    text = " ".join(after.split())
    assert (f"FORGE {lean[5]} ms, {lean[6].rstrip('†')} GiB, read against the graph's {shown[3][5]} "
            f"(AdamW {lean[3]})") in text
    int8 = {method: f"{_row(method, run)['step_ms_median']:.2f}"
            for method, run in (("forge_int8_compile", COMPILE_RUN), ("forge_int8_compile_ro", LEAN_RUN))}
    assert (f"FORGE int8: {int8['forge_int8_compile']} ms compiled, {int8['forge_int8_compile_ro']} "
            f"reduce-overhead") in text
    small = {line[0]: line[7].replace("×", "x") for line in _tables()[LLAMA1B].rows}
    assert f"Llama-3.2-1B (`compile_e91d21d`): torch.compile {small['torch.compile'].lstrip('~')} (inside" in text
    assert (f"reduce-overhead {small['torch.compile reduce-overhead'].lstrip('≥')}, eager "
            f"{small['eager'].lstrip('~')} (`compile1b_1536594`).") in text
    quoted = {_row(m, EVERY_TARGET_RUN)["git_commit"] for m in ("forge_bf16_compile", "forge_bf16_compile_ro")}
    assert quoted == {"e91d21d"}
    assert _row("forge_bf16_compile_ro", STAGED_1B_RUN)["git_commit"] == "1536594"
