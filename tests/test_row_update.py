"""``kernels.row_update``: one pass over every row, each row's gradient read through a slot table,
against the fused kernel's dense step (zero tokens, the dense gradient as its accumulator input) at
the same seed: bit for bit in the interpreter (the CPU), to an ulp / one int8 code on the GPU (the
two kernels may contract multiply-adds differently). Odd widths, ragged row blocks, repeated ids,
rows without a gradient, every rule and state format, stochastic rounding, device scalars, and the
argument errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from forge_core.kernels import NUM_SCALARS, fused_wgrad_update
from forge_core.kernels.row_update import DEFAULT_CONFIGS, RowUpdateConfig, row_update
from forge_core.rules import RULES, get_rule
from forge_core.state import STATE_DTYPES, ParamState

# the rules stepped by the fused kernel's epilogue (the others take forge_core.layer_step)
KERNEL_RULES = sorted(name for name, rule in RULES.items() if rule.epilogue is not None)

from same_update import assert_same_update

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"      # the CPU runs the kernels interpreted
HYPERPARAMETERS = {
    "adamw": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    "sgd": {"lr": 5e-2, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": True},
    "lion": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
    "rmsprop": {"lr": 1e-3, "alpha": 0.9, "weight_decay": 1e-2, "momentum": 0.9, "centered": True},
    "adagrad": {"lr": 1e-2, "lr_decay": 1e-2, "weight_decay": 1e-2, "initial_accumulator_value": 0.1},
    "adamax": {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 1e-2},
    "nadam": {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 1e-2},
    "radam": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 1e-2, "decoupled_weight_decay": True},
    "lamb": {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 1e-2},
}
# The bit-for-bit comparisons take the coordinate-wise rules; a regime-2 rule's per-layer sums are fp32
# sums in each kernel's own order (test_families compares LAMB's row step within rounding).
ELEMENTWISE_RULES = sorted(name for name, rule in RULES.items() if rule.epilogue is not None and not rule.layer_sums)


def _rows(m: int, n: int, count: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, row_grads, the dense gradient they stand for): ``count`` sorted ids with repeats (a
    repeated id's gradient rows are equal copies, as ``row_gradient`` gives them)."""
    generator = torch.Generator().manual_seed(seed)
    ids, _ = torch.sort(torch.randint(0, m, (count,), generator=generator))
    distinct = torch.randn(m, n, generator=generator).to(dtype)
    row_grads = distinct[ids]
    dense = torch.zeros(m, n, dtype=dtype)
    dense[ids] = row_grads
    slots = torch.full((m,), -1, dtype=torch.int32)
    slots[ids] = torch.arange(count, dtype=torch.int32)
    return slots.to(DEVICE), row_grads.to(DEVICE), dense.to(DEVICE)


def _same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert_same_update(ours, theirs, what, exact=DEVICE == "cpu")


def _compare(rule_name: str, state_dtype: str, dtype: torch.dtype, m: int, n: int, *, count: int = 9,
             steps: int = 2, stochastic: bool = False, config: RowUpdateConfig | None = None,
             device_scalars: bool = False) -> None:
    """``steps`` steps of ``row_update`` and of the dense fused step from the same start; equal after."""
    rule = get_rule(rule_name)
    hp = rule.resolve_hp(HYPERPARAMETERS.get(rule_name, {}))
    start = torch.randn(m, n, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    dense_w, rows_w = start.clone(), start.clone()
    dense_s, rows_s = ParamState(dense_w, rule, state_dtype, hp), ParamState(rows_w, rule, state_dtype, hp)
    no_x, no_dy = start.new_zeros((0, n)), start.new_zeros((0, m))
    for step in range(1, steps + 1):
        slots, row_grads, dense = _rows(m, n, count, dtype, seed=step)
        options = dict(stochastic_rounding=stochastic, seed=1_000_003 + step)
        if device_scalars:
            buffer = torch.zeros(NUM_SCALARS, dtype=torch.float32, device=DEVICE)
            buffer[:len(rule.kernel_scalars(hp, step))] = torch.tensor(rule.kernel_scalars(hp, step))
            options = dict(device_scalars=buffer)
        fused_wgrad_update(no_x, no_dy, dense_w, dense_s, hp, step, grad_accum=dense, **options)
        row_update(rows_w, rows_s, hp, step, slots=slots, row_grads=row_grads, config=config, **options)
    _same(rows_w, dense_w, "weight")
    for name in rows_s.state_names:
        _same(rows_s.values[name], dense_s.values[name], name)
        if rows_s.scales[name] is not None:
            _same(rows_s.scales[name], dense_s.scales[name], name + " scales")


@pytest.mark.parametrize("rule_name", ELEMENTWISE_RULES)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rule_and_state_format_equals_the_dense_step(rule_name: str, state_dtype: str,
                                                           dtype: torch.dtype) -> None:
    _compare(rule_name, state_dtype, dtype, 37, 200)          # ragged row block, ragged column block and int8 block


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("config", [RowUpdateConfig(8, 64, 4), RowUpdateConfig(32, 256, 8)])
@pytest.mark.parametrize("m, n", [(37, 72), (64, 256)])
def test_other_block_shapes_and_aligned_sizes(state_dtype: str, config: RowUpdateConfig, m: int, n: int) -> None:
    _compare("adamw", state_dtype, torch.bfloat16, m, n, config=config)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_stochastic_rounding_draws_the_dense_steps_noise(state_dtype: str) -> None:
    _compare("adamw", state_dtype, torch.bfloat16, 37, 72, stochastic=True, steps=3)


@pytest.mark.parametrize("rule_name", ELEMENTWISE_RULES)
def test_device_scalars_give_the_dense_steps_result(rule_name: str) -> None:
    _compare(rule_name, "int8", torch.bfloat16, 37, 72, device_scalars=True)


def test_no_gradient_rows_at_all() -> None:
    _compare("adamw", "bf16", torch.bfloat16, 37, 72, count=0)


def test_more_tokens_than_rows() -> None:
    _compare("lion", "int8", torch.bfloat16, 16, 128, count=64)


def test_default_configs_cover_every_state_format() -> None:
    assert set(DEFAULT_CONFIGS) == set(STATE_DTYPES)
    for state_dtype, config in DEFAULT_CONFIGS.items():
        config.check(state_dtype)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_CONFIGS["bf16"].block_m = 8           # type: ignore[misc]


# ---- argument errors -------------------------------------------------------------------------

def _arguments(state_dtype: str = "bf16") -> dict:
    weight = torch.zeros(37, 72, dtype=torch.bfloat16, device=DEVICE)
    slots, row_grads, _ = _rows(37, 72, 5, torch.bfloat16, seed=1)
    return dict(weight=weight, state=ParamState(weight, get_rule("adamw"), state_dtype), hp=HYPERPARAMETERS["adamw"],
                step=1, slots=slots, row_grads=row_grads)


@pytest.mark.parametrize("change, message", [
    (lambda: dict(slots=torch.zeros(37, dtype=torch.int64, device=DEVICE)),
     r"slots must be a contiguous int32 tensor of shape \(37,\)"),
    (lambda: dict(slots=torch.zeros(36, dtype=torch.int32, device=DEVICE)),
     r"slots must be a contiguous int32 tensor of shape \(37,\)"),
    (lambda: dict(slots=torch.zeros(37, 2, dtype=torch.int32, device=DEVICE)[:, 0]),
     r"slots must be a contiguous int32"),
    (lambda: dict(row_grads=torch.zeros(5, 71, dtype=torch.bfloat16, device=DEVICE)),
     r"row_grads must be \(T, 72\) \(the weight's width\)"),
    (lambda: dict(row_grads=torch.zeros(5, 72, device=DEVICE)),
     r"row_grads must have the weight's dtype torch.bfloat16"),
    (lambda: dict(config=RowUpdateConfig(16, 96, 4)), r"block_n must be a power of two"),
    (lambda: dict(config=RowUpdateConfig(16, 32, 4)), r"int8 states need block_n a multiple of 64"),
])
def test_bad_arguments_are_one_line_value_errors(change, message: str) -> None:
    arguments = {**_arguments("int8"), **change()}
    with pytest.raises(ValueError, match=message) as error:
        row_update(arguments.pop("weight"), arguments.pop("state"), arguments.pop("hp"), arguments.pop("step"),
                   **arguments)
    assert "\n" not in str(error.value)


def test_device_scalars_are_checked_as_the_fused_kernels() -> None:
    arguments = _arguments()
    buffer = torch.zeros(NUM_SCALARS, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="row_update: stochastic rounding draws a new seed every step"):
        row_update(arguments.pop("weight"), arguments.pop("state"), arguments.pop("hp"), arguments.pop("step"),
                   device_scalars=buffer, stochastic_rounding=True, **arguments)
    arguments = _arguments()
    with pytest.raises(ValueError, match="device_scalars must be a contiguous 1-D float32 tensor"):
        row_update(arguments.pop("weight"), arguments.pop("state"), arguments.pop("hp"), arguments.pop("step"),
                   device_scalars=buffer[:4], **arguments)
