"""The deferred rules (regime 3: Adafactor, AdaLomo, SM3, Adam-mini, LARS) on the per-layer path.

What each test pins:
* Adafactor's reference (and the RuleOptimizer on it) is torch.optim.Adafactor within 1e-5 relative
  in fp32, matrices and vectors, with and without weight decay;
* fused (G formed inside a real model's backward, stepped, freed) equals the reference applied to
  the unfused gradient, for every rule: the same function on the same G up to summation order;
* the gradient residency is one layer's G: the tracker sees each G freed before the next forms;
* state_dict save / load resumes every rule bit-identically, bf16 states included;
* each reference against its paper's formula on a hand-checkable case; the refusals.
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import forge_core
from forge_core.layer_step import track_gradient_residency
from forge_core.rules import get_rule
from forge_core.rules.adam_mini import blocks_of
from forge_core.rules.rule_optimizer import RuleOptimizer

DEFERRED = {
    "adafactor": {"lr": 1e-2, "weight_decay": 0.1},
    "adalomo": {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 1.0},
    "sm3": {"lr": 0.05, "momentum": 0.9},
    "adam_mini": {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "head_dim": 6},
    "lars": {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01},
}


class Attention(nn.Module):
    """Odd widths; q and k named so Adam-mini partitions them by head (head_dim 6)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.q_proj = nn.Linear(30, 18, bias=False)
        self.k_proj = nn.Linear(30, 12, bias=False)
        self.mlp = nn.Linear(30, 45)
        self.out = nn.Linear(45 + 18 + 12, 17)
        self.norm = nn.LayerNorm(17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.q_proj(x), self.k_proj(x), torch.tanh(self.mlp(x))], dim=-1)
        return self.norm(self.out(h))


def _batches(count: int, seed: int = 11) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 23, 30, generator=generator) for _ in range(count)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[..., :17]).square().mean()


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for x in batches:
        _loss(model, x).backward()
        opt.step()
        opt.zero_grad()


def _fuse(model: nn.Module, rule: str, **kwargs) -> forge_core.ForgeOptimizer:
    return forge_core.fuse(model, rule, probe_inputs=torch.zeros(2, 30), **{**DEFERRED[rule], **kwargs})


def _reference_optimizer(model: nn.Module, rule: str) -> RuleOptimizer:
    names = {id(p): n for n, p in model.named_parameters()}
    return RuleOptimizer(model.parameters(), get_rule(rule), parameter_names=names, **DEFERRED[rule])


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(13, 37), (37,)])
def test_adafactor_reference_is_torch_adafactor(shape, weight_decay) -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=generator)
    grads = [torch.randn(shape, generator=generator) * (i + 1) for i in range(6)]
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    mine = get_rule("adafactor").fallback_optimizer([ours], capturable=True, lr=1e-2, weight_decay=weight_decay)
    assert isinstance(mine, RuleOptimizer)
    torch_adafactor = torch.optim.Adafactor([theirs], lr=1e-2, weight_decay=weight_decay, foreach=False)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        torch_adafactor.step()
    assert _relative_error(ours.detach(), theirs.detach()) <= 1e-5
    assert not torch.equal(ours, start)


def test_fused_adafactor_equals_torch_adafactor_in_a_model() -> None:
    model = Attention()
    twin = copy.deepcopy(model)
    opt = _fuse(model, "adafactor")
    torch_adafactor = torch.optim.Adafactor(twin.parameters(), **DEFERRED["adafactor"])
    batches = _batches(6)
    _train(model, opt, batches)
    _train(twin, torch_adafactor, batches)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_fused_equals_the_reference_on_the_unfused_gradient(rule: str) -> None:
    model = Attention()
    twin = copy.deepcopy(model)
    opt = _fuse(model, rule)
    assert sorted(opt.fused_module_names()) == ["k_proj", "mlp", "out", "q_proj"]
    reference = _reference_optimizer(twin, rule)
    batches = _batches(6)
    _train(model, opt, batches)
    _train(twin, reference, batches)
    start = Attention()
    for (name, a), b, c in zip(model.named_parameters(), twin.parameters(), start.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name
        if a.dim() == 2:
            assert not torch.equal(a, c), name


def test_the_gradient_residency_is_one_layer() -> None:
    model = Attention()
    opt = _fuse(model, "adafactor")
    fused = [m.weight for m in (model.q_proj, model.k_proj, model.mlp, model.out)]
    with track_gradient_residency() as residency:
        _loss(model, _batches(1)[0]).backward()
        assert residency.live_bytes == 0
    assert residency.formed == len(fused)
    assert residency.peak_bytes == 4 * max(w.numel() for w in fused) < 4 * sum(w.numel() for w in fused)
    assert all(w.grad is None for w in fused)
    opt.step()


class WideHead(nn.Module):
    """A body and a head 10x its size, run on few tokens: the head's fp32 G outweighs twice its kept X
    and dY, so its step waits for the end of the backward (``LayerPath.defers``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(30, 40, bias=False)
        self.head = nn.Linear(40, 400, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _wide_head_losses(rule: str, defer: bool, monkeypatch: pytest.MonkeyPatch, **kwargs) -> tuple[nn.Module, list[tuple]]:
    """Train a ``WideHead`` 4 steps (the head deferred or not); the shapes of the Gs in forming order."""
    import forge_core.layer_step as layer_step
    import forge_core.wgrad_gemm as wgrad_gemm

    monkeypatch.setattr(layer_step.LayerPath, "defer_largest", defer)
    formed: list[tuple] = []
    original = wgrad_gemm.weight_gradient

    def recording(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        formed.append((dy2.shape[1], x2.shape[1]))
        return original(dy2, x2)

    monkeypatch.setattr(layer_step, "weight_gradient", recording)
    model = WideHead()
    opt = forge_core.fuse(model, rule, probe_inputs=torch.zeros(2, 30), **{**DEFERRED[rule], **kwargs})
    generator = torch.Generator().manual_seed(5)
    steps = kwargs.get("accumulate_steps", 1)
    for _ in range(4):
        for _ in range(steps):
            (model(torch.randn(2, 3, 30, generator=generator)) - 0.5).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, formed


@pytest.mark.parametrize("rule", sorted(DEFERRED))
@pytest.mark.parametrize("options", [{"accumulate_steps": 1}, {"accumulate_steps": 2}, {"capturable": True}])
def test_the_largest_weight_steps_at_the_end_of_the_backward_to_the_same_result(
        rule: str, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's G forms after the body's (it waits for the backward's end, past the activations'
    peak), and the weights equal bit for bit those of stepping the head inside its own backward."""
    deferred, order = _wide_head_losses(rule, True, monkeypatch, **options)
    in_place, in_place_order = _wide_head_losses(rule, False, monkeypatch, **options)
    head, body = (400, 40), (40, 30)
    assert order == [body, head] * 4 and in_place_order == [head, body] * 4
    for (name, a), b in zip(deferred.named_parameters(), in_place.parameters()):
        assert torch.equal(a, b), name


class EmbeddedWideHead(WideHead):
    """``WideHead`` behind an unfused embedding, whose gradient is formed last in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 30)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(self.embedding(tokens))


@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_the_largest_weight_steps_before_the_unfused_gradients_are_formed(
        rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's step runs once the last other fused weight has stepped, so its G never coexists
    with the embedding's gradient; the result equals stepping the head inside its own backward."""
    import forge_core.layer_step as layer_step

    model = EmbeddedWideHead()
    twin = copy.deepcopy(model)
    opt = forge_core.fuse(model, rule, probe_inputs=torch.zeros(2, 3, dtype=torch.long), **DEFERRED[rule])
    head_stepped_first: list[bool] = []
    before = model.head.weight.detach().clone()
    model.embedding.weight.register_post_accumulate_grad_hook(
        lambda _: head_stepped_first.append(not torch.equal(before, model.head.weight)))
    tokens = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(1))
    (model(tokens) - 0.5).square().mean().backward()
    assert head_stepped_first == [True]
    opt.step()

    monkeypatch.setattr(layer_step.LayerPath, "defer_largest", False)
    twin_opt = forge_core.fuse(twin, rule, probe_inputs=torch.zeros(2, 3, dtype=torch.long), **DEFERRED[rule])
    (twin(tokens) - 0.5).square().mean().backward()
    twin_opt.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_state_dict_resume_is_bit_identical(rule: str, state_dtype: str) -> None:
    batches = _batches(6)
    straight = Attention()
    source = copy.deepcopy(straight)
    straight_opt = _fuse(straight, rule, state_dtype=state_dtype)
    _train(straight, straight_opt, batches)
    first = _fuse(source, rule, state_dtype=state_dtype)
    _train(source, first, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": source.state_dict(), "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = Attention(seed=4)
    resumed_opt = _fuse(resumed, rule, state_dtype=state_dtype)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, batches[3:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_capturable_steps_read_the_device_step_and_match_eager(rule: str) -> None:
    model = Attention()
    twin = copy.deepcopy(model)
    opt = _fuse(model, rule, capturable=True)
    eager = _fuse(twin, rule)
    batches = _batches(3)
    _train(model, opt, batches)
    _train(twin, eager, batches)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


def test_a_model_with_every_weight_fused_never_steps_the_empty_fallback(monkeypatch) -> None:
    """torch refuses to capture a non-capturable optimizer's step even when it holds no parameter
    (Muon's AdamW fallback over a bias-free ``WideHead``), so an empty fallback is never stepped."""
    model = WideHead()
    opt = forge_core.fuse(model, "muon", probe_inputs=torch.zeros(2, 30), lr=0.02)
    assert not any(group["params"] for group in opt.fallback_optimizer.param_groups)

    def refuse() -> None:
        raise AssertionError("the empty fallback was stepped")
    monkeypatch.setattr(opt.fallback_optimizer, "step", refuse)
    before = model.head.weight.detach().clone()
    (model(torch.randn(2, 3, 30)) - 0.5).square().mean().backward()
    opt.step()
    assert not torch.equal(before, model.head.weight)


@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_micro_batches_use_the_fp32_accumulator(rule: str) -> None:
    k = 2
    model = Attention()
    twin = copy.deepcopy(model)
    opt = _fuse(model, rule, accumulate_steps=k)
    reference = _reference_optimizer(twin, rule)
    batches = _batches(2 * k + 1)
    for start in (0, k):
        for x in batches[start:start + k]:
            (_loss(model, x) / k).backward()
            (_loss(twin, x) / k).backward()
        opt.step()
        reference.step()
        opt.zero_grad()
        reference.zero_grad()
    (_loss(model, batches[-1]) / k).backward()     # one micro-batch of two, then the data ends
    (_loss(twin, batches[-1]) / k).backward()
    opt.step()
    reference.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


def test_adam_mini_partitions_queries_and_keys_by_head() -> None:
    hp = DEFERRED["adam_mini"]
    model = Attention()
    opt = _fuse(model, "adam_mini")
    shapes = {name: tuple(entry["exp_avg_sq"].shape) for name, entry in zip(
        opt.fused_module_names(), (opt.state_dict()["state"][i] for i in opt.state_dict()["forge"]["fused"]))}
    assert shapes == {"q_proj": (3, 1), "k_proj": (2, 1), "mlp": (45, 1), "out": (17, 1)}
    assert blocks_of((18, 30), {**hp, "head_dim": None}, "q_proj") == 18
    assert blocks_of((17,), hp, "norm.weight") == 1
    # one second moment per block: the mean of G^2 over the head's 6 rows x 30 columns
    weight, grad = torch.zeros(18, 30), torch.randn(18, 30)
    states = {"exp_avg": torch.zeros(18, 30), "exp_avg_sq": torch.zeros(3, 1)}
    get_rule("adam_mini").reference(weight, grad, states, {**hp, "betas": (0.0, 0.5)}, 1)
    torch.testing.assert_close(states["exp_avg_sq"].flatten(), 0.5 * grad.square().reshape(3, -1).mean(1))


def test_references_follow_their_papers_on_small_cases() -> None:
    # SM3-II: nu = min(row, col) + g^2; the accumulators are the row / column maxima of nu
    rows, cols = torch.tensor([[1.0], [4.0]]), torch.tensor([[2.0, 3.0, 0.5]])
    grad = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]])
    nu = torch.minimum(rows, cols) + grad.square()
    weight = torch.zeros(2, 3)
    states = {"row_accumulator": rows.clone(), "col_accumulator": cols.clone()}
    get_rule("sm3").reference(weight, grad.clone(), states, {"lr": 1.0, "eps": 0.0}, 1)
    torch.testing.assert_close(states["row_accumulator"], nu.amax(1, keepdim=True))
    torch.testing.assert_close(states["col_accumulator"], nu.amax(0, keepdim=True))
    torch.testing.assert_close(weight, -grad / nu.sqrt())
    # LARS: v = lr * eta * |w| / (|g| + wd |w|) * (g + wd w), then w -= v
    weight, grad = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 1.0])
    buffer = torch.zeros(2)
    get_rule("lars").reference(weight, grad.clone(), {"momentum_buffer": buffer},
                               {"lr": 2.0, "momentum": 0.9, "weight_decay": 0.5, "trust_coefficient": 0.1, "eps": 0.0}, 1)
    trust = 0.1 * 5.0 / (1.0 + 0.5 * 5.0)
    expected_step = 2.0 * trust * (torch.tensor([0.0, 1.0]) + 0.5 * torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(buffer, expected_step)
    torch.testing.assert_close(weight, torch.tensor([3.0, 4.0]) - expected_step)
    # AdaLomo, first step: r, c are the means of g^2 (+ eps1); U = g / sqrt(r c / mean r), normalized to
    # rms <= 1; the step is lr * max(eps2, rms(w)) * U
    grad = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    weight = torch.full((2, 2), 2.0)
    states = {"exp_avg_sq_row": torch.zeros(2, 1), "exp_avg_sq_col": torch.zeros(1, 2)}
    get_rule("adalomo").reference(weight, grad.clone(), states, {"lr": 0.1, "eps": (0.0, 1e-3)}, 1)
    r, c = grad.square().mean(1, keepdim=True), grad.square().mean(0, keepdim=True)
    update = grad / (r * c / r.mean()).sqrt()
    update = update / max(1.0, update.square().mean().sqrt().item())
    torch.testing.assert_close(weight, torch.full((2, 2), 2.0) - 0.1 * 2.0 * update)


@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_states_other_than_fp32_and_bf16_are_refused(rule: str) -> None:
    with pytest.raises(ValueError, match=rf"rule {rule!r} cannot store state_dtype='int8'; it takes \['bf16', 'fp32'\]"):
        _fuse(Attention(), rule, state_dtype="int8")


def test_factored_states_are_small_and_counted() -> None:
    model = Attention()
    opt = _fuse(model, "adafactor")
    fused = [model.q_proj, model.k_proj, model.mlp, model.out]
    factored = 4 * sum(m.weight.shape[0] + m.weight.shape[1] for m in fused)
    assert opt.memory_breakdown()["optimizer_states"] == factored
    lars = _fuse(Attention(), "lars")
    assert lars.memory_breakdown()["optimizer_states"] == 4 * sum(m.weight.numel() for m in fused)
    assert math.isclose(opt.memory_breakdown()["weights"], lars.memory_breakdown()["weights"])


@pytest.mark.parametrize("rule", sorted(DEFERRED))
def test_bf16_weights_are_stepped_in_place_close_to_fp32(rule: str) -> None:
    """A bf16 model: the weight is stepped in its own dtype, op by op in fp32, without an fp32 copy;
    five steps stay within bf16 rounding of the same steps on the fp32 model."""
    model = Attention().to(torch.bfloat16)
    twin = Attention()
    opt = forge_core.fuse(model, rule, probe_inputs=torch.zeros(2, 30, dtype=torch.bfloat16), **DEFERRED[rule])
    reference = _reference_optimizer(twin, rule)
    batches = _batches(5)
    for x in batches:
        _loss(model, x.to(torch.bfloat16)).float().backward()
        opt.step()
        opt.zero_grad()
    _train(twin, reference, batches)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        if a.dim() == 2:
            assert a.dtype == torch.bfloat16 and _relative_error(a.detach().float(), b.detach()) <= 2e-2, name


LLAMA_8B_SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096),
                   "down_proj": (4096, 14336)}


@pytest.mark.parametrize("rule", sorted(DEFERRED))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_equals_reference_at_llama_8b_shapes(rule: str) -> None:
    """Five steps per Llama-3.1-8B projection shape from 512 tokens of bf16 activations: the
    per-layer path against the reference fed the same G, the path's own GEMM (``weight_gradient``:
    cuBLAS bf16 products, fp32 accumulate; its distance from the exact product is
    test_the_per_layer_gemm_is_a_bf16_gemm_with_an_fp32_result's). Why the same G and not the fp32
    product: SM3's first step is sign(G) (its accumulators start at 0, so nu = G^2), and an element
    whose G is within the two GEMMs' summation-order rounding of zero flips its step, 2 * lr *
    (1 - momentum) = 1e-2, half a weight's scale (with the fp32 product's G, q_proj ends 1.7e-4
    from the reference on an H100 at d54da0b).
    Adafactor also against torch.optim.Adafactor."""
    from forge_core.layer_step import LayerState, layer_wgrad_update
    from forge_core.wgrad_gemm import weight_gradient

    generator = torch.Generator(device="cuda").manual_seed(0)
    hp = DEFERRED[rule]
    for name, (rows, cols) in LLAMA_8B_SHAPES.items():
        weight = nn.Parameter(torch.randn(rows, cols, device="cuda", generator=generator) * 0.02)
        twin = nn.Parameter(weight.detach().clone())
        state = LayerState(weight, get_rule(rule), "fp32", hp, name)
        reference = RuleOptimizer([twin], get_rule(rule), parameter_names={id(twin): name + ".weight"}, **hp)
        torch_twin = nn.Parameter(weight.detach().clone())
        torch_adafactor = torch.optim.Adafactor([torch_twin], **hp) if rule == "adafactor" else None
        for step in range(1, 6):
            x = torch.randn(512, cols, device="cuda", generator=generator).bfloat16()
            dy = (torch.randn(512, rows, device="cuda", generator=generator) * 1e-3).bfloat16()
            layer_wgrad_update(x, dy, weight, state, hp, step)
            twin.grad = weight_gradient(dy, x)
            reference.step()
            if torch_adafactor is not None:
                torch_twin.grad = twin.grad.clone()
                torch_adafactor.step()
        assert _relative_error(weight.detach(), twin.detach()) <= 1e-5, name
        if torch_adafactor is not None:
            assert _relative_error(weight.detach(), torch_twin.detach()) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", ["adafactor", "lars"])
def test_gradient_residency_is_one_layer_on_the_gpu(rule: str) -> None:
    """Twelve bf16 Llama-3.1-8B MLP projections (gate / down alternating, 512 tokens): the backward's
    peak above what it starts with stays within 2.5 of one layer's fp32 G (G, one row block of the
    rule's temporaries, at most G's size, and the activations' gradients) and under the unfused bf16
    gradient pool (6 of them)."""
    torch.manual_seed(0)
    shapes = [(4096, 14336), (14336, 4096)] * 6
    model = nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in shapes]).to("cuda", torch.bfloat16)
    opt = forge_core.fuse(model, rule, probe_inputs=False, **DEFERRED[rule])
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):                   # the second step runs on warm allocator caches
        loss = model(x).float().square().mean()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with track_gradient_residency() as residency:
            loss.backward()
            torch.cuda.synchronize()
        opt.step()
        peak = torch.cuda.max_memory_allocated() - before
    layer_g = 4096 * 14336 * 4
    assert residency.peak_bytes == layer_g and residency.formed == len(shapes)
    assert peak <= 2.5 * layer_g
    assert peak < len(shapes) * 4096 * 14336 * 2        # the unfused bf16 pool of these weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", ["muon", *sorted(DEFERRED)])
@pytest.mark.parametrize("wide_head", [False, True])
def test_capturable_step_replays_in_a_cuda_graph(rule: str, wide_head: bool) -> None:
    """Forward, backward (the per-layer steps on the side stream; a ``WideHead``'s head at the end of
    the backward) and ``opt.step()`` captured once and replayed: three replays after two eager steps
    equal five eager steps."""
    hp = DEFERRED.get(rule, {"lr": 0.02, "weight_decay": 0.1})
    model = (WideHead() if wide_head else Attention()).cuda()
    twin = copy.deepcopy(model)
    probe = torch.zeros(2, 30, device="cuda")
    captured = forge_core.fuse(model, rule, probe_inputs=probe, capturable=True, **hp)
    eager = forge_core.fuse(twin, rule, probe_inputs=probe, **hp)
    batches = [x.cuda()[:2, :3] if wide_head else x.cuda() for x in _batches(5)]

    def step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        ((m(x) - 0.5).square().mean() if wide_head else _loss(m, x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in batches[:2]:
            step(model, captured, x)
    torch.cuda.current_stream().wait_stream(side)
    static = batches[2].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(model, captured, static)
    for x in batches[2:]:
        static.copy_(x)
        graph.replay()
    for x in batches:
        step(twin, eager, x)
    torch.cuda.synchronize()
    assert captured.steps_taken == 5
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_per_layer_gemm_is_a_bf16_gemm_with_an_fp32_result() -> None:
    """The deferred path's G and Muon's momentum GEMM: bf16 operands, fp32 accumulate and result
    (torch's out_dtype matmuls), at Llama-3.1-8B's gate shape and 512 tokens."""
    from forge_core.wgrad_gemm import accumulate_product, out_dtype_gemm_available, weight_gradient

    device = torch.device("cuda", torch.cuda.current_device())
    assert out_dtype_gemm_available(device)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 4096, device="cuda", generator=generator).bfloat16()
    dy = torch.randn(512, 14336, device="cuda", generator=generator).bfloat16()
    exact = dy.double().t() @ x.double()
    grad = weight_gradient(dy, x)
    assert grad.dtype == torch.float32 and _relative_error(grad.double(), exact) <= 1e-6
    buffer = torch.randn(14336, 4096, device="cuda", generator=generator)
    expected = 0.95 * buffer.double() + 0.05 * exact
    accumulate_product(buffer, dy, x, beta=0.95, alpha=0.05)
    assert _relative_error(buffer.double(), expected) <= 1e-6


@pytest.mark.parametrize("rule", ["adafactor", "sm3"])
def test_row_blocks_give_the_same_bits_as_one_block(rule: str, monkeypatch) -> None:
    """Adafactor's and SM3's layer-sized temporaries are computed in row blocks into G: blocks of one
    row give the bits of one block of the whole matrix (the per-element arithmetic is the same)."""
    from forge_core.rules import scalars

    generator = torch.Generator().manual_seed(5)
    weight0 = torch.randn(13, 37, generator=generator)
    grads = [torch.randn(13, 37, generator=generator) for _ in range(3)]
    results = []
    for block_bytes in (scalars.ROW_BLOCK_BYTES, 4 * 37):
        monkeypatch.setattr(scalars, "ROW_BLOCK_BYTES", block_bytes)
        assert len(list(scalars.row_blocks(weight0))) == (1 if block_bytes > 4 * 37 else 13)
        weight = weight0.clone()
        states = {name: torch.zeros(shape) for name, shape in
                  get_rule(rule).shapes_of_states((13, 37), DEFERRED[rule], "w").items()}
        for step, grad in enumerate(grads, start=1):
            get_rule(rule).reference(weight, grad.clone(), states, DEFERRED[rule], step)
        results.append((weight, states))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])
