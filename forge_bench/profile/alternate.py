"""Two or more arms resident in one process, their steps taking turns in blocks: the host-bound comparison.

    forge-bench profile alternate --model llama-3.2-1b --methods adamw_fused_compile,forge_bf16_compile \
        --blocks 16 --steps 20 --out reports/h200/alternate_1b.md

Why: where a step is the host's (batch 1 of a small model, under ``torch.compile``), a step's time follows the
host's speed, which moves 10-30% on a virtual machine within seconds; two arms measured one after the other, or in
processes of their own, each draw a speed of their own. Here every arm is built, compiled and warmed up in this one
process, then the blocks run in turns (ABBA: neither arm always goes first) on the CPUs a sweep's cell is pinned to,
twice: with a synchronize before each step, timing its forward, backward and ``step()`` on the host and the step's
wall time (where the GPU's own work shows), then back to back with CUDA events per step, as a sweep's cell times them
(where the host's time is the step's). The per-block ratios, each of two adjacent blocks, give the spread the
medians hide. Arms that need a peer package load it beside the others: profile those one process each (``profile
host``).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

from forge_bench.profile.common import StepOptions, timed_step_phases, warmed_up_split_arm

DEFAULT_METHODS = ("adamw_fused_compile", "forge_bf16_compile")
PHASES = ("forward", "backward", "optimizer")


def block_orders(methods: list[str], blocks: int) -> list[list[str]]:
    """Each block's order of the arms: as given in even blocks, reversed in odd ones (ABBA), so that no arm always
    follows the same one or goes first."""
    return [list(methods) if block % 2 == 0 else list(reversed(methods)) for block in range(blocks)]


def synced_block(arm: Any, batches: list, steps: int) -> dict[str, list[float]]:
    """``steps`` steps with a synchronize before each: host seconds of each phase and each step's wall seconds."""
    times: dict[str, list[float]] = {name: [] for name in (*PHASES, "wall")}
    for i in range(steps):
        torch.cuda.synchronize()
        for name, seconds in zip((*PHASES, "wall"), timed_step_phases(arm, batches[i % len(batches)])):
            times[name].append(seconds)
    return times


def back_to_back_block(arm: Any, batches: list, steps: int) -> float:
    """The median ms of ``steps`` steps run back to back, each timed by CUDA events (a sweep cell's timing)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for i, (start, end) in enumerate(events):
        start.record()
        arm.step(batches[i % len(batches)])
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def profile_arms(options: StepOptions, methods: list[str], blocks: int) -> dict[str, Any]:
    """Build and warm up every arm here, then the synced blocks and the back-to-back blocks in turns."""
    arms = {}
    for method in methods:
        arms[method] = warmed_up_split_arm("profile alternate", options, method)
    synced: dict[str, dict[str, list[float]]] = {m: {name: [] for name in (*PHASES, "wall")} for m in methods}
    for order in block_orders(methods, blocks):
        for method in order:
            for name, values in synced_block(*arms[method], options.steps).items():
                synced[method][name] += values
    back_to_back: dict[str, list[float]] = {m: [] for m in methods}
    for order in block_orders(methods, blocks):
        for method in order:
            back_to_back[method].append(back_to_back_block(*arms[method], options.steps))
    return {"methods": methods, "blocks": blocks, "steps": options.steps,
            "synced_ms": {m: {name: 1e3 * statistics.median(v) for name, v in times.items()}
                          for m, times in synced.items()},
            "back_to_back_ms": back_to_back}


def to_markdown(result: dict[str, Any], options: StepOptions, device: str) -> str:
    """Per arm: the synced step (wall, host phases, their sum) and the back-to-back median; then each arm's
    speed-up over the first arm, block by block."""
    methods, first = result["methods"], result["methods"][0]
    lines = [f"# Arms taking turns in one process: {options.title()} ({device})", "",
             f"{result['blocks']} blocks of {result['steps']} steps per arm and mode, in turns (ABBA), after "
             f"{options.warmup} warm-up steps each. Synced: a synchronize before each step, host ms per phase "
             "(`time.perf_counter`) and the step's wall ms. Back to back: each block's median of CUDA-event step "
             f"times, as a sweep cell times them. Speed-up: {first}'s ms over the arm's (above 1: the arm is faster); "
             "per block: the speed-up within each block, where both arms ran next to each other in time (a drift of the "
             "host's speed they share cancels), its median and range.",
             "", "| arm | synced wall ms | forward | backward | optimizer | host sum | back to back ms | speed-up, "
             "back to back | per block, median (min-max) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = result["back_to_back_ms"][first]
    for method in methods:
        synced = result["synced_ms"][method]
        blocks = result["back_to_back_ms"][method]
        host_sum = sum(synced[name] for name in PHASES)
        ratios = [b / own for b, own in zip(base, blocks)]
        lines.append(f"| {method} | {synced['wall']:.2f} | {synced['forward']:.2f} | {synced['backward']:.2f} | "
                     f"{synced['optimizer']:.2f} | {host_sum:.2f} | {statistics.median(blocks):.2f} | "
                     f"{statistics.median(base) / statistics.median(blocks):.2f}x | "
                     f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}x-{max(ratios):.2f}x) |")
    return "\n".join(lines) + "\n"


def run(options: StepOptions, methods: list[str], out: Path, blocks: int) -> int:
    """Every arm in this process, then the Markdown report at ``out`` and its JSON beside it."""
    if len(methods) < 2:
        raise SystemExit(f"profile alternate: needs at least two arms to take turns, got {methods}")
    result = profile_arms(options, methods, blocks)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_markdown(result, options, torch.cuda.get_device_name(0)))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(out.read_text())
    return 0
