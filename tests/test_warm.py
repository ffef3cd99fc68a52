"""``forge-bench tune-cache warm``: a suite's FORGE cells tuned into a tune cache, nothing measured
(forge_bench/warm.py)."""
import ast
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from forge_bench import models as models_mod
from forge_bench.arm import ArmUnavailable
from forge_bench import warm as warm_mod
from forge_bench.cli import app
from forge_bench.suite import load_suite
from forge_core.kernels import dispatch, tune_cache
from forge_core.kernels import tuning as tuning_module
from forge_core.kernels.tile_config import INTERPRETER_CONFIG

cli = CliRunner()
SUITE = """
name: warm_test
device: {device}
dtype: float32
warmup_steps: 1
timed_steps: 2
repeats: 1
timeout_s: 120
seed: 0
optimizer: {{lr: 1.0e-3, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, momentum: 0.9}}
parity: {{enabled: true, steps: 2, tolerance: 0.02, max_layers: 2}}
grids:
  - name: g
    models: [tiny-llama]
    batch: [2]
    seq: [16]
    methods: [no_optimizer, forge_bf16]
"""


def write_suite(tmp_path: Path, device: str = "cpu") -> Path:
    path = tmp_path / "warm_test.yaml"
    path.write_text(SUITE.format(device=device))
    return path


@pytest.fixture
def tuner(monkeypatch):
    """The tuner on (also in the interpreter) with one candidate and no timing, in a fresh process's
    tables: the choices it makes, and their keys, are the real path's."""
    monkeypatch.setattr(tuning_module, "use_fixed_config", lambda: False)
    monkeypatch.setattr(tuning_module, "tune_config", lambda candidates, run, time_ms, **kw: (INTERPRETER_CONFIG, {}))
    monkeypatch.setattr(tuning_module, "TUNED", {})
    monkeypatch.setattr(tuning_module, "FROM_DISK", set())
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    monkeypatch.delenv(tune_cache.ENV, raising=False)
    dispatch.PLANS.clear()


def tuning_keys(path: Path) -> set[tuple]:
    """(weight shape, tokens, kernel name, state format) of every choice in a tune cache."""
    entries = json.loads(path.read_text())["entries"]
    keys = set()
    for key in entries:
        text = tune_cache.split_entry_key(key)[1].replace("torch.float32", "'f32'").replace("torch.bfloat16", "'bf16'")
        parsed = ast.literal_eval(text)
        keys.add((parsed[0], parsed[1], parsed[4], parsed[5]))
    return keys


@pytest.mark.slow
def test_warm_tunes_each_fused_weight_shape_of_the_cells_twin_once(tuner, tmp_path):
    suite = load_suite(write_suite(tmp_path))
    cache = tmp_path / "out" / "tune.json"
    outcomes = warm_mod.warm(suite, list(suite.cells), cache)

    assert [o.status for o in outcomes] == ["skipped", "warmed"]
    assert "no_optimizer is not a FORGE arm" in outcomes[0].reason
    twin = models_mod.build_model("tiny-llama", "float32", "cpu", seed=0,
                                  num_layers=models_mod.reduced_depth("tiny-llama", 2))
    linear_shapes = {tuple(m.weight.shape) for m in twin.modules() if isinstance(m, torch.nn.Linear)}
    keys = tuning_keys(cache)
    assert {(shape, 2 * 16, "adamw", "bf16") for shape in linear_shapes} <= keys
    assert {tokens for _, tokens, _, _ in keys} == {2 * 16}
    assert outcomes[1].added == len(json.loads(cache.read_text())["entries"]) > 0
    assert tune_cache.ENV not in __import__("os").environ      # put back as it was

    # a later process finds every choice in the file: warming again adds nothing
    tuning_module.TUNED.clear()
    tuning_module.FROM_DISK.clear()
    dispatch.PLANS.clear()
    again = warm_mod.warm(suite, [suite.cells[1]], cache)
    assert [(o.status, o.added) for o in again] == [("warmed", 0)]
    assert tuning_module.FROM_DISK


@pytest.mark.slow
def test_warm_cli_prints_each_cell_and_the_total(tuner, tmp_path):
    cache = tmp_path / "tune.json"
    res = cli.invoke(app, ["tune-cache", "warm", str(write_suite(tmp_path)), "--out", str(cache),
                           "--only", "forge_bf16"])
    assert res.exit_code == 0, res.output
    assert "g/tiny-llama/b2/s16/forge_bf16: warmed (" in res.output
    assert f"1 cells warmed, 0 skipped, 0 failed; {len(json.loads(cache.read_text())['entries'])} choices added" \
        in " ".join(res.output.split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_warm_refuses_a_gpu_suite_without_a_gpu_in_one_line(tmp_path):
    cache = tmp_path / "tune.json"
    res = cli.invoke(app, ["tune-cache", "warm", str(write_suite(tmp_path, device="cuda")), "--out", str(cache)])
    assert res.exit_code == 2
    assert "no CUDA device is visible" in res.output
    assert not cache.exists()


def test_warm_refuses_a_file_that_is_not_a_tune_cache_and_leaves_it(tmp_path):
    cache = tmp_path / "tune.json"
    cache.write_text("[1, 2]")
    res = cli.invoke(app, ["tune-cache", "warm", str(write_suite(tmp_path)), "--out", str(cache)])
    assert res.exit_code == 2
    assert f"{cache} is not a tune cache" in " ".join(res.output.split())
    assert cache.read_text() == "[1, 2]"


def test_warm_refuses_a_pattern_that_matches_no_cell(tmp_path):
    res = cli.invoke(app, ["tune-cache", "warm", str(write_suite(tmp_path)), "--out", str(tmp_path / "t.json"),
                           "--only", "nothing_like_this"])
    assert res.exit_code == 2
    assert "matches none of the 2 cells" in " ".join(res.output.split())


def test_a_failing_cell_is_reported_and_the_next_one_runs(tuner, tmp_path, monkeypatch):
    suite = load_suite(write_suite(tmp_path))
    calls = []

    def fail_first(suite_arg, cell):
        calls.append(cell.method)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    monkeypatch.setattr(warm_mod, "warm_cell", fail_first)
    forge_cell = suite.cells[1]
    outcomes = warm_mod.warm(suite, [forge_cell, forge_cell], tmp_path / "tune.json")
    assert [o.status for o in outcomes] == ["failed", "warmed"]
    assert outcomes[0].reason == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times the kernels on a CUDA device")
def test_warm_on_a_gpu_writes_the_choices_a_later_process_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_TUNE_SHIPPED", "0")        # tune every shape here, whatever the package ships
    monkeypatch.setattr(tuning_module, "TUNED", {})
    monkeypatch.setattr(tuning_module, "FROM_DISK", set())
    dispatch.PLANS.clear()
    suite = load_suite(write_suite(tmp_path, device="cuda"))
    cache = tmp_path / "tune.json"
    outcomes = warm_mod.warm(suite, [suite.cells[1]], cache)
    assert outcomes[0].status == "warmed" and outcomes[0].added > 0
    assert {tokens for _, tokens, _, _ in tuning_keys(cache)} == {2 * 16}

    tuning_module.TUNED.clear()
    dispatch.PLANS.clear()
    again = warm_mod.warm(suite, [suite.cells[1]], cache)
    assert [(o.status, o.added) for o in again] == [("warmed", 0)]
    assert tuning_module.FROM_DISK          # the tiles came from the file, not from tuning


def test_an_arm_that_cannot_take_the_model_is_skipped_with_its_reason(tuner, tmp_path, monkeypatch):
    suite = load_suite(write_suite(tmp_path))

    def unavailable(suite_arg, cell):
        raise ArmUnavailable("forge_bf16: no Linear of this model can be fused")

    monkeypatch.setattr(warm_mod, "warm_cell", unavailable)
    outcomes = warm_mod.warm(suite, [suite.cells[1]], tmp_path / "tune.json")
    assert [(o.status, o.reason) for o in outcomes] == [
        ("skipped", "ArmUnavailable: forge_bf16: no Linear of this model can be fused")]
