"""The fused Triton kernel (TRITON_INTERPRET=1 on CPU) against the plain-torch reference.

Shapes are deliberately odd (Dout=70, Din=90, BT=100 as 2x50) so every mask is exercised.
A step of each side starts from identical weights and states; for bf16 / int8 storage the
two sides may differ by one rounding step where fp32 summation order differs. Tile tuning:
test_tuning.py; the shared helpers: kernel_pairs.py.
"""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge_core.kernels import (dispatch, fused_wgrad_update, launch, reference_wgrad_update, tile_config,
                                tile_kernel, tuning)
from forge_core.kernels.direct_launch import constexpr_tail
from forge_core.kernels.reference import flatten_tokens
from forge_core.kernels.tile_config import TileConfig, default_config
from forge_core.rules import get_rule
from forge_core.state import QBLOCK, STATE_DTYPES, ParamState
from kernel_pairs import (DEVICE, HP, assert_storage_close, copy_state, make_inputs, state_pair,
                          default_device)  # noqa: F401  (default_device: an autouse fixture)


def _compare_step(x, dy, pair, rule_name, step, **kwargs):
    (w_fused, s_fused), (w_ref, s_ref) = pair
    hp = HP[rule_name]
    before = w_fused.clone()
    fused_wgrad_update(x, dy, w_fused, s_fused, hp, step, **kwargs)
    reference_wgrad_update(x, dy, w_ref, s_ref, hp, step, **kwargs)
    assert not torch.equal(w_fused, before), "the fused step changed nothing"
    assert_storage_close(w_fused, w_ref, f"weight at step {step}")
    for name in s_ref.values:
        assert_storage_close(s_fused.values[name], s_ref.values[name], f"{name} at step {step}")
        if s_ref.scales[name] is not None:
            torch.testing.assert_close(s_fused.scales[name], s_ref.scales[name], rtol=2e-6, atol=0)
    # continue both from the fused side's result, so each step is compared from equal inputs
    w_ref.copy_(w_fused)
    copy_state(s_ref, s_fused)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["w32", "w16"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("rule_name", ["adamw", "sgd", "lion"])
def test_fused_matches_reference(rule_name, state_dtype, weight_dtype):
    x, dy = make_inputs(70, 90, (2, 50))
    weight = torch.randn(70, 90).to(weight_dtype)
    pair = state_pair(weight, rule_name, state_dtype)
    for step in (1, 2):
        _compare_step(x, dy, pair, rule_name, step)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("shape,config", [
    ((70, 90, 100), TileConfig(32, 64, 32, 8, 4, 1, prefetch=True)),      # ragged, W/states loaded first
    ((64, 128, 64), TileConfig(32, 64, 32, 8, 4, 1)),                     # every tile full: no masks
    ((64, 128, 64), TileConfig(32, 64, 32, 8, 4, 1, prefetch=True)),
    # prefetch with a column split: slab 0 before the main loop, each later slab one slab ahead
    ((70, 200, 100), TileConfig(32, 128, 32, 8, 4, 1, prefetch=True, split_n=2)),   # ragged
    # ragged in M, N and K with 16-byte rows: the TMA main loop, zero-filled past the edges
    ((72, 200, 100), TileConfig(32, 128, 32, 8, 4, 1, prefetch=True, split_n=2)),
    ((64, 256, 64), TileConfig(32, 128, 32, 8, 4, 1, prefetch=True, split_n=2)),
    ((70, 300, 100), TileConfig(32, 256, 32, 8, 4, 1, prefetch=True, split_n=4)),   # ragged, four slabs
    ((64, 256, 64), TileConfig(32, 256, 32, 8, 4, 1, prefetch=True, split_n=4)),
    ((70, 300, 100), TileConfig(32, 256, 32, 8, 4, 1, split_n=4)),
])
def test_kernel_variants_match_reference(shape, config, state_dtype):
    dout, din, tokens = shape
    x, dy = make_inputs(dout, din, (tokens,), torch.bfloat16, seed=5)
    (w_fused, s_fused), (w_ref, s_ref) = state_pair(torch.randn(dout, din).bfloat16(), "adamw", state_dtype)
    fused_wgrad_update(x, dy, w_fused, s_fused, HP["adamw"], 2, config=config)
    reference_wgrad_update(x, dy, w_ref, s_ref, HP["adamw"], 2)
    assert_storage_close(w_fused, w_ref, "weight")
    for name in s_ref.values:
        assert_storage_close(s_fused.values[name], s_ref.values[name], name)


@pytest.mark.parametrize("rule_name", ["sgd", "lion"])
def test_prefetched_slabs_with_one_state(rule_name):
    """One-state rules through the prefetching split epilogue (the second state slot stays empty)."""
    x, dy = make_inputs(70, 300, (100,), torch.bfloat16, seed=7)
    pair = state_pair(torch.randn(70, 300).bfloat16(), rule_name, "bf16")
    (w_fused, s_fused), (w_ref, s_ref) = pair
    config = TileConfig(32, 256, 32, 8, 4, 1, prefetch=True, split_n=4)
    for step in (1, 2):
        fused_wgrad_update(x, dy, w_fused, s_fused, HP[rule_name], step, config=config)
        reference_wgrad_update(x, dy, w_ref, s_ref, HP[rule_name], step)
        assert_storage_close(w_fused, w_ref, f"weight, step {step}")
        for name in s_ref.values:
            assert_storage_close(s_fused.values[name], s_ref.values[name], name)
        w_ref.copy_(w_fused)
        copy_state(s_ref, s_fused)


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(input_dtype):
    x, dy = make_inputs(70, 90, (100,), input_dtype, seed=3)
    pair = state_pair(torch.randn(70, 90), "adamw", "fp32")
    _compare_step(x, dy, pair, "adamw", 1)


@pytest.mark.parametrize("din", [70, 4100])
def test_int8_ragged_blocks(din):
    x, dy = make_inputs(3, din, (40,), seed=din)
    pair = state_pair(torch.randn(3, din), "adamw", "int8")
    assert pair[0][1].scales["exp_avg"].shape == (3, -(-din // QBLOCK))
    for step in (1, 2):
        _compare_step(x, dy, pair, "adamw", step)


def test_int8_subnormal_block_scale_stores_zero_codes():
    """A first moment decaying with zero gradients reaches blocks whose scale is subnormal, where
    1 / scale overflows (and the GPU's hardware reciprocal flushes the divisor to 0): without a
    guard a zero element becomes a NaN pattern (code -1 on the GPU) and the others inf patterns.
    Such blocks store zero codes (state.py), which decode to finite values."""
    weight = torch.randn(4, 128)
    state = ParamState(weight, get_rule("adamw"), "int8")
    moment = torch.rand(4, 128) * 1e-37
    moment[:, ::3] = 0.0
    state.store("exp_avg", moment)
    state.store("exp_avg_sq", torch.full((4, 128), 1e-4))
    assert state.scales["exp_avg"].max().item() < 1.1754943508222875e-38      # subnormal scales
    x = torch.randn(8, 128)
    dy = torch.zeros(8, 4)
    hp = dict(HP["adamw"], weight_decay=0.0)
    fused_wgrad_update(x, dy, weight, state, hp, 1)
    assert torch.all(state.values["exp_avg"] == 0)
    assert torch.all(torch.isfinite(state.dequantize("exp_avg")))


@pytest.mark.parametrize("rule_name,optimizer", [
    ("adamw", lambda p, hp: torch.optim.AdamW(p, **hp, foreach=False)),
    ("sgd", lambda p, hp: torch.optim.SGD(p, **hp, foreach=False)),
])
def test_fp32_fused_steps_match_torch_optim(rule_name, optimizer):
    hp = dict(HP[rule_name])
    if rule_name == "sgd":
        hp = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.05)
    weight = torch.randn(70, 90)
    state = ParamState(weight, get_rule(rule_name), "fp32")
    fused_weight = weight.clone()
    param = torch.nn.Parameter(weight.clone())
    opt = optimizer([param], hp)
    for step in (1, 2, 3):
        x, dy = make_inputs(70, 90, (2, 50), seed=10 + step)
        fused_wgrad_update(x, dy, fused_weight, state, hp, step)
        param.grad = dy.reshape(-1, 70).t() @ x.reshape(-1, 90)
        opt.step()
        torch.testing.assert_close(fused_weight, param.detach(), rtol=1e-6, atol=1e-6)


def test_grad_accum_is_added_before_the_rule():
    x1, dy1 = make_inputs(70, 90, (60,), seed=1)
    x2, dy2 = make_inputs(70, 90, (40,), seed=2)
    accum = dy1.t() @ x1
    weight = torch.randn(70, 90)
    (w_fused, s_fused), (w_ref, s_ref) = state_pair(weight, "adamw", "fp32")
    fused_wgrad_update(x2, dy2, w_fused, s_fused, HP["adamw"], 1, grad_accum=accum)
    reference_wgrad_update(torch.cat([x1, x2]), torch.cat([dy1, dy2]), w_ref, s_ref, HP["adamw"], 1)
    torch.testing.assert_close(w_fused, w_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s_fused.values["exp_avg"], s_ref.values["exp_avg"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("update", [fused_wgrad_update, reference_wgrad_update], ids=["fused", "reference"])
def test_stochastic_rounding_is_unbiased_between_neighbours(update):
    ulp = 2.0 ** -7                      # bf16 spacing in [1, 2)
    fraction = 0.3
    weight = torch.ones(70, 90, dtype=torch.bfloat16)
    state = ParamState(weight, get_rule("sgd"), "fp32")
    x = torch.full((1, 90), -fraction * ulp)
    dy = torch.ones(1, 70)                 # G = -0.3 ulp everywhere; w <- 1 + 0.3 ulp
    update(x, dy, weight, state, dict(lr=1.0), 1, stochastic_rounding=True, seed=123)
    values = weight.float()
    assert torch.all((values == 1.0) | (values == 1.0 + ulp))
    up = (values == 1.0 + ulp).float().mean().item()
    sigma = (fraction * (1 - fraction) / values.numel()) ** 0.5
    assert abs(up - fraction) < 5 * sigma
    # deterministic per seed, different across seeds
    again = torch.ones(70, 90, dtype=torch.bfloat16)
    update(x, dy, again, ParamState(again, get_rule("sgd"), "fp32"), dict(lr=1.0), 1, stochastic_rounding=True, seed=123)
    other = torch.ones(70, 90, dtype=torch.bfloat16)
    update(x, dy, other, ParamState(other, get_rule("sgd"), "fp32"), dict(lr=1.0), 1, stochastic_rounding=True, seed=9)
    assert torch.equal(again, weight) and not torch.equal(other, weight)


def test_round_to_nearest_without_stochastic_rounding():
    weight = torch.ones(70, 90, dtype=torch.bfloat16)
    x = torch.full((1, 90), -0.3 * 2.0 ** -7)
    fused_wgrad_update(x, torch.ones(1, 70), weight, ParamState(weight, get_rule("sgd"), "fp32"), dict(lr=1.0), 1)
    assert torch.all(weight == 1.0)


class _AllocationWatcher(TorchDispatchMode):
    """Records every fp32 tensor of at least ``numel`` elements a torch op creates (new storage)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.found = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        in_storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel \
                    and t.untyped_storage().data_ptr() not in in_storages:
                self.found.append(str(func))
        return out


def test_fused_step_never_allocates_a_weight_shaped_fp32_tensor():
    x, dy = make_inputs(70, 90, (2, 50), torch.bfloat16)
    for update, should_allocate in ((reference_wgrad_update, True), (fused_wgrad_update, False)):
        weight = torch.randn(70, 90, dtype=torch.bfloat16)
        state = ParamState(weight, get_rule("adamw"), "bf16")
        with _AllocationWatcher(70 * 90) as watcher:
            update(x, dy, weight, state, HP["adamw"], 1)
        assert bool(watcher.found) == should_allocate, (update.__name__, watcher.found)


def test_three_d_inputs_are_flattened_as_views():
    x = torch.randn(2, 50, 90)
    assert flatten_tokens(x, 90, "x").data_ptr() == x.data_ptr()
    assert flatten_tokens(x, 90, "x")._base is x
    sliced = torch.randn(2, 50, 180)[..., :90]          # row-strided: still one 2-D view
    flat = flatten_tokens(sliced, 90, "x")
    assert flat.data_ptr() == sliced.data_ptr() and flat.stride() == (180, 1)
    pair = state_pair(torch.randn(70, 90), "sgd", "fp32")
    dy = torch.randn(2, 50, 140)[..., ::2]              # column-strided dY
    _compare_step(sliced, dy, pair, "sgd", 1)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.randn(10, 91)), r"x must have shape"),
    (dict(dy=torch.randn(11, 70)), "tokens"),
    (dict(x=torch.randn(10, 90, dtype=torch.float64)), "dtypes"),
    (dict(x=torch.randn(10, 90).bfloat16()), "share a dtype"),
    (dict(weight=torch.randn(70, 90).half()), "weight dtype"),
    (dict(grad_accum=torch.randn(70, 90).half()), "grad_accum"),
])
@pytest.mark.parametrize("update", [fused_wgrad_update, reference_wgrad_update], ids=["fused", "reference"])
def test_bad_arguments_raise_clear_errors(update, bad, match):
    args = dict(x=torch.randn(10, 90), dy=torch.randn(10, 70), weight=torch.randn(70, 90), grad_accum=None)
    args.update(bad)
    state = ParamState(torch.zeros(70, 90), get_rule("adamw"), "fp32")
    with pytest.raises(ValueError, match=match):
        update(args["x"], args["dy"], args["weight"], state, HP["adamw"], 1, grad_accum=args["grad_accum"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_changing_lr_does_not_recompile():
    x, dy = make_inputs(256, 256, (128,), torch.bfloat16)
    x, dy = x.cuda(), dy.cuda()
    weight = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    state = ParamState(weight, get_rule("adamw"), "bf16")
    config = default_config(256, 256, 128, 2)
    fused_wgrad_update(x, dy, weight, state, dict(HP["adamw"], lr=1e-3), 1, config=config)
    kernel = tile_kernel.fused_wgrad_update_kernel
    compiled = sum(len(c) for c in kernel.device_caches.values()) if hasattr(kernel, "device_caches") else None
    for step, lr in enumerate([2e-3, 5e-4, 1e-5], start=2):
        fused_wgrad_update(x, dy, weight, state, dict(HP["adamw"], lr=lr), step, config=config)
    if compiled is not None:
        assert sum(len(c) for c in kernel.device_caches.values()) == compiled


def test_launch_plan_is_reused_and_follows_every_change(monkeypatch):
    """The per-weight launch plan (host-overhead cache) must never serve stale arguments: a new lr
    and step, a new token count and a replaced state tensor all reach the kernel."""
    launches = []
    real_run = launch.run_plan
    monkeypatch.setattr(launch, "run_plan", lambda plan, *a: (launches.append(plan), real_run(plan, *a))[1])
    (w_ours, s_ours), (w_ref, s_ref) = state_pair(torch.randn(70, 90), "adamw", "fp32")
    hp = dict(HP["adamw"])
    cached = []
    for step, (lr, tokens) in enumerate([(1e-2, (2, 50)), (3e-3, (2, 50)), (3e-3, (37,)), (5e-3, (37,))], 1):
        hp["lr"] = lr
        x, dy = make_inputs(70, 90, tokens, seed=step)
        if step == 4:   # a load that replaces a state tensor instead of copying into it
            for state in (s_ours, s_ref):
                state.values["exp_avg"] = state.values["exp_avg"].clone()
        # a pinned config: plans are cached for tuned and pinned configs, not for the untuned
        # default this file's GPU runs use (FORGE_AUTOTUNE=0)
        fused_wgrad_update(x, dy, w_ours, s_ours, hp, step, config=tile_config.INTERPRETER_CONFIG)
        reference_wgrad_update(x, dy, w_ref, s_ref, hp, step)
        assert_storage_close(w_ours, w_ref, f"weight, step {step}")
        for name in s_ref.values:
            assert_storage_close(s_ours.values[name], s_ref.values[name], f"{name}, step {step}")
        (plan,) = dispatch.PLANS[s_ours].values()
        cached.append(plan)
    assert launches[1] is cached[0] and cached[1] is cached[0], "the same layout must reuse its plan"
    assert cached[2] is not cached[1] and launches[2] is not cached[1], "a new token count needs a new plan"
    assert cached[3] is not cached[2] and launches[3] is not cached[2], "a replaced state tensor needs a new plan"


def test_direct_launcher_passes_runtime_arguments_then_constexprs(monkeypatch):
    """The direct launch hands Triton's compiled-kernel launcher what the JIT would: grid, the current
    stream, the handles, then every kernel parameter in signature order (constexprs by name from the
    plan); it steps aside (False) on another device, and is not built for a compiled object of
    another layout."""
    import triton

    from fake_triton_launch import FakeActive, plain_compiled

    calls = []
    compiled = plain_compiled(calls, lambda grid, stream, *args: ("metadata", grid, stream, len(args)))
    active = FakeActive(device=3)
    monkeypatch.setattr(triton.runtime, "driver", type("FakeDriver", (), {"active": active})())
    names = constexpr_tail(tile_kernel.fused_wgrad_update_kernel)
    assert names[0] == "EPILOGUE" and names[-1] == "QB" and "seed" not in names
    kwargs = {name: f"value-of-{name}" for name in names}
    kwargs.update(num_warps=4, num_stages=2)          # launch options, not kernel parameters
    plan = launch.LaunchPlan(TileConfig(32, 64, 32, 8, 4, 1), (7,), (), kwargs)
    direct = launch.direct_launcher(compiled, plan)
    runtime_args = ("x2", "dy2", 5, 0.5)
    assert direct(runtime_args) is True
    (call,) = calls
    constexprs = tuple(f"value-of-{name}" for name in names)
    assert call[:7] == (7, 1, 1, 1003, "function-handle", "packed", None), "no launch hook: no launch metadata"
    assert call[9:] == runtime_args + constexprs
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert direct(runtime_args) is True
    assert calls[-1][6] == ("metadata", (7,), 1003, 4 + len(names)), "a profiler's hook reads the metadata"
    del calls[1:]
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    active.device = 0
    assert direct(runtime_args) is False and len(calls) == 1, "another current device: the JIT path must run"
    assert launch.direct_launcher(object(), plan) is None


@pytest.mark.parametrize("in_memory", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_direct_arguments_are_the_jit_arguments_as_addresses(in_memory, accumulate):
    """What a direct launch passes (``direct_kernel_args``) is, position by position, what a launch through
    the JIT passes (``kernel_args``) with every tensor as its address: same order, same values."""
    from forge_core.kernels.direct_launch import as_pointers

    weight = torch.zeros(24, 40, dtype=torch.bfloat16)
    state = ParamState(weight, get_rule("adamw"), "int8")
    states, scales = launch.kernel_states(state)
    x2, dy2 = torch.zeros(9, 40, dtype=torch.bfloat16), torch.zeros(9, 24, dtype=torch.bfloat16)
    accum = torch.zeros(24, 40) if accumulate else None
    meta = launch.kernel_meta(state, torch.bfloat16, grad_accum=accumulate, stochastic=False, ieee=False,
                              scalars_in_memory=in_memory)
    plan = launch.make_plan(TileConfig(16, 32, 16, 8, 4, 1), x2, dy2, weight, states, scales, accum, meta)
    plan.fixed_pointers = as_pointers(plan.fixed_args)
    scalars = torch.arange(launch.NUM_SCALARS, dtype=torch.float32) if in_memory else \
        tuple(float(i) / 4 for i in range(launch.NUM_SCALARS))
    jit = launch.kernel_args(plan, x2, dy2, scalars, 77, accum)
    direct = launch.direct_kernel_args(plan, x2, dy2, scalars, 77, accum)
    assert direct == as_pointers(jit)
    assert not any(isinstance(argument, torch.Tensor) for argument in direct)


def test_direct_launch_of_a_tma_plan_encodes_its_descriptors(monkeypatch):
    """With Triton 3.6's launcher layout, a TMA plan's direct launch hands the raw launcher what
    Triton's descriptor wrapper would: the base arguments, then x2 and dy2, each descriptor as
    (tensor map from the kernel's own descriptor metadata, shape, strides), the rest, the constexprs;
    and ``run_plan`` builds no TensorDescriptor for it. Another layout keeps the plain direct launch."""
    import triton

    from fake_triton_launch import descriptor_meta, install

    fake = install(monkeypatch, {2, 3}, [descriptor_meta([32, 64]), descriptor_meta([32, 128], swizzle=64)])
    FakeCompiled = type(fake.compiled)
    calls, encoded = fake.calls, fake.encoded
    names = constexpr_tail(tile_kernel.fused_wgrad_update_kernel)
    kwargs = {name: f"value-of-{name}" for name in names}
    kwargs["TMA"] = True
    x2, dy2 = torch.zeros(48, 200, dtype=torch.bfloat16), torch.zeros(48, 136, dtype=torch.bfloat16)
    weight = torch.zeros(136, 200, dtype=torch.bfloat16)
    fixed = (weight, weight, weight, weight, weight, 136, 200, 48, 200, 1, 200, 1, 1, 200, 1)
    plan = launch.LaunchPlan(TileConfig(64, 128, 32, 8, 4, 1), (5,), fixed, kwargs)
    plan.direct = launch.direct_launcher(FakeCompiled(), plan)
    assert plan.direct_builds_descriptors
    monkeypatch.setattr(launch, "TensorDescriptor", lambda *a, **k: pytest.fail("no descriptor objects"))
    assert launch.run_plan(plan, x2, dy2, (0.5,) * launch.NUM_SCALARS, 7) is None
    (call,) = calls
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    assert call[:13] == (5, 1, 1, 99, "function-handle", False, True, None, None, "packed", None, *hooks)
    # tensors as their addresses: the C launcher then asks the driver about none of them
    assert call[13] == x2.data_ptr() and call[14] == dy2.data_ptr()
    assert call[15:20] == (f"map@{x2.data_ptr()}", 48, 200, 200, 1)
    assert call[20:25] == (f"map@{dy2.data_ptr()}", 48, 136, 136, 1)
    assert call[25:31] == (weight.data_ptr(),) * 6 and call[-len(names):] == tuple(kwargs[name] for name in names)
    assert not any(isinstance(argument, torch.Tensor) for argument in call)
    assert encoded == [(128, 6, (32, 64), 0), (64, 6, (32, 128), 0)]
    fake.driver._BASE_ARGS_FORMAT = "another layout"
    other = launch.LaunchPlan(TileConfig(64, 128, 32, 8, 4, 1), (5,), (), kwargs)
    assert launch.direct_launcher(FakeCompiled(), other) is not None
    assert not other.direct_builds_descriptors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch exists on CUDA only (the "
                                                           "interpreter always runs Triton's JIT path)")
@pytest.mark.parametrize("state_dtype,tma", [("bf16", True), ("int8", True), ("int8", False), ("fp32", True)])
def test_direct_launch_gives_the_jit_launch_bits(monkeypatch, state_dtype, tma):
    """A cached plan launches without the JIT from its second step: the weights and states must be
    bit-identical to launches through the JIT at every step, for seeds that the JIT used to specialise
    on (divisible by 16, equal to 1), with stochastic rounding drawing from them. On Triton 3.6 a TMA
    plan's direct launch encodes its own tensor maps (``raw_tma_launch``): the same bits again."""
    import triton

    kernel = tile_kernel.fused_wgrad_update_kernel
    config = TileConfig(64, 128, 32, 8, 4, 3, split_n=2, tma=tma)       # int8: slabs of whole 64-blocks
    (w_direct, s_direct), (w_jit, s_jit) = state_pair(torch.randn(136, 200).bfloat16(), "adamw", state_dtype)
    hp = dict(HP["adamw"])
    for step, seed in enumerate([7, 16, 1, 4096 + 5], start=1):
        hp["lr"] = 1e-3 * step
        x, dy = make_inputs(136, 200, (2, 48), torch.bfloat16, seed=step)
        jit_calls = []
        real_run = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, **k: (jit_calls.append(1), real_run(*a, **k))[1])
        fused_wgrad_update(x, dy, w_direct, s_direct, hp, step, config=config, stochastic_rounding=True, seed=seed)
        assert len(jit_calls) == (1 if step == 1 else 0), f"step {step}: the cached plan must skip the JIT"
        monkeypatch.setenv("FORGE_DIRECT_LAUNCH", "0")
        dispatch.PLANS.pop(s_jit, None)        # a fresh plan: its first (JIT) launch is the one compared
        fused_wgrad_update(x, dy, w_jit, s_jit, hp, step, config=config, stochastic_rounding=True, seed=seed)
        monkeypatch.delenv("FORGE_DIRECT_LAUNCH")
        monkeypatch.setattr(kernel, "run", real_run)
        (plan,) = dispatch.PLANS[s_direct].values()
        assert plan.direct is not None
        if tma and triton.__version__.startswith("3.6."):      # the layout raw_tma_launch knows
            assert plan.direct_builds_descriptors
        assert torch.equal(w_direct, w_jit), f"weight, step {step}"
        for name in s_jit.values:
            assert torch.equal(s_direct.values[name], s_jit.values[name]), f"{name}, step {step}"


def test_tuned_configs_are_described_per_weight_shape(monkeypatch):
    """A benchmark row names the tile that ran each shape, so two timings can be told apart."""
    key = ((4096, 1024), 512, torch.bfloat16, torch.bfloat16, "adamw", "int8", False, False, False, "cuda:0")
    config = TileConfig(64, 128, 64, 8, 8, 4, prefetch=True, split_n=2)
    monkeypatch.setattr(tuning, "TUNED", {key: config})
    assert tuning.describe_tuned_configs() == {"4096x1024/bt512/adamw/int8": "64x128x64 w8 s4 g8 split2 prefetch"}
    # a winner that loads its main loop through pointers instead of TMA says so
    monkeypatch.setattr(tuning, "TUNED", {key: dataclasses.replace(config, tma=False, max_registers=128)})
    assert tuning.describe_tuned_configs() == {
        "4096x1024/bt512/adamw/int8": "64x128x64 w8 s4 g8 split2 prefetch maxnreg128 pointers"}


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("shape", [(72, 200, 100), (64, 128, 64)], ids=["ragged", "even"])
def test_tma_and_pointer_main_loops_give_the_same_bits(shape, state_dtype):
    """The TMA main loop (descriptors, zero past the edges) and the pointer one (masks) compute the
    same G, so the same update to the bit; the plan says which one ran. (Odd feature counts such as
    70 have rows of 140 bytes, which TMA cannot take: the ragged case here is 72 x 200.)"""
    dout, din, tokens = shape
    x, dy = make_inputs(dout, din, (tokens,), torch.bfloat16, seed=11)
    results = []
    for tma in (True, False):
        config = TileConfig(32, 128, 32, 8, 4, 1, prefetch=True, split_n=2, tma=tma)
        (weight, state), _ = state_pair(torch.randn(dout, din, generator=torch.Generator().manual_seed(3),
                                               device="cpu").to(DEVICE, torch.bfloat16), "adamw", state_dtype)
        fused_wgrad_update(x, dy, weight, state, HP["adamw"], 2, config=config)
        (plan,) = dispatch.PLANS[state].values()
        if DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9:
            assert plan.tma == tma, "the plan must take the TMA path exactly when asked"
            assert plan.kwargs["TMA"] == tma
        results.append((weight, state))
    (w_tma, s_tma), (w_ptr, s_ptr) = results
    assert torch.equal(w_tma, w_ptr)
    for name in s_tma.values:
        assert torch.equal(s_tma.values[name], s_ptr.values[name]), name


def test_tma_needs_sixteen_bit_unit_stride_aligned_inputs():
    """Inputs the TMA hardware cannot take fall back to pointer loads instead of failing."""
    x = torch.randn(64, 96).bfloat16()
    dy = torch.randn(64, 40).bfloat16()
    assert launch.tma_inputs(x, dy) == (DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    assert not launch.tma_inputs(x.float(), dy.float()), "fp32 inputs keep the pointer path"
    assert not launch.tma_inputs(x[:0], dy[:0]), "no tokens: nothing to describe"
    assert not launch.tma_inputs(x[:, 1:], dy[:, 1:]), "a base off the 16-byte grid"
    assert not launch.tma_inputs(x[:, ::2], dy[:, ::2]), "a feature stride other than 1"
    wide = torch.randn(64, 97).bfloat16()
    assert not launch.tma_inputs(wide[:, :96], dy), "a row stride of 194 bytes"


def test_misaligned_activations_take_the_pointer_path_and_stay_right():
    """A plan made for aligned activations is not reused for a view whose base is off the 16-byte grid
    (the alignment is part of the plan's signature): the first step runs TMA, the second pointers."""
    config = TileConfig(32, 64, 32, 8, 4, 1, tma=True)
    (w_ours, s_ours), (w_ref, s_ref) = state_pair(torch.randn(70, 90).bfloat16(), "adamw", "fp32")
    base_x, base_dy = make_inputs(96, 96, (40,), torch.bfloat16, seed=2)       # rows of 192 bytes
    tma_expected = DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    for step, offset in ((1, 0), (2, 1)):
        x = base_x[:, offset:offset + 90]
        dy = base_dy[:, offset:offset + 70]
        fused_wgrad_update(x, dy, w_ours, s_ours, HP["adamw"], step, config=config)
        reference_wgrad_update(x, dy, w_ref, s_ref, HP["adamw"], step)
        (plan,) = dispatch.PLANS[s_ours].values()
        assert plan.tma == (tma_expected and offset == 0), f"offset {offset}"
        assert_storage_close(w_ours, w_ref, f"weight, step {step}")
        w_ref.copy_(w_ours)
        copy_state(s_ref, s_ours)


def test_a_gpu_launch_asks_for_fp_fusion_and_keeps_its_register_cap(monkeypatch):
    """The int8 codes are one FFMA (y * inverse + 1.5 * 2^23, codec.int8_codes): Triton 3.10 turns FP fusion
    off by default, so the launch asks for it rather than inherit the default."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    weight = torch.zeros(64, 64)
    state = ParamState(weight, get_rule("adamw"), "int8")
    x2, dy2 = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    meta = dict(EPILOGUE=get_rule("adamw").epilogue)
    states = list(state.values.values())
    scales = list(state.scales.values())
    capped = launch.make_plan(TileConfig(64, 64, 32, 8, 4, 2, max_registers=128), x2, dy2, weight, states, scales,
                              None, meta)
    assert capped.kwargs["enable_fp_fusion"] is True and capped.kwargs["maxnreg"] == 128
    uncapped = launch.make_plan(TileConfig(64, 64, 32, 8, 4, 2), x2, dy2, weight, states, scales, None, meta)
    assert uncapped.kwargs["enable_fp_fusion"] is True and "maxnreg" not in uncapped.kwargs


def test_launches_are_counted_by_path():
    """Every fused launch counts once, as ``direct`` (a kept plan's launcher) or ``jit``; the
    interpreter never launches directly, and ``reset_launch_paths`` zeroes the counts."""
    from forge_core.kernels import launch_paths, reset_launch_paths

    weight = torch.randn(6, 40)
    state = ParamState(weight, get_rule("adamw"), "fp32")
    x, dy = make_inputs(6, 40, (9,))
    reset_launch_paths()
    for step in (1, 2, 3):
        fused_wgrad_update(x, dy, weight, state, HP["adamw"], step)
    counts = launch_paths()
    assert counts["direct"] + counts["jit"] + counts["graph"] == 3 and counts["recorded"] == counts["native"] == 0
    if DEVICE == "cpu":
        assert counts == {"direct": 0, "jit": 3, "graph": 0, "recorded": 0, "native": 0}
    reset_launch_paths()
    assert launch_paths() == {"direct": 0, "jit": 0, "graph": 0, "recorded": 0, "native": 0}
