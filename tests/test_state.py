"""forge_core.state: int8 block quantization (the spec the kernel reproduces) and ParamState."""
import math

import pytest
import torch

from forge_core.rules import get_rule
from forge_core.state import (QBLOCK, STATE_DTYPES, ParamState, dequantize_blockwise, num_blocks,
                              quantize_blockwise)


@pytest.mark.parametrize("din", [64, 70, 130, 4100])
def test_signed_roundtrip_error_is_at_most_half_a_step(din):
    torch.manual_seed(din)
    x = torch.randn(5, din) * torch.logspace(-3, 2, 5).unsqueeze(1)
    q, scale = quantize_blockwise(x, sqrt_domain=False)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.shape == (5, num_blocks(din)) and scale.dtype == torch.float32
    back = dequantize_blockwise(q, scale, sqrt_domain=False)
    per_element_scale = scale.repeat_interleave(QBLOCK, dim=1)[:, :din]
    assert torch.all((back - x).abs() <= per_element_scale * 0.5 * (1 + 1e-5) + 1e-30)
    # the block maximum is represented exactly by code +-127
    assert int(q.abs().max()) == 127


def test_ragged_last_block_uses_only_its_own_elements():
    x = torch.zeros(1, 70)
    x[0, :64] = 100.0          # a big first block
    x[0, 64:] = torch.linspace(-1, 1, 6)
    q, scale = quantize_blockwise(x, sqrt_domain=False)
    assert scale.shape == (1, 2)
    assert scale[0, 1].item() == pytest.approx(1.0 / 127.0)
    assert q[0, 64].item() == -127 and q[0, 69].item() == 127


def test_round_half_to_even():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 0.49, -0.51, 126.5]])
    q, scale = quantize_blockwise(x, sqrt_domain=False)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 0, 2, -2, 0, -1, 126]]


def test_sqrt_domain_keeps_second_moment_positive_and_finite():
    v = torch.zeros(2, 90)
    v[0, 0] = 1e4
    v[0, 1:] = 1e-12            # tiny next to the block max: would round to code 0
    q, scale = quantize_blockwise(v, sqrt_domain=True)
    back = dequantize_blockwise(q, scale, sqrt_domain=True)
    assert torch.all(back[0] > 0) and torch.all(torch.isfinite(back))
    assert back[0, 1].item() == pytest.approx((math.sqrt(1e4) / 127) ** 2, rel=1e-5)
    assert back[0, 0].item() == pytest.approx(1e4, rel=1e-5)
    assert torch.all(back[1] == 0)      # an all-zero block stays exactly zero
    assert torch.all(scale[1] == 0)


@pytest.mark.parametrize("codes, smallest", [("int8", 1.0), ("fp8", 2.0 ** -9)])
def test_a_floored_state_keeps_every_value_at_the_smallest_code_or_above(codes: str, smallest: float):
    """Adamax's ``exp_inf`` (``Rule.floored_states``): coded as it is, codes floored where the block's
    scale is normal; an all-zero block stays zero, a subnormal one codes zero."""
    u = torch.zeros(3, 70)
    u[0, 0], u[0, 1:64] = 50.0, 1e-9        # below half a code next to 50: code 0 unfloored
    u[0, 64:] = torch.tensor([1e-3, 2.0, 1e-12, 0.5, 1e-7, 3.0])
    u[2, :2] = torch.tensor([1e-37, 5e-38])
    plain_q, plain_scale = quantize_blockwise(u, sqrt_domain=False, codes=codes)
    q, scale = quantize_blockwise(u, sqrt_domain=False, codes=codes, floored=True)
    assert torch.equal(scale, plain_scale)
    assert float(plain_q[0, 1].float()) == 0.0 and float(q[0, 1].float()) == smallest
    back = dequantize_blockwise(q, scale, sqrt_domain=False)
    step = scale.repeat_interleave(QBLOCK, dim=1)[:, :70]
    assert torch.all(back[0] >= step[0] * smallest * (1 - 1e-6))      # never 0 next to a non-zero maximum
    assert back[0, 0].item() == pytest.approx(50.0, rel=1e-6)
    assert torch.all(q[1].float() == 0) and torch.all(scale[1] == 0)
    assert 0.0 < scale[2, 0].item() < torch.finfo(torch.float32).tiny and torch.all(q[2].float() == 0)


@pytest.mark.parametrize("state_dtype", ["int8", "fp8"])
def test_adamax_stores_exp_inf_floored_and_exp_avg_as_it_is(state_dtype: str):
    rule = get_rule("adamax")
    value = torch.zeros(2, 64)
    value[:, 0], value[:, 1] = 10.0, 1e-9
    state = ParamState(value, rule, state_dtype)
    assert state.code_domain("exp_inf") == 2 and state.code_domain("exp_avg") == 0
    assert state.is_floored("exp_inf") and not state.is_sqrt_domain("exp_inf")
    assert ParamState(value, get_rule("adamw"), state_dtype).code_domain("exp_avg_sq") == 1
    state.store("exp_inf", value)
    state.store("exp_avg", value)
    assert torch.all(state.dequantize("exp_inf") > 0)
    assert state.dequantize("exp_avg")[0, 1].item() == 0.0


def test_sqrt_domain_clamps_negative_inputs():
    q, scale = quantize_blockwise(torch.tensor([[-1.0, 4.0]]), sqrt_domain=True)
    back = dequantize_blockwise(q, scale, sqrt_domain=True)
    assert torch.all(back >= 0)


def test_quantize_rejects_empty_and_dequantize_checks_shapes():
    with pytest.raises(ValueError, match="non-empty"):
        quantize_blockwise(torch.zeros(3, 0), sqrt_domain=False)
    with pytest.raises(ValueError, match="int8"):
        dequantize_blockwise(torch.zeros(2, 64), torch.zeros(2, 1), sqrt_domain=False)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_blockwise(torch.zeros(2, 65, dtype=torch.int8), torch.zeros(2, 1), sqrt_domain=False)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_param_state_layout_store_and_dequantize(state_dtype):
    weight = torch.randn(7, 130)
    state = ParamState(weight, get_rule("adamw"), state_dtype)
    assert set(state.values) == {"exp_avg", "exp_avg_sq"}
    expected_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                      "fp8": torch.float8_e4m3fn}[state_dtype]
    for name in state.values:
        assert state.values[name].dtype == expected_dtype and state.values[name].shape == (7, 130)
        assert torch.all(state.dequantize(name) == 0)
        if state_dtype in ("int8", "fp8"):
            assert state.scales[name].shape == (7, 3)
        else:
            assert state.scales[name] is None
    value = torch.rand(7, 130)
    state.store("exp_avg_sq", value)
    # fp8: sqrt(v) within half an e4m3 step (1/16 relative), so v within 1/8 and a bit
    tolerance = {"fp32": 0.0, "bf16": 2 ** -8, "int8": 2.0 / 127, "fp8": 0.13}[state_dtype]
    assert torch.allclose(state.dequantize("exp_avg_sq"), value, rtol=tolerance, atol=tolerance)
    per_element = {"fp32": 4, "bf16": 2, "int8": 1, "fp8": 1}[state_dtype]
    expected_bytes = 2 * 7 * 130 * per_element + (2 * 7 * 3 * 4 if state_dtype in ("int8", "fp8") else 0)
    assert state.nbytes() == expected_bytes


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_state_dict_round_trip_is_exact(state_dtype):
    weight = torch.randn(5, 70)
    state = ParamState(weight, get_rule("adamw"), state_dtype)
    state.store("exp_avg", torch.randn(5, 70))
    state.store("exp_avg_sq", torch.rand(5, 70))
    saved = {k: v.clone() for k, v in state.state_dict().items()}
    if state_dtype in ("int8", "fp8"):
        assert set(saved) == {"exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"}
    else:
        assert set(saved) == {"exp_avg", "exp_avg_sq"}
    other = ParamState(weight, get_rule("adamw"), state_dtype)
    other.load_state_dict(saved)
    for key, value in other.state_dict().items():
        assert torch.equal(value, saved[key])
    with pytest.raises(KeyError, match="exp_avg"):
        other.load_state_dict({})
    bad = dict(saved)
    bad["exp_avg"] = saved["exp_avg"][:, :3]
    with pytest.raises(ValueError, match="expected"):
        other.load_state_dict(bad)


def test_param_state_rejects_bad_arguments():
    with pytest.raises(ValueError, match="state_dtype"):
        ParamState(torch.zeros(2, 2), get_rule("sgd"), "fp4")
    with pytest.raises(ValueError, match="2-D"):
        ParamState(torch.zeros(4), get_rule("sgd"), "fp32")
    state = ParamState(torch.zeros(2, 3), get_rule("sgd"), "fp32")
    with pytest.raises(KeyError, match="no state"):
        state.dequantize("exp_avg")
    with pytest.raises(ValueError, match="shape"):
        state.store("momentum_buffer", torch.zeros(3, 2))


def test_subnormal_block_scale_keeps_its_scale_and_stores_zero_codes():
    x = torch.zeros(2, 64)
    x[0, :5] = torch.tensor([1e-37, -5e-38, 0.0, 3e-38, 1e-45])
    x[1, :2] = torch.tensor([1.0, -0.25])
    q, scale = quantize_blockwise(x, sqrt_domain=False)
    assert 0.0 < scale[0, 0].item() < torch.finfo(torch.float32).tiny
    assert torch.all(q[0] == 0)
    assert q[1, :2].tolist() == [127, -32]
    assert torch.all(torch.isfinite(dequantize_blockwise(q, scale, sqrt_domain=False)))
