"""2-D fallback parameters (embeddings, tied / excluded weights) stepped by the fused kernel in
``step()`` (``forge_core.optimizer.DenseWeight``): same result as torch's optimizer, the arm's state
format, step counts, state_dict and resume, and the opt-out."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import forge_core

BACKENDS = ["reference", "triton"]
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


class TinyLM(nn.Module):
    """An embedding (2-D, used outside any Linear), a fused Linear, a norm (1-D) and an unused row
    range of the vocabulary (rows no batch touches still decay, as under torch's AdamW). The
    Linear reads a detached copy of the embedding output, so the embedding's gradient does not
    depend on the fused kernel's fp32 summation order (which Adam would amplify in near-zero
    gradients): the comparison with torch isolates the dense step."""

    def __init__(self, vocab: int = 53, width: int = 70) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(ids)
        return self.norm(embedded) + self.proj(embedded.detach())


def _model(device: str, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(device)


def _batches(count: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 40, (3, 11), generator=generator).to(device) for _ in range(count)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for ids in batches:
        out = model(ids)
        (out - 0.5).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _fuse(model: nn.Module, **kwargs) -> forge_core.ForgeOptimizer:
    kwargs.setdefault("backend", "reference")
    ids = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
    return forge_core.fuse(model, probe_inputs=ids, **{**HP, **kwargs})


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_steps_equal_torch_adamw(backend: str) -> None:
    device = _device(backend)
    model = _model(device)
    reference = copy.deepcopy(model)
    opt = _fuse(model, backend=backend)
    assert [p is model.embed.weight for p in opt.dense_parameters()] == [True]
    assert all(p is not model.embed.weight for g in opt.fallback_optimizer.param_groups for p in g["params"])
    assert any(p is model.embed.weight for p in opt.fallback_parameters())
    reference_opt = torch.optim.AdamW(reference.parameters(), **HP)
    batches = _batches(4, device)
    _train(model, opt, batches)
    _train(reference, reference_opt, batches)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # rows no batch touched moved too (weight decay and the moments' own decay, as torch does)
    assert not torch.equal(model.embed.weight[45:], _model(device).embed.weight[45:])


def test_int8_states_cover_the_embedding_and_shrink_its_memory() -> None:
    bf16_opt = _fuse(_model("cpu"), state_dtype="bf16")
    int8_model = _model("cpu")
    int8_opt = _fuse(int8_model, state_dtype="int8")
    _train(int8_model, int8_opt, _batches(2, "cpu"))
    state = int8_opt.state_dict()["state"]
    index = [i for i, p in enumerate(int8_model.parameters()) if p is int8_model.embed.weight][0]
    assert state[index]["exp_avg"].dtype == torch.int8 and state[index]["exp_avg_sq_scale"].dtype == torch.float32
    assert float(state[index]["step"]) == 2.0
    assert int8_opt.memory_breakdown()["optimizer_states"] < bf16_opt.memory_breakdown()["optimizer_states"]


def test_dense_2d_false_leaves_the_embedding_to_torch() -> None:
    model = _model("cpu")
    opt = _fuse(model, dense_2d=False, state_dtype="int8")
    assert opt.dense_parameters() == []
    assert any(p is model.embed.weight for g in opt.fallback_optimizer.param_groups for p in g["params"])
    _train(model, opt, _batches(1, "cpu"))
    assert opt.fallback_optimizer.state[model.embed.weight]["exp_avg"].dtype == torch.float32


def test_a_weight_without_gradient_is_skipped_and_keeps_its_step_count() -> None:
    model = _model("cpu")
    opt = _fuse(model)
    before = model.embed.weight.detach().clone()
    model.embed.weight.requires_grad_(False)          # no .grad this step
    _train(model, opt, _batches(1, "cpu"))
    model.embed.weight.requires_grad_(True)
    assert torch.equal(model.embed.weight, before)
    assert "DenseWeight('embed.weight'" in repr(opt.dense_weights()[0]) and opt.dense_weights()[0].steps_done == 0
    _train(model, opt, _batches(1, "cpu"))
    assert opt._dense[0].steps_done == 1


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_resume_with_dense_weights_is_bit_identical(state_dtype: str) -> None:
    batches = _batches(5, "cpu")
    straight = _model("cpu")
    straight_opt = _fuse(straight, state_dtype=state_dtype)
    _train(straight, straight_opt, batches)

    first = _model("cpu")
    first_opt = _fuse(first, state_dtype=state_dtype)
    _train(first, first_opt, batches[:2])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _model("cpu", seed=1)
    resumed_opt = _fuse(resumed, state_dtype=state_dtype)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, batches[2:])
    for ours, theirs in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(ours, theirs)


def test_a_state_dict_with_another_dense_setting_is_refused() -> None:
    model = _model("cpu")
    opt = _fuse(model, state_dtype="int8")
    _train(model, opt, _batches(1, "cpu"))
    other = _fuse(_model("cpu"), state_dtype="int8", dense_2d=False)
    with pytest.raises(ValueError, match="different set of 2-D fallback weights"):
        other.load_state_dict(opt.state_dict())


def test_the_kernel_keeps_no_reference_to_a_dense_gradient() -> None:
    """The launch plan is cached per weight; a dense .grad is a new tensor every step, and a plan that
    held it would keep a weight-sized tensor alive (1 GiB for Llama-3.1-8B's embedding)."""
    import weakref

    from forge_core.kernels import fused_wgrad_update, reference_wgrad_update
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = torch.randn(53, 70, device=device).bfloat16()
    reference_weight = weight.clone()
    state = ParamState(weight, get_rule("adamw"), "bf16")
    reference_state = ParamState(reference_weight, get_rule("adamw"), "bf16")
    no_x, no_dy = weight.new_zeros((0, 70)), weight.new_zeros((0, 53))
    for step in (1, 2):
        grad = torch.randn(53, 70, device=device).bfloat16()   # bf16, as a bf16 model's .grad
        fused_wgrad_update(no_x, no_dy, weight, state, HP, step, grad_accum=grad)
        reference_wgrad_update(no_x, no_dy, reference_weight, reference_state, HP, step, grad_accum=grad)
        alive = weakref.ref(grad)
        del grad
        assert alive() is None, "a cached launch plan kept the gradient alive"
    # the interpreter truncates fp32 -> bf16 casts where the reference rounds: one bf16 step apart at most
    torch.testing.assert_close(weight.float(), reference_weight.float(), rtol=1e-2, atol=1e-2)
