"""What the per-arm profilers share: their options, one process per arm, an arm built and warmed
up as a sweep cell builds it and then measured on the same CPUs as every other arm, and interval
arithmetic on trace events."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from forge_bench import lanes
from forge_bench import methods as methods_mod
from forge_bench import models as models_mod
from forge_bench.arm import TrainConfig
from forge_bench.cell import BATCH_POOL, eager_steps
from forge_bench.peer_probes import hide_peer_packages_except


@dataclass(frozen=True)
class StepOptions:
    """The cell every per-arm profiler measures, and how long it profiles it."""
    model: str = "llama-3.1-8b"
    batch: int = 1
    seq: int = 512
    dtype: str = "bfloat16"
    activations: str = "hf"      # "lean": forge_core.lean_activations on the model before the arm is built
    steps: int = 3
    warmup: int = 10

    def child_arguments(self) -> list[str]:
        """These options as the command line of a per-arm child process."""
        return ["--model", self.model, "--batch", str(self.batch), "--seq", str(self.seq), "--dtype", self.dtype,
                "--activations", self.activations, "--steps", str(self.steps), "--warmup", str(self.warmup)]

    def title(self) -> str:
        lean = ", lean activations" if self.activations == "lean" else ""
        return f"{self.model}, batch {self.batch}, seq {self.seq}{lean}"


def run_each_method(command: list[str], methods: list[str], child_args: list[str], out: Path, *,
                    option: str = "--methods",
                    environment: Callable[[str], Mapping[str, str]] | None = None) -> list[dict]:
    """Run ``forge-bench profile COMMAND --one --methods M ... --out TMP`` per method (a fresh process
    each, as a sweep cell); returns the JSON each wrote, skipping (and reporting) the ones that failed.
    The children write beside ``out``, so its folder is made first (a new folder would otherwise
    fail every arm after its whole warm-up). ``option`` names what the child takes one of (``--variants``
    for ``profile layers``); ``environment(method)``: variables a child runs with beside this process's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for method in methods:
        tmp = out.with_suffix(f".{method}.json")
        cmd = [sys.executable, "-m", "forge_bench.cli", *command, "--one", option, method, *child_args,
               "--out", str(tmp)]
        env = {**os.environ, **environment(method)} if environment is not None else None
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            print(f"forge-bench {' '.join(command)}: {method} failed (exit {proc.returncode})", file=sys.stderr)
            continue
        results.append(json.loads(tmp.read_text()))
        tmp.unlink()
    return results


def run_and_report(command: list[str], methods: list[str], child_args: list[str], out: Path,
                   render: Callable[[list[dict], str], str], what: str, json_beside: bool = False) -> int:
    """Every arm in its own process (``run_each_method``), then the Markdown ``render(results, device)`` at
    ``out``, and the results' JSON beside it when ``json_beside``; 1 (nothing written) when no arm ran.
    ``what``: the past participle the refusal uses ("profiled", "timed")."""
    results = run_each_method(command, methods, child_args, out)
    if not results:
        print(f"forge-bench {' '.join(command)}: no arm could be {what}; nothing written", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, device))
    if json_beside:
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(out.read_text())
    return 0


def warmed_up_arm(tool: str, options: StepOptions, method_name: str, warmup: int | None = None,
                  capturable: bool = False) -> tuple[Any, list]:
    """One arm built on the GPU as a sweep cell builds it, after ``warmup`` steps (default
    ``options.warmup``; autotuners and the allocator settled); returns (arm, its batches). ``tool``
    names the caller in errors. ``capturable``: built for a CUDA graph capture and warmed up on a
    side stream, as a graph cell is before its capture (``cell.GraphedStep``).

    Runs in a per-arm child process: the peer packages other arms use are hidden first
    (``peer_probes.hide_peer_packages_except``), as in a sweep's cell process."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool}: needs a CUDA device (torch.cuda.is_available() is False)")
    method = methods_mod.get_method(method_name)
    hide_peer_packages_except(method.requires)
    reason = method.unavailable_reason("cuda", capturable)
    if reason:
        raise SystemExit(f"{tool}: {method_name}: {reason}")
    model = models_mod.build_model(options.model, options.dtype, "cuda", seed=0)
    models_mod.apply_activations(model, options.activations)
    torch.manual_seed(0)
    arm = method.build(model, TrainConfig(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, device="cuda",
                                          capturable=capturable))
    batches = [models_mod.make_batch(options.model, options.batch, options.seq, "cuda", seed=i)
               for i in range(BATCH_POOL)]
    warm = eager_steps(arm, batches, options.warmup if warmup is None else warmup, side_stream=capturable)
    del warm
    torch.cuda.synchronize()
    pin_measured_threads()
    return arm, batches


def warmed_up_split_arm(tool: str, options: StepOptions, method_name: str) -> tuple[Any, list]:
    """``warmed_up_arm`` for the profilers that time a step's phases (``timed_step_phases``): a one-line refusal
    for an arm whose step is not split into ``loss_of`` and ``finish_step``."""
    arm, batches = warmed_up_arm(tool, options, method_name)
    if not (callable(getattr(arm, "loss_of", None)) and callable(getattr(arm, "finish_step", None))):
        raise SystemExit(f"{tool}: {method_name} does not split its step into loss_of and finish_step")
    return arm, batches


def timed_step_phases(arm: Any, batch: Mapping[str, torch.Tensor]) -> tuple[float, float, float, float]:
    """One step of ``arm`` split as the host spends it: seconds in its forward, its backward and its optimizer
    (each phase's work queued when it returns), then the step's wall seconds up to a synchronize."""
    started = time.perf_counter()
    loss = arm.loss_of(batch)
    forward_done = time.perf_counter()
    loss.backward()
    backward_done = time.perf_counter()
    arm.finish_step()
    step_done = time.perf_counter()
    torch.cuda.synchronize()
    return (forward_done - started, backward_done - forward_done, step_done - backward_done,
            time.perf_counter() - started)


def pin_measured_threads() -> list[int]:
    """Put this arm process's threads on the CPUs every arm of the profile measures on, as a sweep's lane
    does (D114: a virtual machine's CPUs do not run alike, and the arms' processes run one after the
    other); called once the arm is warm, so its build and compiles keep every CPU. Returns the CPUs ([]:
    too few to spare, or no per-thread affinity here)."""
    sets = lanes.cpu_sets(1, lanes.CPUS_PER_CELL)
    return lanes.pin_threads(sets[0]) if sets else []


def union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals (touching ones merge)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def chrome_trace(prof: Any, name: str, keep_at: Path | None) -> dict:
    """The profiler's Chrome trace as a dict (torch writes it only to a file), kept gzipped at
    ``keep_at`` when given: both profilers read the trace back the same way."""
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / f"{name}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
    if keep_at is not None:
        with gzip.open(keep_at, "wt") as fh:
            json.dump(trace, fh)
    return trace
