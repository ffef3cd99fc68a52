"""``forge-bench profile host``: its report, its refusal without a GPU, and the timers it wraps around
a fused layer's update."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import forge_core
from forge_bench.profile import common, host
from forge_bench.profile.common import StepOptions

RESULTS = [
    {"method": "adamw_fused", "linear_layers": 145, "steps": 20, "wall_ms": 36.4,
     "host_ms": {"forward": 9.0, "backward": 14.5, "optimizer": 2.9}, "calls": {}},
    {"method": "forge_bf16", "linear_layers": 145, "steps": 20, "wall_ms": 52.8,
     "host_ms": {"forward": 11.0, "backward": 20.3, "optimizer": 2.4},
     "calls": {"launch: Triton tile plan": {"calls_per_step": 97.0, "us_per_call": 18.6},
               "update (whole)": {"calls_per_step": 3.0, "us_per_call": 42.2},
               host.NATIVE_REPLAYS: {"calls_per_step": 142.0, "us_per_call": 6.5},
               "an older report's untimed call": {"calls_per_step": 4.0, "us_per_call": None}}},
]


def test_the_report_gives_each_phase_per_step_and_the_backward_per_linear_layer() -> None:
    text = host.to_markdown(RESULTS, StepOptions(model="vit-large-16", batch=3, seq=197), "NVIDIA H200")
    lines = text.splitlines()
    assert lines[0] == "# Host time of an eager step: vit-large-16, batch 3, seq 197 (NVIDIA H200)"
    assert "| adamw_fused | 36.40 | 9.00 | 14.50 | 2.90 | 100.0 | 145 |" in lines
    assert "| forge_bf16 | 52.80 | 11.00 | 20.30 | 2.40 | 140.0 | 145 |" in lines
    assert "## forge_bf16: calls inside the steps" in lines and "## adamw_fused: calls inside the steps" not in lines
    assert "| update (whole) | 3 | 42.2 | 0.13 |" in lines
    assert "| replay: C++ hook (forge_core.native_hooks, timed in C++) | 142 | 6.5 | 0.92 |" in lines
    assert "| an older report's untimed call | 4 | not timed | not timed |" in lines
    assert "| launch: Triton tile plan | 97 | 18.6 | 1.80 |" in lines


def test_it_refuses_without_a_gpu_in_one_line(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit, match="profile host: needs a CUDA device"):
        host.run_one(StepOptions(model="gpt2"), "forge_bf16", tmp_path / "x.json")


def test_the_call_timer_counts_and_times_each_label() -> None:
    timer = host.CallTimer()
    square = timer.wrap("square", lambda v: v * v)
    assert [square(v) for v in (2, 3, 4, 5)] == [4, 9, 16, 25]
    (label, call), = timer.per_step(2).items()
    assert label == "square" and call["calls_per_step"] == 2.0 and call["us_per_call"] > 0
    timer.reset()
    assert timer.per_step(1) == {}


def test_the_timers_see_every_fused_update_of_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from forge_core.fused_weight import FusedWeight
    from forge_core.kernels import dispatch, launch

    for owner, name in ((FusedWeight, "__call__"), (launch, "run_plan"), (dispatch.WsPlan, "run")):
        monkeypatch.setattr(owner, name, getattr(owner, name))        # restored after the test
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 20), nn.GELU(), nn.Linear(20, 4))
    opt = forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=torch.randn(2, 12))
    timer = host.CallTimer()
    host.time_forge_internals(timer)
    for _ in range(3):
        model(torch.randn(5, 12)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    calls = timer.per_step(3)
    assert calls["update (whole)"]["calls_per_step"] == 3.0, calls
    assert host.linear_layers(model) == 3
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    assert host.linear_layers(nn.Sequential(conv1d(8, 4), nn.ReLU(), nn.Linear(8, 2))) == 2


class _TinyRegressor(nn.Module):
    """A model as the arms call it: keyword inputs in, an object with ``.loss`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(loss=(self.body(x) - labels).square().mean())


def test_each_arm_is_timed_phase_by_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's loop on a CPU stand-in for the GPU arm: phases, wall time, FORGE's calls, layers."""
    from forge_bench.torch_arms import ForgeArm, TorchArm
    from forge_core.fused_weight import FusedWeight
    from forge_core.kernels import dispatch, launch

    for owner, name in ((FusedWeight, "__call__"), (launch, "run_plan"), (dispatch.WsPlan, "run")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    batches = [{"x": torch.randn(4, 12), "labels": torch.randn(4, 3)} for _ in range(2)]

    def build(kind: str):
        torch.manual_seed(0)
        model = _TinyRegressor()
        if kind == "torch":
            return TorchArm(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {})
        return ForgeArm(model, forge_core.fuse(model, lr=1e-3, backend="reference",
                                               probe_inputs={"x": batches[0]["x"], "labels": batches[0]["labels"]}), {})

    for kind, method in (("torch", "adamw_fused"), ("forge", "forge_bf16")):
        monkeypatch.setattr(common, "warmed_up_arm", lambda tool, options, name, kind=kind: (build(kind), batches))
        result = host.profile_one(StepOptions(steps=4), method)
        assert result["method"] == method and result["linear_layers"] == 2 and result["steps"] == 4
        assert set(result["host_ms"]) == {"forward", "backward", "optimizer"}
        assert result["wall_ms"] >= result["host_ms"]["backward"] > 0
        if kind == "torch":
            assert result["calls"] == {}
        else:
            assert result["calls"]["update (whole)"]["calls_per_step"] == 2.0


def test_a_compiled_twin_is_timed_and_a_replaying_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A default-mode twin splits its step as its eager arm does; a reduce-overhead one is refused in one line."""
    from forge_bench import compiled_arms
    from forge_bench.torch_arms import TorchArm

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(compiled_arms.torch, "compile", lambda function, mode=None: function)   # the split, not Inductor
    batches = [{"x": torch.randn(4, 12), "labels": torch.randn(4, 3)}]
    for mode in ("default", "reduce-overhead"):
        model = _TinyRegressor()
        arm = compiled_arms.CompiledArm(TorchArm(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {}), mode)
        monkeypatch.setattr(common, "warmed_up_arm", lambda tool, options, name, arm=arm: (arm, batches))
        if mode == "default":
            result = host.profile_one(StepOptions(steps=3), "adamw_fused_compile")
            assert result["host_ms"]["optimizer"] > 0 and result["linear_layers"] == 2
        else:
            with pytest.raises(SystemExit, match="adamw_fused_compile_ro replays CUDA graphs"):
                host.profile_one(StepOptions(steps=3), "adamw_fused_compile_ro")
