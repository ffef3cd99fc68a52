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
