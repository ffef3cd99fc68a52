"""Tile tuning of the fused kernel (``forge_core.kernels.tuning``): which candidates are timed, in
what order and on what (scratch copies, never the real weight and states), and that the choice is
kept; on the GPU when there is one, else in the Triton interpreter."""
import contextlib
import dataclasses
import io

import pytest
import torch

from forge_core.kernels import fused_wgrad_update, launch, reference_wgrad_update, tuning
from forge_core.kernels.tile_config import TileConfig, candidate_configs, config_space, default_config, fits
from forge_core.kernels.tuning import tune_config
from forge_core.state import QBLOCK
from kernel_pairs import HP, assert_storage_close, make_inputs, state_pair, default_device  # noqa: F401


def test_config_space_pruning():
    space = config_space()
    assert len(space) == 3 * 3 * 3 * 3 * 2 * 5          # tiles^2 x BK x GROUP x warps {4,8} x stages
    for m, n, k in [(4096, 4096, 512), (1024, 4096, 8192), (128256, 4096, 2048), (70, 90, 100)]:
        for input_bytes in (2, 4):
            candidates = candidate_configs(m, n, k, input_bytes)
            assert 1 <= len(candidates) <= 16
            assert all(fits(c, input_bytes) for c in candidates)
            assert all(c.block_n % QBLOCK == 0 for c in candidates)
            assert all(c.num_stages <= max(2, -(-k // c.block_k)) for c in candidates)
            assert all(c.num_warps in (4, 8) for c in candidates)   # 16 warps gave wrong weights on the H100
    assert not fits(TileConfig(256, 256, 128, 8, 8, 6), 2)
    assert fits(default_config(4096, 4096, 512, 2), 2)


def test_tuning_runs_on_scratch_and_applies_the_update_once(monkeypatch):
    """The tuner times candidates on scratch copies; the real weight/state see exactly one step."""
    x, dy = make_inputs(70, 90, (100,))
    (w_real, s_real), (w_ref, s_ref) = state_pair(torch.randn(70, 90), "adamw", "int8")
    candidates = [TileConfig(32, 64, 32, 8, 4, 1), TileConfig(64, 64, 32, 8, 4, 1)]
    launched = []
    timed = []
    original_run = launch.run_plan

    def tracking_run(plan, *args):                       # every launch, tuning or real, goes through run_plan
        launched.append((plan.config, plan.fixed_args[0].data_ptr()))   # fixed_args[0]: the weight written
        return original_run(plan, *args)

    def fake_bench(fn):
        real_before = w_real.clone(), {k: v.clone() for k, v in s_real.state_dict().items()}
        for _ in range(3):                                  # a benchmark runs the kernel many times
            fn()
        assert torch.equal(w_real, real_before[0]), "tuning touched the real weight"
        assert all(torch.equal(v, real_before[1][k]) for k, v in s_real.state_dict().items())
        config = launched[-1][0]
        timed.append(config)
        return ({32: 2.0, 64: 1.0}[config.block_m] - (0.5 if config.group == 32 else 0.0)
                - (0.25 if config.prefetch and config.block_m == 64 else 0.0))

    monkeypatch.setattr(tuning, "candidate_configs", lambda m, n, k, b: candidates)
    monkeypatch.setattr(tuning, "bench_ms", fake_bench)
    monkeypatch.setattr(launch, "run_plan", tracking_run)
    monkeypatch.setattr(tuning, "use_fixed_config", lambda: False)
    monkeypatch.setattr(tuning, "TUNED", {})
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    fused_wgrad_update(x, dy, w_real, s_real, HP["adamw"], 1)
    reference_wgrad_update(x, dy, w_ref, s_ref, HP["adamw"], 1)
    # every candidate without, then with prefetch, plain and under the 16-warps-per-SM register cap;
    # then the other groups on the fastest (64, prefetch; the capped twin ties and was timed later)
    assert [(c.block_m, c.prefetch, c.max_registers) for c in timed[:6]] == [
        (32, False, None), (64, False, None), (32, True, None), (32, True, 128), (64, True, None), (64, True, 128)]
    # the three fastest again with pointer loads in the main loop (the fake timing ignores the loader)
    assert [(c.block_m, c.prefetch, c.max_registers, c.tma) for c in timed[6:9]] == [
        (64, True, None, False), (64, True, 128, False), (64, False, None, False)]
    assert [(c.group, c.prefetch, c.max_registers, c.tma) for c in timed[9:]] == [
        (16, True, None, True), (32, True, None, True)]
    real_launches = [c for c, ptr in launched if ptr == w_real.data_ptr()]
    assert real_launches == [TileConfig(64, 64, 32, 32, 4, 1, prefetch=True)], "one real launch, with the winner"
    assert list(tuning.tuned_configs().values()) == real_launches
    assert_storage_close(w_real, w_ref, "weight after tuned step")
    for name in s_ref.values:
        assert_storage_close(s_real.values[name], s_ref.values[name], name)
    # a second call with the same key reuses the choice without timing again
    fused_wgrad_update(x, dy, w_real, s_real, HP["adamw"], 2)
    assert len(timed) == 11


def test_a_first_call_inside_a_capture_is_refused_in_one_line_before_any_launch(monkeypatch):
    """Tuning times launches, which a CUDA graph capture cannot hold: a weight's first call made inside one gets
    a line naming what to do, raised before anything is launched or copied (not a CUDA error later)."""
    x, dy = make_inputs(70, 90, (100,))
    (weight, state), _ = state_pair(torch.randn(70, 90), "adamw", "bf16")
    before = weight.clone()

    def no_launch(*args, **kwargs):
        raise AssertionError("launched inside the capture")
    monkeypatch.setattr(launch, "run_plan", no_launch)
    monkeypatch.setattr(tuning, "scratch_copies", no_launch)
    monkeypatch.setattr(tuning, "graph_capturing", lambda: True)
    monkeypatch.setattr(tuning, "use_fixed_config", lambda: False)
    monkeypatch.setattr(tuning, "TUNED", {})
    monkeypatch.setenv("FORGE_AUTOTUNE", "1")
    monkeypatch.delenv("FORGE_TUNE_CACHE", raising=False)
    monkeypatch.setattr(tuning.tune_cache, "shipped_path", lambda device: None)
    with pytest.raises(RuntimeError) as raised:
        fused_wgrad_update(x, dy, weight, state, HP["adamw"], 1)
    assert str(raised.value) == (
        "forge_core: the fused kernel for a 70x90 weight at 100 tokens is tuned at its first call, which cannot run "
        "inside a CUDA graph capture: run one step before capturing, keep the choices in FORGE_TUNE_CACHE, or set "
        "FORGE_AUTOTUNE=0")
    assert torch.equal(weight, before) and not tuning.TUNED


def test_register_cap_keeps_sixteen_warps_per_sm():
    config = TileConfig(64, 128, 64, 8, 8, 4, prefetch=True, split_n=2)
    assert tuning.sixteen_warps_per_sm(config) == TileConfig(64, 128, 64, 8, 8, 4, prefetch=True, split_n=2,
                                                                   max_registers=128)     # two programs
    assert tuning.sixteen_warps_per_sm(TileConfig(64, 64, 32, 8, 4, 6)) == TileConfig(
        64, 64, 32, 8, 4, 6, max_registers=128)                                           # four programs
    assert tuning.sixteen_warps_per_sm(TileConfig(64, 64, 64, 8, 8, 4, max_registers=96)) is None


def test_prefetch_variants_are_what_the_tuner_and_the_sweep_time():
    config = TileConfig(64, 128, 64, 8, 8, 4, split_n=2)
    assert tuning.prefetch_variants(config) == [
        config, dataclasses.replace(config, prefetch=True), dataclasses.replace(config, prefetch=True, max_registers=128)]
    capped = TileConfig(64, 64, 32, 8, 4, 6, max_registers=96)      # already capped: no second cap
    assert tuning.prefetch_variants(capped) == [capped, dataclasses.replace(capped, prefetch=True)]
    assert tuning.prefetch_variants(config, ()) == []


def _fake_timing(cost):
    """A ``run_on_scratch`` that records each config and a ``time_ms`` that charges it ``cost(config)``."""
    timed = []

    def run(config):
        timed.append(config)

    def time_ms(fn):
        fn()
        return cost(timed[-1])

    return run, time_ms


def test_tune_config_times_prefetch_under_the_register_cap():
    """Each 8-warp candidate is timed plain, prefetching, and prefetching at 128 registers; the capped
    variant can win and is what the tuner returns."""
    run, time_ms = _fake_timing(lambda c: 1.0 - 0.2 * c.prefetch - 0.3 * (c.max_registers == 128))
    candidate = TileConfig(64, 128, 64, 8, 8, 4, split_n=2)
    best, timings = tune_config([candidate], run, time_ms, groups=(8,), tma_flips=0)
    assert set(timings) == {candidate, dataclasses.replace(candidate, prefetch=True),
                            dataclasses.replace(candidate, prefetch=True, max_registers=128)}
    assert best == dataclasses.replace(candidate, prefetch=True, max_registers=128)


def test_tune_config_tries_the_other_main_loop_loader_on_the_fastest():
    """TMA helps some tiles and slows others (the 8-warp 64x128 one): the fastest few are also timed
    with the other loader, and a pointer-loading winner is returned as such."""
    run, time_ms = _fake_timing(
        lambda c: {64: 1.0, 128: 2.0}[c.block_n] - (0.5 if c.block_n == 64 and not c.tma else 0.0))
    candidates = [TileConfig(64, 64, 32, 8, 4, 2), TileConfig(64, 128, 32, 8, 4, 2)]
    best, timings = tune_config(candidates, run, time_ms, groups=(8,), prefetch_options=(), tma_flips=1)
    assert best == TileConfig(64, 64, 32, 8, 4, 2, tma=False)
    assert TileConfig(64, 128, 32, 8, 4, 2, tma=False) not in timings, "only the fastest is flipped"
    assert len(timings) == 3


def test_tune_config_retimes_the_finalists_round_robin():
    """One lucky first timing must not pick the tile: the fastest few within the margin are timed again,
    interleaved, and ranked by their median; a config far behind is not re-timed."""
    fast, lucky, slow = TileConfig(64, 64, 32, 8, 4, 2), TileConfig(64, 128, 32, 8, 4, 2), TileConfig(128, 128, 32, 8, 4, 2)
    seen: dict[TileConfig, int] = {}
    order: list[TileConfig] = []

    def cost(config):
        seen[config] = seen.get(config, 0) + 1
        order.append(config)
        if config == lucky:
            return 0.95 if seen[config] == 1 else 1.02       # a clock peak on its first timing
        return {fast: 1.0, slow: 2.0}[config]

    run, time_ms = _fake_timing(cost)
    best, timings = tune_config([fast, lucky, slow], run, time_ms, groups=(8,), prefetch_options=(), tma_flips=0,
                                finalists=4, final_rounds=5)
    assert best == fast
    assert timings[lucky] == pytest.approx(1.02) and timings[fast] == pytest.approx(1.0)
    assert seen == {fast: 6, lucky: 6, slow: 1}, "only configs within the margin are re-timed"
    finals = order[3:]
    assert all(set(finals[i:i + 2]) == {fast, lucky} for i in range(0, 10, 2)), "each round times every finalist"
    assert finals[0] != finals[2], "the rounds rotate their order"
    # finalists=1 keeps the single-pass ranking (the lucky timing wins)
    seen.clear()
    best, _ = tune_config([fast, lucky, slow], run, time_ms, groups=(8,), prefetch_options=(), tma_flips=0,
                          finalists=1)
    assert best == lucky and seen == {fast: 1, lucky: 1, slow: 1}


def test_tune_config_skips_configs_that_do_not_fit_the_device():
    class OutOfResources(Exception):
        pass

    class PTXASError(Exception):
        pass

    ran = []

    def run(config):
        if config.block_m == 256:
            raise OutOfResources("shared memory")
        if config.max_registers is not None:
            raise PTXASError("ptxas fatal: (C7602) Insufficient registers (128) to compile instruction")
        ran.append(config)

    def time_ms(fn):
        fn()
        return {64: 3.0, 128: 1.0}[ran[-1].block_m] - (0.1 if ran[-1].group == 16 else 0.0)

    best, timings = tune_config([TileConfig(bm, 64, 32, 8, 4, 2) for bm in (64, 128, 256)], run, time_ms,
                                groups=(8, 16), prefetch_options=(), tma_flips=0)
    assert best == TileConfig(128, 64, 32, 16, 4, 2)
    assert all(c.block_m != 256 for c in timings) and len(timings) == 3
    # an 8-warp candidate whose register-capped prefetch variant ptxas refuses is still tuned
    ran.clear()
    best, timings = tune_config([TileConfig(64, 64, 32, 8, 8, 2)], run, time_ms, groups=(8,), tma_flips=0)
    assert all(c.max_registers is None for c in timings) and len(timings) == 2

    def broken(config):
        raise ValueError("a real bug must not be swallowed")

    # what Triton prints before raising PTXASError (the whole PTX) stays out of the cell's log
    def refused_loudly(config):
        if config.max_registers is not None:
            print("//\n// Generated by LLVM NVPTX Back-End\n" + "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n" * 100)
            raise PTXASError("ptxas fatal: (C7602) Insufficient registers (128)")
        ran.append(config)

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        tune_config([TileConfig(64, 64, 32, 8, 8, 2)], refused_loudly, time_ms, groups=(8,))
    assert "NVPTX" not in captured.getvalue()

    with pytest.raises(ValueError, match="real bug"):
        tune_config([TileConfig(64, 64, 32, 8, 4, 2)], broken, time_ms)


def test_scratch_copies_are_separate_storage_and_none_when_memory_runs_out(monkeypatch):
    weight = torch.randn(8, 64, dtype=torch.bfloat16)
    states = [torch.randn(8, 64), torch.randint(-127, 127, (8, 64), dtype=torch.int8)]
    scales = [None, torch.rand(8, 1)]
    copied_weight, copied_states, copied_scales = tuning.scratch_copies(weight, states, scales)
    for original, copy in [(weight, copied_weight), *zip(states, copied_states), (scales[1], copied_scales[1])]:
        assert torch.equal(original, copy) and original.data_ptr() != copy.data_ptr()
    assert copied_scales[0] is None

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(torch.Tensor, "clone", out_of_memory)
    assert tuning.scratch_copies(weight, states, scales) is None
