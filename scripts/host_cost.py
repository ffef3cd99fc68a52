"""The host's cost of one fused layer in an eager backward, against a plain Linear's: one process.

    python3 scripts/host_cost.py --out host_cost.json

Why: an eager Llama-8B step at batch 1 is bound by the host (its backward enqueues in 77-82 ms with
plain Linears and 106-190 ms with FORGE, against 54-87 ms of kernels), so each fused layer's Python
and launch work is step time there. This measures it on a stack of small Linears (GPU work of a few
microseconds per layer, so every timing is the host's), per layer and per piece, without a profiler
(cProfile doubles the cost of Python calls):

- ``backward_us_per_layer``: ``loss.backward()`` enqueue time over the stack divided by its depth, for
  plain Linears (the native backward: dX, dW, AccumulateGrad) and for FORGE with the update on the
  side stream and in line;
- the pieces of a fused layer's backward, each timed alone in a loop: the dX matmul, one cached
  ``fused_wgrad_update`` (TMA and pointer loads; direct launch and Triton's JIT path), the plan
  signature, the side-stream fork (also behind queued GPU work), ``record_stream``;
- with ``--against OLD_TREE``: the same arms with OLD_TREE's forge_core imported in the same process
  (host speed drifts by 30% between processes there), and the per-round paired difference.

Arms are interleaved over ``--rounds`` rounds (medians reported), so host drift hits each alike.
The tile is pinned (no tuning): the host cost does not depend on it, except TMA against pointers.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _sync()
    return elapsed / calls * 1e6


class _Stack(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _import_tree(tree: Path, name: str):
    """``tree``'s forge_core as the package ``name``, beside this tree's (its imports are relative), so
    one process times both: host speed drifts by 30% between processes on the H100 hosts."""
    package_dir = tree / "forge_core"
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"host_cost: no forge_core package in {tree}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--against", type=Path, default=None,
                    help="a tree whose forge_core is timed in the same process (arms suffixed @against)")
    ap.add_argument("--variants", action="store_true",
                    help="also time variants of the side-stream fork (some drop orderings: timing only)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("host_cost: needs a CUDA device (or TRITON_INTERPRET=1 for a smoke run on the CPU)", file=sys.stderr)
        return 2

    import forge_core
    packages = {"": forge_core}
    if args.against is not None:
        packages["@against"] = _import_tree(args.against, "forge_core_against")
    tma_wanted = {"value": True}
    for package in packages.values():
        fused_module = importlib.import_module(package.__name__ + ".kernels.fused")
        pinned = {tma: fused_module.TileConfig(64, 64, 32, 8, 4, 4, tma=tma) for tma in (True, False)}
        fused_module._tuned_config = lambda *a, _pinned=pinned, **k: _pinned[tma_wanted["value"]]
    from forge_core import overlap
    from forge_core.kernels import fused

    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.width, device=device, dtype=torch.bfloat16)

    def make(kind: str, package=forge_core):
        model = _Stack(args.depth, args.width).to(device, torch.bfloat16)
        if kind == "native":
            return model, None
        tma_wanted["value"] = kind != "forge_pointers"
        opt = package.fuse(model, "adamw", lr=1e-4, state_dtype="bf16", overlap=kind != "forge_inline",
                           probe_inputs=False)
        for _ in range(3):                  # plans built, direct launchers set
            model(x).float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, opt

    arms = {"native": make("native")}
    for suffix, package in packages.items():
        for kind in ("forge", "forge_inline", "forge_pointers"):
            arms[kind + suffix] = make(kind, package)
    variant = {"name": "full"}
    if args.variants:
        # Variants of the side-stream fork (forge_core.linear calls run_beside by name): which of its
        # parts costs the host what. Only for timing: some of them drop an ordering a real step needs.
        from forge_core import linear
        real_run_beside = overlap.run_beside

        def run_beside_variant(update, device_, used):
            name = variant["name"]
            if name == "noop_update":
                return real_run_beside(lambda: None, device_, used)
            if name == "no_record":
                return real_run_beside(update, device_, ())
            if name == "no_switch":
                main_ = torch.cuda.current_stream(device_)
                side_ = overlap.side_stream(device_)
                side_.wait_stream(main_)
                update()
                for tensor in used:
                    tensor.record_stream(side_)
                return overlap._queue_join(main_, side_)
            return real_run_beside(update, device_, used)

        linear.run_beside = run_beside_variant
        for kind in ("noop_update", "no_record", "no_switch"):
            arms[f"forge_{kind}"] = make("forge")
        inline_noop_model, inline_noop_opt = make("forge_inline")
        for module in inline_noop_model.layers:
            module.forge_updater = lambda x_, dy_: None
        arms["forge_inline_noop_update"] = (inline_noop_model, inline_noop_opt)

    def backward_us(model, opt) -> float:
        loss = model(x).float().sum()
        _sync()
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        _sync()
        return elapsed * 1e6 / args.depth

    # pieces, on a layer of a model of their own (update() re-plans it)
    dy = torch.randn(args.tokens, args.width, device=device, dtype=torch.bfloat16)
    piece_layers = {}
    for suffix, package in packages.items():
        piece_opt = make("forge", package)[1]
        binding = piece_opt._bindings[0]
        piece_layers[suffix] = (importlib.import_module(package.__name__ + ".kernels.fused"), binding.weight,
                                binding.state, piece_opt._kernel_hyperparameters(0))
    main_stream = torch.cuda.current_stream() if cuda else None
    side = overlap.side_stream(device) if cuda else None

    def update(suffix: str, tma: bool, direct: bool) -> Callable[[], None]:
        fused_module, weight, state, hp = piece_layers[suffix]
        tma_wanted["value"] = tma
        fused_module._PLANS.pop(state, None)
        fused_module.fused_wgrad_update(x, dy, weight, state, hp, 1)       # builds (and caches) the plan
        plan = next(iter(fused_module._PLANS[state].values()))
        if not direct:
            plan.direct = None
        return lambda: fused_module.fused_wgrad_update(x, dy, weight, state, hp, 1)

    _, weight, state, _ = piece_layers[""]

    def signature() -> object:
        return fused._plan_signature(x, dy, weight, state, None, False, None, False)

    def fork() -> None:
        side.wait_stream(main_stream)
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main_stream)

    def record() -> None:
        x.record_stream(side)
        dy.record_stream(side)

    cached_event = torch.cuda.Event() if cuda else None

    def fork_cached_event() -> None:
        cached_event.record(main_stream)
        side.wait_event(cached_event)

    def busy_main() -> None:         # GPU work queued on the main stream: an event recorded there pends,
        torch.cuda._sleep(20_000)    # as in a backward, where the dX GEMMs run ahead of the host

    pieces = {
        "current_stream_no_device": lambda: torch.cuda.current_stream(),
        "fork_cached_event": fork_cached_event,
        "set_stream_pair": lambda: (torch.cuda.set_stream(side), torch.cuda.set_stream(main_stream)),
        "dx_matmul": lambda: torch.matmul(dy, weight),
        "plan_signature": signature,
        "side_stream_fork": fork,
        "record_stream_x2": record,
        "current_stream_by_device": lambda: torch.cuda.current_stream(device),
        "busy_main": busy_main,
        "busy_main+side_stream_fork": lambda: (busy_main(), fork()),
        "busy_main+fork_cached_event": lambda: (busy_main(), fork_cached_event()),
    }
    if not cuda:                 # the smoke run: no streams; the pointer/TMA choice is the interpreter's
        pieces = {name: fn for name, fn in pieces.items() if name in ("dx_matmul", "plan_signature")}
    results: dict[str, list[float]] = {}
    names = list(arms)
    for round_index in range(args.rounds):
        shift = round_index % len(names)              # rotate the order: no arm always runs first
        for kind in names[shift:] + names[:shift]:
            model, opt = arms[kind]
            tma_wanted["value"] = not kind.startswith("forge_pointers")
            base = kind.split("@")[0]
            variant["name"] = base[len("forge_"):] if base.startswith("forge_") else "full"
            results.setdefault(f"backward_us_per_layer/{kind}", []).append(backward_us(model, opt))
        for suffix in packages:
            for tma in (True, False):
                for direct in (True, False):
                    name = f"fused_update_us/{'tma' if tma else 'pointers'}/{'direct' if direct else 'jit'}{suffix}"
                    results.setdefault(name, []).append(_per_call_us(update(suffix, tma, direct), args.calls))
        for name, fn in pieces.items():
            results.setdefault(f"piece_us/{name}", []).append(_per_call_us(fn, args.calls))
    medians = {name: statistics.median(values) for name, values in results.items()}
    native = results["backward_us_per_layer/native"]
    for kind in [k for k in arms if k != "native"]:
        extra = [a - b for a, b in zip(results[f"backward_us_per_layer/{kind}"], native)]
        medians[f"fused_layer_extra_us/{kind}"] = statistics.median(extra)
    if args.against is not None:        # paired by round: this tree minus the other, per layer
        for kind in ("forge", "forge_inline", "forge_pointers"):
            diffs = [a - b for a, b in zip(results[f"backward_us_per_layer/{kind}"],
                                           results[f"backward_us_per_layer/{kind}@against"])]
            quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
            medians[f"this_minus_against_us/{kind}"] = statistics.median(diffs)
            medians[f"this_minus_against_us/{kind}/q1"] = quartiles[0]
            medians[f"this_minus_against_us/{kind}/q3"] = quartiles[2]
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
           "forge_core": forge_core.__file__, "against": str(args.against) if args.against else None,
           "depth": args.depth, "width": args.width, "tokens": args.tokens, "rounds": args.rounds,
           "medians": medians, "all": results}
    args.out.write_text(json.dumps(out, indent=1))
    for name, value in medians.items():
        print(f"{value:9.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
