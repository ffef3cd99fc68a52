"""Every regime-3 rule's ``matrix_step`` on its Triton passes (``forge_core.kernels.matrix_steps``:
factored's for Adafactor and AdaLomo, SM3's, Adam-mini's and LARS's own).

What each test pins:
* ``matrix_step`` equals the plain-torch reference (the spec) within 1e-5 relative in fp32 over
  five steps on odd shapes (tails in both dimensions, more than one column span), with momentum,
  weight decay, maximize, clipping, head blocks, zero rows and columns of G (AdaLomo's tiny eps:
  its two inverse roots stay finite where their product would underflow), the step an int or a
  0-d device tensor;
* a bf16 weight with bf16 layer-sized states (read and rounded by the kernel) stays as close to
  the fp32 trajectory as the reference's;
* operands of the wrong shape are refused with the operand named;
* the layer path and a ForgeOptimizer's fallback take the kernels, and a fused model equals the
  unfused arm.
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
from forge_core.kernels import matrix_steps
from forge_core.rules import get_rule
from forge_core.rules.base import matrix_step_states

pytestmark = pytest.mark.skipif(not matrix_steps.runs_here(torch.zeros(2, 2)) and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a CUDA device")

SHAPES = [(37, 301), (6, 2 * matrix_steps.COLUMN_SPAN + 7)]
CASES = [
    ("adafactor", {"lr": 1e-2}, "weight"), ("adafactor", {"lr": 1e-2, "weight_decay": 0.1}, "weight"),
    ("adafactor", {"lr": 3e-2, "maximize": True, "d": 2.0}, "weight"),
    ("adalomo", {"lr": 1e-2}, "weight"), ("adalomo", {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.5}, "weight"),
    ("sm3", {"lr": 0.1}, "weight"),
    ("sm3", {"lr": 0.05, "momentum": 0.9}, "weight"),
    ("adam_mini", {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}, "mlp.weight"),
    ("adam_mini", {"lr": 1e-2, "head_dim": 3, "weight_decay": 0.1}, "self_attn.q_proj.weight"),
    ("adam_mini", {"lr": 0.0}, "weight"),
    ("lars", {"lr": 1e-1, "weight_decay": 1e-2}, "weight"),
    ("lars", {"lr": 1e-1, "momentum": 0.0, "trust_coefficient": 0.02}, "weight"),
]


def _device() -> str:
    return "cpu" if matrix_steps.DECORATED_FOR_INTERPRETER else "cuda"


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _zero_states(rule_name: str, shape: tuple[int, int], hp: dict, name: str,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    rule = get_rule(rule_name)
    return {state: torch.zeros(size, device=_device(), dtype=dtype)
            for state, size in rule.shapes_of_states(shape, rule.resolve_hp(hp), name).items()}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rule_name, hp, name", CASES)
def test_matrix_step_equals_the_reference_over_steps(rule_name: str, hp: dict, name: str,
                                                     shape: tuple[int, int]) -> None:
    """Five steps; the second with a row and a column of G at zero (SM3's nu and LARS's norm see
    them), the fourth with the step as a 0-d device tensor, as a capturable optimizer passes it."""
    rule = get_rule(rule_name)
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(shape, generator=generator).to(_device())
    twin = weight.clone()
    states = _zero_states(rule_name, shape, hp, name)
    twin_states = copy.deepcopy(states)
    for step in range(1, 6):
        grad = torch.randn(shape, generator=generator).to(_device())
        if step == 2:
            grad[3].zero_()
            grad[:, 5].zero_()
        at = torch.tensor(float(step), device=_device()) if step == 4 else step
        rule.matrix_step(weight, grad.clone(), states, hp, at, matrix_steps)
        rule.reference(twin, grad.clone(), twin_states, hp, at)
        assert torch.isfinite(weight).all()
        assert _relative_error(weight, twin) <= 1e-5, step
        for state in states:
            assert _relative_error(states[state], twin_states[state]) <= 1e-5, (step, state)


def test_matrix_step_reads_g_and_never_writes_it() -> None:
    generator = torch.Generator().manual_seed(3)
    shape = (37, 301)
    for rule_name, hp, name in CASES:
        grad = torch.randn(shape, generator=generator).to(_device())
        kept = grad.clone()
        weight = torch.randn(shape, generator=generator).to(_device())
        get_rule(rule_name).matrix_step(weight, grad, _zero_states(rule_name, shape, hp, name), hp, 1, matrix_steps)
        assert torch.equal(grad, kept), rule_name


@pytest.mark.parametrize("rule_name, hp, name", [case for case in CASES if case[1].get("lr") != 0.0])
def test_a_bf16_weight_and_bf16_states_stay_as_close_to_fp32_as_the_reference(rule_name: str, hp: dict,
                                                                            name: str) -> None:
    """Against the same steps on fp32, the kernels' bf16 weight and layer-sized bf16 states (each
    rounded once a step) are no further off than the reference's (rounded per op, through fp32
    copies of the states, as the layer path runs it)."""
    rule = get_rule(rule_name)
    generator = torch.Generator().manual_seed(8)
    shape = (37, 301)
    start = torch.randn(shape, generator=generator)
    weight, twin, exact = start.to(_device(), torch.bfloat16), start.to(_device(), torch.bfloat16), start.to(_device())
    stored = _zero_states(rule_name, shape, hp, name, torch.bfloat16)
    twin_stored = copy.deepcopy(stored)
    exact_states = _zero_states(rule_name, shape, hp, name)
    for step in range(1, 5):
        grad = torch.randn(shape, generator=generator).to(_device())
        states = matrix_step_states(stored, shape)
        rule.matrix_step(weight, grad.clone(), states, hp, step, matrix_steps)
        for state, value in states.items():
            if value.data_ptr() != stored[state].data_ptr():
                stored[state].copy_(value)
        twin_states = {state: value.float() for state, value in twin_stored.items()}
        rule.reference(twin, grad.clone(), twin_states, hp, step)
        for state, value in twin_states.items():
            twin_stored[state].copy_(value)
        rule.reference(exact, grad.clone(), exact_states, hp, step)
    fused_error, reference_error = _relative_error(weight, exact), _relative_error(twin, exact)
    assert fused_error <= 1.25 * reference_error + 1e-4, (fused_error, reference_error)


def test_matrix_step_states_pass_a_layer_sized_state_as_stored_and_a_small_one_in_fp32() -> None:
    layer = torch.zeros(4, 5, dtype=torch.bfloat16)
    rows = torch.zeros(4, 1, dtype=torch.bfloat16)
    fp32 = torch.zeros(1, 5)
    states = matrix_step_states({"m": layer, "r": rows, "c": fp32}, (4, 5))
    assert states["m"] is layer and states["c"] is fp32
    assert states["r"].dtype == torch.float32 and states["r"].data_ptr() != rows.data_ptr()


def test_operands_of_another_shape_are_refused_with_their_name() -> None:
    grad = torch.zeros(8, 6, device=_device())
    weight = torch.zeros(8, 6, device=_device())
    with pytest.raises(ValueError, match="sm3_update: the column accumulator must be a contiguous fp32 tensor of 6"):
        matrix_steps.sm3_update(weight, grad, torch.zeros(8, device=_device()), torch.zeros(5, device=_device()),
                                0.1, 1e-30)
    with pytest.raises(ValueError, match="sm3_update: momentum > 0 needs the momentum buffer"):
        matrix_steps.sm3_update(weight, grad, torch.zeros(8, device=_device()), torch.zeros(6, device=_device()),
                                0.1, 1e-30, momentum=0.9)
    with pytest.raises(ValueError, match="block_adam_update: 3 second-moment blocks do not divide the 8 rows"):
        matrix_steps.block_adam_update(weight, grad, torch.zeros_like(weight), torch.zeros(3, 1, device=_device()),
                                       0.9, 1.0, 1e-8, 1.0, -1.0)
    with pytest.raises(ValueError, match=r"lars_update: the momentum buffer \(6, 8\)"):
        matrix_steps.lars_update(weight, grad, torch.zeros(6, 8, device=_device()), torch.ones(()), torch.ones(()),
                                 0.1, 0.9, 0.0, 1e-3, 1e-8)
    with pytest.raises(ValueError, match=r"lars_update: weight \(8, 6\) \(strides \(1, 8\)\)"):
        matrix_steps.lars_update(weight.t().contiguous().t(), grad, torch.zeros_like(weight), torch.ones(()),
                                 torch.ones(()), 0.1, 0.9, 0.0, 1e-3, 1e-8)


UPDATE_KERNELS = {"sm3": "sm3_update", "adam_mini": "block_adam_update", "lars": "lars_update"}


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 30)
        self.q_proj = nn.Linear(30, 24, bias=False)
        self.out = nn.Linear(24, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.q_proj(self.embed(ids))))


@pytest.mark.parametrize("rule_name, hp", [("sm3", {"lr": 0.05, "momentum": 0.9}),
                                           ("adam_mini", {"lr": 1e-2, "weight_decay": 0.1, "head_dim": 6}),
                                           ("lars", {"lr": 0.5, "weight_decay": 1e-2})])
def test_a_fused_model_steps_through_the_kernels_and_equals_the_unfused_arm(monkeypatch, rule_name: str,
                                                                            hp: dict) -> None:
    """The fused Linear weights (layer path) and the embedding (the ForgeOptimizer's fallback) step
    through ``matrix_step``; four steps of the model equal the unfused arm's (the reference on every
    parameter) within 1e-5."""
    from forge_core.rules.rule_optimizer import RuleOptimizer

    rule = get_rule(rule_name)
    stepped: list[tuple[int, ...]] = []
    kernel = UPDATE_KERNELS[rule_name]
    original = getattr(matrix_steps, kernel)

    def counting(weight, *args) -> None:
        stepped.append(tuple(weight.shape))
        original(weight, *args)
    monkeypatch.setattr(matrix_steps, kernel, counting)
    torch.manual_seed(9)
    model = _Embedded().to(_device())
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(10)).to(_device())
    opt = forge_core.fuse(model, rule_name, probe_inputs=ids, **hp)
    assert isinstance(opt.fallback_optimizer, RuleOptimizer) and opt.fallback_optimizer.matrix_kernels is matrix_steps
    names = {id(p): n for n, p in twin.named_parameters()}
    unfused = RuleOptimizer(twin.parameters(), rule, parameter_names=names, **hp)
    for _ in range(4):
        for m, o in ((model, opt), (twin, unfused)):
            m(ids).square().mean().backward()
            o.step()
            o.zero_grad()
    assert {(50, 30), (24, 30), (20, 24)} <= set(stepped)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name


@pytest.mark.parametrize("module, kernels", [("factored", 5), ("matrix_steps", 3)])
def test_the_kernels_compile_for_sm90_on_a_machine_without_a_gpu(module: str, kernels: int) -> None:
    """What the interpreter cannot show: each kernel (factored's in both forms of the update) through
    Triton's sm_90 compile, at the LM head's shape with a bf16 weight and states (in a process
    without TRITON_INTERPRET, which would replace them)."""
    code = (f"import torch; from forge_core.kernels import {module}; "
            f"compiled = {module}.compile_offline(128256, 4096, torch.bfloat16); "
            "print(len(compiled), sum(len(k.asm['cubin']) > 0 for k in compiled))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == [str(kernels), str(kernels)]
