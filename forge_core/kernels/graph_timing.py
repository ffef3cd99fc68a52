"""Timing a GPU call the way a captured training step pays for it: replays of a CUDA graph.

Why here: the kernel choice (``ws_choice``) times the two fused kernels this way for a capturable
step, and the kernel benchmark (``forge-bench kernel``) times every operation this way; both
must measure the same thing (no host launch cost, no first-call compile).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable

import torch


def captured(call: Callable[[Any], None], items: Iterable[Any]) -> "torch.cuda.CUDAGraph":
    """A CUDA graph running ``call`` once on each item, warmed up first on a side stream (JIT,
    tuning, library handles stay outside the graph) and replayed once."""
    items = list(items)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for item in items:
            call(item)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in items:
            call(item)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: "torch.cuda.CUDAGraph", calls_per_replay: int, replays: int) -> float:
    """Median ms of one call: ``replays`` replays between CUDA events, each divided by its calls."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_replay)
    return statistics.median(times)
