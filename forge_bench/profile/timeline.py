"""Is a training step host-bound, GPU-bound or stalled on a sync? Read it off a profiler timeline.

    forge-bench profile timeline --model llama-3.1-8b --methods no_optimizer,adamw_fused,forge_bf16 \
        --out reports/h100/timeline_llama8b_b1_s512.md [--trace-dir DIR]

Each method runs in its own process, warms up, then records a few steps with torch.profiler (CPU
and CUDA activities, each step inside a ``record_function`` range). From the Chrome trace it works
out, per step: how long the GPU was busy, how much of the step it sat idle and in which gaps,
which host op launched the kernel that ended each idle gap (that op is where the host was slow),
when the host finished enqueueing the step compared with when the GPU finished it, and every CUDA
runtime call that can block the host (synchronize, blocking copies, cudaMalloc / cudaFree).

The profiler slows the host (a few microseconds per op), so absolute step times run above a
sweep's; the *shape* of the timeline (idle share, who causes the gaps, syncs) is what this is for.
"""
from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from forge_bench.profile.common import BATCH_POOL, chrome_trace, StepOptions, run_and_report, union_intervals, warmed_up_arm

STEP_PREFIX = "forge_step_"
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
# Runtime calls that make the host wait for the GPU (or for the driver's allocator).
BLOCKING_CALLS = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree",
                  "cudaHostAlloc", "cudaStreamWaitEvent", "cuStreamSynchronize", "cudaEventQuery")
MIN_GAP_US = 5.0
TOP_GAPS = 10
DEFAULT_METHODS = ("no_optimizer", "adamw_fused", "forge_bf16")
COMMAND = ["profile", "timeline"]


def _stacks_at(cpu_ops: list[dict], probes: list[dict]) -> dict[int, list[str]]:
    """For each probe event (a runtime call), the names of the host ops on its thread that enclose
    it, outermost first; keyed by ``id(probe)``. One sweep per thread (ops on a thread nest)."""
    by_thread: dict[Any, list[tuple[float, int, dict]]] = defaultdict(list)
    for op in cpu_ops:
        by_thread[op.get("tid")].append((op["ts"], 0, op))
    for probe in probes:
        by_thread[probe.get("tid")].append((probe["ts"], 1, probe))
    stacks: dict[int, list[str]] = {}
    for items in by_thread.values():
        items.sort(key=lambda item: (item[0], item[1], -item[2].get("dur", 0.0)))
        open_ops: list[dict] = []
        for ts, kind, event in items:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] < ts:
                open_ops.pop()
            if kind == 0:
                open_ops.append(event)
            else:
                stacks[id(event)] = [op["name"] for op in open_ops]
    return stacks


def _gap_owner(stack: list[str]) -> str:
    """The most telling name for the host code that launched a kernel: the autograd node or
    module-level op when there is one, else the innermost op."""
    for name in stack:
        if name.startswith("autograd::engine::evaluate_function"):
            return name.replace("autograd::engine::evaluate_function: ", "backward: ")
        if name.startswith("Optimizer.step") or name.startswith("## forge"):
            return name
    return stack[-1] if stack else "(no host op)"


def analyse_trace(trace: dict) -> dict[str, Any]:
    """Per-step host/GPU summary of a torch.profiler Chrome trace whose steps are wrapped in
    ``record_function(f"{STEP_PREFIX}{i}")`` ranges."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    for e in events:
        e["ts"] = float(e["ts"])
        e["dur"] = float(e.get("dur", 0.0))
    steps = sorted((e for e in events if str(e.get("name", "")).startswith(STEP_PREFIX)
                    and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no '{STEP_PREFIX}*' ranges in the trace: wrap each step in record_function")
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATEGORIES]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    cpu_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    gpu_by_corr: dict[Any, list[dict]] = defaultdict(list)
    for e in gpu:
        gpu_by_corr[e.get("args", {}).get("correlation")].append(e)
    runtime_by_corr = {e.get("args", {}).get("correlation"): e for e in runtime}

    per_step = []
    for step in steps:
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        calls = [e for e in runtime if t0 <= e["ts"] <= t1]
        work = [g for c in calls for g in gpu_by_corr.get(c.get("args", {}).get("correlation"), [])]
        if not work:
            continue
        busy_intervals = union_intervals([(g["ts"], g["ts"] + g["dur"]) for g in work])
        gpu_start, gpu_end = busy_intervals[0][0], busy_intervals[-1][1]
        busy = sum(b - a for a, b in busy_intervals)
        # Idle gaps inside the step's GPU span, and who launched the work that ended each one.
        work_sorted = sorted(work, key=lambda g: g["ts"])
        work_starts = [g["ts"] for g in work_sorted]
        raw_gaps = []
        for (_, prev_end), (next_start, _) in zip(busy_intervals, busy_intervals[1:]):
            if next_start - prev_end < MIN_GAP_US:
                continue
            first = work_sorted[bisect.bisect_left(work_starts, next_start)]
            raw_gaps.append((next_start - prev_end, first, runtime_by_corr.get(first.get("args", {}).get("correlation"))))
        stacks = _stacks_at(cpu_ops, [launch for _, _, launch in raw_gaps if launch is not None])
        gaps = []
        for gap_us, first, launch in raw_gaps:
            stack = stacks.get(id(launch), []) if launch is not None else []
            stack = [name for name in stack if not name.startswith(STEP_PREFIX)]
            gaps.append({"gap_us": gap_us, "owner": _gap_owner(stack), "innermost": stack[-1] if stack else "",
                         "kernel": str(first.get("name", ""))[:80]})
        by_owner: dict[str, float] = defaultdict(float)
        for gap in gaps:
            by_owner[gap["owner"]] += gap["gap_us"]
        blocking: dict[str, dict[str, float]] = {}
        for c in calls:
            if any(key in c["name"] for key in BLOCKING_CALLS):
                slot = blocking.setdefault(c["name"], {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
                slot["count"] += 1
                slot["total_ms"] += c["dur"] / 1000.0
                slot["max_ms"] = max(slot["max_ms"], c["dur"] / 1000.0)
        launches = [c for c in calls if "Launch" in c["name"]]
        host_enqueue_end = max((c["ts"] + c["dur"] for c in calls), default=t0)
        per_step.append({
            "host_ms": step["dur"] / 1000.0,
            "gpu_span_ms": (gpu_end - gpu_start) / 1000.0,
            "gpu_busy_ms": busy / 1000.0,
            "gpu_idle_ms": (gpu_end - gpu_start - busy) / 1000.0,
            "first_launch_to_gpu_start_ms": (gpu_start - t0) / 1000.0,
            "host_enqueue_done_before_gpu_end_ms": (gpu_end - host_enqueue_end) / 1000.0,
            "launches": len(launches),
            "launch_ms_total": sum(c["dur"] for c in launches) / 1000.0,
            "launch_ms_max": max((c["dur"] for c in launches), default=0.0) / 1000.0,
            "gaps": len(gaps),
            "top_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:TOP_GAPS],
            "gap_ms_by_owner": dict(sorted(((k, v / 1000.0) for k, v in by_owner.items()), key=lambda kv: -kv[1])[:12]),
            "blocking_calls": blocking,
        })
    if not per_step:
        raise ValueError("the step ranges launched no GPU work (was CUDA activity recorded?)")
    return {"steps": per_step, **{f"median_{k}": statistics.median(s[k] for s in per_step)
                                  for k in ("host_ms", "gpu_span_ms", "gpu_busy_ms", "gpu_idle_ms",
                                            "host_enqueue_done_before_gpu_end_ms", "launches",
                                            "launch_ms_total")}}


def record_one(options: StepOptions, method_name: str, trace_path: Path | None) -> dict[str, Any]:
    """Record ``options.steps`` steps of one arm in this process; returns ``analyse_trace``'s summary
    (and keeps the gzipped Chrome trace at ``trace_path`` when given)."""
    arm, batches = warmed_up_arm("profile timeline", options, method_name)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(options.steps):
            with record_function(f"{STEP_PREFIX}{i}"):
                arm.step(batches[i % BATCH_POOL])
        torch.cuda.synchronize()
    trace = chrome_trace(prof, f"step_timeline_{method_name}", trace_path)
    return {"method": method_name, **analyse_trace(trace)}


def to_markdown(results: Iterable[dict], title: str) -> str:
    """The report: medians per arm, then the last recorded step's gaps and blocking calls per arm."""
    lines = [f"# Step timeline: {title}", "",
             "torch.profiler with CPU + CUDA activity (host times inflated by the profiler). Medians over "
             "the recorded steps. `idle` = GPU idle inside the step's GPU span; `enqueue slack` = how long "
             "before the GPU finished the step the host had launched all of it (near 0: host-bound).", "",
             "| method | host ms | GPU span ms | GPU busy ms | GPU idle ms | enqueue slack ms | launches | launch ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    results = list(results)
    for r in results:
        lines.append(f"| {r['method']} | {r['median_host_ms']:.1f} | {r['median_gpu_span_ms']:.1f} | "
                     f"{r['median_gpu_busy_ms']:.1f} | {r['median_gpu_idle_ms']:.1f} | "
                     f"{r['median_host_enqueue_done_before_gpu_end_ms']:.1f} | {r['median_launches']:.0f} | "
                     f"{r['median_launch_ms_total']:.1f} |")
    for r in results:
        last = r["steps"][-1]
        lines += ["", f"## {r['method']} (last recorded step)", "", "GPU idle by the host code that ended the gap:", "",
                  "| host code | idle ms |", "|---|---:|"]
        lines += [f"| `{k[:100]}` | {v:.2f} |" for k, v in last["gap_ms_by_owner"].items()]
        lines += ["", "Calls that can block the host:", "", "| call | count | total ms | max ms |", "|---|---:|---:|---:|"]
        lines += [f"| `{k}` | {v['count']} | {v['total_ms']:.2f} | {v['max_ms']:.3f} |"
                  for k, v in sorted(last["blocking_calls"].items(), key=lambda kv: -kv[1]["total_ms"])]
        lines += ["", "Largest gaps:", "", "| idle us | host code | innermost op | next kernel |", "|---:|---|---|---|"]
        lines += [f"| {g['gap_us']:.0f} | `{g['owner'][:60]}` | `{g['innermost'][:50]}` | `{g['kernel'][:50]}` |"
                  for g in last["top_gaps"]]
    return "\n".join(lines) + "\n"


def run_one(options: StepOptions, method: str, out: Path, trace_dir: Path | None) -> None:
    """The per-arm child: record ``method`` and write its JSON to ``out``."""
    trace = trace_dir / f"trace_{method}.json.gz" if trace_dir else None
    out.write_text(json.dumps(record_one(options, method, trace)))


def run(options: StepOptions, methods: list[str], out: Path, trace_dir: Path | None) -> int:
    """Every arm in its own process, then the Markdown report at ``out`` and its JSON beside it."""
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)
    child_args = options.child_arguments() + (["--trace-dir", str(trace_dir)] if trace_dir else [])
    return run_and_report(COMMAND, methods, child_args, out, lambda results, device: to_markdown(
        results, f"{options.model}, batch {options.batch}, seq {options.seq}"), "recorded", json_beside=True)
