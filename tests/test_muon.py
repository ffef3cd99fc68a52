"""Fused Muon (regime 2, ``forge_core.rules.muon``) against torch.optim.Muon + torch.optim.AdamW.

Tolerance: the momentum arithmetic is fp32 (the buffer equals torch's to rounding), but each step
rounds the Newton-Schulz input to bf16, and a one-ulp flip of a single bf16 input element moves
torch's own Newton-Schulz output by up to ~0.01 (measured: 0.0059-0.0098 over 20 flips on 90x70,
33x90 and 257x129 matrices, five iterations). The fused update's input differs from torch's by
fp32 rounding, which flips at most a few bf16 roundings per step, so after n steps the weights may
differ by ``n * adjusted_lr * 2**-6`` (2**-6 = 0.0156 > 0.0098) per element, and every parameter
stepped by AdamW by what the changed gradients make of that.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import forge_core
from forge_core.layer_step import layer_wgrad_update, LayerState
from forge_core.newton_schulz import adjusted_lr
from forge_core.rules import get_rule
from forge_core.rules.muon import hidden_and_other_parameters

NS_ROUNDING = 2.0 ** -6


class TinyLM(nn.Module):
    """Embedding, two hidden Linears with odd widths, a norm and an untied head."""

    def __init__(self, vocab: int = 37, width: int = 24, hidden: int = 41, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))


def _batches(count: int, seed: int = 7, vocab: int = 37) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3, 19), generator=generator) for _ in range(count)]


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


HP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"adamw_lr": 3e-3, "adamw_betas": (0.9, 0.95), "adamw_weight_decay": 0.05}


def _fuse(model: nn.Module, **kwargs) -> forge_core.ForgeOptimizer:
    return forge_core.fuse(model, "muon", probe_inputs=_batches(1)[0], **{**HP, **ADAMW, **kwargs})


def _torch_pair(model: nn.Module, nesterov: bool) -> list[torch.optim.Optimizer]:
    hidden, other = hidden_and_other_parameters(model)
    return [torch.optim.Muon(hidden, nesterov=nesterov, **HP),
            torch.optim.AdamW(other, lr=ADAMW["adamw_lr"], betas=ADAMW["adamw_betas"],
                              weight_decay=ADAMW["adamw_weight_decay"])]


def _train(model, optimizers, batches, accumulate: int = 1) -> None:
    for start in range(0, len(batches), accumulate):
        for ids in batches[start:start + accumulate]:
            (_loss(model, ids) / accumulate).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _bound(model: nn.Module, steps: int) -> float:
    """The Newton-Schulz rounding bound of the module docstring, for the model's largest lr factor."""
    return steps * max(adjusted_lr(HP["lr"], None, m.weight.shape) for m in (model.up, model.down)) * NS_ROUNDING


@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_muon_equals_torch_muon(nesterov: bool) -> None:
    steps = 6
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = _fuse(model, nesterov=nesterov)
    assert sorted(opt.fused_module_names()) == ["down", "up"]
    assert "head" in opt.excluded_modules and isinstance(opt.fallback_optimizer, torch.optim.AdamW)
    batches = _batches(steps)
    _train(model, [opt], batches)
    _train(twin, _torch_pair(twin, nesterov), batches)
    bound = _bound(model, steps)
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), TinyLM().parameters()))
    assert moved > 10 * bound            # the comparison is not vacuous
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert (a - b).abs().max().item() <= bound, name


def test_momentum_through_the_gemm_is_torch_lerp_for_one_layer() -> None:
    """The algebra, without Newton-Schulz rounding in the way: from the same buffer and gradient,
    the fused layer update leaves torch's buffer (to fp32 rounding), Nesterov or not, and with
    Nesterov the transient it orthogonalizes is torch's ``G.lerp(B, mu)``."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 29, 33, generator=generator)
    dy = torch.randn(2, 29, 45, generator=generator)
    grad = dy.reshape(-1, 45).t() @ x.reshape(-1, 33)
    start = torch.randn(45, 33, generator=generator)
    for nesterov in (True, False):
        weight = nn.Parameter(torch.randn(45, 33, generator=generator))
        hp = {**HP, "nesterov": nesterov}
        state = LayerState(weight, get_rule("muon"), "fp32", hp, "w")
        state.values["momentum_buffer"].copy_(start)
        layer_wgrad_update(x, dy, weight, state, hp, 1)
        expected = start.clone().lerp_(grad, 1 - HP["momentum"])
        torch.testing.assert_close(state.values["momentum_buffer"], expected, rtol=1e-6, atol=1e-6)
        if nesterov:
            transient = start * HP["momentum"] ** 2 + (1 - HP["momentum"] ** 2) * grad
            torch.testing.assert_close(transient, grad.lerp(expected, HP["momentum"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_micro_batches_accumulate_like_the_summed_gradient(nesterov: bool) -> None:
    k = 3
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = _fuse(model, nesterov=nesterov, accumulate_steps=k)
    # without Nesterov the buffer takes the micro-batches: no fp32 accumulator exists
    assert opt.memory_breakdown()["gradients"] == sum(
        p.numel() * 4 for p in opt.fallback_parameters()) + (0 if not nesterov else 4 * (24 * 41 + 41 * 24))
    batches = _batches(2 * k)
    _train(model, [opt], batches, accumulate=k)
    _train(twin, _torch_pair(twin, nesterov), batches, accumulate=k)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert (a - b).abs().max().item() <= _bound(model, 2), name


def test_partial_accumulation_is_applied_at_step() -> None:
    for nesterov in (True, False):
        model = TinyLM()
        twin = copy.deepcopy(model)
        opt = _fuse(model, nesterov=nesterov, accumulate_steps=4)
        pair = _torch_pair(twin, nesterov)
        for ids in _batches(2):
            (_loss(model, ids) / 4).backward()
            (_loss(twin, ids) / 4).backward()
        opt.step()
        for optimizer in pair:
            optimizer.step()
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            assert (a - b).abs().max().item() <= _bound(model, 1), (nesterov, name)


def test_bf16_momentum_trains_close_to_fp32_momentum() -> None:
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = _fuse(model, state_dtype="bf16")
    assert opt.state_dict()["state"][1]["momentum_buffer"].dtype == torch.bfloat16
    reference = _fuse(twin)
    batches = _batches(5)
    _train(model, [opt], batches)
    _train(twin, [reference], batches)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert (a - b).abs().max().item() <= 4 * _bound(model, 5)


@pytest.mark.parametrize("kwargs, match", [
    ({"state_dtype": "int8"}, r"cannot store state_dtype=.int8.; it takes \[.bf16., .fp32.\]"),
    ({"stochastic_rounding": True}, "stochastic_rounding is a fused-kernel option"),
    ({"betas": (0.9, 0.95)}, "has no hyper-parameter"),
    ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn must be one of"),
    ({"momentum": -0.1}, "momentum must be >= 0"),
])
def test_bad_settings_are_refused_at_fuse(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _fuse(TinyLM(), **kwargs)


def test_the_chunked_head_path_is_refused_for_a_layer_rule() -> None:
    model = TinyLM()
    opt = forge_core.fuse(model, "adafactor", probe_inputs=_batches(1)[0])
    binding = model.head.forge_updater
    with pytest.raises(ValueError, match="row block by row block"):
        binding.begin_row_updates(torch.zeros(3, 24))
    assert opt.rule.name == "adafactor"


@pytest.mark.parametrize("state_dtype, nesterov", [("fp32", True), ("bf16", False)])
def test_state_dict_resume_is_bit_identical(state_dtype: str, nesterov: bool) -> None:
    batches = _batches(6)
    straight = TinyLM()
    source = copy.deepcopy(straight)
    straight_opt = _fuse(straight, state_dtype=state_dtype, nesterov=nesterov)
    _train(straight, [straight_opt], batches)
    first = _fuse(source, state_dtype=state_dtype, nesterov=nesterov)
    _train(source, [first], batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": source.state_dict(), "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = TinyLM(seed=5)
    resumed_opt = _fuse(resumed, lr=1.0, state_dtype=state_dtype, nesterov=nesterov)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert resumed_opt.fallback_optimizer.param_groups[0]["lr"] == ADAMW["adamw_lr"]
    _train(resumed, [resumed_opt], batches[3:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_capturable_keeps_the_step_on_the_device_and_steps_the_same() -> None:
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = _fuse(model, capturable=True)
    reference = _fuse(twin)
    batches = _batches(3)
    _train(model, [opt], batches)
    _train(twin, [reference], batches)
    assert opt.steps_taken == 3
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


LLAMA_8B_SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096),
                   "down_proj": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_muon_equals_torch_muon_at_llama_8b_shapes(state_dtype: str, nesterov: bool) -> None:
    """Five steps of each Llama-3.1-8B projection shape, 512 tokens of bf16 activations, against
    torch.optim.Muon on an fp32 copy of the weight fed the fp32 product of the same activations."""
    steps, tokens = 5, 512
    generator = torch.Generator(device="cuda").manual_seed(0)
    hp = {**HP, "nesterov": nesterov}
    for name, (rows, cols) in LLAMA_8B_SHAPES.items():
        weight = nn.Parameter(torch.randn(rows, cols, device="cuda", generator=generator) * 0.02)
        twin = nn.Parameter(weight.detach().clone())
        state = LayerState(weight, get_rule("muon"), state_dtype, hp, name)
        torch_muon = torch.optim.Muon([twin], **hp)
        for _ in range(steps):
            x = torch.randn(tokens, cols, device="cuda", generator=generator).bfloat16()
            dy = (torch.randn(tokens, rows, device="cuda", generator=generator) * 1e-3).bfloat16()
            layer_wgrad_update(x, dy, weight, state, hp, 1)
            twin.grad = dy.float().t() @ x.float()
            torch_muon.step()
        slack = 1.0 if state_dtype == "fp32" else 4.0      # bf16 momentum rounds the buffer every step
        bound = slack * steps * adjusted_lr(HP["lr"], None, (rows, cols)) * NS_ROUNDING
        assert (weight - twin).abs().max().item() <= bound, name
