"""The warp-specialized Gluon kernel (forge_core/kernels/hopper_ws.py).

On a CPU machine: its scope check names each problem, and it compiles for sm_90 (the local
Triton's ptxas) without spills for every config the tuner may pick. On a Hopper GPU: one step
equals the Triton kernel's and the fp32 reference's, for rules with one and with two states and
for both scalar sources."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge_core.kernels import fused_wgrad_update, hopper_ws, tile_kernel, tuning, ws_choice
from forge_core.kernels.dispatch import WsPlan
from forge_core.kernels.launch import kernel_scalars
from forge_core.kernels.hopper_ws import WsConfig, config_problem, unsupported_reason
from forge_core.rules import get_rule
from forge_core.state import ParamState

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on a Hopper (sm_90) GPU only")
needs_gluon = pytest.mark.skipif(hopper_ws.GLUON_IMPORT_ERROR is not None,
                                 reason=f"Gluon not importable: {hopper_ws.GLUON_IMPORT_ERROR}")
bf16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]


def _call(m=256, n=256, k=64, device="cpu", dtype=bf16):
    x2, dy2 = torch.zeros(k, n, dtype=dtype, device=device), torch.zeros(k, m, dtype=dtype, device=device)
    weight = torch.zeros(m, n, dtype=dtype, device=device)
    return x2, dy2, weight, [torch.zeros_like(weight), torch.zeros_like(weight)]


@needs_gluon
@pytest.mark.parametrize("change, message", [
    (dict(dtype=torch.float32), "it takes bf16 only"),
    (dict(m=200), "is not a multiple of the 128x128 tile"),
    (dict(k=0), "no tokens: its main loop's TMA descriptors need at least one row"),
])
def test_the_scope_check_names_the_problem(change, message):
    assert message in unsupported_reason(*_call(**change))


@needs_gluon
def test_states_must_be_bf16_or_int8_and_one_or_two():
    x2, dy2, weight, states = _call()
    message = "it takes one or two bf16 states, or one or two int8 states"
    assert unsupported_reason(x2, dy2, weight, [s.float() for s in states]) == message
    assert unsupported_reason(x2, dy2, weight, states * 2) == message
    assert unsupported_reason(x2, dy2, weight, [states[0], states[1].to(torch.int8)]) == message


@needs_gluon
def test_int8_states_need_one_block_wide_slabs_and_their_scales():
    x2, dy2, weight, states = _call()
    codes = [s.to(torch.int8) for s in states]
    scales = [torch.zeros(256, 4), torch.zeros(256, 4)]
    config = ws_choice.CANDIDATES[0]
    assert "int8 states need 64-column slabs" in unsupported_reason(x2, dy2, weight, codes, WsConfig(), scales)
    assert "fp32 block scales of shape (256, 4)" in unsupported_reason(x2, dy2, weight, codes, config)
    assert "fp32 block scales" in unsupported_reason(x2, dy2, weight, codes, config, [scales[0], scales[1][:, :3]])
    assert unsupported_reason(x2, dy2, weight, codes, config, scales).startswith("tensors are on cpu")


@needs_gluon
def test_a_cpu_call_is_refused_after_the_shape_checks():
    assert unsupported_reason(*_call()) == "tensors are on cpu; the warp-specialized kernel needs a CUDA device"


@needs_gluon
def test_unaligned_activations_are_refused():
    x2, dy2, weight, states = _call()
    assert "do not match the 256x256 weight" in unsupported_reason(x2[:, 1:], dy2, weight, states)
    odd = torch.zeros(64 * 256 + 1, dtype=bf16)[1:].view(64, 256)          # base 2 bytes past 16
    assert "x is not TMA-compatible" in unsupported_reason(odd, dy2, weight, states)


@pytest.mark.parametrize("config, message", [
    (WsConfig(block_m=96), "not a wgmma tile"),
    (WsConfig(slab_n=128), "must tile a column half"),
    (WsConfig(slab_m=48), "must tile a column half"),
    (WsConfig(state_stages=1), "two stages or more"),
    (WsConfig(epilogue_warps=8, max_registers=168), "over the 65536-register file"),
    (WsConfig(stages=4, state_stages=4), "of shared memory, over"),
    (WsConfig(block_m=192, mma_warps=8, max_registers=128), "8 MMA warps cannot split 192 rows"),
    (WsConfig(mma_warps=2), "2 MMA warps cannot split"),
    (WsConfig(parked_halves=3), "parked_halves is 1 or 2"),
    (WsConfig(block_m=256, stages=2, mma_warps=8, max_registers=128), "of shared memory, over"),   # two parked halves
])
def test_configs_that_cannot_launch_are_named(config, message):
    assert message in config_problem(config)


BF16_CANDIDATES = [c for c in ws_choice.CANDIDATES if config_problem(c) is None]
INT8_ONLY = [c for c in ws_choice.CANDIDATES if c not in BF16_CANDIDATES]


def test_the_default_and_every_tuner_candidate_fit():
    """Every candidate fits int8 states; all but the int8-only ones (eight epilogue warps on 64x64
    slabs three deep, six 32-deep or twelve 16-deep operand slots) fit bf16 states too, so bf16 calls
    are not left without candidates."""
    assert config_problem(hopper_ws.DEFAULT_CONFIG) is None
    for config in ws_choice.CANDIDATES:
        assert config_problem(config, state_bytes=1) is None, config
    assert len(BF16_CANDIDATES) == 6 and len(INT8_ONLY) == 2
    for config in INT8_ONLY:
        assert "of shared memory, over" in config_problem(config)
    for config in ws_choice.BF16_ONLY:
        assert config_problem(config) is None, config


def test_one_parked_half_frees_the_shared_memory_of_a_256_row_tile():
    one = ws_choice.BF16_ONLY[0]
    two = dataclasses.replace(one, parked_halves=2)
    assert two.shared_memory_bytes() - one.shared_memory_bytes() == 256 * (64 + 4) * 4
    assert "of shared memory, over" in config_problem(two) and config_problem(one) is None


def test_int8_states_need_slabs_one_block_scale_wide():
    """Named before a compile: halving the slab to 32 columns takes 256x128 int8 tiles off the stack
    offline (sm_90) but the codec keeps one scale per 64 columns of a row."""
    narrow = dataclasses.replace(ws_choice.BF16_ONLY[1], slab_n=32, state_stages=4)
    assert config_problem(narrow) is None
    assert "int8 states need 64-column slabs" in config_problem(narrow, state_bytes=1)


def test_int8_states_leave_room_for_a_deeper_state_ring():
    deep = WsConfig(stages=2, slab_m=32, slab_n=64, state_stages=8, group=1, epilogue_warps=8, max_registers=128)
    assert "of shared memory, over" in config_problem(deep)              # bf16 states: 234496 B
    assert config_problem(deep, state_bytes=1) is None                    # int8 codes: half the state bytes


def _offline_compile(rule: str, configs: list[WsConfig], state: str = "bf16") -> list[dict]:
    """scripts/offline_sass.py --ws in a process of its own: compiling needs Triton's real code
    generator, and this test process runs Triton in the interpreter on a CPU machine."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "offline_sass.py"), "--shape", "4096x4096",
                           "--rule", rule, "--state", state, "--ws", json.dumps([dataclasses.asdict(c) for c in configs])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@needs_gluon
def test_every_config_the_tuner_may_pick_compiles_for_sm90_without_spills():
    """ptxas for sm_90 from the installed Triton: no local memory, the register cap kept, and the
    shared memory within the config's estimate (what a launch would be refused on); AdamW (two
    states) for every config, Lion and SGD (one state, the dummy second ring) for the first; with
    int8 states AdamW for every candidate and Lion for the first."""
    configs = [hopper_ws.DEFAULT_CONFIG, *BF16_CANDIDATES, *ws_choice.BF16_ONLY]
    results = _offline_compile("adamw", configs)
    results += _offline_compile("lion", configs[1:2]) + _offline_compile("sgd", configs[1:2])
    results += _offline_compile("adamw", list(ws_choice.CANDIDATES), "int8") + _offline_compile("lion", configs[1:2], "int8")
    assert len(results) == len(configs) + 2 + len(ws_choice.CANDIDATES) + 1
    for result in results:
        config = WsConfig(**result["config"])
        assert result["stack"] == 0 and 0 < result["registers"] <= config.max_registers, result
        assert result["shared"] <= result["estimate"] <= hopper_ws.SHARED_MEMORY_BYTES, result


@needs_gluon
def test_the_direct_launch_encodes_w_and_states_once_and_the_activations_per_launch(monkeypatch):
    """With Triton 3.6's launcher layout, a later launch of a chosen plan hands the raw launcher what
    the JIT would: the base arguments, the five tensor maps (x2's and dy2's encoded per launch, W's
    and the states' once, when the launcher is built), then the kernel's other arguments in
    ``kernel_call``'s order, then its constexprs. It steps aside (False) for calls the compiled
    kernel was not specialised for."""
    import triton

    from fake_triton_launch import descriptor_meta, install
    from forge_core.kernels.direct_launch import as_pointers, constexpr_tail

    config = ws_choice.CANDIDATES[1]
    fake = install(monkeypatch, set(range(5)), [descriptor_meta([config.block_k, config.block_n]),
                                                descriptor_meta([config.block_k, config.block_m])]
                   + [descriptor_meta([config.slab_m, config.slab_n])] * 3)
    monkeypatch.setattr(hopper_ws, "sm_count", lambda index: 6)
    x2, dy2, weight, states = _call(m=256, n=512, k=64)
    epilogue = get_rule("adamw").epilogue
    scalars = tuple(float(i) / 8 for i in range(8))
    direct = hopper_ws.direct_launcher(fake.compiled, x2, dy2, weight, states, None, epilogue, scalars, config,
                                       (False, True))
    assert [e[2] for e in fake.encoded] == [(config.slab_m, config.slab_n)] * 3, "W and the states, once"
    x_next = torch.ones_like(x2)
    assert direct(x_next, dy2, scalars) is True
    (call,) = fake.calls
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    assert call[:13] == (6, 1, 1, 99, "function-handle", False, True, None, None, "packed", None, *hooks)
    maps = [call[13 + 5 * i: 18 + 5 * i] for i in range(5)]
    for tensor, encoded in zip((x_next, dy2, weight, *states), maps):
        assert encoded == (f"map@{tensor.data_ptr()}", *tensor.shape, *tensor.stride())
    args, kwargs = hopper_ws.kernel_call(x_next, dy2, weight, states, None, epilogue, scalars, config, (False, True))
    names = constexpr_tail(hopper_ws.ws_fused_kernel)
    assert names[0] == "EPILOGUE" and names[-1] == "PREFETCH_SCALES"
    assert call[38:] == as_pointers(args[5:]) + tuple(kwargs[name] for name in names)
    assert not any(isinstance(argument, torch.Tensor) for argument in call), "addresses, not tensors"
    assert len(fake.encoded) == 5, "x2 and dy2 per launch"
    assert direct(x2, dy2, torch.zeros(8)) is False, "compiled for scalars as arguments"
    states[1].set_(torch.zeros_like(states[1]))
    assert direct(x2, dy2, scalars) is False, "a state tensor moved: its tensor map is stale"
    assert len(fake.calls) == 1
    fake.driver._BASE_ARGS_FORMAT = "another layout"
    assert hopper_ws.direct_launcher(fake.compiled, x2, dy2, weight, states, None, epilogue, scalars, config,
                                     (False, True)) is None


HP = {"adamw": dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
      "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
      "sgd": dict(lr=1e-2, momentum=0.9, weight_decay=0.05)}


def _problem(rule_name, m, n, k, seed=0, state_dtype="bf16"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(m, n, device="cuda", generator=g) * 0.02).to(bf16)
    state = ParamState(weight, get_rule(rule_name), state_dtype)
    for name in state.rule.state_names:
        value = torch.randn(m, n, device="cuda", generator=g) * 1e-3
        state.store(name, value.square() if name == "exp_avg_sq" else value)
    x = torch.randn(k, n, device="cuda", generator=g).to(bf16)
    dy = (torch.randn(k, m, device="cuda", generator=g) * 0.01).to(bf16)
    return x, dy, weight, state


def _copy(weight, state):
    twin = ParamState(weight.clone(), state.rule, state.state_dtype)
    for name in state.rule.state_names:
        twin.values[name].copy_(state.values[name])
        if state.scales[name] is not None:
            twin.scales[name].copy_(state.scales[name])
    return weight.clone(), twin


def _launch(x, dy, weight, state, hp, step, config, scalars=None):
    rule = state.rule
    hopper_ws.launch(x, dy, weight, [state.values[n] for n in rule.state_names], rule.epilogue,
                     kernel_scalars(rule, hp, step) if scalars is None else scalars, config,
                     scales=[state.scales[n] for n in rule.state_names],
                     sqrt_domain=tuple(state.is_sqrt_domain(n) for n in rule.state_names))


# every rule on three candidates (the seven-slot 32-deep operand ring among them), and the
# two-state-only candidates on AdamW (the rules they are offered to)
_RULE_CONFIGS = ([(rule, config) for rule in ("adamw", "lion", "sgd")
                  for config in (ws_choice.CANDIDATES[0], ws_choice.CANDIDATES[3], ws_choice.CANDIDATES[5])]
                 + [("adamw", config) for config in ws_choice.BF16_ONLY])


@needs_hopper
@pytest.mark.parametrize("m, n, k", [(1024, 4096, 520), (4096, 1024, 64)])
@pytest.mark.parametrize("rule_name, config", _RULE_CONFIGS)
def test_one_step_equals_the_triton_kernel_and_the_reference(rule_name, m, n, k, config, monkeypatch):
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")           # the Triton side: its untuned default tile
    x, dy, weight, state = _problem(rule_name, m, n, k)
    w_ws, s_ws = _copy(weight, state)
    w_tr, s_tr = _copy(weight, state)
    rule = state.rule
    _launch(x, dy, w_ws, s_ws, HP[rule_name], 7, config)
    fused_wgrad_update(x, dy, w_tr, s_tr, HP[rule_name], 7)
    w32 = weight.float()
    states32 = {n_: state.values[n_].float() for n_ in rule.state_names}
    rule.reference(w32, dy.float().t() @ x.float(), states32, HP[rule_name], 7)
    assert (w_ws != w_tr).float().mean().item() <= 1e-4       # fp32 summation order may flip a rounding
    torch.testing.assert_close(w_ws.float(), w32, rtol=1e-2, atol=(w32 - weight.float()).abs().max().item() * 0.05)
    for name in rule.state_names:
        assert (s_ws.values[name] != s_tr.values[name]).float().mean().item() <= 1e-4


@needs_hopper
@pytest.mark.parametrize("rule_name", ["adamw", "lion"])
@pytest.mark.parametrize("config", [ws_choice.CANDIDATES[0], ws_choice.CANDIDATES[3], *INT8_ONLY,
                                    dataclasses.replace(INT8_ONLY[0], prefetch_scales=False)])
def test_int8_states_are_requantized_as_the_triton_kernel_does(rule_name, config, monkeypatch):
    """int8 codes and block scales (state.py's format) from both kernels: a code may differ by one
    next to a rounding tie (fp32 summation order of G), no more, and rarely; the weight as bf16.
    1024 x 4096 is 256 tiles, so programs cross tiles (the prefetched scales of a program's next tile)."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    x, dy, weight, state = _problem(rule_name, 1024, 4096, 520, state_dtype="int8")
    w_ws, s_ws = _copy(weight, state)
    w_tr, s_tr = _copy(weight, state)
    _launch(x, dy, w_ws, s_ws, HP[rule_name], 7, config)
    fused_wgrad_update(x, dy, w_tr, s_tr, HP[rule_name], 7)
    assert (w_ws != w_tr).float().mean().item() <= 1e-4
    for name in state.rule.state_names:
        diff = (s_ws.values[name].int() - s_tr.values[name].int()).abs()
        assert diff.max().item() <= 1 and diff.float().mean().item() <= 1e-3
        torch.testing.assert_close(s_ws.scales[name], s_tr.scales[name], rtol=1e-5, atol=0)


@needs_hopper
def test_scalars_from_device_memory_give_the_same_step():
    x, dy, weight, state = _problem("adamw", 1024, 4096, 512)
    a, sa = _copy(weight, state)
    b, sb = _copy(weight, state)
    rule = state.rule
    scalars = kernel_scalars(rule, HP["adamw"], 3)
    config = ws_choice.CANDIDATES[1]
    hopper_ws.launch(x, dy, a, [sa.values[n] for n in rule.state_names], rule.epilogue, scalars, config)
    buffer = torch.tensor(scalars, dtype=torch.float32, device="cuda")
    hopper_ws.launch(x, dy, b, [sb.values[n] for n in rule.state_names], rule.epilogue, buffer, config)
    assert torch.equal(a, b)
    for name in rule.state_names:
        assert torch.equal(sa.values[name], sb.values[name])


def test_the_program_cap_bounds_the_persistent_grid(monkeypatch):
    monkeypatch.setattr(hopper_ws, "sm_count", lambda device_index: 132)
    weight = torch.empty(1024, 4096)                        # 8 x 32 = 256 tiles of 128x128
    config = ws_choice.CANDIDATES[0]
    assert hopper_ws.grid_size(weight, config, 0) == 132
    monkeypatch.setattr(hopper_ws, "PROGRAM_CAP", 100)
    assert hopper_ws.grid_size(weight, config, 0) == 100
    assert hopper_ws.grid_size(torch.empty(128, 512), config, 0) == 4     # fewer tiles than programs
    monkeypatch.setattr(hopper_ws, "PROGRAM_CAP", 0)
    assert hopper_ws.grid_size(weight, config, 0) == 1


@needs_hopper
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_capped_grid_gives_the_same_step(state_dtype, monkeypatch):
    """Each program walks the tiles from its id in strides of the program count: fewer programs
    (7, so they end on different tiles) update every tile exactly as one per SM does."""
    x, dy, weight, state = _problem("adamw", 1024, 4096, 520, state_dtype=state_dtype)
    a, sa = _copy(weight, state)
    b, sb = _copy(weight, state)
    config = ws_choice.CANDIDATES[0] if state_dtype == "bf16" else INT8_ONLY[0]
    _launch(x, dy, a, sa, HP["adamw"], 7, config)
    monkeypatch.setattr(hopper_ws, "PROGRAM_CAP", 7)
    _launch(x, dy, b, sb, HP["adamw"], 7, config)
    assert torch.equal(a, b)
    for name in state.rule.state_names:
        assert torch.equal(sa.values[name], sb.values[name])
        if sa.scales[name] is not None:
            assert torch.equal(sa.scales[name], sb.scales[name])


@needs_hopper
def test_a_launch_outside_the_scope_raises_one_line():
    x, dy, weight, state = _problem("adamw", 1024, 4096, 512)
    with pytest.raises(ValueError, match="hopper_ws: weight 1000x4096 is not a multiple"):
        hopper_ws.launch(x, dy[:, :1000], weight[:1000], [s[:1000] for s in state.values.values()],
                         state.rule.epilogue, (0.0,) * 8)


@needs_hopper
def test_the_tuner_keeps_the_faster_kernel_and_the_step_stays_right(monkeypatch, tmp_path):
    """fused_wgrad_update with tuning on: whichever kernel ws_choice picks, the step matches the
    reference, and the choice is recorded (tune cache entry, describe_tuned_configs)."""
    import json
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")          # (the GPU machine's test runs set it to 0)
    monkeypatch.setenv("FORGE_TUNE_CACHE", str(tmp_path / "tc.json"))
    monkeypatch.setattr(tuning, "TUNED", {})
    monkeypatch.setattr(ws_choice, "CHOSEN", {})
    monkeypatch.setattr(ws_choice, "CANDIDATES", ws_choice.CANDIDATES[:2])
    x, dy, weight, state = _problem("adamw", 1024, 4096, 512)
    before = weight.float()
    states32 = {n: state.values[n].float() for n in state.rule.state_names}
    fused_wgrad_update(x, dy, weight, state, HP["adamw"], 5)
    w32 = before.clone()
    state.rule.reference(w32, dy.float().t() @ x.float(), states32, HP["adamw"], 5)
    torch.testing.assert_close(weight.float(), w32, rtol=1e-2, atol=(w32 - before).abs().max().item() * 0.05)
    entries = json.loads((tmp_path / "tc.json").read_text())["entries"]
    assert any("hopper_ws" in key for key in entries)
    described = tuning.describe_tuned_configs()["1024x4096/bt512/adamw/bf16"]
    chosen = ws_choice.CHOSEN[next(iter(ws_choice.CHOSEN))]
    assert described.startswith("hopper_ws") == (chosen is not None)


@needs_hopper
def test_a_capturable_call_is_decided_on_graph_timings(monkeypatch, tmp_path):
    """Scalars in device memory (a step made to be captured): both kernels are timed in CUDA graphs,
    and the step still matches the reference."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")          # (the GPU machine's test runs set it to 0)
    monkeypatch.setenv("FORGE_TUNE_CACHE", str(tmp_path / "tc.json"))
    monkeypatch.setattr(tuning, "TUNED", {})
    monkeypatch.setattr(ws_choice, "CHOSEN", {})
    monkeypatch.setattr(ws_choice, "CANDIDATES", ws_choice.CANDIDATES[:1])
    monkeypatch.setattr(ws_choice, "BF16_ONLY", ())          # one candidate: one timing, then the rounds
    graph_timings = []
    real = ws_choice.graph_time_ms
    monkeypatch.setattr(ws_choice, "graph_time_ms", lambda run: graph_timings.append(real(run)) or graph_timings[-1])
    x, dy, weight, state = _problem("adamw", 4096, 4096, 512)
    before = weight.float()
    states32 = {n: state.values[n].float() for n in state.rule.state_names}
    buffer = torch.tensor(kernel_scalars(state.rule, HP["adamw"], 4), dtype=torch.float32, device="cuda")
    fused_wgrad_update(x, dy, weight, state, HP["adamw"], 4, device_scalars=buffer)
    assert len(graph_timings) == 1 + 2 * ws_choice.ROUNDS and all(t > 0 for t in graph_timings)
    assert all(key[-1] == "graph" for key in ws_choice.CHOSEN)
    w32 = before.clone()
    state.rule.reference(w32, dy.float().t() @ x.float(), states32, HP["adamw"], 4)
    torch.testing.assert_close(weight.float(), w32, rtol=1e-2, atol=(w32 - before).abs().max().item() * 0.05)


@needs_hopper
@pytest.mark.parametrize("state_dtype, config", [("bf16", ws_choice.CANDIDATES[1]), ("int8", INT8_ONLY[0])])
@pytest.mark.parametrize("device_scalars", [False, True])
def test_direct_launches_give_the_jit_launch_bits(monkeypatch, state_dtype, config, device_scalars):
    """A chosen plan launches without the JIT from its second step: its weight and states must be
    bit-identical to launches through the JIT at every step (new activations and scalars each
    step), with the scalars as arguments and in device memory."""
    import triton

    kernel = hopper_ws.ws_fused_kernel
    _, _, weight, state = _problem("adamw", 1024, 4096, 520, state_dtype=state_dtype)
    (w_direct, s_direct), (w_jit, s_jit) = _copy(weight, state), _copy(weight, state)
    rule = state.rule

    def plan(w, s):
        return WsPlan(config, w, [s.values[n] for n in rule.state_names], [s.scales[n] for n in rule.state_names],
                       rule.epilogue, tuple(s.is_sqrt_domain(n) for n in rule.state_names))

    direct_plan = plan(w_direct, s_direct)
    buffer = torch.zeros(8, dtype=torch.float32, device="cuda")
    for step in range(1, 4):
        scalars = kernel_scalars(rule, dict(HP["adamw"], lr=1e-3 * step), step)
        if device_scalars:
            buffer.copy_(torch.tensor(scalars))
            scalars = buffer
        x, dy, _, _ = _problem("adamw", 1024, 4096, 520, seed=step, state_dtype=state_dtype)
        jit_calls = []
        real_run = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, **k: (jit_calls.append(1), real_run(*a, **k))[1])
        direct_plan.run(x, dy, scalars)
        monkeypatch.setattr(kernel, "run", real_run)
        if triton.__version__.startswith("3.6."):       # the launcher layout raw_tma_launch knows
            assert direct_plan.direct is not None
            assert len(jit_calls) == (1 if step == 1 else 0), f"step {step}: the plan must skip the JIT"
        monkeypatch.setenv("FORGE_DIRECT_LAUNCH", "0")
        plan(w_jit, s_jit).run(x, dy, scalars)
        monkeypatch.delenv("FORGE_DIRECT_LAUNCH")
        assert torch.equal(w_direct, w_jit), f"weight, step {step}"
        for name in rule.state_names:
            assert torch.equal(s_direct.values[name], s_jit.values[name]), f"{name}, step {step}"
            if s_jit.scales[name] is not None:
                assert torch.equal(s_direct.scales[name], s_jit.scales[name]), f"{name} scales, step {step}"


@needs_hopper
def test_an_eager_choice_times_both_kernels_through_direct_launches(monkeypatch, tmp_path):
    """Scalars as arguments (an eager step): the choice's do_bench timings of the Triton tile and of
    the Gluon candidate launch without either JIT after each plan's first launch, as the eager steps
    after the choice do (a JIT launch costs 100-240 us of host time)."""
    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip("the direct launches need Triton 3.6's launcher layout")
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")          # (the GPU machine's test runs set it to 0)
    monkeypatch.setenv("FORGE_TUNE_CACHE", str(tmp_path / "tc.json"))
    monkeypatch.setattr(tuning, "TUNED", {})
    monkeypatch.setattr(ws_choice, "CHOSEN", {})
    monkeypatch.setattr(ws_choice, "CANDIDATES", ws_choice.CANDIDATES[:1])
    jit_launches = []
    for kernel in (tile_kernel.fused_wgrad_update_kernel, hopper_ws.ws_fused_kernel):
        monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **k: (jit_launches.append(1), _run(*a, **k))[1])
    through_jit = []
    real_bench = tuning.bench_ms

    def bench(fn):
        fn()                                   # a plan's first launch is the JIT's
        before = len(jit_launches)
        ms = real_bench(fn)
        through_jit.append(len(jit_launches) - before)
        return ms

    monkeypatch.setattr(tuning, "bench_ms", bench)
    x, dy, weight, state = _problem("adamw", 1024, 4096, 512)
    fused_wgrad_update(x, dy, weight, state, HP["adamw"], 5)
    choice_timings = through_jit[-(1 + 2 * ws_choice.ROUNDS):]     # the candidate, then the round-robin
    assert len(choice_timings) == 1 + 2 * ws_choice.ROUNDS and not any(choice_timings), through_jit
