"""The factored rules' Triton passes over G (``forge_core.kernels.factored``) and their ``matrix_step``.

What each test pins:
* each pass equals its torch expression on odd shapes (tails in both dimensions, more than one
  column span), fp32 and bf16 weights;
* ``matrix_step`` equals the plain-torch reference (the spec) of Adafactor and of AdaLomo within
  1e-5 relative in fp32, with weight decay, maximize, clipping and zero rows, over several steps,
  and is deterministic;
* the layer path takes it for 2-D weights where the kernels run, and a fused model then still
  equals torch.optim.Adafactor.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import forge_core
from forge_core.kernels import factored
from forge_core.rules import get_rule

pytestmark = pytest.mark.skipif(not factored.runs_here(torch.zeros(2, 2)) and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a CUDA device")

SHAPES = [(37, 301), (5, 2 * factored.COLUMN_SPAN + 7), (factored.ROWS + 1, 1)]


def _device() -> str:
    return "cpu" if factored.DECORATED_FOR_INTERPRETER else "cuda"


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_square_sums_are_the_row_and_column_sums_of_g_squared(shape: tuple[int, int]) -> None:
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(_device())
    rows, cols = factored.square_sums(grad)
    assert rows.shape == (shape[0],) and cols.shape == (shape[1],)
    assert _relative_error(rows, grad.square().sum(dim=1)) <= 1e-6
    assert _relative_error(cols, grad.square().sum(dim=0)) <= 1e-6


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_update_and_its_square_sum_equal_torch(shape: tuple[int, int], weight_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(shape, generator=generator).to(_device())
    row_factor = torch.rand(shape[0], generator=generator).to(_device()) * 2
    col = torch.rand(shape[1], generator=generator).to(_device())
    row_factor[0] = 0.0                                  # the clamp at eps^2 binds on the first row
    eps_sq = 1e-6
    update = grad / (row_factor[:, None] * col[None, :]).clamp(min=eps_sq).sqrt()
    total = factored.update_square_sum(grad, row_factor, col, eps_sq)
    assert total.dim() == 0 and _relative_error(total, update.square().sum()) <= 1e-5

    weight = torch.randn(shape, generator=generator).to(_device(), weight_dtype)
    expected = (weight.float() - 0.25 * update).to(weight_dtype)
    factored.apply_update(weight, grad, row_factor, col, eps_sq, torch.tensor(-0.25, device=_device()))
    assert _relative_error(weight, expected) <= (1e-6 if weight_dtype == torch.float32 else 4e-3)


def test_scales_multiply_g_by_both_factors() -> None:
    generator = torch.Generator().manual_seed(6)
    shape = SHAPES[0]
    grad = torch.randn(shape, generator=generator).to(_device())
    row_scale = torch.rand(shape[0], generator=generator).to(_device()) + 0.5
    col_scale = torch.rand(shape[1], generator=generator).to(_device()) + 0.5
    update = grad * row_scale[:, None] * col_scale[None, :]
    total = factored.update_square_sum(grad, row_scale, col_scale, 0.0, scales=True)
    assert _relative_error(total, update.square().sum()) <= 1e-5
    weight = torch.randn(shape, generator=generator).to(_device())
    expected = weight + 0.5 * update
    factored.apply_update(weight, grad, row_scale, col_scale, 0.0, torch.tensor(0.5, device=_device()), scales=True)
    assert _relative_error(weight, expected) <= 1e-6


def test_apply_update_refuses_a_weight_of_another_shape() -> None:
    grad = torch.zeros(4, 6, device=_device())
    with pytest.raises(ValueError, match=r"must be a row-major matrix of G's shape \(4, 6\)"):
        factored.apply_update(torch.zeros(6, 4, device=_device()), grad, torch.ones(4, device=_device()),
                              torch.ones(6, device=_device()), 1e-6, torch.tensor(1.0, device=_device()))


MATRIX_CASES = [
    ("adafactor", {"lr": 1e-2}), ("adafactor", {"lr": 1e-2, "weight_decay": 0.1}),
    ("adafactor", {"lr": 3e-2, "maximize": True, "d": 2.0}),
    ("adalomo", {"lr": 1e-2}), ("adalomo", {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.5}),
]


def _zero_states(rule_name: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    rule = get_rule(rule_name)
    return {name: torch.zeros(size, device=_device())
            for name, size in rule.state_shapes(shape, rule.defaults, "weight").items()}


@pytest.mark.parametrize("rule_name, hp", MATRIX_CASES)
def test_matrix_step_equals_the_reference_over_steps(rule_name: str, hp: dict) -> None:
    """Five steps on an odd shape, the second with a row and a column of G at zero (AdaLomo's
    tiny eps: its two inverse roots stay finite where their product would underflow)."""
    rule = get_rule(rule_name)
    generator = torch.Generator().manual_seed(2)
    shape = (37, 301)
    weight = torch.randn(shape, generator=generator).to(_device())
    twin = weight.clone()
    states = _zero_states(rule_name, shape)
    twin_states = copy.deepcopy(states)
    for step in range(1, 6):
        grad = torch.randn(shape, generator=generator).to(_device())
        if step == 2:
            grad[3].zero_()
            grad[:, 5].zero_()
        rule.matrix_step(weight, grad.clone(), states, hp, step, factored)
        rule.reference(twin, grad.clone(), twin_states, hp, step)
        assert torch.isfinite(weight).all()
        assert _relative_error(weight, twin) <= 1e-5, step
        for name in states:
            assert _relative_error(states[name], twin_states[name]) <= 1e-5, (step, name)


@pytest.mark.parametrize("rule_name", ["adafactor", "adalomo"])
def test_matrix_step_is_deterministic(rule_name: str) -> None:
    rule = get_rule(rule_name)
    generator = torch.Generator().manual_seed(3)
    shape = (factored.ROWS * 3 + 5, factored.COLUMN_SPAN + 300)
    grad = torch.randn(shape, generator=generator).to(_device())
    start = torch.randn(shape, generator=generator).to(_device())
    results = []
    for _ in range(2):
        weight = start.clone()
        states = _zero_states(rule_name, shape)
        rule.matrix_step(weight, grad.clone(), states, {"lr": 1e-2}, 1, factored)
        results.append((weight, *states.values()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_layer_path_takes_the_kernels_and_still_equals_torch_adafactor(monkeypatch) -> None:
    calls: list[tuple[int, ...]] = []
    original = factored.apply_update

    def counting(weight, *args) -> None:
        calls.append(tuple(weight.shape))
        original(weight, *args)
    monkeypatch.setattr(factored, "apply_update", counting)
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(30, 45), nn.Tanh(), nn.Linear(45, 17)).to(_device())
    twin = copy.deepcopy(model)
    hp = {"lr": 1e-2, "weight_decay": 0.1}
    opt = forge_core.fuse(model, "adafactor", probe_inputs=torch.zeros(2, 30, device=_device()), **hp)
    reference = torch.optim.Adafactor(twin.parameters(), **hp)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        x = torch.randn(3, 23, 30, generator=generator).to(_device())
        for m, o in ((model, opt), (twin, reference)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert sorted(set(calls)) == [(17, 45), (45, 30)]
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


def test_the_kernels_compile_for_sm90_on_a_machine_without_a_gpu() -> None:
    """What the interpreter cannot show: each kernel through Triton's sm_90 compile, at the LM head's
    shape with a bf16 weight (in a process without TRITON_INTERPRET, which would replace them)."""
    code = ("import torch; from forge_core.kernels import factored; "
            "compiled = factored.compile_offline(128256, 4096, torch.bfloat16); "
            "print(len(compiled), sum(len(k.asm['cubin']) > 0 for k in compiled))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["5", "5"]
