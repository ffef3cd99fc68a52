"""forge_core.lean: the same forward as transformers, the same gradients, fewer saved bytes."""
from __future__ import annotations

import copy

import pytest
import torch

import forge_core
from forge_core import lean
from forge_bench import models as models_mod

CUDA = torch.cuda.is_available()


def _tiny(dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    model = models_mod.build_model("tiny-llama", dtype, "cpu", seed=3)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    return model


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch) -> str:
    """Both paths of lean: the Triton kernels (CUDA, or the interpreter on CPU) and plain torch."""
    if request.param == "torch":
        monkeypatch.setattr(lean.rowwise, "usable_for", lambda tensor: False)
    elif not lean.rowwise.usable_for(torch.empty(1, device="cuda" if CUDA else "cpu")):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_transformers(dtype, path):
    """The torch path's forward is transformers' op for op (bit-identical loss); the kernels sum
    the variance in another order, so their loss agrees to rounding."""
    device = "cuda" if CUDA and path == "kernels" else "cpu"
    plain = _tiny(dtype).to(device)
    slim = copy.deepcopy(plain)
    report = forge_core.lean_activations(slim)
    assert report == lean.LeanReport(norms=5, mlps=2, scopes=3)  # 2 per layer + final norm; layers + model
    batch = models_mod.make_batch("tiny-llama", 2, 24, device, seed=1)
    loss_plain, grads_plain = _loss_and_grads(plain, batch)
    loss_slim, grads_slim = _loss_and_grads(slim, batch)
    if path == "torch":
        assert torch.equal(loss_plain, loss_slim)
    else:
        torch.testing.assert_close(loss_slim, loss_plain, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)
    assert grads_plain.keys() == grads_slim.keys() and len(grads_plain) == len(list(plain.parameters()))
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    for name, grad in grads_plain.items():
        rel = ((grads_slim[name].float() - grad.float()).norm() / grad.float().norm()).item()
        assert rel <= tolerance, f"{name}: relative gradient error {rel:.2e}"


# bf16 relative tolerance: one rounding of difference on CUDA; the interpreter truncates its casts
BF16_RTOL = 1e-2 if CUDA else 3e-2


def _tensors(*shape: int, dtype: torch.dtype, count: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    device = "cuda" if CUDA else "cpu"
    return [torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [37, 256])
def test_rms_norm_kernels_match_the_reference(dtype, width, path):
    if path == "torch":
        pytest.skip("kernel test")
    x, dy = _tensors(3, 5, width, dtype=dtype, count=2)
    weight = _tensors(width, dtype=dtype, count=1, seed=1)[0] * 0.5 + 1
    eps = 1e-5
    y_ref, rstd_ref = lean.rms_norm_reference(x, weight, eps)
    y, rstd = lean.rowwise.rms_norm_forward(x, weight, eps)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
    if CUDA:   # the same rstd gives the same bits (the interpreter's bf16 casts truncate instead of rounding)
        assert torch.equal(lean.rowwise.rms_norm_forward(x, weight, eps, rstd_ref)[0],
                           lean.rms_normalize(x, weight, rstd_ref))
    torch.testing.assert_close(y, y_ref, rtol=BF16_RTOL if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert torch.equal(lean.rowwise.rms_norm_forward(x, weight, eps, rstd)[0], y)   # recomputation: same bits
    dx_ref, dw_ref = lean.rms_norm_backward_reference(x, weight, rstd_ref, dy)
    dx, dw = lean.rowwise.rms_norm_backward(x, weight, rstd_ref, dy)
    assert dw.dtype == torch.float32 and dx.dtype == dtype
    if dtype == torch.bfloat16 and not CUDA:   # sums of truncated products: compare as a whole
        assert ((dw - dw_ref).norm() / dw_ref.norm()).item() < 1e-2
    else:
        torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)
    bf16_atol = 1e-5 if CUDA else 1e-2     # dx = rstd * (g - x_hat * mean): truncation shows in the cancellation
    torch.testing.assert_close(dx, dx_ref, rtol=BF16_RTOL if dtype == torch.bfloat16 else 1e-5,
                               atol=bf16_atol if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernels_match_torch(dtype, path):
    if path == "torch":
        pytest.skip("kernel test")
    gate, up, grad = _tensors(3, 7, 301, dtype=dtype, count=3)
    gate = gate * 4       # the sigmoid's tails too
    out = lean.rowwise.swiglu_forward(gate, up)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up,
                               rtol=BF16_RTOL if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    assert torch.equal(lean.rowwise.swiglu_forward(gate, up), out)     # recomputation: same bits
    expected = lean.swiglu_backward_reference(gate, up, grad)
    for got, want in zip(lean.rowwise.swiglu_backward(gate, up, grad), expected):
        torch.testing.assert_close(got, want, rtol=2 * BF16_RTOL if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="one shape and dtype"):
        lean.rowwise.swiglu_forward(gate, up[..., :-1])


def test_swiglu_gradients_are_autograds_bit_for_bit(monkeypatch):
    monkeypatch.setattr(lean.rowwise, "usable_for", lambda tensor: False)
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(5, 7, 33, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(5, 7, 33, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(5, 7, 33, generator=gen, dtype=torch.bfloat16)
    expected = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), grad)
    got = torch.autograd.grad(lean.lean_swiglu(gate, up), (gate, up), grad)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_rms_norm_gradients_match_transformers(path):
    """Both compute in fp32 whatever the input dtype (transformers' norm casts): fp32-level agreement."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(19, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 4, 19, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 4, 19, dtype=torch.float64)
    expected = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    got = torch.autograd.grad(lean.lean_rms_norm(x, norm.weight, 1e-5), (x, norm.weight), grad)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=1e-6)


class _CountPacked:
    """Counts what the lean scopes store as recipes instead of tensors."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = lean.SavedTensorScope.pack

        def pack(scope, saved):
            stored = original(scope, saved)
            self.count += isinstance(stored, lean._Packed)
            return stored
        monkeypatch.setattr(lean.SavedTensorScope, "pack", pack)


@pytest.mark.parametrize("fused", [False, True])
def test_norm_outputs_and_swiglu_product_are_not_stored(monkeypatch, fused, path):
    """Per layer: q, k, v and gate, up keep a recipe for their input (the norm's output) and
    down_proj one for the product; with nn.Linear and with ForgeLinear consumers alike."""
    model = _tiny()
    forge_core.lean_activations(model)
    if fused:
        forge_core.fuse(model, "adamw", lr=1e-3, state_dtype="fp32")
    counter = _CountPacked(monkeypatch)
    model(**models_mod.make_batch("tiny-llama", 1, 8, "cpu")).loss.backward()
    assert counter.count == 2 * 6


@pytest.mark.slow
def test_lean_fused_step_equals_plain_fused_step(path):
    plain = _tiny()
    slim = copy.deepcopy(plain)
    forge_core.lean_activations(slim)
    batch = models_mod.make_batch("tiny-llama", 2, 16, "cpu", seed=5)
    for model in (plain, slim):
        opt = forge_core.fuse(model, "adamw", lr=1e-3, weight_decay=0.1, state_dtype="fp32")
        for _ in range(2):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    # Adam turns fp32-rounding-level gradient differences of near-zero entries into up to ~lr-sized
    # steps, so single entries may differ by a few % of lr; a wrong recompute moves whole tensors.
    for (name, a), b in zip(plain.named_parameters(), slim.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")
        assert (b - a).abs().mean().item() < 1e-7, name


def test_no_grad_forward_matches(path):
    plain = _tiny()
    slim = copy.deepcopy(plain)
    forge_core.lean_activations(slim)
    batch = models_mod.make_batch("tiny-llama", 1, 8, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(slim(**batch).logits, plain(**batch).logits, rtol=1e-5, atol=1e-6)


def test_calling_twice_adds_no_second_scope():
    model = _tiny()
    forge_core.lean_activations(model)
    layer_forward = model.model.layers[0].forward
    assert forge_core.lean_activations(model).scopes == 3
    assert model.model.layers[0].forward is layer_forward


def test_model_without_llama_blocks_is_refused():
    model = models_mod.build_model("tiny-gpt2", torch.float32, "cpu")
    with pytest.raises(lean.LeanActivationsError, match="GPT2LMHeadModel has no Llama-style RMSNorm"):
        forge_core.lean_activations(model)


def test_recipe_input_changed_in_place_is_an_error():
    weight = torch.nn.Parameter(torch.ones(8))

    def block(gate, up):
        return (lean.lean_swiglu(gate, up) * weight).sum()     # the mul saves the product: a recipe
    gate = torch.randn(4, 8, requires_grad=True) * 1
    loss = lean.run_in_scope(block, gate, torch.randn(4, 8, requires_grad=True) * 1)
    with torch.no_grad():
        gate.add_(1)
    with pytest.raises(RuntimeError, match="SwiGLU was modified in place"):
        loss.backward()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device: peak memory of a Llama-width layer")
def test_lean_layer_keeps_less_on_the_gpu():
    """One Llama-3.1-8B-width layer at 1 x 512 tokens, bf16: the saved activations shrink by
    ~100 KiB per token (about half), measured by the allocator after the forward."""
    def saved_after_forward(lean_it: bool) -> int:
        model = models_mod.build_model("llama-3.1-8b", "bfloat16", "cuda", num_layers=1)
        model.lm_head.weight.requires_grad_(False)
        if lean_it:
            forge_core.lean_activations(model)
        batch = models_mod.make_batch("llama-3.1-8b", 1, 512, "cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        hidden.float().sum().backward()
        del model, hidden
        torch.cuda.empty_cache()
        return kept
    plain, slim = saved_after_forward(False), saved_after_forward(True)
    saved_per_token = (plain - slim) / 512
    assert saved_per_token >= 90 * 1024, (plain, slim)


def test_a_dtensor_passes_the_saved_tensor_hooks_untouched(tmp_path):
    """Tensor parallel under lean activations: a DTensor (ColwiseParallel's weight, its outputs) has no
    storage pointer to match on, so the scope keeps it as autograd would (torch's tp_adamw arm with
    lean activations crashed on the data-pointer read)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
        scope = lean.SavedTensorScope()
        plain = torch.randn(4, 6)
        scope.register(plain, None)
        scope.register(sharded, None)                # no storage: not registered, no error
        assert len(scope.entries) == 1
        assert scope.pack(sharded) is sharded
        assert lean.SavedTensorScope.unpack(scope.pack(sharded)) is sharded
    finally:
        dist.destroy_process_group()
