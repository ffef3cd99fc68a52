"""fp8 moment states (``state_dtype="fp8"``): float8_e4m3fn codes with one fp32 scale per 64 elements of
a row (forge_core.state's spec), and the kernels' codec (forge_core.kernels.codec) against it, bit for
bit in the CPU interpreter."""
from __future__ import annotations

import copy

import pytest
import torch
import triton
import triton.language as tl

import forge_core
from forge_core.kernels import codec
from forge_core.kernels.device import interpreting
from forge_core.rules import get_rule
from forge_core.state import FP8_MAX, QBLOCK, ParamState, dequantize_blockwise, quantize_blockwise

SMALLEST = 2.0 ** -9            # the smallest positive e4m3fn value
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"      # the CPU runs the kernels interpreted


def test_codes_are_torchs_nearest_even_of_the_scaled_values():
    x = torch.randn(6, 150) * torch.logspace(-4, 3, 6).unsqueeze(1)
    q, scale = quantize_blockwise(x, sqrt_domain=False, codes="fp8")
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (6, 3)
    padded = torch.nn.functional.pad(x, (0, 192 - 150)).reshape(6, 3, QBLOCK)
    assert torch.equal(scale, padded.abs().amax(-1) / FP8_MAX)
    inverse = (1.0 / scale).repeat_interleave(QBLOCK, dim=1)[:, :150]
    assert torch.equal(q.view(torch.uint8), (x * inverse).to(torch.float8_e4m3fn).view(torch.uint8))
    # the block maximum is 448 exactly, and every code decodes within half an fp8 step (1/16 relative)
    assert torch.all(q.float().abs().amax(-1) == FP8_MAX)
    back = dequantize_blockwise(q, scale, sqrt_domain=False)
    per_element = scale.repeat_interleave(QBLOCK, dim=1)[:, :150]
    assert torch.all((back - x).abs() <= x.abs() / 16 * (1 + 1e-6) + per_element * SMALLEST / 2)


def test_ties_round_to_even_and_subnormals_keep_their_grid():
    row = torch.zeros(1, 64)
    values = [448.0, 1.0625, 1.1875, -1.0625, 3 * 2.0 ** -10, 2.0 ** -10, 5 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -11]
    row[0, :len(values)] = torch.tensor(values)
    q, scale = quantize_blockwise(row, sqrt_domain=False, codes="fp8")
    assert scale.item() == 1.0
    assert q.float()[0, :len(values)].tolist() == [448.0, 1.0, 1.25, -1.0, 2 * SMALLEST, 0.0, 2 * SMALLEST, 2.0 ** -6]


def test_sqrt_domain_codes_are_floored_at_the_smallest_code_and_a_zero_block_stays_zero():
    v = torch.zeros(2, 64)
    v[0, 0] = 1e4
    v[0, 1:] = 1e-14            # its square root rounds to code 0 next to sqrt(1e4)
    q, scale = quantize_blockwise(v, sqrt_domain=True, codes="fp8")
    back = dequantize_blockwise(q, scale, sqrt_domain=True)
    assert torch.all(back[0] > 0) and back[0, 1].item() == pytest.approx((100.0 / FP8_MAX * SMALLEST) ** 2, rel=1e-5)
    assert back[0, 0].item() == pytest.approx(1e4, rel=1e-5)
    assert torch.all(back[1] == 0) and torch.all(scale[1] == 0)


def test_a_subnormal_block_scale_keeps_its_scale_and_stores_zero_codes():
    x = torch.zeros(1, 64)
    x[0, :3] = torch.tensor([1e-37, -5e-38, 3e-38])
    q, scale = quantize_blockwise(x, sqrt_domain=False, codes="fp8")
    assert 0.0 < scale.item() < torch.finfo(torch.float32).tiny
    assert torch.all(q.float() == 0)


def test_param_state_stores_fp8_codes_and_block_scales():
    state = ParamState(torch.zeros(5, 70), get_rule("adamw"), "fp8")
    assert all(v.dtype == torch.float8_e4m3fn for v in state.values.values())
    assert all(s.shape == (5, 2) and s.dtype == torch.float32 for s in state.scales.values())
    assert state.nbytes() == 2 * (5 * 70 + 5 * 2 * 4)           # 1 byte a state element + 4 per 64
    value = torch.randn(5, 70)
    state.store("exp_avg", value)
    codes, scale = quantize_blockwise(value, sqrt_domain=False, codes="fp8")
    assert torch.equal(state.values["exp_avg"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(state.dequantize("exp_avg"), dequantize_blockwise(codes, scale, sqrt_domain=False))


@triton.jit
def _roundtrip_kernel(X, CODES, DECODED, N: tl.constexpr):
    offsets = tl.arange(0, N)
    code = codec.fp8_bits_nearest_even(tl.load(X + offsets))
    tl.store(CODES + offsets, code.to(tl.uint8))
    tl.store(DECODED + offsets, codec.fp8_to_float(tl.load(CODES + offsets), False))


@pytest.mark.skipif(not interpreting(), reason="checks the interpreter's integer codec; compiled for a GPU the "
                    "kernels convert with the hardware's fp8 instructions (HW_MATH), not this codec")
def test_the_interpreters_codec_is_torchs_conversion_bit_for_bit():
    """Every fp8 value, every midpoint between neighbours (ties), their fp32 neighbours, and random
    values across the range: the integer rounding and decoding the interpreter runs give torch's bits."""
    every_code = torch.arange(256, dtype=torch.uint8)
    every_code = every_code[(every_code & 0x7F) != 0x7F]                       # no NaN codes
    grid = every_code.view(torch.float8_e4m3fn).float()
    ordered = torch.sort(grid[grid >= 0]).values
    midpoints = (ordered[1:] + ordered[:-1]) / 2
    near = torch.cat([midpoints, torch.nextafter(midpoints, torch.zeros(())),
                      torch.nextafter(midpoints, torch.full((), 500.0))])
    random = torch.randn(4096) * torch.exp2(torch.randint(-14, 8, (4096,)).float())
    x = torch.cat([grid, near, -near, random.clamp(-FP8_MAX, FP8_MAX), torch.tensor([0.0, -0.0, 1e-40])])
    n = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel()))
    codes = torch.empty(n, dtype=torch.uint8)
    decoded = torch.empty(n)
    _roundtrip_kernel[(1,)](x, codes, decoded, n)
    assert torch.equal(codes, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(decoded.view(torch.int32), codes.view(torch.float8_e4m3fn).float().view(torch.int32))


@pytest.mark.parametrize("embedding_rows", [True, False], ids=["row-update", "dense-grad"])
def test_fp8_states_through_fuse_follow_the_reference_backend(embedding_rows: bool, monkeypatch):
    """AdamW with fp8 states on a fused weight and an embedding (its row update, or the dense ``.grad``
    step of a 2-D fallback weight) against the reference backend, which quantizes with state.py: after
    three steps the weights agree to float rounding and the states to one fp8 step of their block."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")          # on the GPU: the untuned tile, no tuning of tiny shapes
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Embedding(23, 70), torch.nn.Linear(70, 37)).to(DEVICE)
    runs = {}
    for backend in ("triton", "reference"):
        model = copy.deepcopy(start)
        opt = forge_core.fuse(model, "adamw", backend=backend, state_dtype="fp8", probe_inputs=False, lr=1e-3,
                              embedding_rows=embedding_rows)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids, target = torch.randint(0, 23, (19,), generator=generator), torch.randn(19, 37, generator=generator)
            ids, target = ids.to(DEVICE), target.to(DEVICE)
            (model(ids) * target).sum().backward()
            opt.step()
            opt.zero_grad()
        owners = list(opt._bindings) + list(opt.dense_weights())
        assert [o.state.state_dtype for o in owners] == ["fp8", "fp8"]
        runs[backend] = (model, owners)
    (model, owners), (ref_model, ref_owners) = runs["triton"], runs["reference"]
    for ours, theirs in zip(model.parameters(), ref_model.parameters()):
        assert (ours - theirs).abs().max() <= 2e-4          # a step is at most lr = 1e-3
    for owner, ref_owner in zip(owners, ref_owners):
        for name in owner.state.state_names:
            ours, theirs = owner.state.dequantize(name), ref_owner.state.dequantize(name)
            assert (ours - theirs).abs().max() <= theirs.abs().max() / 8, name
