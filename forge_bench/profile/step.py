"""Where the time of one eager training step goes: torch.profiler's top CUDA kernels for each arm.

    forge-bench profile step --model llama-3.1-8b --batch 1 --seq 512 \
        --methods adamw_fused,forge_bf16 --out reports/h100/profile.md

Each method runs in its own process (as a sweep cell would: autotuners and the allocator keep
state for the process life), warms up, then profiles ``--steps`` steps. The table lists the
kernels by total CUDA time per step, so the next reader sees what is left between a step and
its floor.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from forge_bench.profile.common import BATCH_POOL, StepOptions, run_and_report, warmed_up_arm

TOP = 15
DEFAULT_METHODS = ("adamw_fused", "forge_bf16")
COMMAND = ["profile", "step"]


def profile_one(options: StepOptions, method_name: str) -> dict:
    """Profile ``options.steps`` steps of one arm in this process; returns the top kernels per step."""
    arm, batches = warmed_up_arm("profile step", options, method_name)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for i in range(options.steps):
            arm.step(batches[i % BATCH_POOL])
        end.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / options.steps
    rows = []
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(evt, "cuda_time_total", 0.0)
        if cuda_us and evt.count:
            rows.append({"kernel": evt.key, "ms_per_step": cuda_us / 1000.0 / options.steps,
                         "calls_per_step": evt.count / options.steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    return {"method": method_name, "step_ms_profiled": step_ms, "kernel_ms_total": total, "top": rows[:TOP]}


def to_markdown(results: list[dict], model: str, batch: int, seq: int, device: str, activations: str = "hf") -> str:
    """The report: one table of the top kernels per arm."""
    lean = ", lean activations" if activations == "lean" else ""
    lines = [f"# Where the time goes: {model}, batch {batch}, seq {seq}{lean} ({device})", "",
             "torch.profiler, CUDA kernel time per step (mean of the profiled steps, after warm-up). "
             "`step ms` is wall time between CUDA events around the profiled steps (profiler overhead "
             "included), so it runs above a sweep's median.", ""]
    for res in results:
        lines += [f"## {res['method']}: step {res['step_ms_profiled']:.1f} ms, kernels {res['kernel_ms_total']:.1f} ms", "",
                  "| kernel | ms / step | % of kernel time | calls / step |", "|---|---:|---:|---:|"]
        for r in res["top"]:
            name = r["kernel"].replace("|", "/")
            if len(name) > 90:
                name = name[:87] + "..."
            share = 100.0 * r["ms_per_step"] / res["kernel_ms_total"] if res["kernel_ms_total"] else 0.0
            lines.append(f"| `{name}` | {r['ms_per_step']:.3f} | {share:.1f} | {r['calls_per_step']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def run_one(options: StepOptions, method: str, out: Path) -> None:
    """The per-arm child: profile ``method`` and write its JSON to ``out``."""
    out.write_text(json.dumps(profile_one(options, method)))


def run(options: StepOptions, methods: list[str], out: Path) -> int:
    """Every arm in its own process, then the Markdown report at ``out``; 1 when no arm could run."""
    return run_and_report(COMMAND, methods, options.child_arguments(), out, lambda results, device: to_markdown(
        results, options.model, options.batch, options.seq, device, options.activations), "profiled")
