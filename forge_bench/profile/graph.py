"""Where the time of a CUDA-graph step goes, with both streams: what the sweep's graph cells time.

    forge-bench profile graph --activations lean --methods adamw_fused,forge_bf16,forge_int8 \
        --out reports/h100/graph_profile_llama8b_b1_s512_lean.md

``profile step`` profiles eager steps, whose host launch cost hides what the GPU does; a graph
replay has none, and with ``fuse(overlap=True)`` the fused updates run on a side stream beside the
backward. Each method runs in its own process, is built capturable, warmed up and captured as a
sweep's graph cell is (``cell.GraphedStep``); its step is timed without the profiler (CUDA events,
median of ``--timed`` replays), then ``--steps`` replays are recorded with CUDA activity, each after
a synchronize and a pause so that replays can be told apart on the timeline.

Per replay it reports the GPU span, the time any kernel ran (union over streams), the idle rest,
each kernel class's summed time and how much of it ran beside another class's kernels, and for the
fused update (one row per launch grid, i.e. per weight shape) the in-graph duration per launch, to
hold against ``forge-bench kernel``'s time for the kernel alone.
"""
from __future__ import annotations

import bisect
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from forge_bench.cell import GRAPH_EAGER_WARMUP, GraphedStep
from forge_bench.profile.common import BATCH_POOL, chrome_trace, StepOptions, run_and_report, union_intervals, warmed_up_arm

DEFAULT_METHODS = ("adamw_fused", "forge_bf16", "forge_int8")
COMMAND = ["profile", "graph"]

TOP = 15                       # kernels listed by name per arm
REPLAY_PAUSE_S = 0.02          # idle between recorded replays; the split below looks for it
REPLAY_SPLIT_US = 10_000.0     # a kernel gap this long starts a new replay
KERNEL_CLASSES = (             # first match wins; the name is lower-cased
    # the Triton and the Gluon kernel, and the row-gradient embedding's one-pass update (row_update.py)
    ("fused update", ("_fused_wgrad_update", "_ws_fused_kernel", "_row_update_kernel")),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("norm", ("rms_norm",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in low for key in keys):
            return label
    return "other"


def _overlap_us(interval: tuple[float, float], union: list[tuple[float, float]], starts: list[float]) -> float:
    """How long ``interval`` shares with a sorted, disjoint ``union`` (``starts``: its starts)."""
    start, end = interval
    i = max(0, bisect.bisect_right(starts, start) - 1)
    total = 0.0
    while i < len(union) and union[i][0] < end:
        a, b = union[i]
        total += max(0.0, min(b, end) - max(a, start))
        i += 1
    return total


def _span(kernel: dict) -> tuple[float, float]:
    return kernel["ts"], kernel["ts"] + kernel["dur"]


def split_replays(kernels: list[dict]) -> list[list[dict]]:
    """Kernel events (sorted by start) grouped into replays at the long pauses between them."""
    replays: list[list[dict]] = []
    last_end = None
    for k in kernels:
        if last_end is None or k["ts"] - last_end > REPLAY_SPLIT_US:
            replays.append([])
        replays[-1].append(k)
        last_end = k["ts"] + k["dur"] if last_end is None else max(last_end, k["ts"] + k["dur"])
    return replays


def analyse_replay(kernels: list[dict]) -> dict[str, Any]:
    """Span, busy union, idle, per-class time and overlap, per-stream busy, fused launches by grid."""
    span = (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)) / 1000.0
    busy = union_intervals([_span(k) for k in kernels])
    busy_ms = sum(b - a for a, b in busy) / 1000.0
    by_class = _group(kernels, lambda k: kernel_class(k["name"]))
    classes = {}
    beside: dict[int, float] = {}            # id(kernel) -> us it ran beside another class's kernels
    for label, members in by_class.items():
        others = union_intervals([_span(k) for k in kernels if kernel_class(k["name"]) != label])
        starts = [a for a, _ in others]
        for k in members:
            beside[id(k)] = _overlap_us(_span(k), others, starts)
        classes[label] = {"ms": sum(k["dur"] for k in members) / 1000.0, "launches": len(members),
                          "beside_other_ms": sum(beside[id(k)] for k in members) / 1000.0}
    streams = {stream: sum(b - a for a, b in union_intervals([_span(k) for k in members])) / 1000.0
               for stream, members in _group(kernels, lambda k: str(k.get("args", {}).get("stream",
                                                                                        k.get("tid")))).items()}
    grids = []
    for grid, members in _group(by_class.get("fused update", []), lambda k: str(k.get("args", {}).get("grid"))).items():
        durs = [k["dur"] for k in members]
        alone = [k["dur"] for k in members if beside[id(k)] < 0.05 * k["dur"]]
        grids.append({"grid": grid, "launches": len(members), "ms_total": sum(durs) / 1000.0,
                      "us_median": statistics.median(durs),
                      "us_median_alone": statistics.median(alone) if alone else None, "alone": len(alone),
                      "registers": members[0].get("args", {}).get("registers per thread"),
                      "blocks_per_sm": members[0].get("args", {}).get("blocks per SM")})
    grids.sort(key=lambda g: -g["ms_total"])
    by_name = _group(kernels, lambda k: k["name"])
    top = sorted(({"kernel": name, "ms": sum(k["dur"] for k in members) / 1000.0, "launches": len(members),
                   "class": kernel_class(name)} for name, members in by_name.items()), key=lambda r: -r["ms"])[:TOP]
    return {"span_ms": span, "busy_ms": busy_ms, "idle_ms": span - busy_ms,
            "kernel_ms": sum(k["dur"] for k in kernels) / 1000.0, "launches": len(kernels),
            "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["ms"])),
            "stream_busy_ms": dict(sorted(streams.items(), key=lambda kv: -kv[1])), "fused_by_grid": grids,
            "top_kernels": top}


def _group(items: list[dict], key) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups


def analyse_trace(trace: dict) -> list[dict[str, Any]]:
    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        raise ValueError("the trace holds no kernel events: CUPTI recorded nothing inside the graph replays")
    for k in kernels:
        k["ts"], k["dur"] = float(k["ts"]), float(k.get("dur", 0.0))
    kernels.sort(key=lambda k: k["ts"])
    return [analyse_replay(replay) for replay in split_replays(kernels)]


def profile_one(options: StepOptions, method_name: str, timed: int, trace_path: Path | None) -> dict[str, Any]:
    """Capture one arm's step as a graph cell does, time ``timed`` replays, record ``options.steps``
    more with the profiler; returns the per-replay analysis."""
    arm, batches = warmed_up_arm("profile graph", options, method_name, GRAPH_EAGER_WARMUP, capturable=True)
    gc.collect()
    torch.cuda.empty_cache()      # the eager steps' blocks back before the capture's own pool (cell.run_timing)
    step = GraphedStep(arm, batches[0])
    for i in range(options.warmup):
        step(batches[i % BATCH_POOL])
    torch.cuda.synchronize()

    gc.collect()
    gc.disable()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(timed)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(timed)]
    for i in range(timed):
        starts[i].record()
        step(batches[i % BATCH_POOL])
        ends[i].record()
    torch.cuda.synchronize()
    gc.enable()
    step_ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(options.steps):
            step(batches[i % BATCH_POOL])
            torch.cuda.synchronize()
            time.sleep(REPLAY_PAUSE_S)
    trace = chrome_trace(prof, f"graph_profile_{method_name}", trace_path)
    replays = analyse_trace(trace)
    return {"method": method_name, "step_ms_median": step_ms, "timed": timed, "replays": replays}


def to_markdown(results: list[dict], title: str) -> str:
    """The report: the median replay per arm, then its kernel classes, top kernels, streams and fused grids."""
    lines = [f"# Graph-replay profile: {title}", "",
             "Each arm captured in a CUDA graph as a sweep's graph cell is, timed without the profiler "
             "(`step ms`: CUDA events, median of the timed replays), then replays recorded with CUDA activity. "
             "Per replay (the table shows the median replay by span): `busy` = time at least one kernel ran "
             "(union over streams), `idle` = span minus busy, `beside` = a class's kernel time that ran "
             "concurrently with another class's kernels.", "",
             "| method | step ms | span ms | busy ms | idle ms | kernel ms (sum) | launches |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    picked = []
    for res in results:
        reps = sorted(res["replays"], key=lambda r: r["span_ms"])
        rep = reps[len(reps) // 2]
        picked.append((res, rep))
        lines.append(f"| {res['method']} | {res['step_ms_median']:.2f} | {rep['span_ms']:.2f} | {rep['busy_ms']:.2f} | "
                     f"{rep['idle_ms']:.2f} | {rep['kernel_ms']:.2f} | {rep['launches']} |")
    for res, rep in picked:
        lines += ["", f"## {res['method']}", "", "| kernel class | ms | launches | ms beside another class |",
                  "|---|---:|---:|---:|"]
        for label, c in rep["classes"].items():
            lines.append(f"| {label} | {c['ms']:.2f} | {c['launches']} | {c['beside_other_ms']:.2f} |")
        lines += ["", f"Top {len(rep['top_kernels'])} kernels by time in the replay:", "",
                  "| kernel | class | ms | launches |", "|---|---|---:|---:|"]
        for k in rep["top_kernels"]:
            name = k["kernel"].replace("|", "/")
            name = name if len(name) <= 90 else name[:87] + "..."
            lines.append(f"| `{name}` | {k['class']} | {k['ms']:.2f} | {k['launches']} |")
        lines += ["", "Busy time per stream: " + ", ".join(f"stream {s} {ms:.2f} ms"
                                                           for s, ms in rep["stream_busy_ms"].items())]
        if rep["fused_by_grid"]:
            lines += ["", "Fused update per launch grid (one grid per weight shape): median µs per launch, and "
                      "over the launches that ran (almost) alone", "",
                      "| grid | launches | ms total | µs / launch | µs alone (n) | regs | blocks / SM |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for g in rep["fused_by_grid"]:
                alone = f"{g['us_median_alone']:.1f} ({g['alone']})" if g["us_median_alone"] is not None else "- (0)"
                lines.append(f"| {g['grid']} | {g['launches']} | {g['ms_total']:.2f} | {g['us_median']:.1f} | "
                             f"{alone} | {g['registers']} | {g['blocks_per_sm']} |")
    return "\n".join(lines) + "\n"


def run_one(options: StepOptions, method: str, timed: int, out: Path, trace_dir: Path | None) -> None:
    """The per-arm child: profile ``method`` and write its JSON to ``out``."""
    trace = trace_dir / f"{method}.json.gz" if trace_dir else None
    out.write_text(json.dumps(profile_one(options, method, timed, trace)))


def run(options: StepOptions, methods: list[str], timed: int, out: Path, trace_dir: Path | None) -> int:
    """Every arm in its own process, then the Markdown report at ``out`` and its JSON beside it."""
    if trace_dir:
        trace_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--timed", str(timed)] + (["--trace-dir", str(trace_dir)] if trace_dir else [])
    return run_and_report(COMMAND, methods, options.child_arguments() + extra, out, lambda results, device: to_markdown(
        results, f"{options.title()} ({device})"), "profiled", json_beside=True)
