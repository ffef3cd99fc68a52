"""Eager fused updates replayed from recorded CUDA graphs (``forge_core.update_graphs``): recorded once a
weight's inputs repeat their placement, replayed after, the same weights and states bit for bit as
launched updates, under an lr schedule. On the CPU a recorder that re-runs the recorded update stands in
for the graph (the tests call the bindings with the same input tensors every step, which is what a
graph's fixed addresses hold); the GPU tests record real graphs in real backward passes."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import forge_core
from forge_core import replayed_updates, traced_updates, update_graphs
from forge_core.kernels import launch_path_counts, launch_paths, reset_launch_paths
from forge_core.update_graphs import UpdateGraphs, replay_problem

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs exist on CUDA only")


class Rerun:
    """A recording that runs the recorded update again at each replay, as a capture would have seen it
    (``graph_capturing()`` true: the optimizer writes no device scalar there, so a replay reads what the
    host wrote before it): the CPU's stand-in for a graph."""

    def __init__(self, update) -> None:
        self.update = update
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with mock.patch.object(replayed_updates, "graph_capturing", lambda: True), \
                mock.patch.object(traced_updates, "graph_capturing", lambda: True):
            self.update()


def rerun_recorder(update, device):
    return Rerun(update)


def _counts() -> dict[str, int]:
    return {"direct": 0, "jit": 0, "graph": 0, "recorded": 0}


def _key(address: int) -> tuple:
    """A key of inputs at ``address`` (none staged): what ``UpdateGraphs.record_and_replay`` reads of it."""
    return (address, address, None)


X, DY = torch.zeros(3), torch.zeros(3)
"""The inputs these keys stand for (unread: nothing is staged)."""


def test_a_placement_seen_twice_is_recorded_and_replayed_after() -> None:
    runs: list[int] = []
    graphs = UpdateGraphs(_counts(), rerun_recorder)
    assert not graphs.replay(_key(1), X, DY) and not graphs.wants_recording(_key(1))      # first sight: launched
    assert graphs.wants_recording(_key(1))                                          # seen before: record
    assert graphs.record_and_replay(_key(1), lambda x, dy: runs.append(1), X, DY)
    assert runs == [1] and graphs.counts["graph"] == graphs.counts["recorded"] == 1
    assert graphs.replay(_key(1), X, DY) and runs == [1, 1] and graphs.counts["graph"] == 2
    assert graphs.counts["recorded"] == 1
    assert not graphs.replay(_key(2), X, DY) and not graphs.wants_recording(_key(2))      # a new placement: launched


def test_at_most_two_placements_are_kept_per_weight() -> None:
    graphs = UpdateGraphs(_counts(), rerun_recorder)
    for address in (1, 2, 3):
        graphs.wants_recording(_key(address))
        assert graphs.wants_recording(_key(address))
        graphs.record_and_replay(_key(address), lambda x, dy: None, X, DY)
    assert list(graphs.graphs) == [_key(2), _key(3)]
    assert len(graphs.graphs) == update_graphs.GRAPHS_PER_WEIGHT


def test_placements_that_alternate_are_both_recorded_and_replayed() -> None:
    """Inputs that go back and forth between two places (a loop that keeps each step's loss moves a small
    gradient's block so) are recorded at their second sight, not only when they repeat back to back."""
    graphs = UpdateGraphs(_counts(), rerun_recorder)
    launched = 0
    for address in (1, 2) * 4:
        if graphs.replay(_key(address), X, DY):
            continue
        if graphs.wants_recording(_key(address)):
            assert graphs.record_and_replay(_key(address), lambda x, dy: None, X, DY)
        else:
            launched += 1
    assert launched == 2 and list(graphs.graphs) == [_key(1), _key(2)] and graphs.counts["graph"] == 6


def test_recording_stops_when_placements_never_settle() -> None:
    """Each placement repeats once and then moves: after RECORDINGS_WITHOUT_REPLAY recordings without a
    replay the weight records no more (each recording costs more host time than a launch)."""
    graphs = UpdateGraphs(_counts(), rerun_recorder)
    recorded = 0
    for address in range(3 * update_graphs.RECORDINGS_WITHOUT_REPLAY):
        graphs.wants_recording(_key(address))
        if graphs.wants_recording(_key(address)):
            recorded += graphs.record_and_replay(_key(address), lambda x, dy: None, X, DY)
    assert recorded == update_graphs.RECORDINGS_WITHOUT_REPLAY + 1 and graphs.stopped
    graphs.clear()
    assert not graphs.stopped and not graphs.graphs


def test_an_update_that_cannot_be_recorded_stays_launched() -> None:
    graphs = UpdateGraphs(_counts(), lambda update, device: None)
    graphs.wants_recording(_key(1))
    assert graphs.wants_recording(_key(1))
    assert not graphs.record_and_replay(_key(1), lambda x, dy: None, X, DY)
    assert graphs.stopped and not graphs.wants_recording(_key(1)) and graphs.counts["graph"] == 0


def test_replay_problem_names_why_in_one_line() -> None:
    cuda = {torch.device("cuda", 0)}
    assert replay_problem(True, "triton", None, cuda) is None
    assert replay_problem(False, "triton", None, cuda) == "FORGE_UPDATE_GRAPHS=0"
    assert replay_problem(True, "reference", None, cuda) == "backend 'reference' launches no kernel to record"
    assert replay_problem(True, "triton", "stochastic_rounding is not supported", cuda) == \
        "stochastic_rounding is not supported"
    assert replay_problem(True, "triton", None, {torch.device("cpu")}) == \
        "CUDA graphs need the fused weights on a CUDA device"


def _mlp(dtype: torch.dtype, seed: int = 0, width: int = 48, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).to(DEVICE, dtype)


def _fuse(model: nn.Module, **kwargs) -> forge_core.ForgeOptimizer:
    dtype = next(model.parameters()).dtype
    probe = torch.zeros(2, model[0].in_features, device=DEVICE, dtype=dtype)
    return forge_core.fuse(model, "adamw", backend="triton", probe_inputs=probe, **HP, **kwargs)


def test_optimizers_say_why_their_updates_are_not_replayed() -> None:
    if DEVICE == "cpu":
        assert _fuse(_mlp(torch.bfloat16)).update_replay_problem == "CUDA graphs need the fused weights on a CUDA device"
    assert "accumulate_steps" in _fuse(_mlp(torch.bfloat16), accumulate_steps=2).update_replay_problem
    assert "stochastic_rounding" in _fuse(_mlp(torch.bfloat16), stochastic_rounding=True).update_replay_problem
    assert all(b.update_graphs is None for b in _fuse(_mlp(torch.bfloat16), accumulate_steps=2).fused_weights())


def _attach_rerun_recordings(opt: forge_core.ForgeOptimizer) -> None:
    for binding in opt.fused_weights():
        binding.update_graphs = UpdateGraphs(launch_path_counts(), rerun_recorder)


def _replayed_and_launched() -> tuple[nn.Module, forge_core.ForgeOptimizer, nn.Module, forge_core.ForgeOptimizer]:
    """Two equal bf16 MLPs fused: the first's updates recorded and replayed (on the CPU by ``Rerun``), the
    second's all launched."""
    replayed_model, launched_model = _mlp(torch.bfloat16), _mlp(torch.bfloat16)
    replayed, launched = _fuse(replayed_model), _fuse(launched_model)
    if DEVICE == "cpu":
        _attach_rerun_recordings(replayed)
    for binding in launched.fused_weights():
        binding.update_graphs = None
    return replayed_model, replayed, launched_model, launched


def test_replayed_updates_equal_launched_ones_under_an_lr_schedule() -> None:
    """Each weight's update is launched at step 1, recorded at step 2 (its inputs lie where they lay), and
    replayed at steps 3-5, with a cosine schedule moving lr every step: the same weights and moments bit
    for bit as an optimizer that launches every update, and the step counts advance alike."""
    replayed_model, replayed, launched_model, launched = _replayed_and_launched()
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5) for opt in (replayed, launched)]
    generator = torch.Generator().manual_seed(7)
    inputs = [(torch.empty(3, 5, b.matrix.shape[1], dtype=torch.bfloat16, device=DEVICE),
               torch.empty(3, 5, b.matrix.shape[0], dtype=torch.bfloat16, device=DEVICE)) for b in replayed.fused_weights()]
    reset_launch_paths()
    for _ in range(5):
        for x, dy in inputs:        # new values where the last step's lay: what a graph replays
            x.copy_(torch.randn(x.shape, generator=generator))
            dy.copy_(torch.randn(dy.shape, generator=generator))
        with torch.no_grad():
            for opt in (replayed, launched):
                for binding, (x, dy) in zip(opt.fused_weights(), inputs):
                    binding(x, dy)
        for opt, schedule in zip((replayed, launched), schedules):
            opt.step()
            schedule.step()
    assert launch_paths()["graph"] == 4 * len(inputs)           # steps 2-5 of each weight
    for a, b in zip(replayed.fused_weights(), launched.fused_weights()):
        assert torch.equal(a.matrix, b.matrix), a.name
        assert a.steps_done == b.steps_done == 5
        for name in a.state.state_names:
            assert torch.equal(a.state.values[name], b.state.values[name]), (a.name, name)


def test_small_inputs_are_keyed_by_layout_and_large_ones_by_address(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.zeros(8, 4, dtype=torch.bfloat16, device=DEVICE)
    x, dy = (torch.zeros(5, n, dtype=torch.bfloat16, device=DEVICE) for n in (4, 8))
    moved_x, moved_dy = torch.zeros_like(x), torch.zeros_like(dy)
    assert UpdateGraphs.key(x, dy, weight) == UpdateGraphs.key(moved_x, moved_dy, weight)
    assert UpdateGraphs.key(x, dy, weight) != UpdateGraphs.key(x.t().contiguous().t(), dy, weight)   # its layout
    assert UpdateGraphs.key(x, dy, weight) != UpdateGraphs.key(x, dy, weight.clone())              # the weight's place
    monkeypatch.setattr(update_graphs, "STAGED_BYTES", x.numel() * x.element_size())
    assert UpdateGraphs.key(x, dy, weight) == UpdateGraphs.key(moved_x, dy, weight)                 # x staged, dy not
    assert UpdateGraphs.key(x, dy, weight) != UpdateGraphs.key(x, moved_dy, weight)


def test_the_staging_limit_is_a_byte_count_or_a_one_line_error() -> None:
    assert update_graphs.staged_bytes(None) == update_graphs.staged_bytes("") == 1 << 20
    assert update_graphs.staged_bytes("0") == 0 and update_graphs.staged_bytes("4096") == 4096
    for bad in ("1MiB", "-1", "1e6"):
        with pytest.raises(ValueError, match=f"FORGE_STAGED_BYTES='{bad}' is not a byte count"):
            update_graphs.staged_bytes(bad)


def test_replays_of_inputs_that_move_every_step_read_them_through_staging() -> None:
    """New input tensors at every step (a loop whose small allocations drift): recorded at step 2 all the
    same, replayed at steps 3-5 from the staging buffers, the same weights and moments bit for bit as an
    optimizer that launches every update."""
    replayed_model, replayed, launched_model, launched = _replayed_and_launched()
    generator = torch.Generator().manual_seed(9)
    reset_launch_paths()
    for _ in range(5):
        inputs = [(torch.randn(3, 5, b.matrix.shape[1], generator=generator).to(DEVICE, torch.bfloat16),
                   torch.randn(3, 5, b.matrix.shape[0], generator=generator).to(DEVICE, torch.bfloat16))
                  for b in replayed.fused_weights()]
        assert all(update_graphs.staged(x) and update_graphs.staged(dy) for x, dy in inputs)
        with torch.no_grad():
            for opt in (replayed, launched):
                for binding, (x, dy) in zip(opt.fused_weights(), inputs):
                    binding(x, dy)
        for opt in (replayed, launched):
            opt.step()
    assert launch_paths()["graph"] == 4 * len(inputs)
    for a, b in zip(replayed.fused_weights(), launched.fused_weights()):
        assert torch.equal(a.matrix, b.matrix), a.name
        for name in a.state.state_names:
            assert torch.equal(a.state.values[name], b.state.values[name]), (a.name, name)


def test_fp32_inputs_stay_launched_their_plan_following_the_tf32_switch() -> None:
    model = _mlp(torch.float32)
    opt = _fuse(model)
    _attach_rerun_recordings(opt)
    binding = opt.fused_weights()[0]
    x = torch.randn(4, binding.matrix.shape[1], device=DEVICE)
    dy = torch.randn(4, binding.matrix.shape[0], device=DEVICE)
    reset_launch_paths()
    with torch.no_grad():
        for _ in range(3):
            binding(x, dy)
            opt.step()
    assert launch_paths()["graph"] == 0 and not binding.update_graphs.graphs


def _static_batches(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(count)]


@needs_cuda
@pytest.mark.gpu
def test_eager_steps_replay_recorded_graphs_bit_for_bit() -> None:
    """A bf16 MLP trained eagerly (the hooked Linear's backward hook calls the update) with and without
    recorded graphs under a cosine schedule: every weight and moment equal after each step, and the
    updates of steps 3 on are replays (one static batch buffer: its address repeats, as a steady loop's
    allocations do)."""
    replayed_model, launched_model = _mlp(torch.bfloat16, width=256, depth=4), _mlp(torch.bfloat16, width=256, depth=4)
    replayed, launched = _fuse(replayed_model), _fuse(launched_model)
    assert replayed.update_replay_problem is None
    for binding in launched.fused_weights():
        binding.update_graphs = None
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8) for opt in (replayed, launched)]
    static = torch.empty(2, 24, 256, device=DEVICE, dtype=torch.bfloat16)
    reset_launch_paths()
    for batch in _static_batches(8, (2, 24, 256), torch.bfloat16):
        static.copy_(batch)
        for model, opt, schedule in zip((replayed_model, launched_model), (replayed, launched), schedules):
            (model(static).float() - static.float()).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
        for (name, a), b in zip(replayed_model.named_parameters(), launched_model.parameters()):
            assert torch.equal(a, b), name
    assert launch_paths()["graph"] >= 5 * len(replayed.fused_weights())
    for a, b in zip(replayed.fused_weights(), launched.fused_weights()):
        for name in a.state.state_names:
            assert torch.equal(a.state.values[name], b.state.values[name]), (a.name, name)


@needs_cuda
@pytest.mark.gpu
def test_a_gpt2_conv1d_model_replays_its_updates_bit_for_bit() -> None:
    """GPT-2's Conv1D (transposed weights: the update takes (dY, x)) through transformers' own forward."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=2, vocab_size=256, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(transformers.GPT2LMHeadModel(config).to(DEVICE, torch.bfloat16).train())
    replayed, launched = (forge_core.fuse(m, "adamw", backend="triton", **HP) for m in models)
    for binding in launched.fused_weights():
        binding.update_graphs = None
    ids = torch.empty(2, 48, dtype=torch.long, device=DEVICE)
    generator = torch.Generator().manual_seed(3)
    reset_launch_paths()
    for _ in range(6):
        ids.copy_(torch.randint(0, 256, (2, 48), generator=generator))
        for model, opt in zip(models, (replayed, launched)):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert launch_paths()["graph"] > 0
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name


def test_a_rule_that_steps_whole_layers_says_so() -> None:
    model = _mlp(torch.bfloat16)
    probe = torch.zeros(2, model[0].in_features, device=DEVICE, dtype=torch.bfloat16)
    opt = forge_core.fuse(model, "muon", backend="triton", probe_inputs=probe, lr=1e-3)
    assert opt.update_replay_problem == "the rule steps whole layers (forge_core.layer_step)"
    assert all(b.update_graphs is None for b in opt.fused_weights())


def _fixed_inputs(opt: forge_core.ForgeOptimizer, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(3, 5, b.matrix.shape[1], generator=generator).to(DEVICE, torch.bfloat16),
             torch.randn(3, 5, b.matrix.shape[0], generator=generator).to(DEVICE, torch.bfloat16))
            for b in opt.fused_weights()]


def _update_all(opt: forge_core.ForgeOptimizer, inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for binding, (x, dy) in zip(opt.fused_weights(), inputs):
            binding(x, dy)
    opt.step()


def test_a_loaded_state_drops_the_recordings_and_trains_on_alike() -> None:
    """``load_state_dict`` forgets every recorded update; the next updates (launched, then recorded again)
    equal those of an optimizer that never recorded, loaded from the same dict."""
    replayed_model, replayed, launched_model, launched = _replayed_and_launched()
    inputs = _fixed_inputs(replayed, torch.Generator().manual_seed(2))
    for _ in range(3):
        _update_all(replayed, inputs)
    assert all(b.update_graphs.graphs for b in replayed.fused_weights())
    saved = replayed.state_dict()
    launched_model.load_state_dict(replayed_model.state_dict())
    launched.load_state_dict(saved)
    replayed.load_state_dict(saved)
    assert not any(b.update_graphs.graphs for b in replayed.fused_weights())
    reset_launch_paths()
    for _ in range(4):
        _update_all(replayed, inputs)
        _update_all(launched, inputs)
    assert launch_paths()["graph"] == 3 * len(inputs)
    for a, b in zip(replayed.fused_weights(), launched.fused_weights()):
        assert torch.equal(a.matrix, b.matrix), a.name
        assert a.steps_done == b.steps_done == 7


class _TiedLM(nn.Module):
    """An embedding whose weight its head reads too: a dense weight ``step()`` updates from its ``.grad``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(40, 48)
        self.body = nn.Linear(48, 48)
        self.head = nn.Linear(48, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.body(self.embed(ids))))


def test_a_dense_weights_step_replays_its_recording_as_a_launched_step() -> None:
    """A tied embedding's step from its ``.grad`` is recorded once the gradient lies where it lay and replayed
    after (a gradient buffer kept by ``zero_grad(set_to_none=False)``), under a cosine schedule: its weight and
    moments equal an optimizer's that launches every step, bit for bit."""
    models = [_TiedLM().to(DEVICE, torch.bfloat16) for _ in range(2)]
    opts = [forge_core.fuse(m, "adamw", backend="triton", probe_inputs=torch.zeros(1, 4, dtype=torch.long,
                                                                                     device=DEVICE), **HP)
            for m in models]
    dense = [opt.dense_weights()[0] for opt in opts]
    assert dense[0].weight is models[0].embed.weight
    assert (dense[0].update_graphs is None) == (DEVICE == "cpu")        # CUDA graphs: CUDA weights only
    if DEVICE == "cpu":
        _attach_rerun_recordings(opts[0])
        dense[0].update_graphs = UpdateGraphs(launch_path_counts(), rerun_recorder)
    for opt in opts:
        for binding in opt.fused_weights():
            binding.update_graphs = None      # the fused updates launched in both: the dense step is compared
    dense[1].update_graphs = None
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6) for opt in opts]
    generator = torch.Generator().manual_seed(9)
    reset_launch_paths()
    for _ in range(6):
        ids = torch.randint(0, 40, (2, 7), generator=generator).to(DEVICE)
        for model, opt, schedule in zip(models, opts, schedules):
            model(ids).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            schedule.step()
    assert launch_paths()["graph"] == 5                     # steps 2-6: recorded at 2 (and replayed), then replayed
    assert torch.equal(models[0].embed.weight, models[1].embed.weight)
    for name in dense[0].state.state_names:
        assert torch.equal(dense[0].state.values[name], dense[1].state.values[name]), name
    assert dense[0].steps_done == dense[1].steps_done == 6


def test_weights_with_different_step_counts_keep_their_updates_launched() -> None:
    """Device mode keeps one step count per param group: where the group's weights were updated a different
    number of times, no update is recorded (each launched one uses its own count)."""
    opt = _fuse(_mlp(torch.bfloat16))
    if DEVICE == "cpu":
        _attach_rerun_recordings(opt)
    first, *others = opt.fused_weights()
    inputs = _fixed_inputs(opt, torch.Generator().manual_seed(4))
    with torch.no_grad():
        first(*inputs[0])           # only the first weight is updated at step 1
    opt.step()
    reset_launch_paths()
    for _ in range(3):
        _update_all(opt, inputs)
    assert launch_paths()["graph"] == 0
    assert all(b.update_graphs.stopped for b in opt.fused_weights())
    assert [b.steps_done for b in opt.fused_weights()] == [4] + [3] * len(others)


@needs_cuda
@pytest.mark.gpu
def test_tuned_gluon_updates_replay_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tuning on, Hopper's Gluon kernel takes the shapes it wins; its recorded updates, replayed (by the C++
    hook where it is built), equal the same updates launched, both optimizers in device mode from the first step
    (``capturable=True``: one kernel choice for both, the one timed in graphs), bit for bit."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper")
    from forge_core.kernels import dispatch

    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    models = [_mlp(torch.bfloat16, width=2048, depth=2) for _ in range(2)]
    replayed, launched = (_fuse(model, capturable=True, state_dtype="bf16") for model in models)
    assert replayed.update_replay_problem is None
    for binding in launched.fused_weights():
        binding.update_graphs = None
        binding.native_slot = None
    static = torch.empty(512, 2048, device=DEVICE, dtype=torch.bfloat16)
    reset_launch_paths()
    for batch in _static_batches(5, (512, 2048), torch.bfloat16):
        static.copy_(batch)
        for model, opt in zip(models, (replayed, launched)):
            (model(static).float() - static.float()).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    plans = [plan for b in replayed.fused_weights() for plan in dispatch.PLANS.get(b.state, {}).values()]
    if not any(isinstance(plan, dispatch.WsPlan) for plan in plans):
        pytest.skip("the tuner gave these shapes to the Triton kernel on this GPU")
    assert launch_paths()["graph"] >= 3 * len(replayed.fused_weights())
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(replayed.fused_weights(), launched.fused_weights()):
        for name in a.state.state_names:
            assert torch.equal(a.state.values[name], b.state.values[name]), (a.name, name)


@needs_cuda
@pytest.mark.gpu
def test_a_weight_tuned_as_it_trains_eagerly_keeps_its_recording(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """With tuning on and nothing stored, a weight's first (launched) update times the kernels with host scalars;
    its recording at the next step reads device scalars, a mode not yet timed. Timing inside that capture
    failed every Gluon candidate, lost the recording and left the weight launched from Python for good (the
    first weight of each such shape). Now every weight records and replays, with no failed candidate."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel runs on Hopper")
    import warnings
    from forge_core.kernels import tune_cache, ws_choice

    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    monkeypatch.setenv("FORGE_TUNE_CACHE", str(tmp_path / "tune_cache.json"))
    monkeypatch.setattr(tune_cache, "shipped_path", lambda device: None)
    monkeypatch.setattr(ws_choice, "CHOSEN", {})
    model = _mlp(torch.bfloat16, width=1536, depth=2)
    opt = _fuse(model, state_dtype="bf16")            # (fp32 states run on the Triton kernel alone)
    static = torch.empty(320, 1536, device=DEVICE, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _static_batches(6, (320, 1536), torch.bfloat16):
            static.copy_(batch)
            (model(static).float() - static.float()).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not [str(w.message) for w in caught if "did not run" in str(w.message)]
    assert any(key[0] == (1536, 1536) and key[-1] == "eager" for key in ws_choice.CHOSEN)
    for binding in opt.fused_weights():
        assert binding.update_graphs.graphs and not binding.update_graphs.stopped, binding.name
