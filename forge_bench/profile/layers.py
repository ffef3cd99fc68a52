"""Host time per fused layer: what one ``nn.Linear`` costs the host in an eager (or compiled) step, FORGE
against torch's own Linear backward and fused AdamW.

    forge-bench profile layers --out reports/h200/layers.md [--dim 2048] [--tokens 512]

Why a chain of Linears: at batch 1 an eager step is bound by the host, and what FORGE adds to it is
per fused layer (the autograd Function, the dX GEMM, the side stream, the update's launch). A chain of
``depth`` square bf16 Linears with no other op isolates that cost: the slope of the backward's host time
between two depths is one layer's, free of the loss's and the step's fixed costs. Each variant runs in
its own process (the tuners, plans and allocator keep state for a process's life), warms up, then
times ``--steps`` steps at each depth, the GPU idle at each backward's start (a sync before), so the
host time is the host's alone. A variant under ``torch.compile`` compiles each depth once in its
warm-up. ``--cprofile`` adds the top Python functions of five FORGE backwards (the deeper chain).
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from forge_bench.profile.common import pin_measured_threads, run_each_method


@dataclass(frozen=True)
class Variant:
    """One way of training the chain: torch or FORGE, its options, the environment it needs."""
    fused: bool
    overlap: bool = False
    compile_mode: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    about: str = ""


VARIANTS: dict[str, Variant] = {
    "torch": Variant(False, about="nn.Linear, fused AdamW"),
    "forge": Variant(True, about="FORGE bf16 AdamW, fuse's defaults (updates in line)"),
    "forge_side_stream": Variant(True, overlap=True, about="FORGE, overlap=True: updates on a side stream"),
    "forge_tile": Variant(True, env={"FORGE_WS_KERNEL": "0"}, about="FORGE, the tile kernel only"),
    "forge_jit": Variant(True, env={"FORGE_DIRECT_LAUNCH": "0"},
                         about="FORGE, every launch through Triton's JIT"),
    "torch_compile": Variant(False, compile_mode="default", about="torch.compile(chain), fused AdamW"),
    "forge_compile": Variant(True, compile_mode="default",
                             about="torch.compile(chain), FORGE bf16 AdamW"),
}
DEFAULT_VARIANTS = ("torch", "forge", "forge_side_stream", "forge_tile", "torch_compile", "forge_compile")


@dataclass(frozen=True)
class ChainOptions:
    """The chain every variant trains and how long each is timed."""
    dim: int = 2048
    tokens: int = 512
    depths: tuple[int, int] = (4, 36)
    warmup: int = 15
    steps: int = 30
    cprofile: bool = False

    def child_arguments(self) -> list[str]:
        return ["--dim", str(self.dim), "--tokens", str(self.tokens), "--depths", f"{self.depths[0]},{self.depths[1]}",
                "--warmup", str(self.warmup), "--steps", str(self.steps)] + (["--cprofile"] if self.cprofile else [])


def build_chain(variant: Variant, depth: int, dim: int) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], Any]:
    """(model, the callable a step runs, optimizer) of ``depth`` bias-free bf16 Linears on the GPU."""
    import forge_core

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(depth))).to("cuda", torch.bfloat16)
    for layer in model:
        nn.init.normal_(layer.weight, std=dim ** -0.5)
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if variant.fused:
        optimizer = forge_core.fuse(model, "adamw", state_dtype="bf16", overlap=variant.overlap, probe_inputs=False,
                                    **hyper)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    run = torch.compile(model, mode=variant.compile_mode) if variant.compile_mode else model
    return model, run, optimizer


def time_depth(variant: Variant, depth: int, options: ChainOptions) -> dict[str, Any]:
    """Median host and synced times of the backward, ``opt.step()`` and the whole step at one depth."""
    torch._dynamo.reset()
    model, run, optimizer = build_chain(variant, depth, options.dim)
    x = torch.randn(options.tokens, options.dim, device="cuda", dtype=torch.bfloat16)

    def loss_of() -> torch.Tensor:
        return run(x).float().square().mean()

    compile_s = None
    for i in range(options.warmup):
        start = time.perf_counter()
        loss_of().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == 0:
            compile_s = time.perf_counter() - start
    pin_measured_threads()
    backward_host, backward_synced, step_host, whole = [], [], [], []
    for _ in range(options.steps):
        loss = loss_of()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        loss_of().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        backward_host.append((t1 - t0) * 1e6)
        backward_synced.append((t2 - t0) * 1e6)
        step_host.append((t3 - t2) * 1e6)
        whole.append((t5 - t4) * 1e6)
    result = {"depth": depth, "backward_host_us": statistics.median(backward_host),
              "backward_synced_us": statistics.median(backward_synced), "step_host_us": statistics.median(step_host),
              "whole_step_us": statistics.median(whole), "first_step_s": compile_s}
    if options.cprofile and variant.fused and depth == max(options.depths):
        result["cprofile"] = profile_backwards(loss_of, optimizer)
    del model, run, optimizer
    torch.cuda.empty_cache()
    return result


def profile_backwards(loss_of: Callable[[], torch.Tensor], optimizer: Any, passes: int = 5, top: int = 30) -> str:
    """The top ``top`` functions by own time over ``passes`` backwards (cProfile's table, as text)."""
    profiler = cProfile.Profile()
    for _ in range(passes):
        loss = loss_of()
        torch.cuda.synchronize()
        profiler.enable()
        loss.backward()
        profiler.disable()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def per_layer(rows: list[dict[str, Any]], key: str) -> float:
    """The slope of ``key`` between the two depths: one layer's share, in us."""
    low, high = sorted(rows, key=lambda r: r["depth"])
    return (high[key] - low[key]) / (high["depth"] - low["depth"])


def measure(name: str, options: ChainOptions) -> dict[str, Any]:
    """The per-variant child's measurement."""
    if not torch.cuda.is_available():
        raise SystemExit("forge-bench profile layers: needs a CUDA device (torch.cuda.is_available() is False)")
    variant = VARIANTS[name]
    rows = [time_depth(variant, depth, options) for depth in options.depths]
    keys = ("backward_host_us", "backward_synced_us", "step_host_us", "whole_step_us")
    return {"variant": name, "about": variant.about, "depths": rows,
            "per_layer": {key: per_layer(rows, key) for key in keys},
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def to_markdown(results: list[dict[str, Any]], options: ChainOptions) -> str:
    """One table: per-layer host time of each variant, and its ratio to torch's."""
    base = next((r for r in results if r["variant"] == "torch"), None)
    device = results[0]["device"] if results else "?"
    lines = [f"# Host time per Linear layer ({device})", "",
             f"A chain of bias-free bf16 `Linear({options.dim}, {options.dim})` at {options.tokens} tokens, depths "
             f"{options.depths[0]} and {options.depths[1]}; per layer = the slope between them (us, median of "
             f"{options.steps} steps). `backward host`: `loss.backward()` until it returns, the GPU idle at its "
             "start; `+ step`: with `opt.step()`'s host time; `whole step`: forward, backward and step, synced.", "",
             "| variant | backward host | + step host | x torch | backward synced | whole step | first step s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base_total = base["per_layer"]["backward_host_us"] + base["per_layer"]["step_host_us"] if base else None
    for r in results:
        p = r["per_layer"]
        total = p["backward_host_us"] + p["step_host_us"]
        ratio = f"{total / base_total:.2f}" if base_total else "-"
        first = max(d["first_step_s"] or 0.0 for d in r["depths"])
        lines.append(f"| {r['variant']} ({r['about']}) | {p['backward_host_us']:.1f} | {total:.1f} | {ratio} | "
                     f"{p['backward_synced_us']:.1f} | {p['whole_step_us']:.1f} | {first:.1f} |")
    for r in results:
        for d in r["depths"]:
            if "cprofile" in d:
                lines += ["", f"## {r['variant']}: cProfile of 5 backwards at depth {d['depth']}", "", "```",
                          d["cprofile"].strip(), "```"]
    return "\n".join(lines) + "\n"


def run(options: ChainOptions, names: list[str], out: Path) -> int:
    """Every variant in its own process (its environment set), then the Markdown report at ``out``."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"forge-bench profile layers: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    results = run_each_method(["profile", "layers"], names, options.child_arguments(), out, option="--variants",
                              environment=lambda name: VARIANTS[name].env)
    if not results:
        print("forge-bench profile layers: no variant could run; nothing written", file=sys.stderr)
        return 1
    out.write_text(to_markdown(results, options))
    out.with_suffix(".json").write_text(json.dumps({"options": asdict(options), "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


def run_one(options: ChainOptions, name: str, out: Path) -> None:
    """The per-variant child: measure and write its JSON to ``out``."""
    out.write_text(json.dumps(measure(name, options)))
