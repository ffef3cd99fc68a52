"""Does the step get faster when its critical path outranks the fused updates? (GPU, one process per
method.)

    python3 scripts/priority_probe.py --out $OUT/priority.jsonl forge_int8 forge_bf16

The fused updates run on a side stream (forge_core.overlap) at the default priority, the same as the
stream that captures the step, so the block scheduler hands out CTAs in launch order: once an
update's thousands of CTAs are queued, the next dX GEMM waits behind them (docs/kernel_notes.md,
session 7). CUDA graphs keep each kernel's stream priority (torch >= 2.10 instantiates with
cudaGraphInstantiateFlagUseNodePriority). This captures the same warmed-up arm twice, once on a
default-priority stream and once on the highest-priority one, and times the two graphs in
alternating rounds of 20 replays (CUDA events), the Llama-3.1-8B b1 s512 lean cell of the headline.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_rounds(steps: dict, batches: list, rounds: int, replays: int) -> dict[str, list[float]]:
    import torch
    medians: dict[str, list[float]] = {name: [] for name in steps}
    gc.collect()
    gc.disable()
    for round_index in range(rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
            for i in range(replays):
                starts[i].record()
                steps[name](batches[i % len(batches)])
                ends[i].record()
            torch.cuda.synchronize()
            medians[name].append(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))
    gc.enable()
    return medians


def probe(method: str, rounds: int, replays: int) -> dict:
    import torch
    from forge_bench import cell as cell_mod
    from forge_bench.profile_step import warmed_up_arm
    from forge_bench.telemetry import nvml_snapshot

    arm, batches = warmed_up_arm("priority_probe", "llama-3.1-8b", 1, 512, method, cell_mod.GRAPH_EAGER_WARMUP,
                                 "bfloat16", "lean", capturable=True)
    gc.collect()
    torch.cuda.empty_cache()
    steps = {"default": cell_mod.GraphedStep(arm, batches[0], torch.cuda.Stream(priority=0)),
             "high": cell_mod.GraphedStep(arm, batches[0], torch.cuda.Stream(priority=-100))}
    for step in steps.values():
        for i in range(5):
            step(batches[i % len(batches)])
    torch.cuda.synchronize()
    clock_before = nvml_snapshot().get("sm_clock_mhz")
    medians = time_rounds(steps, batches, rounds, replays)
    return dict(method=method, rounds=rounds, replays=replays, round_medians=medians,
                median={k: statistics.median(v) for k, v in medians.items()},
                sm_clock_mhz_before=clock_before, sm_clock_mhz_after=nvml_snapshot().get("sm_clock_mhz"),
                torch=torch.__version__, device=torch.cuda.get_device_name())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("methods", nargs="+")
    args = parser.parse_args()
    if args.one:
        (method,) = args.methods
        record = probe(method, args.rounds, args.replays)
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps(record["median"]), flush=True)
        return 0
    for method in args.methods:       # one process per method, as a sweep cell
        done = subprocess.run([sys.executable, __file__, "--one", "--out", args.out, "--rounds", str(args.rounds),
                               "--replays", str(args.replays), method])
        print(f"{method}: rc={done.returncode}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
