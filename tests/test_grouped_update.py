"""``grouped_wgrad_update``: every row group of a weight stepped from its own token range in one
launch equals the reference stepping each group alone, empty groups (a zero gradient) included."""
import os
import subprocess
import sys

import pytest
import torch

from forge_core.kernels import triton_available
from forge_core.kernels.reference import reference_wgrad_update
from forge_core.kernels.tile_config import TileConfig
from kernel_pairs import HP, assert_storage_close, default_device, make_inputs, state_pair  # noqa: F401

if not triton_available():
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)

from forge_core.kernels.grouped_update import grouped_wgrad_update  # noqa: E402

GROUP_TOKENS = (7, 0, 33, 1, 29)        # ragged counts, one group no token reached
ROWS = 24                               # rows per group: not a multiple of the tile's 32


def _ends() -> torch.Tensor:
    return torch.cumsum(torch.tensor(GROUP_TOKENS), 0).to(torch.int32)


def _reference_by_group(x, dy, weight, state, rule_name, step, grad_accum=None) -> None:
    start = 0
    for group, count in enumerate(GROUP_TOKENS):
        r0, r1 = group * ROWS, (group + 1) * ROWS
        accum = grad_accum[r0:r1] if grad_accum is not None else None
        reference_wgrad_update(x[start:start + count], dy[start:start + count], weight[r0:r1], state.rows(r0, r1),
                               HP[rule_name], step, grad_accum=accum)
        start += count


def _assert_pair_close(pair) -> None:
    (w_ours, s_ours), (w_ref, s_ref) = pair
    assert_storage_close(w_ours, w_ref, "weight")
    for name in s_ref.values:
        assert_storage_close(s_ours.values[name], s_ref.values[name], name)


@pytest.mark.parametrize("rule_name", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_groups_in_one_launch_equal_each_group_stepped_alone(rule_name, state_dtype):
    tokens, din = sum(GROUP_TOKENS), 90
    x, dy = make_inputs(ROWS, din, (tokens,))
    pair = state_pair(torch.randn(len(GROUP_TOKENS) * ROWS, din), rule_name, state_dtype)
    (w_ours, s_ours), (w_ref, s_ref) = pair
    before = w_ours.clone()
    for step in (1, 2):
        grouped_wgrad_update(x, dy, w_ours, s_ours, _ends(), ROWS, HP[rule_name], step)
        _reference_by_group(x, dy, w_ref, s_ref, rule_name, step)
    _assert_pair_close(pair)
    empty = slice(ROWS, 2 * ROWS)                # group 1: no token, still stepped (decay, moments)
    if rule_name != "sgd" or state_dtype == "fp32":
        assert not torch.equal(w_ours[empty], before[empty])


def test_bf16_inputs_a_column_split_and_an_accumulator():
    tokens, din = sum(GROUP_TOKENS), 200
    x, dy = make_inputs(ROWS, din, (tokens,), torch.bfloat16, seed=3)
    pair = state_pair(torch.randn(len(GROUP_TOKENS) * ROWS, din).bfloat16(), "adamw", "bf16")
    (w_ours, s_ours), (w_ref, s_ref) = pair
    accum = torch.randn(w_ours.shape) * 0.05
    config = TileConfig(32, 128, 32, 8, 4, 1, split_n=2)
    grouped_wgrad_update(x, dy, w_ours, s_ours, _ends(), ROWS, HP["adamw"], 3, grad_accum=accum.clone(),
                         config=config)
    _reference_by_group(x, dy, w_ref, s_ref, "adamw", 3, grad_accum=accum.clone())
    _assert_pair_close(pair)


def test_seed_stride_gives_each_group_its_own_rounding_stream():
    tokens, din = sum(GROUP_TOKENS), 64
    x, dy = make_inputs(ROWS, din, (tokens,), torch.bfloat16)
    start = torch.randn(len(GROUP_TOKENS) * ROWS, din).bfloat16()
    results = []
    for stride in (0, 0x9E3779B1, 0x9E3779B1):
        (weight, state), _ = state_pair(start.clone(), "adamw", "fp32")
        grouped_wgrad_update(x, dy, weight, state, _ends(), ROWS, HP["adamw"], 1, stochastic_rounding=True,
                             seed=11, seed_stride=stride)
        results.append(weight)
    assert torch.equal(results[1], results[2])                # the same seeds: the same weights
    assert not torch.equal(results[0], results[1])            # another stride: other noise


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "rows_per_group": 25}, "is not 5 groups of 25 rows"),
    (lambda a: {**a, "ends": a["ends"].long()}, "ends must be int32"),
    (lambda a: {**a, "dy": a["dy"][:-1]}, "with one T"),
    (lambda a: {**a, "dy": a["dy"].double()}, "share a dtype"),
])
def test_bad_arguments_name_the_problem(change, message):
    x, dy = make_inputs(ROWS, 64, (sum(GROUP_TOKENS),))
    (weight, state), _ = state_pair(torch.randn(len(GROUP_TOKENS) * ROWS, 64), "adamw", "fp32")
    arguments = change({"x": x, "dy": dy, "ends": _ends(), "rows_per_group": ROWS})
    before = weight.clone()
    with pytest.raises(ValueError, match=message):
        grouped_wgrad_update(arguments["x"], arguments["dy"], weight, state, arguments["ends"],
                             arguments["rows_per_group"], HP["adamw"], 1)
    assert torch.equal(weight, before)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_the_kernel_compiles_for_sm90_on_a_machine_without_a_gpu(state_dtype):
    """What the interpreter cannot show: Triton's sm_90 compile at Qwen3-30B-A3B's gate/up weight
    (128 experts of 1536 x 2048 rows, 512 tokens x top-8 padded), in a process without
    TRITON_INTERPRET, at the GPU's fixed tile."""
    code = ("from forge_core.kernels import grouped_update; "
            f"k = grouped_update.compile_offline(128, 1536, 2048, 8192, {state_dtype!r}); "
            "print(len(k.asm['cubin']) > 0, k.metadata.shared)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2] == "True"
