"""ForgeOptimizer as a torch optimizer: step equality, param_groups, schedulers, state_dict,
resume, micro-batch accumulation, memory breakdown."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import forge_core
from forge_core.rules import get_rule

BACKENDS = ["reference", "triton"]


def _device(backend: str) -> str:
    """The Triton kernel runs on CUDA when there is one, else in the interpreter on CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _mlp(seed: int = 0, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(70, 90), nn.GELU(), nn.Linear(90, 33), nn.LayerNorm(33)).to(device)


def _batches(count: int, seed: int = 123, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 25, 70, generator=generator).to(device) for _ in range(count)]  # BT = 100


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    # Regress onto part of the input: O(1) gradients (a loss that the LayerNorm makes nearly
    # constant would leave gradients at Adam's eps, where any rounding flips an update's sign).
    return (model(batch) - batch[..., :33]).square().mean()


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()


def _fuse(model: nn.Module, **kwargs) -> forge_core.ForgeOptimizer:
    kwargs.setdefault("backend", "reference")
    device = next(model.parameters()).device
    return forge_core.fuse(model, probe_inputs=torch.zeros(2, 70, device=device), **kwargs)


def _assert_same_parameters(a: nn.Module, b: nn.Module, rtol: float, atol: float) -> None:
    for (name, left), right in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(left, right, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_is_a_torch_optimizer_with_all_trainable_parameters() -> None:
    model = _mlp()
    opt = _fuse(model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    grouped = [p for group in opt.param_groups for p in group["params"]]
    assert [id(p) for p in grouped] == [id(p) for p in model.parameters()]
    assert {id(p) for p in opt.fused_parameters()} == {id(model[0].weight), id(model[2].weight)}
    assert len(opt.fallback_parameters()) == 4
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer, hyperparameters, torch_optimizer", [
    ("adamw", {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}, torch.optim.AdamW),
    ("sgd", {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": True}, torch.optim.SGD),
    ("sgd", {"lr": 5e-2, "momentum": 0.8, "dampening": 0.1}, torch.optim.SGD),
])
def test_fused_steps_equal_torch_optimizer(backend: str, optimizer: str, hyperparameters: dict,
                                           torch_optimizer: type) -> None:
    device = _device(backend)
    model = _mlp(device=device)
    reference_model = copy.deepcopy(model)
    opt = _fuse(model, optimizer=optimizer, backend=backend, **hyperparameters)
    assert opt.backend == backend
    reference_opt = torch_optimizer(reference_model.parameters(), **hyperparameters)
    batches = _batches(3 if backend == "triton" else 5, device=device)
    _train(model, opt, batches)
    _train(reference_model, reference_opt, batches)
    _assert_same_parameters(model, reference_model, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lion_fused_equals_its_fallback_optimizer(backend: str) -> None:
    device = _device(backend)
    model = _mlp(device=device)
    reference_model = copy.deepcopy(model)
    hyperparameters = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    opt = _fuse(model, optimizer="lion", backend=backend, **hyperparameters)
    reference_opt = get_rule("lion").fallback_optimizer(reference_model.parameters(), **hyperparameters)
    batches = _batches(3, device=device)
    _train(model, opt, batches)
    _train(reference_model, reference_opt, batches)
    _assert_same_parameters(model, reference_model, rtol=1e-6, atol=1e-6)


def test_lr_change_reaches_the_fused_update() -> None:
    model = _mlp()
    opt = _fuse(model, lr=1e-2, weight_decay=0.1)
    for group in opt.param_groups:
        group["lr"] = 0.0
    frozen = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, _batches(1))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), frozen))
    opt.param_groups[0]["lr"] = 1e-2
    _train(model, opt, _batches(1))
    assert not torch.equal(model[0].weight, frozen[0]) and not torch.equal(model[0].bias, frozen[1])


def test_hyperparameters_are_read_once_per_backward_and_afresh_in_the_next(monkeypatch) -> None:
    """Every fused layer of one backward pass used to rebuild the group's hyper-parameters (host time
    on an eager 8B step); they are read once per pass now, and a change between passes is seen."""
    model = _mlp()
    opt = _fuse(model, lr=1e-2, weight_decay=0.1)
    seen: list[float] = []
    real = opt._update_function
    monkeypatch.setattr(opt, "_update_function", lambda *a, **k: (seen.append(a[4]["lr"]), real(*a, **k))[1])
    reads = []
    group = opt.param_groups[0]

    class CountingGroup(dict):
        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

    opt.param_groups[0] = CountingGroup(group)
    _train(model, opt, _batches(1))
    assert seen == [1e-2, 1e-2], "both fused layers update in one pass"
    assert reads.count("lr") == 1, f"one read of each hyper-parameter per pass, got {reads}"
    opt.param_groups[0]["lr"] = 5e-3
    _train(model, opt, _batches(1))
    assert seen[2:] == [5e-3, 5e-3], "the next pass reads the changed lr"


def test_lr_scheduler_drives_fused_and_fallback_parameters() -> None:
    model = _mlp()
    reference_model = copy.deepcopy(model)
    opt = _fuse(model, lr=1e-2, weight_decay=0.05)
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, weight_decay=0.05)
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=6) for o in (opt, reference_opt)]
    used_lrs = []
    for batch in _batches(6):
        for m, o, s in ((model, opt, schedules[0]), (reference_model, reference_opt, schedules[1])):
            _loss(m, batch).backward()
            o.step()
            o.zero_grad()
            s.step()
        used_lrs.append(opt.fallback_optimizer.param_groups[0]["lr"])  # synced from ours at step()
    assert opt.param_groups[0]["lr"] == reference_opt.param_groups[0]["lr"]
    assert len(set(used_lrs)) == 6  # the schedule really moved the fallback's lr every step
    _assert_same_parameters(model, reference_model, rtol=1e-6, atol=1e-6)


def test_step_count_drives_bias_correction_per_weight() -> None:
    model = _mlp()
    opt = _fuse(model)
    _train(model, opt, _batches(3))
    state = opt.state_dict()
    fused_indices = state["forge"]["fused"]
    assert [float(state["state"][i]["step"]) for i in fused_indices] == [3.0, 3.0]
    assert state["forge"]["steps_taken"] == 3


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_state_dict_round_trip_is_exact(state_dtype: str) -> None:
    model = _mlp()
    opt = _fuse(model, state_dtype=state_dtype, lr=1e-2)
    _train(model, opt, _batches(2))
    saved = copy.deepcopy(opt.state_dict())
    if state_dtype == "int8":
        first = saved["state"][saved["forge"]["fused"][0]]
        assert first["exp_avg"].dtype == torch.int8 and first["exp_avg_sq_scale"].shape == (90, 2)
    other = _mlp(seed=5)
    other_opt = _fuse(other, state_dtype=state_dtype, lr=0.5)
    other_opt.load_state_dict(saved)
    again = other_opt.state_dict()
    assert again["forge"] == saved["forge"] and again["param_groups"] == saved["param_groups"]
    assert set(again["state"]) == set(saved["state"])
    for index, entry in saved["state"].items():
        assert set(again["state"][index]) == set(entry)
        for key, value in entry.items():
            assert torch.equal(again["state"][index][key], value), (index, key)
    assert other_opt.fallback_optimizer.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_resume_from_checkpoint_is_bit_identical(state_dtype: str) -> None:
    batches = _batches(6)
    straight = _mlp()
    resumed_source = copy.deepcopy(straight)
    straight_opt = _fuse(straight, state_dtype=state_dtype, lr=1e-2, weight_decay=0.1)
    _train(straight, straight_opt, batches)

    first_opt = _fuse(resumed_source, state_dtype=state_dtype, lr=1e-2, weight_decay=0.1)
    _train(resumed_source, first_opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": resumed_source.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed = _mlp(seed=99)
    resumed_opt = _fuse(resumed, state_dtype=state_dtype, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, batches[3:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_a_mismatch() -> None:
    opt = _fuse(_mlp(), state_dtype="int8")
    with pytest.raises(ValueError, match="state_dtype"):
        _fuse(_mlp(), state_dtype="fp32").load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="no 'forge' entry"):
        opt.load_state_dict(torch.optim.AdamW(_mlp().parameters()).state_dict())


def test_a_forge_state_dict_is_refused_by_other_optimizer_classes_and_the_reverse() -> None:
    model = _mlp()
    opt = _fuse(model, state_dtype="int8", lr=1e-2)
    _train(model, opt, _batches(2))
    saved = opt.state_dict()
    assert saved["param_groups"][-1]["params"] == [len(list(model.parameters()))]
    # A torch optimizer over the same parameters, in one group or split as HF Trainer splits them
    # (decay / no decay), or over the fallback parameters alone, refuses before touching its state, in
    # one line naming what the dict is (forge_core.torch_guards; torch's own check names group counts).
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    for other in (torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1),
                  torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]),
                  torch.optim.AdamW(opt.fallback_parameters())):
        name = type(other).__name__
        with pytest.raises(ValueError, match=rf"^{name}\.load_state_dict was given a ForgeOptimizer state dict "
                                             rf"\(rule 'adamw', int8 states; its fused weights' moments are FORGE "
                                             rf"kernel states, not {name}'s\): load it into the optimizer "
                                             r"forge_core\.fuse\(model, \.\.\.\) returns"):
            other.load_state_dict(saved)
        assert not other.state
        # torch's own check refuses it too (the guard group), with its message, where the guard is not installed
        with pytest.raises(ValueError, match="different number of parameter groups|doesn't match the size"):
            torch.optim.Optimizer.load_state_dict.forge_load_guard_of(other, saved)
        assert not other.state
    plain = torch.optim.AdamW(model.parameters())               # any other state dict loads as torch loads it
    plain.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    with pytest.raises(ValueError, match=r"not a ForgeOptimizer state dict \(no 'forge' entry\)"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_a_state_dict_without_the_guard_group_still_loads() -> None:
    batches = _batches(4)
    straight = _mlp()
    resumed = copy.deepcopy(straight)
    straight_opt = _fuse(straight, state_dtype="int8", lr=1e-2)
    _train(straight, straight_opt, batches)
    first_opt = _fuse(resumed, state_dtype="int8", lr=1e-2)
    _train(resumed, first_opt, batches[:2])
    saved = copy.deepcopy(first_opt.state_dict())
    saved["param_groups"] = saved["param_groups"][:-1]      # the layout without the guard group
    forge_core.unfuse(resumed)
    resumed_opt = _fuse(resumed, state_dtype="int8", lr=1e-2)
    resumed_opt.load_state_dict(saved)
    _train(resumed, resumed_opt, batches[2:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batch_accumulation_equals_unfused_accumulation(backend: str) -> None:
    k = 3
    device = _device(backend)
    model = _mlp(device=device)
    reference_model = copy.deepcopy(model)
    opt = _fuse(model, lr=1e-2, weight_decay=0.1, accumulate_steps=k, backend=backend)
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, weight_decay=0.1)
    batches = _batches(2 * k if backend == "reference" else k, device=device)
    for start in range(0, len(batches), k):
        for batch in batches[start:start + k]:
            (_loss(model, batch) / k).backward()
            (_loss(reference_model, batch) / k).backward()
        opt.step()
        opt.zero_grad()
        reference_opt.step()
        reference_opt.zero_grad()
    _assert_same_parameters(model, reference_model, rtol=1e-5, atol=1e-6)


def test_partial_accumulation_is_applied_at_step() -> None:
    model = _mlp()
    reference_model = copy.deepcopy(model)
    opt = _fuse(model, lr=1e-2, accumulate_steps=4)
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    for batch in _batches(2):  # 2 of 4 micro-batches, then the end of the data
        (_loss(model, batch) / 4).backward()
        (_loss(reference_model, batch) / 4).backward()
    opt.step()
    reference_opt.step()
    _assert_same_parameters(model, reference_model, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_too_many_backwards_without_step_is_an_error(k: int) -> None:
    model = _mlp()
    opt = _fuse(model, accumulate_steps=k)
    for batch in _batches(k):
        _loss(model, batch).backward()
    with pytest.raises(RuntimeError, match=f"accumulate_steps={k}"):
        _loss(model, _batches(1)[0]).backward()
    opt.step()
    _loss(model, _batches(1)[0]).backward()  # fine again after the step


def test_memory_breakdown_counts_states_fallback_grads_and_accumulators() -> None:
    model = _mlp()
    weight_numel = 70 * 90 + 90 * 33
    fallback_bytes = 4 * (90 + 33 + 33 + 33)
    all_bytes = 4 * sum(p.numel() for p in model.parameters())
    opt = _fuse(model, state_dtype="int8")
    _train(model, opt, _batches(1))
    int8_states = 2 * weight_numel + 2 * 4 * (90 * 2 + 33 * 2)  # codes + fp32 scales, two moments
    torch_states = 2 * fallback_bytes + 4 * 4  # exp_avg, exp_avg_sq, and a float32 step per param
    assert opt.memory_breakdown() == {"weights": all_bytes, "optimizer_states": int8_states + torch_states,
                                      "gradients": fallback_bytes}
    accumulating = _fuse(_mlp(), accumulate_steps=2)
    assert accumulating.memory_breakdown()["gradients"] == fallback_bytes + 4 * weight_numel
    assert accumulating.memory_breakdown()["optimizer_states"] == 2 * 4 * weight_numel  # fallback not stepped yet


def test_closure_is_supported() -> None:
    model = _mlp()
    reference_model = copy.deepcopy(model)
    opt = _fuse(model, lr=1e-2)
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    batch = _batches(1)[0]

    def closure_for(m: nn.Module, o: torch.optim.Optimizer):
        def closure() -> torch.Tensor:
            o.zero_grad()
            loss = _loss(m, batch)
            loss.backward()
            return loss
        return closure

    loss = opt.step(closure_for(model, opt))
    reference_loss = reference_opt.step(closure_for(reference_model, reference_opt))
    assert torch.equal(loss, reference_loss)
    _assert_same_parameters(model, reference_model, rtol=1e-6, atol=1e-7)
