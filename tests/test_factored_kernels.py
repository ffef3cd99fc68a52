"""The factored rules' Triton passes over G (``forge_core.kernels.factored``) and their ``matrix_step``.

What each test pins:
* each pass equals its torch expression on odd shapes (tails in both dimensions, more than one
  column span), fp32 and bf16 weights, with the family's scalars formed in the last kernel;
* ``matrix_step`` is deterministic (its equality with the references of every regime-3 rule, over
  steps and in bf16, is pinned in ``test_matrix_step_kernels.py``);
* the layer path takes it for 2-D weights where the kernels run, and a fused model then still
  equals torch.optim.Adafactor.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import forge_core
from forge_core.kernels import factored, matrix_steps
from forge_core.rules import get_rule

pytestmark = pytest.mark.skipif(not factored.runs_here(torch.zeros(2, 2)) and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a CUDA device")

SHAPES = [(37, 301), (5, 2 * factored.COLUMN_SPAN + 7), (factored.ROWS + 1, 1)]


def _device() -> str:
    return "cpu" if factored.DECORATED_FOR_INTERPRETER else "cuda"


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_square_sums_are_the_scaled_row_and_column_sums_of_g_squared(shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=generator).to(_device())
    weight = torch.randn(shape, generator=generator).to(_device(), torch.bfloat16)
    sums = factored.square_sums(grad)
    assert sums.rows.shape == (shape[0],) and sums.cols.shape == (shape[1],) and sums.weight_squares is None
    assert _relative_error(sums.rows, grad.square().sum(dim=1)) <= 1e-6
    assert _relative_error(sums.cols, grad.square().sum(dim=0)) <= 1e-6
    scaled = factored.square_sums(grad, weight, 0.25, 3.0)
    assert _relative_error(scaled.rows, 0.25 * grad.square().sum(dim=1)) <= 1e-6
    assert _relative_error(scaled.cols, 3.0 * grad.square().sum(dim=0)) <= 1e-6
    assert scaled.weight_squares.dim() == 0
    assert _relative_error(scaled.weight_squares, weight.float().square().sum()) <= 1e-6


def _factor_inputs(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(shape, generator=generator).to(_device())
    row = torch.rand(shape[0], generator=generator).to(_device()) * 2 + 0.1
    col = torch.rand(shape[1], generator=generator).to(_device()) + 0.1
    weight = torch.randn(shape, generator=generator).to(_device())
    return grad, row, col, weight


def _expected_update(grad, row, col, mean, factors) -> torch.Tensor:
    if factors.scales:
        return grad * (row / mean).rsqrt()[:, None] * col.rsqrt()[None, :]
    a = row / max(mean, factors.mean_floor)
    return grad / (a[:, None] * col[None, :]).clamp(min=factors.eps_sq).sqrt()


@pytest.mark.parametrize("scales", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_update_square_sum_equals_torch(shape: tuple[int, int], scales: bool) -> None:
    grad, row, col, _ = _factor_inputs(shape, 1)
    if not scales:
        row[0] = 0.0                                     # the clamp at eps^2 binds on the first row
    mean = row.mean()
    factors = factored.Factors(row, mean, col, mean_floor=0.0 if scales else 10.0, eps_sq=0.0 if scales else 1e-2)
    total = factored.update_square_sum(grad, factors)
    expected = _expected_update(grad, row, col, mean.item(), factors)
    assert total.dim() == 0 and _relative_error(total, expected.square().sum()) <= 1e-5


APPLY_CASES = [  # scales, rho as a tensor, sign, decay_rate, decay_by_alpha, d (a small d makes the clip bind)
    (False, False, 1.0, 0.0, False, 1.0), (False, True, -1.0, 0.01, False, 0.05),
    (True, False, 1.0, 0.1, True, 1.0), (True, True, 1.0, 0.0, True, 1e-3),
]


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales, rho_tensor, sign, decay_rate, decay_by_alpha, d", APPLY_CASES)
def test_apply_update_computes_the_family_scalars_and_equals_torch(scales, rho_tensor, sign, decay_rate,
                                                                   decay_by_alpha, d, weight_dtype) -> None:
    """``W <- W decay + coef U`` with alpha, coef and decay formed in the kernel from the two sums,
    rho a launch argument or a device scalar (a capturable step's)."""
    shape = SHAPES[0]
    grad, row, col, weight = _factor_inputs(shape, 7)
    weight = weight.to(weight_dtype)
    mean = row.mean()
    factors = factored.Factors(row, mean, col, mean_floor=1e-3, eps_sq=1e-6, scales=scales)
    update = _expected_update(grad, row, col, mean.item(), factors)
    rho = 0.03
    n = grad.numel()
    w32 = weight.to(torch.float32, copy=True)
    alpha = max(1e-3, w32.square().sum().div(n).sqrt().item()) * rho
    coef = -sign * alpha / max(1.0, update.square().sum().div(n).sqrt().item() / d)
    decay = 1.0 - (alpha if decay_by_alpha else 1.0) * decay_rate
    expected = (w32 * decay + coef * update).to(weight_dtype)
    scalars = factored.StepScalars(rho=torch.tensor(rho, device=_device()) if rho_tensor else rho, eps2=1e-3, d=d,
                                   sign=sign, decay_rate=decay_rate, decay_by_alpha=decay_by_alpha)
    factored.apply_update(weight, grad, factors, update.square().sum(), w32.square().sum(), scalars)
    assert _relative_error(weight, expected) <= 1e-6          # bf16: the same value, rounded to nearest
    assert not torch.equal(weight, w32.to(weight_dtype))


def test_a_weight_of_another_shape_is_refused() -> None:
    grad = torch.zeros(4, 6, device=_device())
    other = torch.zeros(6, 4, device=_device())
    factors = factored.Factors(torch.ones(4, device=_device()), torch.tensor(1.0, device=_device()),
                               torch.ones(6, device=_device()))
    with pytest.raises(ValueError, match=r"apply_update: weight \(6, 4\).*must be a row-major matrix of G's shape \(4, 6\)"):
        factored.apply_update(other, grad, factors, torch.tensor(1.0), torch.tensor(1.0),
                              factored.StepScalars(rho=1.0, eps2=0.0, d=1.0))
    with pytest.raises(ValueError, match=r"square_sums: weight \(6, 4\)"):
        factored.square_sums(grad, other)


def _zero_states(rule_name: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    rule = get_rule(rule_name)
    return {name: torch.zeros(size, device=_device())
            for name, size in rule.state_shapes(shape, rule.defaults, "weight").items()}


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


def _stepped_shapes(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the weights the layer path's ``apply_update`` (``matrix_steps``, factored's)
    steps from now on, in order."""
    shapes: list[tuple[int, ...]] = []
    original = matrix_steps.apply_update

    def counting(weight, *args) -> None:
        shapes.append(tuple(weight.shape))
        original(weight, *args)
    monkeypatch.setattr(matrix_steps, "apply_update", counting)
    return shapes


def test_the_layer_path_takes_the_kernels_and_still_equals_torch_adafactor(monkeypatch) -> None:
    calls = _stepped_shapes(monkeypatch)
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


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 30)
        self.proj = nn.Linear(30, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


@pytest.mark.parametrize("rule_name", ["adafactor", "adalomo"])
def test_a_forge_optimizer_steps_its_embedding_with_the_kernels(monkeypatch, rule_name: str) -> None:
    """The unfused parameters of a fused factored rule go to a ``RuleOptimizer`` (no host sync) that
    steps the 2-D one (the embedding) with ``matrix_step`` on its gradient as stored; the model still
    equals the unfused arm (torch.optim.Adafactor, or the AdaLomo reference)."""
    from forge_core.rules.rule_optimizer import RuleOptimizer

    shapes = _stepped_shapes(monkeypatch)
    torch.manual_seed(9)
    model = _Embedded().to(_device())
    twin = copy.deepcopy(model)
    hp = {"lr": 1e-2, "weight_decay": 0.1}
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(10)).to(_device())
    opt = forge_core.fuse(model, rule_name, probe_inputs=ids, **hp)
    assert isinstance(opt.fallback_optimizer, RuleOptimizer) and opt.fallback_optimizer.matrix_kernels is matrix_steps
    reference = get_rule(rule_name).fallback_optimizer(twin.parameters(), **hp)
    for _ in range(4):
        for m, o in ((model, opt), (twin, reference)):
            m(ids).square().mean().backward()
            o.step()
            o.zero_grad()
    assert (50, 30) in shapes and (20, 30) in shapes
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


def test_a_rule_optimizer_reads_a_bf16_gradient_in_place() -> None:
    """``matrix_kernels`` step a bf16 parameter from its bf16 gradient, which stays as it was, to
    within the weight's rounding of the reference on an fp32 copy of that gradient."""
    from forge_core.rules.rule_optimizer import RuleOptimizer

    generator = torch.Generator().manual_seed(11)
    start = torch.randn(37, 301, generator=generator).to(_device(), torch.bfloat16)
    grad = torch.randn(37, 301, generator=generator).to(_device(), torch.bfloat16)
    fused, plain = nn.Parameter(start.clone()), nn.Parameter(start.float())
    fused.grad, plain.grad = grad.clone(), grad.float()
    rule = get_rule("adafactor")
    RuleOptimizer([fused], rule, matrix_kernels=factored, lr=1e-2).step()
    RuleOptimizer([plain], rule, lr=1e-2).step()
    assert torch.equal(fused.grad, grad)
    assert _relative_error(fused.detach(), plain.detach().to(torch.bfloat16)) <= 4e-3
    assert not torch.equal(fused.detach(), start)
