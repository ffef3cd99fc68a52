"""Where the time of one training step goes: torch.profiler's top CUDA kernels for each arm.

    python -m forge_bench.profile_step --model llama-3.1-8b --batch 1 --seq 512 \
        --methods adamw_fused forge_bf16 --out reports/h100/profile.md

Each method runs in its own process (as a sweep cell would: autotuners and the allocator keep
state for the process life), warms up, then profiles ``--steps`` steps. The table lists the
kernels by total CUDA time per step, so the next person sees what is left between a step and
its floor.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from forge_bench import methods as methods_mod
from forge_bench import models as models_mod

TOP = 15


def warmed_up_arm(tool: str, model_name: str, batch: int, seq: int, method_name: str, warmup: int,
                  dtype: str, activations: str = "hf", capturable: bool = False) -> tuple[Any, list]:
    """One arm built on the GPU as a sweep cell builds it, after ``warmup`` steps (autotuners and
    the allocator settled); returns (arm, its batches). ``tool`` names the caller in errors.
    ``capturable``: built for a CUDA graph capture and warmed up on a side stream, as a graph cell is
    before its capture (``cell.GraphedStep``)."""
    from forge_bench import cell as cell_mod

    if not torch.cuda.is_available():
        raise SystemExit(f"{tool}: needs a CUDA device (torch.cuda.is_available() is False)")
    method = methods_mod.get_method(method_name)
    reason = method.unavailable_reason("cuda", capturable)
    if reason:
        raise SystemExit(f"{tool}: {method_name}: {reason}")
    model = models_mod.build_model(model_name, dtype, "cuda", seed=0)
    models_mod.apply_activations(model, activations)
    torch.manual_seed(0)
    arm = method.build(model, methods_mod.TrainConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, device="cuda",
                                                      capturable=capturable))
    batches = [models_mod.make_batch(model_name, batch, seq, "cuda", seed=i) for i in range(4)]
    warm = cell_mod._eager_steps(arm, batches, warmup, side_stream=capturable)
    del warm
    torch.cuda.synchronize()
    return arm, batches


def each_method_in_its_own_process(module: str, methods: list[str], child_args: list[str], out: Path) -> list[dict]:
    """Run ``python -m module --one --methods M ... --out TMP`` per method (a fresh process each,
    as a sweep cell); returns the JSON each wrote, skipping (and reporting) the ones that failed.
    The children write beside ``out``, so its folder is made first (a new folder would otherwise
    fail every arm after its whole warm-up)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for method in methods:
        tmp = out.with_suffix(f".{method}.json")
        cmd = [sys.executable, "-m", module, "--one", "--methods", method, *child_args, "--out", str(tmp)]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            print(f"{module}: {method} failed (exit {proc.returncode})", file=sys.stderr)
            continue
        results.append(json.loads(tmp.read_text()))
        tmp.unlink()
    return results


def profile_one(model_name: str, batch: int, seq: int, method_name: str, steps: int, warmup: int,
                dtype: str, activations: str = "hf") -> dict:
    """Profile ``steps`` steps of one arm in this process; returns the top kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    arm, batches = warmed_up_arm("profile_step", model_name, batch, seq, method_name, warmup, dtype, activations)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for i in range(steps):
            arm.step(batches[i % 4])
        end.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / steps
    rows = []
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(evt, "cuda_time_total", 0.0)
        if cuda_us and evt.count:
            rows.append({"kernel": evt.key, "ms_per_step": cuda_us / 1000.0 / steps,
                         "calls_per_step": evt.count / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    return {"method": method_name, "step_ms_profiled": step_ms, "kernel_ms_total": total, "top": rows[:TOP]}


def to_markdown(results: list[dict], model: str, batch: int, seq: int, device: str, activations: str = "hf") -> str:
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


def step_arguments(description: str, methods: list[str], out_help: str) -> argparse.ArgumentParser:
    """The options every per-arm GPU tool here shares (model, shape, arms, steps, output)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--activations", choices=["hf", "lean"], default="hf",
                    help="lean: forge_core.lean_activations on the model before the arm is built")
    ap.add_argument("--methods", nargs="+", default=methods)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True, help=out_help)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child mode: one method, JSON out
    return ap


def child_arguments(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype,
            "--activations", args.activations,
            "--steps", str(args.steps), "--warmup", str(args.warmup)]


def main(argv: list[str] | None = None) -> int:
    ap = step_arguments(__doc__.splitlines()[0], ["adamw_fused", "forge_bf16"], "Markdown file to write")
    args = ap.parse_args(argv)
    if args.one:
        res = profile_one(args.model, args.batch, args.seq, args.methods[0], args.steps, args.warmup, args.dtype,
                          args.activations)
        args.out.write_text(json.dumps(res))
        return 0
    results = each_method_in_its_own_process("forge_bench.profile_step", args.methods, child_arguments(args), args.out)
    if not results:
        print("profile_step: no arm could be profiled; nothing written", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_markdown(results, args.model, args.batch, args.seq, device, args.activations))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
