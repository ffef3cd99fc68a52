"""The report's zoo and training-quality sections on rows made here from one real H100 row:
coverage, the largest model of a family each arm fits, the family figure, the App. E fidelity
table (and its claim line) and the convergence table and figure."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from forge_bench import convergence, fidelity
from forge_bench.report import build_report
from forge_bench.results import write_row
from forge_bench.run_rows import KIND_COLUMN, write_rows

H100_ROW = Path(__file__).resolve().parent / "fixtures" / "h100" / "llama-3.1-8b_b1_s512_adamw_fused_9a3c76cb2a.parquet"
CONVERGENCE_H200 = Path(__file__).resolve().parent / "fixtures" / "convergence_h200"
QWEN3 = {"qwen3-0.6b": 0.596e9, "qwen3-4b": 4.02e9, "qwen3-14b": 14.77e9}


def _sweep_rows(folder: Path) -> None:
    template = pq.read_table(H100_ROW).to_pylist()[0]
    for model, n_params in QWEN3.items():
        for method, fused in (("adamw_fused", 0.0), ("forge_bf16", 0.9), ("forge_int8", 0.9)):
            row = copy.deepcopy(template)
            fits = not (model == "qwen3-14b" and method != "forge_int8")
            row.update(model=model, method=method, n_params=int(n_params), n_fused_params=int(fused * n_params),
                       method_family="forge" if fused else "baseline", cell_id=f"{model}_{method}",
                       status="ok" if fits else "oom_predicted", reason=None if fits else "needs more",
                       peak_allocated_gib=(n_params / 1e9) * (8 if not fused else 5) if fits else None,
                       step_ms_median=n_params / 1e8 if fits else None,
                       method_settings=json.dumps({"not_fused": {"model.embed_tokens (1)": "tied"}} if fused else {}))
            write_row(folder, row)


def _convergence_row(folder: Path, arm: str, seed: int, offset: float) -> None:
    curve = [3.0 - 0.1 * i + offset + 0.001 * seed for i in range(10)]
    write_rows(folder / f"convergence_{arm}_seed{seed}.parquet", [{
        KIND_COLUMN: "convergence", "arm": arm, "seed": seed, "status": "ok", "completed": True,
        "model": "gpt2", "n_params": 85_000_000, "batch": 16, "seq": 512, "steps": 10, "steps_done": 10,
        "lr": 6e-4, "spec_hash": "abc", "corpus_digest": "def", "device_name": "test GPU",
        "train_loss": curve, "val_step": [5, 10], "val_loss": [curve[4], curve[9]],
        "final_val_loss": curve[9], "final_train_loss_smoothed": curve[9], "tokens_per_s": 1e5}],
        convergence.SCHEMA)


def _training_rows(folder: Path) -> None:
    base = {KIND_COLUMN: "fidelity", "vocab": 64, "hidden": 128, "tokens": 64, "steps": 5, "lr": 1e-3,
            "device_name": "test GPU", "finished_at": "2026-01-01T00:00:00+00:00", "weight_dtype": "bfloat16"}
    write_rows(folder / "fidelity.parquet", [
        {**base, "arm": "adamw_bf16", "gradient": "bf16 (stored)", "state_dtype": "bf16", "rms_rel": 4.0e-3,
         "max_abs_dw": 2e-3, "rms_rel_update": 3e-2},
        {**base, "arm": "forge_bf16", "gradient": "fp32 tile (fused)", "state_dtype": "bf16", "rms_rel": 3.9e-3,
         "max_abs_dw": 2e-3, "rms_rel_update": 2.9e-2}], fidelity.SCHEMA)
    for arm, offset in (("adamw_fused", 0.0), ("forge_bf16", 0.004), ("forge_int8", 0.02)):
        for seed in (0, 1):
            _convergence_row(folder, arm, seed, offset)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, str]:
    rows = tmp_path_factory.mktemp("rows")
    _sweep_rows(rows / "sweep")
    _training_rows(rows / "training")
    out = tmp_path_factory.mktemp("report")
    build_report(rows, out, formats=("png",))
    return out, (out / "index.md").read_text()


def test_coverage_table_gives_each_models_fused_share_and_arms(report) -> None:
    out, index = report
    assert "## Coverage across the model zoo" in index
    line = next(l for l in index.splitlines() if l.startswith("| qwen3-4b |"))
    assert "90.0%" in line and "model.embed_tokens (1)" in line
    line14 = next(l for l in index.splitlines() if l.startswith("| qwen3-14b |"))
    assert "oom_predicted / oom_predicted" in line14


def test_largest_fit_table_and_family_figure(report) -> None:
    out, index = report
    assert "| `adamw_fused` | qwen3-4b" in index and "qwen3-14b (oom_predicted)" in index
    assert "| `forge_int8` | qwen3-14b" in index
    assert list((out / "figures").glob("family-scaling-qwen3-*.png"))


def test_fidelity_and_convergence_sections(report) -> None:
    out, index = report
    assert "FORGE bf16 is no further from fp32 than the standard bf16 path here" in index
    section = index.split("## Convergence on real text", 1)[1].splitlines()
    forge = next(l for l in section if l.startswith("| `forge_bf16` | 2 |"))
    assert "+0.0040" in forge and "| yes |" in forge
    int8 = next(l for l in section if l.startswith("| `forge_int8` | 2 |"))
    assert "+0.0200" in int8 and "| no |" in int8
    assert list((out / "figures").glob("convergence-*.png"))


def test_a_repeated_seed_is_averaged_and_its_gap_is_the_noise_floor(tmp_path: Path) -> None:
    """A second folder of the same settings ran fused AdamW's seed 0 again, 0.006 nats worse: the
    baseline's seed 0 is the mean of its two runs, and the gap is reported as run-to-run noise."""
    _training_rows(tmp_path / "first")
    _convergence_row(tmp_path / "again", "adamw_fused", 0, 0.006)
    build_report([tmp_path / "first", tmp_path / "again"], tmp_path / "out", formats=("png",))
    section = (tmp_path / "out" / "index.md").read_text().split("## Convergence on real text", 1)[1].splitlines()
    base = next(l for l in section if l.startswith("| `adamw_fused` |"))
    assert "| 2 (3 runs) |" in base and "| 0.0060 |" in base
    forge = next(l for l in section if l.startswith("| `forge_bf16` | 2 |"))
    assert "+0.0025 ± 0.0021" in forge and forge.count("| — |") == 1, forge
    assert any("ended 0.0060-0.0060 nats apart (1 pair, `adamw_fused`)" in l for l in section)


def _convergence_section(out: Path) -> list[str]:
    return (out / "index.md").read_text().split("## Convergence on real text", 1)[1].splitlines()


def test_each_arm_is_read_against_the_run_to_run_floor_of_its_study(tmp_path: Path) -> None:
    """The floor is the largest end-of-run gap between two runs of one arm and seed over the
    study (here fused AdamW's seed 0, 0.006 apart); an arm is within it when its |Δ val| is at most
    that: FORGE bf16 (+0.0025) is, FORGE int8 (+0.0185) is not; without a repeat there is no floor."""
    _training_rows(tmp_path / "first")
    _convergence_row(tmp_path / "again", "adamw_fused", 0, 0.006)
    build_report([tmp_path / "first", tmp_path / "again"], tmp_path / "out", formats=("png",))
    section = _convergence_section(tmp_path / "out")
    header = next(l for l in section if l.startswith("| Arm |"))
    assert "| \\|Δ val\\| ≤ floor (0.0060) |" in header, header
    forge = next(l for l in section if l.startswith("| `forge_bf16` |")).split(" | ")
    int8 = next(l for l in section if l.startswith("| `forge_int8` |")).split(" | ")
    base = next(l for l in section if l.startswith("| `adamw_fused` |")).split(" | ")
    assert (forge[6], forge[7]) == ("yes", "yes") and (int8[6], int8[7]) == ("no", "no") and base[7] == "—"
    assert any("The largest gap, 0.0060, is this study's floor." in l for l in section)
    build_report(tmp_path / "first", tmp_path / "alone", formats=("png",))
    alone = _convergence_section(tmp_path / "alone")
    assert "| \\|Δ val\\| ≤ floor |" in next(l for l in alone if l.startswith("| Arm |"))
    assert next(l for l in alone if l.startswith("| `forge_bf16` |")).split(" | ")[7] == "—"


def test_floor_curve_is_the_largest_gap_of_a_repeat_at_each_evaluation(tmp_path: Path) -> None:
    """Per validation step, the largest |gap| between two runs of one arm and seed over every arm."""
    from forge_bench.report.training import floor_curve
    from forge_bench.run_rows import load_kind

    _training_rows(tmp_path / "first")
    _convergence_row(tmp_path / "again", "adamw_fused", 0, 0.006)
    _convergence_row(tmp_path / "again", "forge_int8", 1, 0.02 + 0.004)
    assert floor_curve(load_kind([tmp_path / "first"], "convergence")) is None
    steps, floor = floor_curve(load_kind([tmp_path / "first", tmp_path / "again"], "convergence"))
    assert steps.tolist() == [5, 10] and floor == pytest.approx([0.006, 0.006])


def test_real_h200_repeats_give_the_floor_a_delta_is_read_against() -> None:
    """Rows of the committed H200 study and its repeat (seed 1 of fused AdamW and FORGE bf16, each
    run twice; tests/fixtures/convergence_h200): the floor is FORGE bf16's own repeat gap, 0.0078
    (0.8568 against 0.8490); its Δ, +0.0084, is within 0.01 but not within that floor."""
    from forge_bench.report.training import convergence_tables
    from forge_bench.run_rows import load_kind

    frame = load_kind([CONVERGENCE_H200 / "first", CONVERGENCE_H200 / "repeat"], "convergence")
    [table] = convergence_tables(frame)
    recs = {rec["arm"]: rec for rec in table.records}
    forge = recs["forge_bf16"]
    assert forge["run_to_run_floor"] == pytest.approx(0.8567584156990051 - 0.8489773273468018)
    assert forge["delta_val_mean"] == pytest.approx((0.8567584156990051 + 0.8489773273468018) / 2
                                                    - (0.8456505537033081 + 0.8431880474090576) / 2)
    assert forge["within_target"] is True and forge["within_floor"] is False
    assert recs["adamw_fused"]["within_floor"] is None and recs["adamw_fused"]["runs"] == 2


def test_a_folder_of_training_rows_alone_gets_a_report(tmp_path: Path) -> None:
    _training_rows(tmp_path / "rows")
    page = build_report(tmp_path / "rows", tmp_path / "out", formats=("png",))
    text = page.read_text()
    assert "## Convergence on real text" in text and "## Fidelity against fp32 (App. E)" in text


def test_a_folder_of_training_rows_beside_sweep_folders_keeps_the_sweep_tables(tmp_path: Path) -> None:
    _sweep_rows(tmp_path / "sweep")
    _training_rows(tmp_path / "training")
    page = build_report([tmp_path / "sweep", tmp_path / "training"], tmp_path / "out", formats=("png",))
    index = (tmp_path / "out" / "index.md").read_text()
    assert page.read_text().startswith("# FORGE benchmark summary")
    assert "## Coverage across the model zoo" in index and "## Convergence on real text" in index


def test_coverage_takes_the_run_that_measured_every_arm_over_a_newer_forge_only_run(tmp_path: Path) -> None:
    """A newer run of one FORGE arm alone (a first-use check, say) does not replace that arm's numbers
    in a model's line while a run measured all three arms side by side."""
    _sweep_rows(tmp_path / "sweep")
    template = pq.read_table(H100_ROW).to_pylist()[0]
    newer = dict(template, model="qwen3-4b", method="forge_bf16", method_family="forge", n_params=int(4.02e9),
                 n_fused_params=int(0.9 * 4.02e9), cell_id="qwen3-4b_forge_bf16_alone", run_id="20990101T000000Z-x-999999",
                 finished_at="2099-01-01T00:00:00+00:00", step_ms_median=999.0, status="ok")
    write_row(tmp_path / "alone", newer)
    build_report([tmp_path / "sweep", tmp_path / "alone"], tmp_path / "out", formats=("png",))
    index = (tmp_path / "out" / "index.md").read_text()
    line = next(l for l in index.splitlines() if l.startswith("| qwen3-4b |"))
    assert "999" not in line and "40.2" in line
