"""FORGE_TUNE_CACHE: the fused kernel's tile choices reused across processes (forge_core.kernels.tune_cache)."""
import json
import sys
from pathlib import Path

import pytest
import torch

from forge_core.kernels import (count_current_tune_cache_entries, dispatch, fused_wgrad_update, hopper_ws, launch,
                                rekey_tune_cache_entries, tune_cache)
from forge_core.kernels import tuning as tuning_module
from forge_core.kernels.tile_config import TileConfig
from forge_core.rules import get_rule
from forge_core.state import ParamState

SAMPLE_CACHE = Path(__file__).resolve().parent / "fixtures" / "tune_cache_sample.json"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CANDIDATES = [TileConfig(32, 64, 32, 8, 4, 1), TileConfig(64, 64, 32, 8, 4, 1)]


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Tuning on (also under the interpreter), over two candidates, timed by a fake clock that
    prefers 64-row tiles; a fresh process's tables; the cache file in tmp_path. Returns the file
    and the list of configurations timed."""
    timed, planned = [], []

    def fake_bench(fn):
        fn()
        timed.append(planned[-1])
        return {32: 2.0, 64: 1.0}[planned[-1].block_m]

    real_plan = launch.make_plan
    monkeypatch.setattr(launch, "make_plan", lambda config, *a: (planned.append(config), real_plan(config, *a))[1])
    monkeypatch.setattr(tuning_module, "candidate_configs", lambda m, n, k, b: list(CANDIDATES))
    monkeypatch.setattr(tuning_module, "bench_ms", fake_bench)
    monkeypatch.setattr(tuning_module, "use_fixed_config", lambda: False)
    monkeypatch.setattr(tuning_module, "FINALISTS", 1)
    monkeypatch.setattr(tuning_module, "TMA_FLIPS", 0)
    _new_process(monkeypatch)
    path = tmp_path / "tune.json"
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    monkeypatch.setenv(tune_cache.ENV, str(path))
    return path, timed


def _new_process(monkeypatch):
    monkeypatch.setattr(tuning_module, "TUNED", {})
    monkeypatch.setattr(tuning_module, "FROM_DISK", set())
    dispatch.PLANS.clear()


def _step(step=1):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(40, 90, generator=gen).to(DEVICE)
    dy = (torch.randn(40, 70, generator=gen) * 0.1).to(DEVICE)
    weight = torch.randn(70, 90, generator=gen).to(DEVICE)
    state = ParamState(weight, get_rule("adamw"), "fp32")
    before = weight.clone()
    fused_wgrad_update(x, dy, weight, state, HP, step)
    assert not torch.equal(weight, before), "the step must still update the weight"


def test_a_later_process_reuses_the_choice_without_timing(tuning, monkeypatch):
    path, timed = tuning
    _step()
    assert timed, "the first process tunes"
    entries = json.loads(path.read_text())["entries"]
    (entry,) = entries.values()
    assert entry["config"]["block_m"] == 64 and entry["shape"] == "70x90" and entry["tokens"] == 40
    (description,) = tuning_module.describe_tuned_configs().values()
    assert "(tune cache)" not in description

    _new_process(monkeypatch)
    timed.clear()
    _step(2)
    assert timed == [], "a cached choice is not timed again"
    assert list(tuning_module.tuned_configs().values())[0].block_m == 64
    (description,) = tuning_module.describe_tuned_configs().values()
    assert description.endswith("(tune cache)"), "a row must say its tile came from the cache"


def test_another_candidate_list_tunes_again_and_keeps_the_old_entry(tuning, monkeypatch):
    path, timed = tuning
    _step()
    _new_process(monkeypatch)
    timed.clear()
    monkeypatch.setattr(tuning_module, "candidate_configs", lambda m, n, k, b: CANDIDATES[:1])
    with pytest.warns(RuntimeWarning, match=r"holds a tile for 70x90 at 40 tokens made for another kernel source"):
        _step(2)
    assert timed and all(c.block_m == 32 for c in timed), "the fingerprint covers what the tuner chose among"
    assert len(json.loads(path.read_text())["entries"]) == 2


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "entries": {}}), "[]"])
def test_an_unreadable_cache_warns_and_tunes(tuning, content):
    path, timed = tuning
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="FORGE_TUNE_CACHE"):
        _step()
    assert timed
    assert len(json.loads(path.read_text())["entries"]) == 1, "the rewritten file holds the new choice"


def test_an_unwritable_cache_warns_and_the_step_still_runs(tuning, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(tune_cache.ENV, str(blocker / "tune.json"))     # a folder that cannot exist
    with pytest.warns(RuntimeWarning, match="cannot write"):
        _step()
    assert list(tmp_path.iterdir()) == [blocker], "no temporary file is left behind"


def test_no_file_is_written_without_the_variable(tuning, monkeypatch, tmp_path):
    path, timed = tuning
    monkeypatch.delenv(tune_cache.ENV)
    _step()
    assert timed and not path.exists()


def test_the_sweep_runner_names_the_same_variable():
    from forge_bench import runner
    assert runner.TUNE_CACHE_ENV == tune_cache.ENV


def test_a_cell_row_names_the_file_its_tiles_came_from(tuning):
    """forge_bench.cell records the tiles and, beside them, the cache file they were read from."""
    from forge_bench import cell
    path, _ = tuning
    _step()
    configs, source = cell._tuned_kernel_configs()
    assert list(configs) == ["70x90/bt40/adamw/fp32"] and source == path


def test_the_sweep_check_strips_the_mark_the_kernel_writes(tuning, monkeypatch):
    """--check compares tiles without the "(tune cache)" mark: the runner spells it as tuning writes it."""
    from forge_bench import runner
    _step()
    _new_process(monkeypatch)
    _step(2)
    (description,) = tuning_module.describe_tuned_configs().values()
    assert description.endswith(runner.TUNE_CACHE_MARK)


_KERNEL_SOURCE = '''
import triton
import triton.language as tl

SCALE = tl.constexpr({scale})


@triton.jit
def helper(x):
    return x * SCALE


@triton.jit
def kernel(ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(ptr + offs, helper(tl.load(ptr + offs)))
'''


def _kernel_module(tmp_path, name: str, padding: int = 0, scale: float = 2.0):
    """A Triton kernel module on disk (Triton reads a kernel's source from its file)."""
    path = tmp_path / f"{name}.py"
    path.write_text("\n" * padding + _KERNEL_SOURCE.format(scale=scale))
    return _load(path)


def _load(path):
    import importlib.util
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernel_identity_ignores_where_the_kernel_sits_in_its_file(tmp_path):
    top, lower = _kernel_module(tmp_path, "kernel_top"), _kernel_module(tmp_path, "kernel_lower", padding=7)
    assert tune_cache.source_identity(top.kernel) == tune_cache.source_identity(lower.kernel), \
        "an edit above the kernel (an import) must not throw away the tile choices on disk"


def test_the_kernel_identity_follows_what_the_kernel_calls_and_reads(tmp_path):
    base = tune_cache.source_identity(_kernel_module(tmp_path, "kernel_base").kernel)
    other_constant = tune_cache.source_identity(_kernel_module(tmp_path, "kernel_scaled", scale=3.0).kernel)
    assert other_constant != base, "a global the helper reads is part of the kernel"
    edited = _kernel_module(tmp_path, "kernel_edited")
    assert tune_cache.source_identity(edited.helper) != tune_cache.source_identity(edited.kernel)


def test_the_kernel_identity_ignores_docstrings_and_comments_but_not_code(tmp_path):
    base = tune_cache.source_identity(_kernel_module(tmp_path, "kernel_plain").kernel)
    path = tmp_path / "kernel_documented.py"
    documented = _KERNEL_SOURCE.format(scale=2.0).replace(
        "def helper(x):\n", "def helper(x):\n    \"\"\"Why the helper scales.\"\"\"\n    # and a comment\n")
    assert documented != _KERNEL_SOURCE.format(scale=2.0)
    path.write_text(documented)
    assert tune_cache.source_identity(_load(path).kernel) == base, "a reworded docstring compiles the same kernel"
    path = tmp_path / "kernel_changed.py"
    path.write_text(_KERNEL_SOURCE.format(scale=2.0).replace("return x * SCALE", "return x * SCALE + 1"))
    assert tune_cache.source_identity(_load(path).kernel) != base, "a code edit in a callee is a new kernel"


def test_the_fused_kernels_fingerprint_is_the_same_in_a_new_process():
    """The fingerprint of a real key must be reproducible: no object ids or addresses in it."""
    import subprocess
    code = ("import forge_core.kernels.tile_kernel as k, forge_core.kernels.tune_cache as t;"
            "from forge_core.rules import get_rule;"
            "print(t.source_identity(k.fused_wgrad_update_kernel), t.source_identity(get_rule('adamw').epilogue))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1 and len(next(iter(runs)).split()) == 2


def test_a_function_without_a_source_file_still_has_a_reproducible_identity():
    """No object address in the identity, or a cache written by one process never hits in the next."""
    namespace: dict = {}
    exec("def epilogue(w):\n    return w * 2\n", namespace)
    first = tune_cache.source_identity(namespace["epilogue"])
    again: dict = {}
    exec("def epilogue(w):\n    return w * 2\n", again)
    assert tune_cache.source_identity(again["epilogue"]) == first
    assert tune_cache.source_identity(None) == tune_cache.source_identity(None)


def test_a_rekeyed_cache_gives_a_changed_kernel_the_same_tiles_without_timing(tuning, monkeypatch, tmp_path):
    """rekey_tune_cache_entries: an A/B of a kernel change runs both sides on the old tiles."""
    path, timed = tuning
    _step()
    original = tune_cache.source_identity
    monkeypatch.setattr(tune_cache, "source_identity", lambda fn: original(fn) + "-edited")   # a kernel change
    entries = json.loads(path.read_text())["entries"]
    rekeyed, changed = rekey_tune_cache_entries(entries)
    assert changed == 1 and list(rekeyed.values()) == list(entries.values())
    assert count_current_tune_cache_entries(entries) == (0, 1)
    assert count_current_tune_cache_entries(rekeyed) == (1, 1)
    target = tmp_path / "rekeyed.json"
    tune_cache.write(target, rekeyed)
    monkeypatch.setenv(tune_cache.ENV, str(target))
    _new_process(monkeypatch)
    timed.clear()
    _step(2)
    assert timed == [], "the edited kernel finds the old choice under its own fingerprint"
    assert list(tuning_module.tuned_configs().values())[0].block_m == 64

    _new_process(monkeypatch)
    monkeypatch.setenv(tune_cache.ENV, str(path))
    with pytest.warns(RuntimeWarning, match="made for another kernel source"):
        _step(3)                               # the original file: the edited kernel tunes again
    assert timed


@pytest.mark.parametrize("key, entry", [
    ("0000000000000000|not a tuning key", {"triton": "3.6.0", "device": "cpu"}),
    ("0000000000000000|((64, 64), 8, torch.bfloat16, torch.bfloat16, 'no_such_rule', 'bf16')",
     {"triton": "3.6.0", "device": "cpu"}),
    ("0000000000000000|((64, 64), 8, torch.bfloat16, torch.bfloat16, 'adamw', 'bf16', 'graph', 'hopper_ws')",
     {"triton": "3.6.0", "device": "cpu"}),                     # a Gluon choice without its Triton tile
])
def test_rekey_names_an_entry_it_cannot_read(key, entry):
    with pytest.raises(ValueError, match="tune cache entry .* cannot be read") as raised:
        rekey_tune_cache_entries({key: entry})
    assert key in str(raised.value) and "\n" not in str(raised.value)


needs_gluon = pytest.mark.skipif(hopper_ws.GLUON_IMPORT_ERROR is not None,
                                 reason=f"the Gluon choices' fingerprints name the Gluon kernel: {hopper_ws.GLUON_IMPORT_ERROR}")


def _sample_entries() -> dict:
    """A few entries of the GPU-CI baseline's cache (tests/fixtures/README.md)."""
    return json.loads(SAMPLE_CACHE.read_text())["entries"]


@needs_gluon
def test_the_sample_cache_rekeys_every_entry_to_a_current_one():
    """Tiles and Gluon choices, eager and graph: re-keyed, every entry is one this tree looks up, with
    its choice and notes untouched; re-keying that again changes nothing."""
    entries = _sample_entries()
    rekeyed, _ = rekey_tune_cache_entries(entries)
    assert list(rekeyed.values()) == list(entries.values())
    assert [tune_cache.split_entry_key(k)[1] for k in rekeyed] == [tune_cache.split_entry_key(k)[1] for k in entries]
    assert count_current_tune_cache_entries(rekeyed) == (len(entries), len(entries))
    assert rekey_tune_cache_entries(rekeyed) == (rekeyed, 0)


@needs_gluon
def test_rekey_restores_the_fingerprints_of_gluon_choices():
    """A Gluon-or-Triton choice (key ending in 'hopper_ws') under a stale fingerprint gets the one this
    tree's ws_choice.stored would look up; one already current stays as it is."""
    entries, _ = rekey_tune_cache_entries(_sample_entries())
    gluon = {k: v for k, v in entries.items() if k.endswith("'hopper_ws')")}
    assert any("'graph'" in k for k in gluon) and any("'eager'" in k for k in gluon)
    current_key, entry = next(iter(gluon.items()))
    _, key_text = tune_cache.split_entry_key(current_key)
    rekeyed, changed = rekey_tune_cache_entries({f"0000000000000000|{key_text}": entry})
    assert changed == 1 and list(rekeyed) == [current_key]
    assert rekey_tune_cache_entries({current_key: entry})[1] == 0


def test_the_identity_text_does_not_move_when_python_adds_an_empty_field(monkeypatch):
    """Python 3.12 gave FunctionDef a ``type_params`` field: the CPU machines (3.11) and the H100 host
    (3.12) must still hash a kernel alike, or the committed caches miss on the GPU."""
    import ast
    source = "def kernel(x, BLOCK):\n    \"\"\"Doc.\"\"\"\n    return x * BLOCK  # scaled\n"
    before = tune_cache.code_only(source)
    monkeypatch.setattr(ast.FunctionDef, "_fields", ast.FunctionDef._fields + ("added_in_a_later_python",))
    monkeypatch.setattr(ast.FunctionDef, "added_in_a_later_python", [], raising=False)
    assert tune_cache.code_only(source) == before
    assert before == tune_cache.code_only("def kernel(x, BLOCK):\n    return x * BLOCK\n")


def test_tuning_a_shape_prints_one_progress_line_and_a_cache_hit_none(tuning, monkeypatch, capsys):
    """A first use tunes for seconds per shape: one line on stderr says so; a shape read from the
    cache, or FORGE_TUNE_QUIET=1, prints nothing."""
    monkeypatch.delenv(tuning_module.QUIET_ENV, raising=False)
    _step()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("forge_core: tuning")]
    assert lines == [tuning_module.tuning_message(70, 90, 40, "fp32", len(CANDIDATES))]
    assert "70x90 weight at 40 tokens, fp32 states (2 candidate tiles" in lines[0]
    _new_process(monkeypatch)
    _step(2)                                        # read from the cache file
    assert "forge_core: tuning" not in capsys.readouterr().err
    _new_process(monkeypatch)
    monkeypatch.setenv(tuning_module.QUIET_ENV, "1")
    monkeypatch.setenv(tune_cache.ENV, str(tuning[0].with_name("other.json")))    # a miss: tunes again, quietly
    _step(3)
    assert "forge_core: tuning" not in capsys.readouterr().err


def test_a_zero_token_launch_takes_the_default_tile_without_tuning(tuning, monkeypatch, capsys):
    """A flush (the update with no tokens: accumulation's last step, an embedding no token reached) has
    no GEMM to time: no candidate is timed, nothing is announced or written to the cache."""
    path, timed = tuning
    monkeypatch.delenv(tuning_module.QUIET_ENV, raising=False)
    x = torch.zeros(0, 90).to(DEVICE)
    dy = torch.zeros(0, 70).to(DEVICE)
    weight = torch.randn(70, 90, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    state = ParamState(weight, get_rule("adamw"), "fp32")
    before = weight.clone()
    fused_wgrad_update(x, dy, weight, state, HP, 1)
    assert not torch.equal(weight, before), "weight decay still moves the weight"
    assert timed == [] and "forge_core: tuning" not in capsys.readouterr().err
    assert not path.exists() or "x90" not in path.read_text()


# --- the choices shipped with the package ------------------------------------------------------------

def test_a_shipped_choice_is_used_without_tuning_and_can_be_turned_off(tuning, monkeypatch, tmp_path):
    """A first process tunes into its cache; shipped (re-keyed, per GPU model) it lets a fresh process
    with no FORGE_TUNE_CACHE skip tuning; FORGE_TUNE_SHIPPED=0 tunes again."""
    from forge_bench import tune_cache as bench_tune_cache

    path, timed = tuning
    _step()
    tuned = len(timed)
    assert tuned > 0
    shipped_dir = tmp_path / "shipped"
    written = bench_tune_cache.ship([path], folder=shipped_dir)
    target = shipped_dir / tune_cache.shipped_file_name(tuning_module.device_name(torch.empty(0, device=DEVICE)))
    assert list(written) == [target] and written[target][1] == len(json.loads(path.read_text())["entries"])
    monkeypatch.setattr(tune_cache, "SHIPPED_DIR", shipped_dir)
    monkeypatch.delenv(tune_cache.ENV)
    _new_process(monkeypatch)
    _step(2)
    assert len(timed) == tuned, "the shipped choice is read, nothing is timed"
    assert len(tuning_module.FROM_DISK) == 1
    _new_process(monkeypatch)
    monkeypatch.setenv(tune_cache.SHIPPED_ENV, "0")
    _step(3)
    assert len(timed) > tuned


def test_shipped_keys_hold_no_device_index():
    key = "abc|((4096, 4096), 512, torch.bfloat16, torch.bfloat16, 'adamw', 'bf16', False, False, False, 'cuda:3')"
    assert tune_cache.portable_key(key).endswith("'cuda:0')")
    assert tune_cache.shipped_file_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    assert tune_cache.shipped_file_name("NVIDIA H200") == "nvidia-h200.json"


SHIPPED_FILES = sorted(tune_cache.SHIPPED_DIR.glob("*.json"))


@pytest.mark.skipif(hopper_ws.GLUON_IMPORT_ERROR is not None, reason="the shipped Gluon choices' fingerprints need Gluon")
@pytest.mark.parametrize("path", SHIPPED_FILES, ids=[p.name for p in SHIPPED_FILES])
def test_every_shipped_choice_is_current_for_this_tree(path):
    """A kernel change without re-shipping would make every first step tune again, silently: re-ship
    with ``forge-bench tune-cache ship forge_core/tune_caches/*.json``."""
    entries = json.loads(path.read_text())["entries"]
    assert entries and count_current_tune_cache_entries(entries) == (len(entries), len(entries)), (
        f"{path.name}: re-ship with forge-bench tune-cache ship {path}")
    assert {tune_cache.shipped_file_name(e["device"]) for e in entries.values()} == {path.name}
    assert all(tune_cache.portable_key(k) == k for k in entries)


def test_the_package_ships_h100_and_h200_choices():
    assert {p.name for p in SHIPPED_FILES} >= {"nvidia-h100-80gb-hbm3.json", "nvidia-h200.json"}
