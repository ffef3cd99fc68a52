"""Check and time the warp-specialized Gluon kernel (forge_core/kernels/hopper_ws.py) against the
Triton fused kernel on one Hopper GPU, before it is wired into FORGE.

    python3 scripts/ws_bench.py --out $OUT check                     # correctness, a few shapes
    python3 scripts/ws_bench.py --out $OUT time gate:512 q:512 ...   # graph-replay ms and joules

``check``: one AdamW step (bf16 X, dY, W, m, v) by each kernel and by the fp32 reference
(``rule.reference`` on fp32 copies, G in fp32 from the same bf16 inputs), per shape: weight and state
rel-L2 errors against the reference and the fraction of bf16 elements the two kernels disagree on.
``time``: for each shape, the two kernels interleaved (A B A B ...) over ``--rounds`` rounds,
each a CUDA graph over enough input sets to miss L2 (``forge_bench.kernel_bench.measure_graph``),
ms and, with NVML, joules per call. ``host``: host microseconds per eager launch, the Triton kernel
and the Gluon kernel through its JIT and its direct launcher. Records: OUT/ws_check.jsonl,
OUT/ws_time.jsonl, OUT/ws_host.jsonl. ``--configs``:
JSON list of WsConfig field dicts to time (default: the kernel's default).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_bench.kernel_bench import ADAMW_HP, LLAMA_8B_SHAPES, _sets_needed, measure_graph  # noqa: E402
from forge_bench.telemetry import open_energy_counter  # noqa: E402
from forge_core.kernels import fused_wgrad_update, hopper_ws, ws_choice  # noqa: E402
from forge_core.kernels.fused import _kernel_scalars  # noqa: E402
from forge_core.rules import get_rule  # noqa: E402
from forge_core.state import ParamState  # noqa: E402

STEP = 10


def _inputs(dout: int, din: int, tokens: int, device, seed: int = 0, state_dtype: str = "bf16") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def rnd(shape, scale):
        return (torch.randn(shape, device=device, generator=g) * scale).to(bf16)

    weight = rnd((dout, din), 0.02)
    state = ParamState(weight, get_rule("adamw"), state_dtype)
    state.store("exp_avg", torch.randn((dout, din), device=device, generator=g) * 1e-3)
    state.store("exp_avg_sq", (torch.randn((dout, din), device=device, generator=g) * 1e-3).square())
    return dict(x=rnd((tokens, din), 1.0), dy=rnd((tokens, dout), 0.01), weight=weight, state=state)


def _ws_call(s: dict, config: hopper_ws.WsConfig) -> None:
    state = s["state"]
    rule = state.rule
    hopper_ws.launch(s["x"], s["dy"], s["weight"], [state.values[n] for n in rule.state_names],
                     rule.epilogue, _kernel_scalars(rule, ADAMW_HP, STEP), config,
                     scales=[state.scales[n] for n in rule.state_names],
                     sqrt_domain=tuple(state.is_sqrt_domain(n) for n in rule.state_names))


def _triton_call(s: dict) -> None:
    fused_wgrad_update(s["x"], s["dy"], s["weight"], s["state"], ADAMW_HP, STEP)


def _state_copy(state: ParamState) -> ParamState:
    copy = ParamState(torch.empty(state.shape, device=state.values["exp_avg"].device), state.rule, state.state_dtype)
    for name in state.rule.state_names:
        copy.values[name].copy_(state.values[name])
        if state.scales[name] is not None:
            copy.scales[name].copy_(state.scales[name])
    return copy


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check(shapes: list[tuple[str, int]], config: hopper_ws.WsConfig, out: Path, device,
          state_dtype: str = "bf16") -> bool:
    ok = True
    rule = get_rule("adamw")
    for name, tokens in shapes:
        dout, din = LLAMA_8B_SHAPES[name] if name in LLAMA_8B_SHAPES else map(int, name.split("x"))
        base = _inputs(dout, din, tokens, device, state_dtype=state_dtype)
        ws = dict(base, weight=base["weight"].clone(), state=_state_copy(base["state"]))
        tr = dict(base, weight=base["weight"].clone(), state=_state_copy(base["state"]))
        w32 = base["weight"].float()
        states32 = {n: base["state"].dequantize(n) for n in rule.state_names}
        grad = base["dy"].float().t() @ base["x"].float()
        rule.reference(w32, grad, states32, ADAMW_HP, STEP)
        record = dict(shape=name, dout=dout, din=din, tokens=tokens, state_dtype=state_dtype,
                      config=dataclasses.asdict(config))
        try:
            started = time.perf_counter()
            _ws_call(ws, config)
            torch.cuda.synchronize()
            record["ws_first_call_s"] = time.perf_counter() - started
            _triton_call(tr)
            torch.cuda.synchronize()
            record["weight_rel_l2_ws"] = _rel(ws["weight"], w32)
            record["weight_rel_l2_triton"] = _rel(tr["weight"], w32)
            for n in rule.state_names:
                record[f"{n}_rel_l2_ws"] = _rel(ws["state"].dequantize(n), states32[n])
                record[f"{n}_rel_l2_triton"] = _rel(tr["state"].dequantize(n), states32[n])
                codes_ws, codes_tr = ws["state"].values[n], tr["state"].values[n]
                record[f"{n}_differ_frac"] = float((codes_ws != codes_tr).float().mean())
                record[f"{n}_max_code_diff"] = float((codes_ws.float() - codes_tr.float()).abs().max())
            record["weight_differ_frac"] = float((ws["weight"] != tr["weight"]).float().mean())
            step = (w32 - base["weight"].float()).abs().max()
            record["weight_max_diff_over_max_update"] = float((ws["weight"].float() - w32).abs().max() / step)
            good = (record["weight_rel_l2_ws"] <= 2 * record["weight_rel_l2_triton"] + 1e-6
                    and all(record[f"{n}_rel_l2_ws"] <= 2 * record[f"{n}_rel_l2_triton"] + 1e-6
                            and record[f"{n}_max_code_diff"] <= (1 if state_dtype == "int8" else 65535)
                            for n in rule.state_names))
            record["ok"] = bool(good)
        except Exception as exc:       # record and go on: the next shape may still tell something
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {exc}"[:400]
        ok &= record["ok"]
        print(json.dumps(record), flush=True)
        with open(out / "ws_check.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        del base, ws, tr, w32, states32, grad
        torch.cuda.empty_cache()
    return ok


def time_shapes(shapes: list[tuple[str, int]], configs: list[hopper_ws.WsConfig], rounds: int, out: Path,
                device, state_dtype: str = "bf16") -> None:
    counter, no_energy = open_energy_counter(torch.cuda.current_device())
    if counter is None:
        print(no_energy, flush=True)
    for name, tokens in shapes:
        dout, din = LLAMA_8B_SHAPES[name]
        n_sets = _sets_needed(dout * din * 2 * 3 + tokens * (dout + din) * 2)
        sets = [_inputs(dout, din, tokens, device, seed, state_dtype) for seed in range(n_sets)]
        _triton_call(sets[0])        # tunes (or reads FORGE_TUNE_CACHE) outside the graph
        arms = [("triton", _triton_call)] + [(f"ws{i}", lambda s, c=c: _ws_call(s, c)) for i, c in enumerate(configs)]
        for round_ in range(rounds):
            for arm, call in arms:
                record = dict(shape=name, dout=dout, din=din, tokens=tokens, state_dtype=state_dtype, arm=arm,
                              round=round_, sets=n_sets)
                if arm.startswith("ws"):
                    record["config"] = dataclasses.asdict(configs[int(arm[2:])])
                try:
                    record.update(measure_graph(call, sets, counter))
                except Exception as exc:
                    record["error"] = f"{type(exc).__name__}: {exc}"[:400]
                print(json.dumps(record), flush=True)
                with open(out / "ws_time.jsonl", "a") as handle:
                    handle.write(json.dumps(record) + "\n")
        del sets
        torch.cuda.empty_cache()
    if counter is not None:
        counter.close()


def host_cost(shapes: list[tuple[str, int]], config: hopper_ws.WsConfig, out: Path, device,
              state_dtype: str = "bf16", launches: int = 200, repeats: int = 5) -> None:
    """Host microseconds per eager launch: the Triton kernel through ``fused_wgrad_update`` (its cached
    plan's direct launch), and the Gluon kernel's plan (``fused._WsPlan``) through the JIT and
    direct. ``launches`` back-to-back calls without a sync, timed on the host (the GPU queue does
    not fill at 200), then a sync: ``host_us`` the loop, ``eager_us`` loop plus drain, per launch;
    medians over ``repeats``."""
    import os
    import statistics

    from forge_core.kernels.fused import _WsPlan

    for name, tokens in shapes:
        dout, din = LLAMA_8B_SHAPES[name]
        s = _inputs(dout, din, tokens, device, 0, state_dtype)
        state = s["state"]
        rule = state.rule
        scalars = _kernel_scalars(rule, ADAMW_HP, STEP)

        def ws_plan() -> _WsPlan:
            return _WsPlan(config, s["weight"], [state.values[n] for n in rule.state_names],
                           [state.scales[n] for n in rule.state_names], rule.epilogue,
                           tuple(state.is_sqrt_domain(n) for n in rule.state_names))

        jit_plan = ws_plan()
        jit_plan.launched = True              # never builds its direct launcher: every launch through the JIT
        direct_plan = ws_plan()
        previous = os.environ.get(ws_choice.ENV)
        os.environ[ws_choice.ENV] = "0"       # the Triton kernel's plan for this weight, whatever the choice
        try:
            _triton_call(s)
        finally:
            if previous is None:
                os.environ.pop(ws_choice.ENV)
            else:
                os.environ[ws_choice.ENV] = previous
        arms = [("triton", lambda: _triton_call(s)),
                ("ws_jit", lambda: jit_plan.run(s["x"], s["dy"], scalars)),
                ("ws_direct", lambda: direct_plan.run(s["x"], s["dy"], scalars))]
        for _, call in arms:                  # compile / tune, build the plans
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        samples = {arm: ([], []) for arm, _ in arms}
        for _ in range(repeats):
            for arm, call in arms:
                start = time.perf_counter()
                for _ in range(launches):
                    call()
                issued = time.perf_counter()
                torch.cuda.synchronize()
                done = time.perf_counter()
                samples[arm][0].append((issued - start) / launches * 1e6)
                samples[arm][1].append((done - start) / launches * 1e6)
        for arm, (host, eager) in samples.items():
            record = dict(shape=name, dout=dout, din=din, tokens=tokens, state_dtype=state_dtype, arm=arm,
                          launches=launches, host_us=statistics.median(host), eager_us=statistics.median(eager),
                          direct=((direct_plan.direct is not None) if arm == "ws_direct" else
                                  (jit_plan.direct is not None) if arm == "ws_jit" else None),
                          config=dataclasses.asdict(config) if arm != "triton" else None)
            print(json.dumps(record), flush=True)
            with open(out / "ws_host.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
        del s
        torch.cuda.empty_cache()


def _shape_list(items: list[str]) -> list[tuple[str, int]]:
    result = []
    for item in items:
        name, _, tokens = item.partition(":")
        result.append((name, int(tokens or 512)))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default="[{}]", help="JSON list of WsConfig field dicts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--state", choices=("bf16", "int8"), default="bf16")
    parser.add_argument("mode", choices=("check", "time", "host"))
    parser.add_argument("shapes", nargs="*")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ws_bench: needs a CUDA GPU (torch.cuda.is_available() is False)")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    configs = [hopper_ws.WsConfig(**c) for c in json.loads(args.configs)]
    if args.mode == "check":
        shapes = _shape_list(args.shapes or ["q:512", "q:520", "k:2048", "gate:512", "down:512"])
        return 0 if check(shapes, configs[0], args.out, device, args.state) else 1
    if args.mode == "host":
        host_cost(_shape_list(args.shapes or ["k:512", "q:512"]), configs[0], args.out, device, args.state)
        return 0
    time_shapes(_shape_list(args.shapes or ["gate:512"]), configs, args.rounds, args.out, device, args.state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
