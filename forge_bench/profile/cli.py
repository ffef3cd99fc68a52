"""``forge-bench profile``: the per-arm GPU profilers as Typer subcommands (``step``, ``timeline``, ``host``,
``graph``, ``layers``, ``alternate``). Each but ``alternate`` (its arms share one process by design) runs every
``--methods`` arm in its own child process, started as this same command with the hidden ``--one`` flag; the
profiler modules (torch, the model zoo) load only when a command runs, so ``forge-bench --help`` stays quick."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

profile_app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Profile training steps on a GPU, one process per arm: top kernels (step), host/GPU timeline "
         "(timeline), CUDA-graph replays on both streams (graph), host time per fused Linear (layers), host-bound "
         "arms taking turns in one process (alternate). Each writes a Markdown report.",
)

ACTIVATIONS = ("hf", "lean")

Out = Annotated[Path, typer.Option("--out", "-o",
                                   help="Markdown file to write (a JSON beside it for timeline and graph)")]
Model = Annotated[str, typer.Option("--model", help="model zoo name (forge-bench list)")]
Batch = Annotated[int, typer.Option("--batch", min=1, help="sequences per step")]
Seq = Annotated[int, typer.Option("--seq", min=1, help="tokens per sequence")]
Dtype = Annotated[str, typer.Option("--dtype", help="model weight dtype")]
Activations = Annotated[str, typer.Option("--activations", help="hf, or lean: forge_core.lean_activations on the "
                                                                  "model before the arm is built")]
Methods = Annotated[Optional[list[str]], typer.Option("--methods", help="arms to profile, comma-separated or "
                                                                          "repeated (default: see the command)")]
Steps = Annotated[int, typer.Option("--steps", min=1, help="steps (replays for graph) recorded by the profiler")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="warm-up steps before the profiled ones")]
TraceDir = Annotated[Optional[Path], typer.Option("--trace-dir", help="also keep each arm's gzipped Chrome trace here")]
One = Annotated[bool, typer.Option("--one", hidden=True, help="child mode: one method, JSON to --out")]


def _options(model: str, batch: int, seq: int, dtype: str, activations: str, steps: int, warmup: int):
    from forge_bench.profile.common import StepOptions

    if activations not in ACTIVATIONS:
        raise typer.BadParameter(f"{activations!r} is not one of {', '.join(ACTIVATIONS)}", param_hint="--activations")
    return StepOptions(model=model, batch=batch, seq=seq, dtype=dtype, activations=activations, steps=steps,
                       warmup=warmup)


def _methods(given: list[str] | None, default: tuple[str, ...], one: bool) -> list[str]:
    names = [name.strip() for text in (given or []) for name in text.split(",") if name.strip()] or list(default)
    if one and len(names) != 1:
        raise typer.BadParameter(f"a child profiles exactly one arm, got {names}", param_hint="--methods")
    return names


def _run_per_arm(module, options, methods: list[str] | None, out: Path, one: bool) -> None:
    """A profiler whose ``run_one(options, method, out)`` / ``run(options, methods, out)`` take nothing else:
    the child's one arm, or every arm and the report (the exit code)."""
    names = _methods(methods, module.DEFAULT_METHODS, one)
    if one:
        module.run_one(options, names[0], out)
        return
    raise typer.Exit(module.run(options, names, out))


@profile_app.command()
def step(out: Out, model: Model = "llama-3.1-8b", batch: Batch = 1, seq: Seq = 512, dtype: Dtype = "bfloat16",
         activations: Activations = "hf", methods: Methods = None, steps: Steps = 3, warmup: Warmup = 10,
         one: One = False) -> None:
    """Where the time of an eager step goes: torch.profiler's top CUDA kernels per arm.

    Default arms: adamw_fused, forge_bf16."""
    from forge_bench.profile import step as step_mod

    _run_per_arm(step_mod, _options(model, batch, seq, dtype, activations, steps, warmup), methods, out, one)


@profile_app.command()
def timeline(out: Out, model: Model = "llama-3.1-8b", batch: Batch = 1, seq: Seq = 512, dtype: Dtype = "bfloat16",
             activations: Activations = "hf", methods: Methods = None, steps: Steps = 3, warmup: Warmup = 10,
             trace_dir: TraceDir = None, one: One = False) -> None:
    """Is an eager step host-bound, GPU-bound or stalled on a sync? Read off a profiler timeline.

    GPU busy and idle time, the host op that ends each idle gap, the runtime calls that block the
    host. Default arms: no_optimizer, adamw_fused, forge_bf16."""
    from forge_bench.profile import timeline as timeline_mod

    options = _options(model, batch, seq, dtype, activations, steps, warmup)
    names = _methods(methods, timeline_mod.DEFAULT_METHODS, one)
    if one:
        timeline_mod.run_one(options, names[0], out, trace_dir)
        return
    raise typer.Exit(timeline_mod.run(options, names, out, trace_dir))


@profile_app.command()
def host(out: Out, model: Model = "llama-3.1-8b", batch: Batch = 1, seq: Seq = 512, dtype: Dtype = "bfloat16",
         activations: Activations = "hf", methods: Methods = None,
         steps: Annotated[int, typer.Option("--steps", min=1, help="steps timed")] = 20, warmup: Warmup = 10,
         one: One = False) -> None:
    """Where an eager step's host time goes: forward, backward and optimizer per arm and per Linear
    layer, and FORGE's fused updates and launches timed inside the steps (a default-mode ``_compile``
    twin too).

    Default arms: adamw_fused, forge_bf16."""
    from forge_bench.profile import host as host_mod

    _run_per_arm(host_mod, _options(model, batch, seq, dtype, activations, steps, warmup), methods, out, one)


@profile_app.command()
def graph(out: Out, model: Model = "llama-3.1-8b", batch: Batch = 1, seq: Seq = 512, dtype: Dtype = "bfloat16",
          activations: Activations = "hf", methods: Methods = None, steps: Steps = 3, warmup: Warmup = 10,
          timed: Annotated[int, typer.Option("--timed", min=1, help="replays timed without the profiler")] = 20,
          trace_dir: TraceDir = None, one: One = False) -> None:
    """Where the time of a CUDA-graph step goes, on both streams (what a sweep's graph cells time).

    Busy and idle time, kernel classes and their overlap, the fused update per launch grid.
    Default arms: adamw_fused, forge_bf16, forge_int8."""
    from forge_bench.profile import graph as graph_mod

    options = _options(model, batch, seq, dtype, activations, steps, warmup)
    names = _methods(methods, graph_mod.DEFAULT_METHODS, one)
    if one:
        graph_mod.run_one(options, names[0], timed, out, trace_dir)
        return
    raise typer.Exit(graph_mod.run(options, names, timed, out, trace_dir))


@profile_app.command()
def layers(out: Out,
           dim: Annotated[int, typer.Option("--dim", min=16, help="the Linears' width (square weights)")] = 2048,
           tokens: Annotated[int, typer.Option("--tokens", min=1, help="tokens per step")] = 512,
           depths: Annotated[str, typer.Option("--depths", help="two chain depths, comma-separated: the slope "
                                                                "between them is one layer's time")] = "4,36",
           variants: Annotated[Optional[list[str]], typer.Option("--variants", help="variants to time, "
                                                                 "comma-separated or repeated")] = None,
           steps: Steps = 30, warmup: Warmup = 15,
           cprofile: Annotated[bool, typer.Option("--cprofile", help="add the top Python functions of five "
                                                                     "FORGE backwards")] = False,
           one: One = False) -> None:
    """Host time per fused Linear layer, eager and compiled, FORGE against torch's Linear and fused AdamW.

    Default variants: torch, forge, forge_side_stream, forge_tile, torch_compile, forge_compile."""
    from forge_bench.profile import layers as layers_mod

    try:
        low, high = sorted(int(d) for d in depths.split(","))
    except ValueError:
        raise typer.BadParameter(f"{depths!r} is not two comma-separated integers", param_hint="--depths") from None
    if low < 1 or low == high:
        raise typer.BadParameter(f"{depths!r}: two different depths of at least 1", param_hint="--depths")
    options = layers_mod.ChainOptions(dim=dim, tokens=tokens, depths=(low, high), warmup=warmup, steps=steps,
                                      cprofile=cprofile)
    names = _methods(variants, layers_mod.DEFAULT_VARIANTS, one)
    if one:
        layers_mod.run_one(options, names[0], out)
        return
    raise typer.Exit(layers_mod.run(options, names, out))


@profile_app.command()
def alternate(out: Out, model: Model = "llama-3.2-1b", batch: Batch = 1, seq: Seq = 512, dtype: Dtype = "bfloat16",
              activations: Activations = "hf", methods: Methods = None,
              steps: Annotated[int, typer.Option("--steps", min=1, help="steps per block")] = 20,
              blocks: Annotated[int, typer.Option("--blocks", min=2, help="blocks per arm and mode")] = 16,
              warmup: Warmup = 10) -> None:
    """Host-bound arms compared in one process: their steps take turns in blocks, synced and back to back.

    Default arms: adamw_fused_compile, forge_bf16_compile."""
    from forge_bench.profile import alternate as alternate_mod

    options = _options(model, batch, seq, dtype, activations, steps, warmup)
    raise typer.Exit(alternate_mod.run(options, _methods(methods, alternate_mod.DEFAULT_METHODS, False), out, blocks))
