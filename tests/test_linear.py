"""The fused Linear's autograd contract: dX from the pre-update W, no W.grad, backward always runs."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import forge_core
from forge_core.linear import FusedLinearFunction, ForgeLinear

BACKENDS = ["reference", "triton"]


def _device(backend: str) -> str:
    """The Triton kernel runs on CUDA when there is one, else in the interpreter on CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _mlp(seed: int = 0, bias: bool = True, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(70, 90, bias=bias), nn.GELU(), nn.Linear(90, 33, bias=bias)).to(device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_layer_with_input_that_needs_no_grad_still_updates(backend: str) -> None:
    device = _device(backend)
    model = _mlp(device=device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = forge_core.fuse(model, lr=1e-2, backend=backend, probe_inputs=torch.randn(3, 70, device=device))
    x = torch.randn(4, 25, 70, device=device)  # requires_grad=False: the first layer's input
    assert not x.requires_grad
    model(x).square().mean().backward()
    first_weight = model[0].weight
    assert first_weight in [p for p in opt.fused_parameters()]
    assert not torch.equal(first_weight, before[0]), "first layer weight was not updated during backward"
    assert not torch.equal(model[2].weight, before[2])
    assert first_weight.grad is None and model[2].weight.grad is None
    # Biases are not fused: they got ordinary gradients and move at opt.step().
    assert model[0].bias.grad is not None
    bias_before = model[0].bias.detach().clone()
    opt.step()
    assert not torch.equal(model[0].bias, bias_before)


def test_fused_weights_never_get_grad_and_dx_matches_unfused() -> None:
    model = _mlp()
    reference_model = copy.deepcopy(model)
    forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=torch.randn(3, 70))
    x = torch.randn(5, 70, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()
    reference_model(x_ref).sum().backward()
    assert all(p.grad is None for p in (model[0].weight, model[2].weight))
    # dX flows through two fused layers: both used their PRE-update weights.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(model[0].bias.grad, reference_model[0].bias.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model[2].bias.grad, reference_model[2].bias.grad, rtol=1e-6, atol=1e-7)


def test_three_dimensional_inputs_and_no_bias() -> None:
    model = _mlp(bias=False)
    reference_model = copy.deepcopy(model)
    opt = forge_core.fuse(model, optimizer="sgd", lr=0.1, backend="reference", probe_inputs=torch.randn(3, 70))
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    x = torch.randn(2, 7, 70)
    model(x).square().mean().backward()
    opt.step()
    reference_model(x).square().mean().backward()
    reference_opt.step()
    for fused, plain in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)


def test_forward_without_grad_is_plain_linear_and_updates_nothing() -> None:
    model = _mlp()
    forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=torch.randn(3, 70))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 70)
    with torch.no_grad():
        out = model(x)
    plain = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, before[0], before[1])), before[2], before[3])
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert isinstance(model[0], ForgeLinear) and isinstance(model[0], nn.Linear)


def test_function_returns_no_weight_gradient_and_calls_updater_after_dx() -> None:
    weight = nn.Parameter(torch.randn(6, 4))
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def updater(x: torch.Tensor, dy: torch.Tensor) -> None:
        calls.append((x, dy))
        weight.data.mul_(0)  # a destructive "update": dX must already be computed by now

    x = torch.randn(3, 4, requires_grad=True)
    y = FusedLinearFunction.apply(x, weight, None, updater)
    dy = torch.randn(3, 6)
    expected_dx = dy @ weight.detach().clone()
    y.backward(dy)
    assert len(calls) == 1 and weight.grad is None
    torch.testing.assert_close(x.grad, expected_dx, rtol=0, atol=0)
    torch.testing.assert_close(calls[0][1], dy, rtol=0, atol=0)


def test_autocast_backward_runs_and_input_grad_keeps_dtype() -> None:
    model = _mlp()
    forge_core.fuse(model, lr=1e-3, backend="reference", probe_inputs=torch.randn(3, 70))
    before = model[0].weight.detach().clone()
    x = torch.randn(4, 70, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert model[0].weight.dtype == torch.float32 and not torch.equal(model[0].weight, before)


def _graph_names(tensor: torch.Tensor) -> set[str]:
    """Every autograd node type name upstream of ``tensor``."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _fused_pair(monkeypatch: pytest.MonkeyPatch, bias: bool, hooked: bool, seed: int = 3):
    """An MLP fused with the reference backend, eager fused Linears on the hooked path or the Function."""
    import forge_core.linear as linear_module

    monkeypatch.setattr(linear_module, "HOOKED_LINEAR", hooked)
    model = _mlp(seed=seed, bias=bias)
    opt = forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=torch.randn(3, 70))
    return model, opt


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 70), (2, 7, 70)])
def test_hooked_path_equals_the_function_path_exactly(monkeypatch: pytest.MonkeyPatch, bias: bool,
                                                       shape: tuple[int, ...]) -> None:
    results = {}
    for hooked in (True, False):
        model, opt = _fused_pair(monkeypatch, bias, hooked)
        torch.manual_seed(11)
        x = torch.randn(*shape, requires_grad=True)
        losses = []
        for _ in range(3):
            out = model(x)
            names = _graph_names(out)
            assert ("FusedLinearFunctionBackward" in names) is not hooked, names
            loss = out.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(loss.detach())
        results[hooked] = ([p.detach().clone() for p in model.parameters()], x.grad.clone(), losses)
    (hooked_params, hooked_dx, hooked_losses), (function_params, function_dx, function_losses) = \
        results[True], results[False]
    assert all(torch.equal(a, b) for a, b in zip(hooked_losses, function_losses))
    torch.testing.assert_close(hooked_dx, function_dx, rtol=0, atol=0)
    for ours, theirs in zip(hooked_params, function_params):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_hooked_path_takes_a_transposed_input_as_torch_does(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """MLP-Mixer's token mixing reads a transposed view, which F.linear multiplies as a flattened copy: the
    hooked path takes it too (no second forward through the Function), with torch's forward and dX exactly,
    and updates the weights as the Function does."""
    torch.manual_seed(11)
    source = torch.randn(2, 70, 7)
    results = {}
    for arm in ("hooked", "function", "torch"):
        model, opt = _fused_pair(monkeypatch, bias, hooked=arm == "hooked")
        if arm == "torch":
            forge_core.unfuse(model)
        x = source.clone().requires_grad_(True)
        out = model(x.transpose(-1, -2))
        assert ("FusedLinearFunctionBackward" in _graph_names(out)) is (arm == "function")
        out.square().mean().backward()
        if arm != "torch":                   # an unfused model's weights have .grad, which FORGE does not step
            opt.step()
        results[arm] = out.detach(), x.grad, [p.detach().clone() for p in model.parameters()]
    torch.testing.assert_close(results["hooked"][0], results["torch"][0], rtol=0, atol=0)
    torch.testing.assert_close(results["hooked"][1], results["torch"][1], rtol=0, atol=0)
    for ours, theirs in zip(results["hooked"][2], results["function"][2]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_hooked_path_hands_the_update_the_copy_its_gemm_read() -> None:
    """A transposed input is copied once, in the forward; the update reads that copy (no second copy per backward)."""
    from forge_core.linear import hooked_linear

    weight, seen = nn.Parameter(torch.randn(6, 4)), []
    x = torch.randn(2, 4, 3, requires_grad=True).transpose(-1, -2)
    hooked_linear(x, weight, None, lambda first, dy: seen.append((first, dy))).sum().backward()
    (first, dy), = seen
    assert first.shape == (6, 4) and first.is_contiguous() and dy.shape == (6, 6)
    torch.testing.assert_close(first, x.reshape(-1, 4), rtol=0, atol=0)


def test_hooked_path_takes_dx_from_the_weight_before_its_update(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _fused_pair(monkeypatch, bias=True, hooked=True)
    plain = copy.deepcopy(model)
    forge_core.unfuse(plain)
    x = torch.randn(4, 70, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()
    plain(x_plain).sum().backward()
    assert model[0].weight.grad is None and model[2].weight.grad is None
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=0, atol=0)
    torch.testing.assert_close(model[2].bias.grad, plain[2].bias.grad, rtol=0, atol=0)


def test_hooked_path_refuses_a_second_backward_through_one_graph() -> None:
    from forge_core.linear import hooked_linear

    weight, calls = nn.Parameter(torch.randn(6, 4)), []
    out = hooked_linear(torch.randn(3, 4, requires_grad=True), weight, None, lambda x, dy: calls.append(dy))
    loss = out.sum()
    loss.backward(retain_graph=True)
    assert len(calls) == 1 and weight.grad is None
    with pytest.raises(RuntimeError, match="run backward twice"):
        loss.backward()


def test_hooked_path_releases_the_input_after_its_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    model, _ = _fused_pair(monkeypatch, bias=True, hooked=True)
    source = torch.randn(4, 70, requires_grad=True)
    hidden = source * 2                      # the second layer's input is held only by the graph
    loss = model[2](model[1](model[0](hidden))).sum()
    held = weakref.ref(hidden)
    del hidden
    assert held() is not None, "the graph keeps the layer's input for its update"
    loss.backward()
    assert held() is None, "the input outlived the backward that used it while the loss is still referenced"


def test_function_path_where_the_hooked_path_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _fused_pair(monkeypatch, bias=True, hooked=True)
    x = torch.randn(4, 70, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):     # checkpointing, lean activations
        assert "FusedLinearFunctionBackward" in _graph_names(model(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "FusedLinearFunctionBackward" in _graph_names(model(x))
    assert "FusedLinearFunctionBackward" not in _graph_names(model(x))
