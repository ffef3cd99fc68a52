"""ws_choice: the Gluon kernel takes a weight only where it beat the Triton tile, and the choice is
kept (in the process and in FORGE_TUNE_CACHE) without timing again."""
import json

import pytest
import torch

from forge_core.kernels import dispatch, tune_cache, tuning, ws_choice
from forge_core.kernels.device import interpreting
from forge_core.kernels.hopper_ws import WsConfig
from forge_core.kernels.tile_config import TileConfig

A, B = WsConfig(slab_m=32, slab_n=64, state_stages=4), WsConfig(slab_m=64, slab_n=64, group=1)


def _clock(times: dict):
    """A fake time_ms: runs the callable (which names itself) and returns its fixed time."""
    calls = []

    def time_ms(run):
        name = run()
        calls.append(name)
        return times[name]
    return time_ms, calls


def test_the_faster_gluon_config_wins_and_is_timed_against_triton_round_robin():
    time_ms, calls = _clock({"triton": 1.0, "a": 0.9, "b": 0.8})
    choice, medians = ws_choice.choose(lambda: "triton", {A: lambda: "a", B: lambda: "b"}, time_ms, rounds=3)
    assert choice == B and medians == {"triton": 1.0, "hopper_ws": 0.8}
    assert calls == ["a", "b", "triton", "b", "b", "triton", "triton", "b"]


def test_the_triton_tile_stays_when_it_is_faster():
    time_ms, _ = _clock({"triton": 0.7, "a": 0.9})
    assert ws_choice.choose(lambda: "triton", {A: lambda: "a"}, time_ms)[0] is None


def test_a_candidate_that_fails_is_skipped_with_a_warning():
    def broken():
        raise RuntimeError("out of resource: shared memory")
    time_ms, _ = _clock({"triton": 1.0, "a": 0.5})
    with pytest.warns(RuntimeWarning, match="did not run"):
        choice, _ = ws_choice.choose(lambda: "triton", {B: broken, A: lambda: "a"}, time_ms)
    assert choice == A
    with pytest.warns(RuntimeWarning):
        assert ws_choice.choose(lambda: "triton", {B: broken}, time_ms) == (None, {})


def test_the_warning_names_the_cause_of_a_long_cuda_error_before_the_config():
    def cuda_failure():
        raise RuntimeError("CUDA error: too many resources requested for launch\n"
                           "CUDA kernel errors might be asynchronously reported at some other API call, so the "
                           "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
    time_ms, _ = _clock({"triton": 1.0})
    with pytest.warns(RuntimeWarning) as caught:
        ws_choice.choose(lambda: "triton", {B: cuda_failure}, time_ms)
    message = str(caught[0].message)
    assert "(RuntimeError: CUDA error: too many resources requested for launch) and is skipped: " in message
    assert message.endswith(str(B)) and "\n" not in message and "asynchronously" not in message


def test_a_failure_line_is_cut_at_its_limit():
    line = ws_choice.failure_line(ValueError("x" * 500), limit=40)
    assert line == "ValueError: " + "x" * 25 + "..." and len(line) == 40
    assert ws_choice.failure_line(KeyError()) == "KeyError"


def _stored_or_measured(key, candidates, run_triton, run_ws, time_ms, identity, note):
    """The choice as ``dispatch.ws_plan`` reaches it: looked up (``stored``), else timed (``measure``)."""
    known, config = ws_choice.stored(key, candidates, identity, note.get("device", ""))
    return config if known else ws_choice.measure(key, candidates, run_triton, run_ws, time_ms, identity, note)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(ws_choice, "CHOSEN", {})
    monkeypatch.setattr(ws_choice, "FROM_DISK", set())
    monkeypatch.setenv("FORGE_TUNE_CACHE", str(tmp_path / "tc.json"))
    return tmp_path / "tc.json"


@pytest.mark.parametrize("times, expected", [({"triton": 1.0, "a": 0.9}, A), ({"triton": 0.5, "a": 0.9}, None)])
def test_a_later_process_reads_the_choice_from_the_tune_cache(fresh, monkeypatch, times, expected):
    key = ((1024, 4096), 512, "bf16")
    time_ms, calls = _clock(times)
    args = (key, [A], lambda: "triton", lambda config: "a", time_ms, "kernel-identity", {"shape": "1024x4096"})
    assert _stored_or_measured(*args) == expected
    timed = len(calls)
    entry = next(iter(json.loads(fresh.read_text())["entries"].values()))
    assert entry["shape"] == "1024x4096" and set(entry["medians_ms"]) == {"triton", "hopper_ws"}
    monkeypatch.setattr(ws_choice, "CHOSEN", {})               # a new process
    assert _stored_or_measured(*args) == expected and len(calls) == timed
    assert (key in ws_choice.FROM_DISK)
    other = (key, [A], lambda: "triton", lambda config: "a", time_ms, "another-kernel", {})
    monkeypatch.setattr(ws_choice, "CHOSEN", {})
    _stored_or_measured(*other)
    assert len(calls) > timed                                    # another kernel source: timed again


def test_no_candidates_outside_the_scope(monkeypatch):
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    args = (x, x, w, [w, w], [None, None])
    assert ws_choice.candidates_for(*args, "fp32", None, False) == []
    assert ws_choice.candidates_for(*args, "bf16", w, False) == []          # a gradient accumulator
    assert ws_choice.candidates_for(*args, "bf16", None, True) == []        # stochastic rounding
    assert ws_choice.candidates_for(*args, "bf16", None, False) == []       # CPU tensors
    monkeypatch.setenv(ws_choice.ENV, "0")
    assert not ws_choice.enabled()


def test_the_two_state_bf16_candidates_are_offered_to_those_calls_alone(monkeypatch):
    """The 256x128 candidates spill with int8 states and with one state (offline sm_90): offered to
    calls with two bf16 states only, after the common candidates."""
    monkeypatch.setattr(ws_choice.hopper_ws, "unsupported_reason", lambda *args: None)
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    two, one = (w, w, w, [w, w], [None, None]), (w, w, w, [w], [None])
    assert ws_choice.candidates_for(*two, "bf16", None, False) == [*ws_choice.CANDIDATES, *ws_choice.BF16_ONLY]
    assert ws_choice.candidates_for(*two, "int8", None, False) == list(ws_choice.CANDIDATES)
    assert ws_choice.candidates_for(*one, "bf16", None, False) == list(ws_choice.CANDIDATES)


def test_a_choice_is_described_for_benchmark_rows():
    assert ws_choice.describe(A, True) == "hopper_ws 128x128x64 s3 slab32x64x4 g8 epi4 (tune cache)"


def test_chosen_configs_are_keyed_by_the_tuning_key(monkeypatch):
    monkeypatch.setattr(ws_choice, "CHOSEN", {("k", "graph"): A, ("q", "eager"): None})
    assert ws_choice.chosen_configs() == {("k",): A}


def test_a_gluon_choice_is_what_the_benchmark_rows_name(monkeypatch):
    """tuning.describe_tuned_configs / tuned_configs report the Gluon kernel where ws_choice kept it."""
    key = ((4096, 4096), 512, torch.bfloat16, torch.bfloat16, "adamw", "bf16", False, False, False, "cuda:0")
    tile = TileConfig(64, 128, 64, 8, 8, 4, split_n=2)
    monkeypatch.setattr(tuning, "TUNED", {key: tile})
    monkeypatch.setattr(ws_choice, "CHOSEN", {key + ("graph",): A})
    monkeypatch.setattr(ws_choice, "FROM_DISK", set())
    assert tuning.describe_tuned_configs() == {"4096x4096/bt512/adamw/bf16": ws_choice.describe(A, False)}
    assert tuning.tuned_configs() == {key: A}
    monkeypatch.setattr(ws_choice, "CHOSEN", {key + ("graph",): None})          # the tile won
    assert tuning.describe_tuned_configs()["4096x4096/bt512/adamw/bf16"].startswith("64x128x64")


@pytest.mark.skipif(not interpreting(),
                    reason="the interpreter's guard; on a GPU the choice is tested in test_hopper_ws")
def test_no_gluon_timing_under_the_interpreter():
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    tile = TileConfig(64, 64, 32, 8, 4, 1)
    assert dispatch.ws_plan(("k",), "bf16", x, x, w, [w, w], [None, None], None, False, (0.0,) * 8, 0, {},
                            tile) is None


class _NoCopies(torch.Tensor):
    """A weight or state that fails the test when copied: a stored choice must need no scratch copies."""

    def clone(self, *args, **kwargs):
        raise AssertionError("scratch copy made for a choice that was already stored")

    def detach(self):
        return self


@pytest.mark.parametrize("where", ["process", "tune cache", "shipped"])
def test_a_stored_choice_is_looked_up_before_any_scratch_copy(fresh, monkeypatch, where):
    """A first step whose Gluon-or-Triton choices are all stored (in the process, FORGE_TUNE_CACHE or the
    file shipped for the GPU) copies no weight or moment: those copies (the LM head's the largest) raised a fresh
    process's Llama-3.1-8B peak by 2.3 GiB over its later steps."""
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(ws_choice, "candidates_for", lambda *args: [A])
    w = torch.zeros(256, 256, dtype=torch.bfloat16).as_subclass(_NoCopies)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    tile = TileConfig(64, 64, 32, 8, 4, 1)
    meta = {"NUM_SUMS": 0, "S0_SQRT": False, "S1_SQRT": False, "EPILOGUE": "adamw"}
    key = ((256, 256), 64, "bf16")
    identity = tuning.ws_identity("adamw", tile, dispatch.triton.__version__, tuning.device_name(w), False)
    time_ms, _ = _clock({"triton": 0.5, "a": 0.9})          # an earlier process: the Triton tile won
    _stored_or_measured(key + ("eager",), [A], lambda: "triton", lambda config: "a", time_ms, identity, {})
    if where != "process":
        monkeypatch.setattr(ws_choice, "CHOSEN", {})          # a new process
    if where == "shipped":
        monkeypatch.delenv("FORGE_TUNE_CACHE")
        monkeypatch.setattr(tune_cache, "shipped_path", lambda device: fresh)
    # the Triton tile was the stored choice: no Gluon plan, and no copy of w on the way
    assert dispatch.ws_plan(key, "bf16", x, x, w, [w, w], [None, None], None, False, (0.0,) * 8, 0, meta,
                            tile) is None
    assert ws_choice.CHOSEN[key + ("eager",)] is None


@pytest.mark.parametrize("eager_choice", [A, None])
def test_no_timing_inside_a_capture_the_eager_choice_stands_in(fresh, monkeypatch, eager_choice):
    """An eager update recorded as a graph of itself (forge_core.update_graphs) reads its scalars from the device,
    a choice mode the weight's earlier launched update did not time. Timing there synchronized inside the
    capture: every candidate failed, the recording was lost and the weight never replayed. Now the eager choice
    (or the Triton tile) is used, nothing is timed or copied, and the graph mode's choice stays open."""
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: True)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(ws_choice, "candidates_for", lambda *args: [A, B])

    def no_timing(*args, **kwargs):
        raise AssertionError("timed inside a capture")
    monkeypatch.setattr(ws_choice, "measure", no_timing)
    w = torch.zeros(256, 256, dtype=torch.bfloat16).as_subclass(_NoCopies)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    meta = {"NUM_SUMS": 0, "S0_SQRT": False, "S1_SQRT": False, "EPILOGUE": "adamw"}
    key = ((256, 256), 64, "bf16")
    ws_choice.CHOSEN[key + ("eager",)] = eager_choice
    device_scalars = torch.zeros(8)
    plan = dispatch.ws_plan(key, "bf16", x, x, w, [w, w], [None, None], None, False, device_scalars, 0, meta,
                            TileConfig(64, 64, 32, 8, 4, 1))
    assert (plan.config if plan is not None else None) == eager_choice
    assert key + ("graph",) not in ws_choice.CHOSEN
