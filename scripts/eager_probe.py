"""Where an eager training step's wall time goes on the host: one arm, one process.

    python3 scripts/eager_probe.py --model llama-3.2-1b --method forge_bf16 --out probe.json

Why: an eager step of a small model is bound by the host (the 1B no_optimizer step is ~50 ms
eager and ~16 ms as a graph replay), so a regression there is in Python, in launches or in a
synchronisation, not in a kernel. Uses only ``forge_bench.methods`` / ``models`` calls that every
tree since session 10 has, so one boot can run it against an old tree (``PYTHONPATH=OLD``) and
this one. It records:

- the build and the warm-up (which holds the tuner's work) in seconds;
- per step, with a synchronize after each: the host's enqueue time and the time to completion
  (enqueue close to completion: the host is the bottleneck, or the step waits on the GPU);
- per step, the process's CPU time over all threads, its context switches and the machine's stolen
  time (is a slow step descheduled, or does the same work run slower?);
- the allocator's retries, cudaMalloc and cudaFree calls in the timed window;
- the host time of each phase (forward to the loss, backward, optimizer step and zero_grad);
- the pipelined step (no synchronize between steps, CUDA events over the window);
- how many calls of one step synchronise with the device (``torch.cuda.set_sync_debug_mode``);
- cProfile of ``--profile-steps`` steps: the top functions by own time and by cumulative time;
- torch.profiler over two steps: summed kernel time per step and the fused update's launches.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import io
import json
import pstats
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch


def _top(profile: cProfile.Profile, key: str, count: int, steps: int) -> list[dict]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls_per_step": calls / steps,
                     "own_ms_per_step": own * 1e3 / steps, "cum_ms_per_step": cumulative * 1e3 / steps})
    field = {"tottime": "own_ms_per_step", "cumulative": "cum_ms_per_step"}[key]
    return sorted(rows, key=lambda r: -r[field])[:count]


def _syncing_calls(step) -> list[str]:
    """The warnings torch raises for each call of one step that waits on the device."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0][:200] for w in caught]


def _kernel_times(step, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us, fused_us, fused_launches = 0.0, 0.0, 0
    for event in prof.key_averages():
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        total_us += us
        if "_fused_wgrad_update" in event.key:
            fused_us += us
            fused_launches += event.count
    return {"kernel_ms_per_step": total_us / 1e3 / steps, "fused_ms_per_step": fused_us / 1e3 / steps,
            "fused_launches_per_step": fused_launches / steps}


_ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                       "num_ooms")


def _allocator_counters() -> dict[str, int]:
    """The caching allocator's counters whose growth during a timed window means hidden device work:
    a retry frees cached segments after a device-wide synchronisation; a device alloc / free is a
    cudaMalloc / cudaFree (both synchronise or stall the host)."""
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0)) for name in _ALLOCATOR_COUNTERS}


def _cpu_times() -> dict[str, float]:
    """This process's CPU time (all threads: the autograd engine runs a CUDA backward on its own
    thread), its context switches, and the machine's stolen time (hypervisor), for one step's
    delta: a host-bound step whose wall time moves while its CPU time does not waits for the CPU
    (descheduled, stolen); one whose CPU time moves with it runs slower code or a slower CPU."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_ms": (usage.ru_utime + usage.ru_stime) * 1e3, "voluntary_switches": float(usage.ru_nvcsw),
           "involuntary_switches": float(usage.ru_nivcsw)}
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
        out["machine_steal_ms"] = float(fields[8]) * tick_ms if len(fields) > 8 else 0.0
        out["machine_busy_ms"] = sum(float(v) for i, v in enumerate(fields[1:], 1) if i not in (4, 5)) * tick_ms
    except (OSError, ValueError, IndexError):
        pass
    return out


def _phase_times(arm, batches, steps: int) -> dict | None:
    """Host time per phase of a plain training step (forward to the loss, backward, optimizer step
    and zero_grad), each step synchronised at its end: where the enqueue time of a host-bound step
    goes. None for an arm without ``model`` (the phases are then not separable here)."""
    model, optimizer = getattr(arm, "model", None), getattr(arm, "optimizer", None)
    if model is None or type(arm).__name__ not in ("TorchArm", "ForgeArm"):
        return None
    forward, backward, update, wait = [], [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = model(**batches[i % len(batches)]).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        (optimizer if type(arm).__name__ == "ForgeArm" else model).zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        for phase, value in zip((forward, backward, update, wait), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phase.append(value * 1e3)
    return {name: statistics.median(values) for name, values in
            (("forward_ms", forward), ("backward_ms", backward), ("step_ms", update), ("wait_ms", wait))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--method", default="forge_bf16")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--no-tma", action="store_true",
                    help="load the main loop through pointers (patches fused.tma_inputs; trees with TMA only)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("eager_probe: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2

    import forge_core
    if args.no_tma:
        from forge_core.kernels import fused
        fused.tma_inputs = lambda x2, dy2: False
    from forge_bench import methods as methods_mod
    from forge_bench import models as models_mod

    t0 = time.perf_counter()
    model = models_mod.build_model(args.model, "bfloat16", "cuda", seed=0)
    torch.manual_seed(0)
    arm = methods_mod.get_method(args.method).build(
        model, methods_mod.TrainConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, device="cuda"))
    batches = [models_mod.make_batch(args.model, args.batch, args.seq, "cuda", seed=i) for i in range(4)]
    counter = iter(range(10 ** 9))

    def step():
        return arm.step(batches[next(counter) % len(batches)])

    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t2 = time.perf_counter()

    gc.collect()
    gc.disable()            # as the sweep's timed window does (forge_bench.cell)
    counters_before = _allocator_counters()
    enqueue, complete = [], []
    host: dict[str, list[float]] = {}
    for _ in range(args.steps):
        before = _cpu_times()
        start = time.perf_counter()
        step()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        after = _cpu_times()
        enqueue.append((queued - start) * 1e3)
        complete.append((done - start) * 1e3)
        for name in after:
            host.setdefault(name, []).append(after[name] - before.get(name, 0.0))

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    pipelined = begin.elapsed_time(end) / args.steps
    counters_after = _allocator_counters()
    phases = _phase_times(arm, batches, args.steps)
    gc.enable()

    syncs = _syncing_calls(step)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    kernels = _kernel_times(step, 2)

    result = {
        "model": args.model, "batch": args.batch, "seq": args.seq, "method": args.method, "no_tma": args.no_tma,
        "forge_core": forge_core.__file__, "cpus_allowed": sorted(os.sched_getaffinity(0)), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "build_s": t1 - t0, "warmup_s": t2 - t1,
        "enqueue_ms_median": statistics.median(enqueue), "complete_ms_median": statistics.median(complete),
        "enqueue_ms": enqueue, "complete_ms": complete, "pipelined_ms": pipelined,
        "host_per_step": host,
        "cpu_ms_median": statistics.median(host["cpu_ms"]),
        "allocator_window_steps": 2 * args.steps,
        "allocator_events_in_window": {name: counters_after[name] - counters_before[name]
                                       for name in _ALLOCATOR_COUNTERS},
        "host_phases_ms": phases,
        "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
        "syncing_calls_per_step": len(syncs), "syncing_calls": sorted(set(syncs))[:20],
        **kernels,
        "top_own": _top(profiler, "tottime", 40, args.profile_steps),
        "top_cumulative": _top(profiler, "cumulative", 40, args.profile_steps),
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.method} ({forge_core.__file__}): build {result['build_s']:.1f} s, warm-up {result['warmup_s']:.1f} s, "
          f"enqueue {result['enqueue_ms_median']:.2f} ms, complete {result['complete_ms_median']:.2f} ms, "
          f"pipelined {pipelined:.2f} ms, process CPU {result['cpu_ms_median']:.1f} ms/step, kernels {kernels['kernel_ms_per_step']:.2f} ms/step "
          f"(fused {kernels['fused_ms_per_step']:.2f} in {kernels['fused_launches_per_step']:.0f}), "
          f"{len(syncs)} syncing calls, allocator {result['allocator_events_in_window']}, phases {phases}")
    for row in result["top_own"][:12]:
        print(f"   {row['own_ms_per_step']:8.2f} ms own  {row['calls_per_step']:7.0f} calls  {row['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
