"""Capturable mode (``fuse(..., capturable=True)``): the step count and the kernel scalars on the
device, so a whole training step can be replayed as a CUDA graph. Without a GPU the Triton
kernel runs in the interpreter and the device is the CPU: the arithmetic is the same code."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import forge_core
from forge_core.kernels import NUM_SCALARS, fused_wgrad_update
from forge_core.rules import RULES, get_rule
from forge_core.state import ParamState

# the rules stepped by the fused kernel's epilogue (the others take forge_core.layer_step)
KERNEL_RULES = sorted(name for name, rule in RULES.items() if rule.epilogue is not None)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPERPARAMETERS = {
    "adamw": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    "sgd": {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": True},
    "lion": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
    "rmsprop": {"lr": 1e-3, "alpha": 0.9, "weight_decay": 1e-2, "momentum": 0.9, "centered": True},
    "adamax": {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 1e-2},
    "nadam": {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 1e-2, "decoupled_weight_decay": True},
    "radam": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 1e-2},
}
CAPTURABLE_RULES = sorted(name for name in KERNEL_RULES if RULES[name].option_problem(capturable=True) is None)
# The torch optimizers whose capturable step rounds differently from their default one. Capturable, they
# form the bias corrections (and RAdam's rho_t, NAdam's mu / mu_product) as fp32 tensor ops on the step
# tensor (torch._foreach_pow(beta, steps), then sub / div / mul in place, and the parameter update as
# addcdiv(exp_avg, exp_inf * ((beta1^t - 1) / lr)) in Adamax); by default as Python floats, applied with
# one addcdiv by a double step size (the `if capturable:` branches of _multi_tensor_adamax, _radam and
# _nadam in torch/optim/). forge_core makes the fallback capturable on CUDA only
# (rules.base.capturable_flag), so on the CPU both runs take the default path, bit for bit.
ROUNDING_FALLBACKS = (torch.optim.Adamax, torch.optim.RAdam, torch.optim.NAdam)
FALLBACK_TOLERANCE = 1e-5
"""Largest difference over the largest magnitude of a fallback parameter after one step of each path:
the bound tests/test_families.py calls equal, some 80 fp32 ulps, where a wrong step would differ by
about lr (1e-3) relative."""


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(70, 90), nn.GELU(), nn.Linear(90, 33), nn.LayerNorm(33)).to(DEVICE)


def _batches(count: int, seed: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 25, 70, generator=generator).to(DEVICE) for _ in range(count)]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch) - batch[..., :33]).square().mean()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = _loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _fuse(model: nn.Module, **kwargs) -> forge_core.ForgeOptimizer:
    return forge_core.fuse(model, backend="triton", probe_inputs=torch.zeros(2, 70, device=DEVICE), **kwargs)


def _rounds_differently(opt: forge_core.ForgeOptimizer) -> bool:
    """Whether ``opt``'s torch fallback is one of ``ROUNDING_FALLBACKS`` in its capturable mode."""
    fallback = opt.fallback_optimizer
    return isinstance(fallback, ROUNDING_FALLBACKS) and bool(fallback.defaults.get("capturable", False))


def _match_fallback_parameters(plain_opt: forge_core.ForgeOptimizer, capt_opt: forge_core.ForgeOptimizer) -> None:
    """The capturable run's torch-stepped parameters within ``FALLBACK_TOLERANCE`` of the default run's,
    then set to them: the next forward, so every fused weight's G, is the same in both runs, and the
    fused kernels' steps can be compared bit for bit."""
    plain_groups, capt_groups = plain_opt.fallback_optimizer.param_groups, capt_opt.fallback_optimizer.param_groups
    with torch.no_grad():
        for plain_group, capt_group in zip(plain_groups, capt_groups, strict=True):
            for index, (ours, theirs) in enumerate(zip(capt_group["params"], plain_group["params"], strict=True)):
                difference = (ours - theirs).abs().max().item()
                assert difference <= FALLBACK_TOLERANCE * theirs.abs().max().item(), (index, difference)
                ours.copy_(theirs)


@pytest.mark.parametrize("rule_name", CAPTURABLE_RULES)
@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_device_scalars_equal_the_host_scalars_in_fp32(rule_name: str, step: int) -> None:
    rule = get_rule(rule_name)
    hp = rule.resolve_hp(HYPERPARAMETERS.get(rule_name, {}))
    host = torch.tensor(rule.kernel_scalars(hp, step), dtype=torch.float64).to(torch.float32)
    values = rule.kernel_scalars_on_device(hp, torch.tensor(float(step), dtype=torch.float64))
    device = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values]).to(torch.float32)
    assert torch.equal(device, host), (device, host)


class _HostReads(TorchDispatchMode):
    """Records every op that copies a device value to the host (``item()``, ``tolist()``, a tensor
    used as a Python index): inside a CUDA graph capture each one fails."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule_name", CAPTURABLE_RULES)
def test_device_scalars_never_read_the_step_on_the_host(rule_name: str) -> None:
    """What a captured step recomputes at every replay must stay on the device (NAdam's mu_product
    table was once indexed by the step tensor, an item() that broke its graph capture)."""
    rule = get_rule(rule_name)
    hp = rule.resolve_hp(HYPERPARAMETERS.get(rule_name, {}))
    rule.kernel_scalars_on_device(hp, torch.tensor(3.0, dtype=torch.float64))   # builds any table outside
    with _HostReads() as mode:
        rule.kernel_scalars_on_device(hp, torch.tensor(4.0, dtype=torch.float64))
    assert mode.reads == []


@pytest.mark.parametrize("rule_name", CAPTURABLE_RULES)
def test_capturable_training_is_bit_identical_to_the_default_path(rule_name: str) -> None:
    """Same kernels, same fp32 scalars (from the device buffer instead of launch arguments), an LR
    schedule moving lr every step: every weight and state equal, bit for bit. Where torch's capturable
    fallback rounds differently (``ROUNDING_FALLBACKS``, on CUDA), its parameters are compared within
    ``FALLBACK_TOLERANCE`` after each step and carried over, and the fused weights bit for bit."""
    plain, captured = _mlp(), _mlp()
    plain_opt = _fuse(plain, optimizer=rule_name, **HYPERPARAMETERS.get(rule_name, {}))
    capt_opt = _fuse(captured, optimizer=rule_name, capturable=True, **HYPERPARAMETERS.get(rule_name, {}))
    assert capt_opt.capturable and not plain_opt.capturable
    match_fallback = _rounds_differently(capt_opt)
    assert match_fallback == (DEVICE == "cuda" and isinstance(capt_opt.fallback_optimizer, ROUNDING_FALLBACKS))
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (plain_opt, capt_opt)]
    for batch in _batches(4):
        for model, opt, schedule in ((plain, plain_opt, schedules[0]), (captured, capt_opt, schedules[1])):
            _train_step(model, opt, batch)
            schedule.step()
        if match_fallback:
            _match_fallback_parameters(plain_opt, capt_opt)
    for (name, a), b in zip(plain.named_parameters(), captured.parameters()):
        assert torch.equal(a, b), name
    assert capt_opt.steps_taken == 4
    for left, right in zip(plain_opt._bindings, capt_opt._bindings):
        for key in left.state.values:
            assert torch.equal(left.state.values[key], right.state.values[key]), key


def test_capturable_state_dict_carries_the_device_step_count_and_resumes_exactly() -> None:
    batches = _batches(5)
    straight = _mlp()
    straight_opt = _fuse(straight, capturable=True, **HYPERPARAMETERS["adamw"])
    for batch in batches:
        _train_step(straight, straight_opt, batch)

    first = _mlp()
    first_opt = _fuse(first, capturable=True, **HYPERPARAMETERS["adamw"])
    for batch in batches[:2]:
        _train_step(first, first_opt, batch)
    first_opt._bindings[0].steps_done = 0        # host counters lag behind replays: the device count wins
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    assert all(float(entry["step"]) == 2.0 for entry in checkpoint["optimizer"]["state"].values())

    resumed = _mlp(seed=3)
    resumed_opt = _fuse(resumed, capturable=True, **HYPERPARAMETERS["adamw"])
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert float(resumed_opt._device_steps[0]) == 2.0
    for batch in batches[2:]:
        _train_step(resumed, resumed_opt, batch)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_capturable_refuses_what_a_replay_cannot_do() -> None:
    with pytest.raises(ValueError, match="needs the Triton backend"):
        forge_core.fuse(_mlp(), backend="reference", capturable=True, probe_inputs=False)
    with pytest.raises(ValueError, match="accumulate_steps"):
        _fuse(_mlp(), capturable=True, accumulate_steps=2)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        _fuse(_mlp(), capturable=True, stochastic_rounding=True)


def test_device_scalars_argument_is_checked() -> None:
    weight = torch.randn(64, 64, device=DEVICE)
    state = ParamState(weight, get_rule("adamw"), "fp32")
    x, dy = torch.randn(16, 64, device=DEVICE), torch.randn(16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="float32 tensor of at least 8"):
        fused_wgrad_update(x, dy, weight, state, {}, 1, device_scalars=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        fused_wgrad_update(x, dy, weight, state, {}, 1,
                           device_scalars=torch.zeros(NUM_SCALARS, dtype=torch.float64, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("rule_name", CAPTURABLE_RULES)
def test_a_captured_training_step_replays_like_eager_steps(rule_name: str) -> None:
    """forward + backward (fused updates) + opt.step() captured once, replayed 4 times, equals 4
    eager capturable steps bit for bit (step count and bias corrections advance on the device)."""
    eager, graphed = _mlp(), _mlp()
    eager_opt = _fuse(eager, optimizer=rule_name, capturable=True, **HYPERPARAMETERS.get(rule_name, {}))
    graph_opt = _fuse(graphed, optimizer=rule_name, capturable=True, **HYPERPARAMETERS.get(rule_name, {}))
    # The eager steps compute their scalars by the device ops a captured step replays, not on the host: CUDA's
    # float64 pow can differ from the host's in the last bit, and NAdam's fp32 scalars then in one ulp.
    eager_opt._device_steps_on_host = [None] * len(eager_opt._device_steps_on_host)
    batches = _batches(7)
    for batch in batches[:3]:                    # warm-up: tuning, compilation, fallback state
        _train_step(eager, eager_opt, batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in batches[:3]:
            _train_step(graphed, graph_opt, batch)
    torch.cuda.current_stream().wait_stream(side)
    static_batch = batches[3].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _train_step(graphed, graph_opt, static_batch)
    graph_losses = []
    for batch in batches[3:]:
        static_batch.copy_(batch)
        graph.replay()
        graph_losses.append(static_loss.clone())
    eager_losses = [_train_step(eager, eager_opt, batch) for batch in batches[3:]]
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(graph_losses), torch.stack(eager_losses))
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(a, b), name
    assert graph_opt.steps_taken == 7


def test_a_rule_with_too_many_device_scalars_is_a_clear_error() -> None:
    import dataclasses

    model = _mlp()
    opt = _fuse(model, capturable=True, **HYPERPARAMETERS["adamw"])
    too_many = (0.0,) * (NUM_SCALARS + 1)
    opt.rule = dataclasses.replace(opt.rule, kernel_scalars_on_device=lambda hp, step: too_many,
                                   kernel_scalars=lambda hp, step: too_many)
    with pytest.raises(ValueError, match=r"rule 'adamw' returned 9 kernel scalars; at most 8"):
        _loss(model, _batches(1)[0]).backward()
    opt._device_steps_on_host[0] = None          # the device ops' values (after a captured step) are checked too
    with pytest.raises(ValueError, match=r"rule 'adamw' returned 9 kernel scalars; at most 8"):
        opt._write_device_scalars(0)


class _Writes(TorchDispatchMode):
    """Records the ATen ops run inside it on a view of ``target`` (besides the views themselves)."""

    VIEWS = ("aten.slice", "aten.select", "aten.alias", "aten.detach", "aten.view")

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.storage = target.untyped_storage().data_ptr()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        name = str(func.overloadpacket)
        if first is not None and first.untyped_storage().data_ptr() == self.storage and name not in self.VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule_name", CAPTURABLE_RULES)
def test_device_scalars_known_on_the_host_are_written_with_one_copy(rule_name: str) -> None:
    """Where the host knows the device step count, ``step()`` writes the next step's scalars with one copy of
    the host's values, equal to what the device ops compute (the path a captured step takes)."""
    model = _mlp()
    opt = _fuse(model, optimizer=rule_name, capturable=True, **HYPERPARAMETERS.get(rule_name, {}))
    for batch in _batches(3):
        _train_step(model, opt, batch)
    assert opt._device_steps_on_host == [3]
    with _Writes(opt._device_scalars[0]) as mode:
        opt._write_device_scalars(0)
    assert mode.ops == ["aten.copy_"]
    from_host = opt._device_scalars[0].clone()
    opt._device_steps_on_host[0] = None
    with _Writes(opt._device_scalars[0]) as mode:
        opt._write_device_scalars(0)
    assert len(mode.ops) > 1                # a fill or a copy per scalar
    # equal on the CPU; CUDA's float64 pow may differ from the host's in the last bit (one fp32 ulp at most)
    tolerance = 0.0 if DEVICE == "cpu" else 2.0 ** -23
    torch.testing.assert_close(opt._device_scalars[0], from_host, rtol=tolerance, atol=0.0)
    assert float(opt._device_steps[0]) == 3.0


def test_a_step_inside_a_capture_hands_the_scalars_to_the_device_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step captured into a CUDA graph advances the device count at every replay, unseen by the host: from
    that step on the scalars are computed from the device count, until a load or a read of the counts."""
    import forge_core.traced_updates as traced_updates

    model = _mlp()
    opt = _fuse(model, capturable=True, **HYPERPARAMETERS["adamw"])
    _train_step(model, opt, _batches(1)[0])
    assert opt._device_steps_on_host == [1]
    _loss(model, _batches(1)[0]).backward()
    monkeypatch.setattr(traced_updates, "graph_capturing", lambda: True)
    opt.step()
    monkeypatch.undo()
    opt.zero_grad()
    assert opt._device_steps_on_host == [None]
    opt._device_steps[0].fill_(5.0)                 # as five replays of the captured step would leave it
    opt._write_device_scalars(0)
    expected = get_rule("adamw").kernel_scalars(opt._kernel_hyperparameters(0), 6)
    assert torch.equal(opt._device_scalars[0][:len(expected)].cpu(), torch.tensor(expected, dtype=torch.float32))
    assert opt.steps_taken == 5 and opt._device_steps_on_host == [5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device")
def test_scalar_writes_queued_behind_a_busy_stream_each_land() -> None:
    """Host-computed scalars written while the stream is busy (their copies queued behind ~tens of milliseconds of
    GPU work): each target receives its own values (no pinned source is reused before its copy has run)."""
    from forge_core.traced_updates import write_scalars

    targets = [torch.zeros(NUM_SCALARS, device="cuda") for _ in range(12)]
    torch.cuda._sleep(50_000_000)
    for index, target in enumerate(targets):
        write_scalars(target, "adamw", tuple(float(index + i) for i in range(7)))
    torch.cuda.synchronize()
    for index, target in enumerate(targets):
        assert target[:7].tolist() == [float(index + i) for i in range(7)], index
