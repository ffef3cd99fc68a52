"""Where an eager step's host time goes, per arm: the forward, the backward and the optimizer step as the
host spends them, per Linear layer, and inside FORGE's backward the fused updates and their launches.

    forge-bench profile host --model vit-large-16 --batch 3 --seq 197 \
        --methods adamw_fused,forge_bf16 --out reports/h200/host.md

Why: at batch 1 an eager step is bound by the host (section 2 of docs/design.md), and FORGE's cost
there is Python per fused layer. Timed in a loop, those calls take two to three times less than
inside a real step, where the model's own code keeps the host's caches cold; here they are timed
inside the steps themselves. A default-mode compiled twin (``<arm>_compile``) is timed the same way; a
reduce-overhead one, whose steps are graph replays, is refused. Each arm runs in its own process, warms up, then times ``--steps``
steps; host times are ``time.perf_counter`` around each phase (the host has queued the phase's
work when it returns), the step's wall time includes a synchronize.
"""
from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from forge_core import native_hooks

from forge_bench.profile.common import StepOptions, run_and_report, timed_step_phases, warmed_up_split_arm

DEFAULT_METHODS = ("adamw_fused", "forge_bf16")
COMMAND = ["profile", "host"]
PHASES = ("forward", "backward", "optimizer")
NATIVE_REPLAYS = "replay: C++ hook (forge_core.native_hooks, timed in C++)"


class CallTimer:
    """Host seconds and calls of wrapped functions, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` with its host time added to ``label`` at every call."""
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started
                self.calls[label] = self.calls.get(label, 0) + 1
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Per label: calls per step and host microseconds per call."""
        return {label: {"calls_per_step": self.calls[label] / steps,
                        "us_per_call": 1e6 * self.seconds[label] / self.calls[label]}
                for label in sorted(self.seconds) if self.calls[label]}


def time_forge_internals(timer: CallTimer) -> None:
    """Wrap, in this process, what a fused layer's backward calls: the whole update of a weight
    (``FusedWeight.__call__``: the optimizer's bookkeeping, the plan lookup, the launch), the two
    launches it may end in (the Triton tile plan's, the Gluon plan's) and the replay of its recorded
    graph (``forge_core.update_graphs``) that takes their place once recorded."""
    from forge_core.fused_weight import FusedWeight
    from forge_core.kernels import dispatch, launch
    from forge_core.update_graphs import UpdateGraphs

    FusedWeight.__call__ = timer.wrap("update (whole)", FusedWeight.__call__)
    launch.run_plan = timer.wrap("launch: Triton tile plan", launch.run_plan)
    dispatch.WsPlan.run = timer.wrap("launch: Gluon plan", dispatch.WsPlan.run)
    UpdateGraphs.replay = timer.wrap("replay: recorded graph", UpdateGraphs.replay)


def linear_layers(model: torch.nn.Module) -> int:
    """The model's Linear-like layers: ``nn.Linear`` and transformers' ``Conv1D`` (fused or not)."""
    from forge_core.conv1d import is_conv1d, is_forge_conv1d

    return sum(1 for module in model.modules()
               if isinstance(module, torch.nn.Linear) or is_conv1d(module) or is_forge_conv1d(module))


def profile_one(options: StepOptions, method_name: str) -> dict:
    """Time ``options.steps`` eager steps of one arm in this process, phase by phase."""
    arm, batches = warmed_up_split_arm("profile host", options, method_name)
    if getattr(arm, "mode", None) == "reduce-overhead":
        raise SystemExit(f"profile host: {method_name} replays CUDA graphs, whose host time is not split into "
                         "forward, backward and optimizer; profile graph times replays")
    timer = CallTimer()
    if getattr(arm, "n_fused_params", 0):
        time_forge_internals(timer)
        for i in range(2):                                   # the wrapped calls, once, before the window
            arm.step(batches[i % len(batches)])
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    walls = []
    torch.cuda.synchronize()
    timer.reset()
    native_hooks.reset_native_replays()
    for i in range(options.steps):
        *seconds, wall = timed_step_phases(arm, batches[i % len(batches)])
        walls.append(wall)
        for name, value in zip(PHASES, seconds):
            phases[name].append(value)
    layers = linear_layers(arm.model)
    calls = timer.per_step(options.steps)
    native_replays = native_hooks.native_replays()
    if native_replays:                    # replayed from C++, timed there (no Python to wrap)
        calls[NATIVE_REPLAYS] = {"calls_per_step": native_replays / options.steps,
                                 "us_per_call": 1e6 * native_hooks.native_replay_seconds() / native_replays}
    return {"method": method_name, "linear_layers": layers, "steps": options.steps,
            "wall_ms": 1e3 * statistics.median(walls),
            "host_ms": {name: 1e3 * statistics.median(values) for name, values in phases.items()},
            "calls": calls}


def to_markdown(results: list[dict], options: StepOptions, device: str) -> str:
    """The report: one table of phases for every arm (per step and per Linear layer), then FORGE's timed calls."""
    lines = [f"# Host time of an eager step: {options.title()} ({device})", "",
             f"Medians of {results[0]['steps'] if results else 0} steps after {options.warmup} warm-up steps, each arm "
             "in its own process. Host ms: `time.perf_counter` around each phase (its work queued when it "
             "returns); wall ms: the step with a synchronize. Per layer: divided by the model's Linear layers.", "",
             "| arm | wall ms | forward | backward | optimizer | backward us / Linear | Linear layers |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        host = res["host_ms"]
        per_layer = 1e3 * host["backward"] / res["linear_layers"] if res["linear_layers"] else float("nan")
        lines.append(f"| {res['method']} | {res['wall_ms']:.2f} | {host['forward']:.2f} | {host['backward']:.2f} | "
                     f"{host['optimizer']:.2f} | {per_layer:.1f} | {res['linear_layers']} |")
    for res in results:
        if not res["calls"]:
            continue
        lines += ["", f"## {res['method']}: calls inside the steps", "",
                  "| call | calls / step | us / call | ms / step |", "|---|---:|---:|---:|"]
        for label, call in res["calls"].items():
            if call["us_per_call"] is None:
                lines.append(f"| {label} | {call['calls_per_step']:.0f} | not timed | not timed |")
                continue
            lines.append(f"| {label} | {call['calls_per_step']:.0f} | {call['us_per_call']:.1f} | "
                         f"{call['calls_per_step'] * call['us_per_call'] / 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def run_one(options: StepOptions, method: str, out: Path) -> None:
    """The per-arm child: time ``method`` and write its JSON to ``out``."""
    out.write_text(json.dumps(profile_one(options, method)))


def run(options: StepOptions, methods: list[str], out: Path) -> int:
    """Every arm in its own process, then the Markdown report at ``out`` and its JSON beside it."""
    return run_and_report(COMMAND, methods, options.child_arguments(), out,
                          lambda results, device: to_markdown(results, options, device), "timed", json_beside=True)
