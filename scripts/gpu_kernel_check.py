"""Check and time the fused wgrad + optimizer kernel on a CUDA GPU (one call of the device tool).

    PYTHONUNBUFFERED=1 python3 scripts/gpu_kernel_check.py --out $OUT 2>&1 | tee $OUT/log.txt

1. correctness: one fused step at each Llama-3.1-8B Linear shape, BT in {512, 4096}, inputs and
   weight bf16 or fp32, AdamW with fp32 / bf16 / int8 states (and SGD, Lion at one shape), against
   the torch reference on the same device; plus a pure-GEMM check (SGD, lr=1: W0 - W1 = G);
2. properties: changing lr does not recompile; the fused call allocates no weight-sized memory;
3. timing (``--time``): forge_bench.kernel_bench on a subset, tuning tables printed.
Results go to $OUT/check.jsonl (one JSON object per line, written as they come) and the log.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
HP = {"adamw": dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
      "sgd": dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
      "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)}


def emit(out: Path, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(out / "check.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")


def compare(name: str, ours: torch.Tensor, ref: torch.Tensor, before: torch.Tensor | None = None) -> dict:
    """Error measures: relative L2 of the difference; for the weight, max |diff| over max |update|."""
    ours32, ref32 = ours.float(), ref.float()
    diff = (ours32 - ref32)
    record = {f"{name}_rel_l2": (diff.norm() / ref32.norm().clamp_min(1e-30)).item()}
    if ours.dtype == torch.int8:
        record[f"{name}_max_code_diff"] = int(diff.abs().max().item())
        record[f"{name}_frac_diff"] = (diff != 0).float().mean().item()
    elif ours.dtype == torch.bfloat16:
        record[f"{name}_frac_diff"] = (diff != 0).float().mean().item()
        ulp = torch.where(ref32 == 0, torch.ones_like(ref32), ref32.abs() * 2.0 ** -7)
        record[f"{name}_max_diff_over_ulp"] = (diff.abs() / ulp).max().item()
    if before is not None:
        update = (ref32 - before.float()).abs().max().item()
        record[f"{name}_max_diff_over_max_update"] = diff.abs().max().item() / max(update, 1e-30)
    return record


def guarded(out: Path, fn, *args) -> None:
    """Run one check; an exception becomes an error record instead of ending the script."""
    try:
        fn(out, *args)
    except Exception as error:  # noqa: BLE001
        import traceback
        emit(out, dict(kind="error", check=fn.__name__, args=[str(a) for a in args],
                       error=f"{type(error).__name__}: {str(error)[:500]}", where=traceback.format_exc()[-1500:]))
        torch.cuda.empty_cache()


def check_step(out: Path, label: str, dout: int, din: int, tokens: int, dtype: torch.dtype, rule_name: str,
               state_dtype: str) -> None:
    from forge_core.kernels import fused_wgrad_update, reference_wgrad_update
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    torch.manual_seed(dout + din + tokens)
    device = "cuda"
    x = torch.randn(tokens, din, device=device).to(dtype)
    dy = (torch.randn(tokens, dout, device=device) * 0.01).to(dtype)
    w0 = (torch.randn(dout, din, device=device) * 0.02).to(dtype)
    rule = get_rule(rule_name)
    states = [ParamState(w0, rule, state_dtype) for _ in range(2)]
    for n in rule.state_names:
        value = torch.randn(dout, din, device=device)
        value = value.abs() * 1e-6 if n in rule.sqrt_domain_states else value * 1e-4
        for state in states:
            state.store(n, value)
    del value
    torch.manual_seed(0)
    w_fused, w_ref = w0.clone(), w0.clone()
    started = time.perf_counter()
    fused_wgrad_update(x, dy, w_fused, states[0], HP[rule_name], 3)
    torch.cuda.synchronize()
    fused_s = time.perf_counter() - started
    reference_wgrad_update(x, dy, w_ref, states[1], HP[rule_name], 3)
    torch.cuda.synchronize()
    record = dict(kind="correctness", shape=label, dout=dout, din=din, tokens=tokens, dtype=str(dtype),
                  rule=rule_name, state_dtype=state_dtype, first_call_s=round(fused_s, 2))
    record.update(compare("weight", w_fused, w_ref, w0))
    for n in rule.state_names:
        record.update(compare(n, states[0].values[n], states[1].values[n]))
        if states[0].scales[n] is not None:
            record.update(compare(n + "_scale", states[0].scales[n], states[1].scales[n]))
    record["finite"] = bool(torch.isfinite(w_fused.float()).all().item())
    emit(out, record)
    del x, dy, w0, w_fused, w_ref, states
    torch.cuda.empty_cache()


def check_gemm(out: Path, label: str, dout: int, din: int, tokens: int) -> None:
    """G itself: an fp32 weight, SGD lr=1 without momentum, so W0 - W1 = G exactly up to rounding."""
    from forge_core.kernels import fused_wgrad_update
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    torch.manual_seed(1)
    x = torch.randn(tokens, din, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, dout, device="cuda", dtype=torch.bfloat16)
    w0 = torch.zeros(dout, din, device="cuda")
    w = w0.clone()
    fused_wgrad_update(x, dy, w, ParamState(w, get_rule("sgd"), "fp32"), dict(lr=1.0), 1)
    g_ref = dy.double().t() @ x.double()
    g_ours = (w0 - w).double()
    emit(out, dict(kind="gemm", shape=label, tokens=tokens,
                   g_rel_l2_vs_fp64=((g_ours - g_ref).norm() / g_ref.norm()).item()))
    del x, dy, w0, w, g_ref, g_ours
    torch.cuda.empty_cache()


def check_properties(out: Path) -> None:
    from forge_core.kernels import fused_wgrad_update
    from forge_core.kernels import fused as fused_module
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    dout, din, tokens = 4096, 4096, 512
    x = torch.randn(tokens, din, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, dout, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dout, din, device="cuda", dtype=torch.bfloat16)
    state = ParamState(w, get_rule("adamw"), "bf16")
    config = fused_module.default_config(dout, din, tokens, 2)
    fused_wgrad_update(x, dy, w, state, dict(HP["adamw"], lr=1e-3), 1, config=config)
    torch.cuda.synchronize()
    kernel = fused_module._fused_wgrad_update_kernel

    def compiled_count():
        caches = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", {})
        total = 0
        for value in caches.values():
            total += len(value[0]) if isinstance(value, tuple) else len(value)
        return total

    before = compiled_count()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for step, lr in enumerate((2e-3, 3e-4, 1e-6), start=2):
        fused_wgrad_update(x, dy, w, state, dict(HP["adamw"], lr=lr), step, config=config)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    emit(out, dict(kind="properties", compiled_before=before, compiled_after=compiled_count(),
                   extra_peak_bytes_during_fused=int(extra), weight_fp32_bytes=dout * din * 4))


def install_tuning_log(out: Path) -> None:
    """Record every tuning table (all candidate timings per key) in check.jsonl."""
    from forge_core.kernels import fused as fused_module
    if getattr(fused_module.tune_config, "logged", False):
        return
    original = fused_module.tune_config

    def logged_tune(candidates, run_on_scratch, time_ms, *args, **kwargs):
        best, timings = original(candidates, run_on_scratch, time_ms, *args, **kwargs)
        emit(out, dict(kind="tuning", best=str(best),
                       timings={str(c): round(t, 4) for c, t in sorted(timings.items(), key=lambda kv: kv[1])}))
        return best, timings

    logged_tune.logged = True
    fused_module.tune_config = logged_tune


def run_timing(out: Path, shapes, bts, state_dtypes, budget_s: float) -> None:
    from forge_bench import kernel_bench
    from forge_core.kernels import fused as fused_module

    install_tuning_log(out)
    started = time.perf_counter()
    device = kernel_bench.require_cuda()
    bandwidth = BANDWIDTH[0]
    for name in shapes:
        dout, din = kernel_bench.LLAMA_8B_SHAPES[name]
        for tokens in bts:
            if time.perf_counter() - started > budget_s:
                emit(out, dict(kind="timing_skipped", shape=name, tokens=tokens, reason="time budget"))
                continue
            for row in kernel_bench.bench_shape(dout, din, tokens, state_dtypes, device, bandwidth):
                emit(out, dict(kind="timing", shape=name, **row))


def rotating_sets(dout: int, din: int, tokens: int, state_dtype: str) -> list[tuple]:
    """(x, dy, weight, AdamW state) sets, enough that rotating through them keeps W and the states
    out of L2 (``time_graph_ms``), as in a model's step."""
    from forge_bench.kernel_bench import _sets_needed
    from forge_bench.floor import state_traffic_bytes
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    rule = get_rule("adamw")
    sets = []
    for _ in range(_sets_needed(state_traffic_bytes([(dout, din)], 2.0, state_dtype) / 2)):
        w = (torch.randn(dout, din, device="cuda") * 0.02).bfloat16()
        state = ParamState(w, rule, state_dtype)
        state.store("exp_avg", torch.randn(dout, din, device="cuda") * 1e-4)
        state.store("exp_avg_sq", torch.rand(dout, din, device="cuda") * 1e-6)
        sets.append((torch.randn(tokens, din, device="cuda").bfloat16(),
                     (torch.randn(tokens, dout, device="cuda") * 0.01).bfloat16(), w, state))
    return sets


def sweep_configs(out: Path, dout: int, din: int, tokens: int, state_dtype: str, configs) -> None:
    """Time each tile configuration on rotating input sets; report registers, spills, shared memory."""
    from forge_bench.kernel_bench import measure_graph
    from forge_bench.floor import state_traffic_bytes
    from forge_core.kernels import fused as fused_module
    from forge_core.kernels import fused_wgrad_update, reference_wgrad_update
    from forge_core.rules import get_rule
    from forge_core.state import ParamState

    rule = get_rule("adamw")
    state_bytes = state_traffic_bytes([(dout, din)], 2.0, state_dtype)
    sets = rotating_sets(dout, din, tokens, state_dtype)
    x, dy, w, state = sets[0]
    w = w.clone()                                  # timing updates the sets in place: keep a start point
    start_state = {k: v.clone() for k, v in state.state_dict().items()}
    reference_w = w.clone()
    reference_state = ParamState(reference_w, rule, state_dtype)
    reference_state.load_state_dict(start_state)
    reference_wgrad_update(x, dy, reference_w, reference_state, HP["adamw"], 3)
    first_result: dict[str, torch.Tensor] | None = None   # the first config's output, for bitwise_equal_to_first
    for config in configs:
        record = dict(kind="sweep", dout=dout, din=din, tokens=tokens, state_dtype=state_dtype, config=str(config))
        try:
            handle = None
            # correctness first, on a copy of set 0: one step of this config against the reference
            trial_w = w.clone()
            trial_state = ParamState(trial_w, rule, state_dtype)
            trial_state.load_state_dict(start_state)
            scalars = tuple(rule.kernel_scalars(HP["adamw"], 3)) + (0.0,)
            meta = fused_module.kernel_meta(trial_state, x.dtype, grad_accum=False, stochastic=False, ieee=False,
                                            scalars_in_memory=False)
            started = time.perf_counter()
            handle = fused_module._launch(config, x, dy, trial_w,
                                          [trial_state.values["exp_avg"], trial_state.values["exp_avg_sq"]],
                                          [trial_state.scales["exp_avg"], trial_state.scales["exp_avg_sq"]], None,
                                          scalars, 0, meta)
            torch.cuda.synchronize()
            record["compile_s"] = round(time.perf_counter() - started, 2)
            record.update(compare("weight", trial_w, reference_w, w))
            for name in ("exp_avg", "exp_avg_sq"):
                record.update(compare(name, trial_state.values[name], reference_state.values[name]))
            # Against the reference, only the fp32 sum order of G differs (cuBLAS vs our tiles): no
            # weight may move by more than 5% of the largest update, the moments stay within 1e-3
            # relative L2 and int8 codes within one code. A per-element ulp bound cannot work: a
            # weight that crosses zero has a bf16 ulp far below the update's own rounding.
            record["ok"] = bool(record["weight_max_diff_over_max_update"] <= 0.05
                                and all(record[f"{n}_rel_l2"] <= 1e-3 for n in ("exp_avg", "exp_avg_sq"))
                                and all(record.get(f"{n}_max_code_diff", 0) <= 1 for n in ("exp_avg", "exp_avg_sq")))
            # Split and prefetch change only when loads are issued: with one tile shape the bits must
            # not move. Recorded for every config against the first (other tile shapes may differ).
            result = {"weight": trial_w, **{n: trial_state.values[n] for n in ("exp_avg", "exp_avg_sq")}}
            if first_result is None:
                first_result = {k: v.clone() for k, v in result.items()}
            record["bitwise_equal_to_first"] = all(torch.equal(result[k], first_result[k]) for k in result)
            del trial_w, trial_state, result
            for attr in ("n_regs", "n_spills"):
                record[attr] = getattr(handle, attr, None)
            record["shared"] = getattr(getattr(handle, "metadata", None), "shared", None)
            # time, and with an NVML counter the joules per call over ~0.5 s of replays: the
            # Llama-8B step runs at the 700 W cap, where a tile's energy is what it costs the step
            measured = measure_graph(
                lambda s: fused_wgrad_update(s[0], s[1], s[2], s[3], HP["adamw"], 3, config=config), sets,
                ENERGY[0] if ENERGY else None)
            record["ms"] = measured.pop("ms")
            record.update({f"{k}_per_call" if k == "j" else k: v for k, v in measured.items()})
            # The same launch with no tokens: the epilogue alone (W / state traffic and the rule's
            # arithmetic, no main loop). Against ms it says how much of the GEMM the epilogue hides.
            no_x, no_dy = sets[0][0][:0], sets[0][1][:0]
            epilogue = measure_graph(
                lambda s: fused_wgrad_update(no_x, no_dy, s[2], s[3], HP["adamw"], 3, config=config), sets,
                ENERGY[0] if ENERGY else None)
            record["epilogue_only_ms"] = epilogue.pop("ms")
            record.update({f"epilogue_only_{k}": v for k, v in epilogue.items()})
            traffic_ms = state_bytes / BANDWIDTH[0] * 1e3 if BANDWIDTH else None
            record["traffic_ms"] = traffic_ms
        except Exception as error:  # noqa: BLE001 - report and go on
            record["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        emit(out, record)
    del sets
    torch.cuda.empty_cache()


BANDWIDTH: list[float] = []
ENERGY: list = []          # a telemetry.EnergyCounter, when the caller opened one (sweeps record joules)


def run_sweep(out: Path, dout: int, din: int, tokens: int, state_dtype: str) -> None:
    """Every tuning candidate of the shape, without and with prefetch, and prefetching under the
    16-warps-per-SM register cap: what ``tune_config`` times before its TMA flips, GROUP pass and
    finals (those depend on the timings)."""
    from forge_core.kernels.fused import candidate_configs, prefetch_variants, supports
    configs = [v for c in candidate_configs(dout, din, tokens, 2) if supports(c, state_dtype)
               for v in prefetch_variants(c)]
    sweep_configs(out, dout, din, tokens, state_dtype, configs)


SWEEP_SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "gate": (14336, 4096), "down": (4096, 14336),
                "lm_head": (128256, 4096)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--time-shapes", nargs="*", default=["q", "k", "gate", "down", "lm_head"])
    parser.add_argument("--time-bts", nargs="*", type=int, default=[512, 8192])
    parser.add_argument("--time-states", nargs="*", default=["bf16", "int8", "fp32"])
    parser.add_argument("--time-budget", type=float, default=200.0)
    parser.add_argument("--sweep", nargs="*", default=[], metavar="SHAPE:BT:STATES",
                        help="check and time every tuning candidate, with and without prefetch, e.g. q:512:bf16 "
                             f"(shapes {list(SWEEP_SHAPES)})")
    parser.add_argument("--quick-correctness", action="store_true", help="only the q/o and lm_head shapes")
    parser.add_argument("--bench", action="store_true", help="forge_bench.kernel_bench.main into --out")
    parser.add_argument("--bench-shapes", nargs="*")
    parser.add_argument("--bench-bts", nargs="*", type=int)
    parser.add_argument("--bench-states", nargs="*", help="state dtypes for --bench (default: all)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton
    emit(out, dict(kind="env", device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, autotune=os.environ.get("FORGE_AUTOTUNE", "1")))
    sweep_cases = []
    for case in args.sweep:
        name, tokens, state_dtype = case.split(":")
        sweep_cases.append((*SWEEP_SHAPES[name], int(tokens), state_dtype))
    if sweep_cases or args.time:
        from forge_bench.floor import measure_copy_bandwidth
        BANDWIDTH.append(measure_copy_bandwidth(torch.device("cuda")))
        emit(out, dict(kind="copy_bandwidth", gbps=BANDWIDTH[0] / 1e9))
    for case in sweep_cases:
        guarded(out, run_sweep, *case)
    if not args.skip_correctness:
        os.environ["FORGE_AUTOTUNE"] = "0"     # correctness with the default tile config: fewer compiles
        for rule_name in ("sgd", "lion"):
            for state_dtype in ("fp32", "bf16", "int8"):
                guarded(out, check_step, "q/o", 4096, 4096, 512, torch.bfloat16, rule_name, state_dtype)
        shapes = SHAPES if not args.quick_correctness else {k: SHAPES[k] for k in ("q/o", "lm_head")}
        for label, (dout, din) in shapes.items():
            for tokens in (512, 4096):
                guarded(out, check_gemm, label, dout, din, tokens)
                for dtype in (torch.bfloat16, torch.float32):
                    for state_dtype in ("fp32", "bf16", "int8"):
                        guarded(out, check_step, label, dout, din, tokens, dtype, "adamw", state_dtype)
        guarded(out, check_properties)
        os.environ["FORGE_AUTOTUNE"] = "1"
    if args.time:
        run_timing(out, args.time_shapes, args.time_bts, args.time_states, args.time_budget)
    if args.bench:
        install_tuning_log(out)
        from forge_bench import kernel_bench
        frame = kernel_bench.main(out, args.bench_shapes or None, args.bench_bts or None, args.bench_states or None)
        print(frame.to_string(index=False, columns=["shape", "tokens", "state_dtype", "fused_ms", "roofline_ms",
                                                    "ratio_to_roofline", "baseline_ms", "speedup_vs_baseline"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
