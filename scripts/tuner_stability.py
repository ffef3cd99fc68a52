"""Does the tuner pick the same, fastest tile every time? (GPU, one call of the device tool.)

    python3 scripts/tuner_stability.py --out $OUT --repeats 4 gate:512:int8 gate:512:bf16 q:512:int8

For each SHAPE:BT:STATES, tune the shape ``--repeats`` times per arm, the arms alternating:
``single`` ranks every candidate by one do_bench each (``FINALISTS = 1``, the tuner up to session
12), ``finals`` re-times the fastest few round-robin (the current ``FINALISTS``). Then every tile
any tuning chose is timed where it matters, one step on rotating W / state sets in a CUDA graph
(``time_graph_ms``), all of them in each of ``--rounds`` interleaved rounds. A tuner is as good
as the graph time of what it picks: the summary gives, per arm, each pick's median graph time
over the fastest pick's. Records: OUT/check.jsonl (kind = tuned, graph, summary).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpu_kernel_check as check  # noqa: E402
from forge_bench.kernel_bench import time_graph_ms  # noqa: E402
from forge_bench.telemetry import nvml_snapshot  # noqa: E402
from forge_core.kernels import fused as fused_module  # noqa: E402
from forge_core.kernels import fused_wgrad_update  # noqa: E402

ARMS = {"single": 1, "finals": fused_module.FINALISTS}


def tune_once(sample: tuple, finalists: int) -> tuple[fused_module.TileConfig, float]:
    """Forget this shape's tuning and launch plan, tune it again; the pick and the seconds it took."""
    x, dy, weight, state = sample
    for key in [k for k in fused_module._TUNED if k[0] == tuple(weight.shape) and k[1] == x.shape[0]]:
        del fused_module._TUNED[key]
    fused_module._PLANS.pop(state, None)
    fused_module.FINALISTS = finalists
    started = time.perf_counter()
    fused_wgrad_update(x, dy, weight, state, check.HP["adamw"], 3)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    (config,) = [c for k, c in fused_module._TUNED.items() if k[0] == tuple(weight.shape) and k[1] == x.shape[0]]
    return config, seconds


def study(out: Path, name: str, tokens: int, state_dtype: str, repeats: int, rounds: int) -> None:
    dout, din = check.SWEEP_SHAPES[name]
    sets = check.rotating_sets(dout, din, tokens, state_dtype)
    picks: dict[str, list[fused_module.TileConfig]] = {arm: [] for arm in ARMS}
    for repeat in range(repeats):
        for arm, finalists in (ARMS.items() if repeat % 2 == 0 else reversed(ARMS.items())):
            config, seconds = tune_once(sets[0], finalists)
            picks[arm].append(config)
            check.emit(out, dict(kind="tuned", shape=name, tokens=tokens, state_dtype=state_dtype, arm=arm,
                                 repeat=repeat, config=str(config), tune_s=round(seconds, 2),
                                 sm_clock_mhz=nvml_snapshot().get("sm_clock_mhz")))
    fused_module.FINALISTS = ARMS["finals"]
    distinct = list(dict.fromkeys(c for configs in picks.values() for c in configs))
    graph_ms: dict[fused_module.TileConfig, list[float]] = {c: [] for c in distinct}
    for round_index in range(rounds):
        shift = round_index % len(distinct)
        for config in distinct[shift:] + distinct[:shift]:
            ms = time_graph_ms(lambda s: fused_wgrad_update(s[0], s[1], s[2], s[3], check.HP["adamw"], 3,
                                                            config=config), sets)
            graph_ms[config].append(ms)
            check.emit(out, dict(kind="graph", shape=name, tokens=tokens, state_dtype=state_dtype,
                                 round=round_index, config=str(config), ms=round(ms, 5)))
    median = {c: statistics.median(v) for c, v in graph_ms.items()}
    fastest = min(median.values())
    for arm, configs in picks.items():
        excess = [median[c] / fastest - 1.0 for c in configs]
        check.emit(out, dict(kind="summary", shape=name, tokens=tokens, state_dtype=state_dtype, arm=arm,
                             picks=[str(c) for c in configs], pick_ms=[round(median[c], 5) for c in configs],
                             fastest_pick_ms=round(fastest, 5), mean_excess=round(statistics.mean(excess), 4),
                             worst_excess=round(max(excess), 4), distinct_picks=len(set(configs))))
    del sets
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=4, help="tunings per arm and shape")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved graph timings of the picks")
    parser.add_argument("cases", nargs="+", metavar="SHAPE:BT:STATES")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tuner_stability: needs a CUDA GPU")
    # every repeat must tune afresh: a FORGE_TUNE_CACHE would hand each one the first repeat's pick
    os.environ.pop(fused_module.tune_cache.ENV, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        try:
            name, tokens, state_dtype = case.split(":")
            check.SWEEP_SHAPES[name]
        except (ValueError, KeyError):
            raise SystemExit(f"tuner_stability: cannot read case {case!r} (SHAPE:BT:STATES, SHAPE one of "
                             f"{', '.join(check.SWEEP_SHAPES)})") from None
        check.guarded(out, study, name, int(tokens), state_dtype, args.repeats, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
