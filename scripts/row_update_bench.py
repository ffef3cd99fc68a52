"""Time the row-gradient embedding's update on the GPU: ``kernels.row_update`` (one pass over every row,
the gradient read through a slot table) over a handful of block shapes, against the two-pass path it
replaced (the fused kernel over every row with zero tokens, then on the gathered touched rows, with
the gather and scatter) and the dense step (the fused kernel on a dense gradient), at Llama-3.1-8B's
embedding (128256 x 4096 bf16, T = 512 random ids), AdamW with bf16 and int8 states.

    python3 scripts/row_update_bench.py --out row_update.jsonl
    python3 scripts/row_update_bench.py --out X.jsonl --states int8 --configs 16x128/w4 32x128/w8 --rounds 3

One JSON line per arm, configuration and round (appended to --out): ms (median of
triton.testing.do_bench) and GB/s of the one-pass traffic: W and the states read and written (int8:
with their scales), the distinct touched gradient rows and the slot table read. Every arm is given the
same bytes, so GB/s compares like ms. Rounds are interleaved (every arm once per round), so the clock
drift under the power cap shows as the spread between rounds. Before timing, the default block shape's
result is compared with the dense step's (``check`` records: differing elements, largest difference).
The fused kernel tunes its tile for the two-pass and dense arms at their first launch, as in training.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forge_core.kernels import fused_wgrad_update  # noqa: E402
from forge_core.kernels.row_gradient import row_gradient  # noqa: E402
from forge_core.kernels.row_update import DEFAULT_CONFIGS, RowUpdateConfig, row_update  # noqa: E402
from forge_core.rules import get_rule  # noqa: E402
from forge_bench.floor import state_traffic_bytes  # noqa: E402
from forge_core.state import QBLOCK, STATE_DTYPES, ParamState  # noqa: E402

ROWS, WIDTH, TOKENS = 128256, 4096, 512
HP = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEP = 10
_SPEC = re.compile(r"^(\d+)x(\d+)/w(\d+)$")


def parse_config(spec: str) -> RowUpdateConfig:
    """``BMxCN/wWARPS`` (e.g. ``16x128/w4``) -> a RowUpdateConfig; a one-line SystemExit otherwise."""
    match = _SPEC.match(spec)
    if match is None:
        raise SystemExit(f"row_update_bench: cannot read block shape {spec!r} (want BMxCN/wWARPS, e.g. 16x128/w4)")
    config = RowUpdateConfig(*map(int, match.groups()))
    try:
        config.check("fp32")
    except ValueError as error:
        raise SystemExit(f"row_update_bench: {spec!r}: {error}") from None
    return config


def sweep() -> list[RowUpdateConfig]:
    """BM {8..64} x CN {64, 128, 256} x warps {4, 8}, keeping 8 to 64 elements of each tensor per thread
    (fewer leaves the 16-byte loads half empty; more costs registers, hence occupancy)."""
    return [RowUpdateConfig(bm, cn, warps) for bm in (8, 16, 32, 64) for cn in (64, 128, 256) for warps in (4, 8)
            if 8 <= bm * cn // (32 * warps) <= 64]


def configs_for(state_dtype: str, configs: list[RowUpdateConfig]) -> list[RowUpdateConfig]:
    """The configs this state format can run, the default first."""
    default = DEFAULT_CONFIGS[state_dtype]
    usable = [c for c in configs if state_dtype != "int8" or c.block_n % QBLOCK == 0]
    return [default] + [c for c in usable if c != default]


def traffic_bytes(state_dtype: str, rows: int, width: int, distinct: int, weight_bytes: int = 2) -> int:
    """Bytes a single pass must move: W and two AdamW states read and written (int8: codes and scales;
    the floor's ``state_traffic_bytes``), the distinct gradient rows and the slot table read."""
    return round(state_traffic_bytes([(rows, width)], weight_bytes, state_dtype)) \
        + distinct * width * weight_bytes + rows * 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file (appended)")
    parser.add_argument("--states", nargs="+", default=["bf16", "int8"], choices=STATE_DTYPES)
    parser.add_argument("--configs", nargs="+", type=parse_config, default=None, metavar="BMxCN/wW",
                        help="block shapes of row_update (default: the sweep)")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-baselines", action="store_true", help="time row_update only (not two-pass / dense)")
    args = parser.parse_args(argv)
    if min(args.rows, args.width, args.tokens, args.rounds) < 1:
        raise SystemExit("row_update_bench: --rows, --width, --tokens and --rounds must be positive")
    return args


class Case:
    """One state format's tensors: W and its AdamW state, a step's ids, gradient rows and slot table."""

    def __init__(self, state_dtype: str, rows: int, width: int, tokens: int) -> None:
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.state_dtype = state_dtype
        self.weight = (torch.randn(rows, width, device="cuda", generator=generator) * 0.02).bfloat16()
        self.state = ParamState(self.weight, get_rule("adamw"), state_dtype)
        for name in self.state.values:                     # moments of a trained model, not zeros
            value = torch.randn(rows, width, device="cuda", generator=generator) * 1e-3
            self.state.store(name, value.abs() ** 2 if self.state.is_sqrt_domain(name) else value)
            del value
        ids = torch.randint(0, rows, (tokens,), device="cuda", generator=generator)
        dy = torch.randn(tokens, width, device="cuda", generator=generator).bfloat16()
        self.touched, self.row_grads = row_gradient(ids, dy, torch.bfloat16)
        self.slots = torch.empty(rows, dtype=torch.int32, device="cuda")
        self.build_slots()
        self.distinct = int(torch.unique(self.touched).numel())

    def build_slots(self) -> None:
        """As ``ForgeOptimizer._step_rows``: fill, then each sorted id's position."""
        self.slots.fill_(-1)
        self.slots[self.touched] = torch.arange(self.touched.numel(), dtype=torch.int32, device="cuda")

    def copy(self) -> tuple[torch.Tensor, ParamState]:
        """Fresh copies of W and the state (for the check against the dense step)."""
        weight = self.weight.clone()
        state = ParamState(weight, self.state.rule, self.state_dtype)
        state.load_state_dict(self.state.state_dict())
        return weight, state


def row_update_arm(case: Case, config: RowUpdateConfig) -> Callable[[], None]:
    return lambda: row_update(case.weight, case.state, HP, STEP, slots=case.slots, row_grads=case.row_grads,
                              seed=STEP, config=config)


def two_pass_arm(case: Case) -> Callable[[], None]:
    """The path before the slot table (session 27): gather the touched rows of W and the state, the fused
    kernel over every row with zero tokens and no gradient, again on the gathered rows with theirs,
    scatter back."""
    weight, state = case.weight, case.state
    count, width = case.row_grads.shape
    compact_weight = weight.new_empty((count, width))
    compact_state = ParamState(compact_weight, state.rule, state.state_dtype)
    no_x, no_dy = weight.new_zeros((0, width)), weight.new_zeros((0, weight.shape[0]))
    compact_no_dy = weight.new_zeros((0, count))

    def both(action: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        for name in state.values:
            action(state.values[name], compact_state.values[name])
            if state.scales[name] is not None:
                action(state.scales[name], compact_state.scales[name])

    def step() -> None:
        torch.index_select(weight, 0, case.touched, out=compact_weight)
        both(lambda full, compact: torch.index_select(full, 0, case.touched, out=compact))
        fused_wgrad_update(no_x, no_dy, weight, state, HP, STEP, seed=STEP)
        fused_wgrad_update(no_x, compact_no_dy, compact_weight, compact_state, HP, STEP, grad_accum=case.row_grads,
                           seed=STEP + 1)
        weight.index_copy_(0, case.touched, compact_weight)
        both(lambda full, compact: full.index_copy_(0, case.touched, compact))

    return step


def dense_arm(case: Case) -> Callable[[], None]:
    """The fused kernel on a dense gradient (what ``fuse(embedding_rows=False)`` steps)."""
    weight, width = case.weight, case.weight.shape[1]
    grad = torch.zeros_like(weight)
    grad[case.touched] = case.row_grads
    no_x, no_dy = weight.new_zeros((0, width)), weight.new_zeros((0, weight.shape[0]))
    return lambda: fused_wgrad_update(no_x, no_dy, weight, case.state, HP, STEP, grad_accum=grad, seed=STEP)


def check_against_dense(case: Case) -> dict:
    """One row_update step (default block shape) against one dense fused step from the same start."""
    rows_weight, rows_state = case.copy()
    dense_weight, dense_state = case.copy()
    grad = torch.zeros_like(dense_weight)
    grad[case.touched] = case.row_grads
    width = grad.shape[1]
    fused_wgrad_update(grad.new_zeros((0, width)), grad.new_zeros((0, grad.shape[0])), dense_weight, dense_state, HP,
                       STEP, grad_accum=grad, seed=STEP)
    row_update(rows_weight, rows_state, HP, STEP, slots=case.slots, row_grads=case.row_grads, seed=STEP)
    record = {"weight_differing": int((rows_weight != dense_weight).sum()),
              "weight_max_abs_diff": float((rows_weight.float() - dense_weight.float()).abs().max())}
    for name in rows_state.values:
        ours, theirs = rows_state.values[name], dense_state.values[name]
        record[f"{name}_differing"] = int((ours != theirs).sum())
        record[f"{name}_max_abs_diff"] = float((ours.float() - theirs.float()).abs().max())
    return record


def time_ms(fn: Callable[[], None]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_states(state_dtype: str, args: argparse.Namespace, configs: list[RowUpdateConfig],
                 emit: Callable[[dict], None], summary: dict[tuple, tuple[int, list[float]]]) -> None:
    """Every arm for one state format, ``args.rounds`` interleaved rounds (its tensors are freed on return)."""
    case = Case(state_dtype, args.rows, args.width, args.tokens)
    nbytes = traffic_bytes(state_dtype, args.rows, args.width, case.distinct)
    emit({"kind": "check", "states": state_dtype, "config": dataclasses.asdict(DEFAULT_CONFIGS[state_dtype]),
          **check_against_dense(case)})
    arms: list[tuple[str, dict, Callable[[], None]]] = [
        ("row_update", dataclasses.asdict(c), row_update_arm(case, c)) for c in configs_for(state_dtype, configs)]
    arms.append(("slot_table", {}, case.build_slots))
    if not args.no_baselines:
        arms.append(("two_pass", {}, two_pass_arm(case)))
        arms.append(("dense", {}, dense_arm(case)))
    for round_index in range(args.rounds):
        for name, config, fn in arms:
            record = {"kind": name, "states": state_dtype, "config": config, "round": round_index}
            try:
                ms = time_ms(fn)
            except Exception as error:  # noqa: BLE001 - a shape that cannot compile: say so, go on
                emit({**record, "error": f"{type(error).__name__}: {str(error)[:300]}"})
                continue
            summary.setdefault((state_dtype, name, json.dumps(config)), (nbytes, []))[1].append(ms)
            emit({**record, "ms": round(ms, 4), "bytes": nbytes, "distinct_rows": case.distinct,
                  "gb_per_s": round(nbytes / ms / 1e6, 1) if name != "slot_table" else None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("row_update_bench: needs a CUDA GPU")
    configs = args.configs if args.configs is not None else sweep()
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": args.rows, "width": args.width, "tokens": args.tokens, "rule": "adamw", "weight": "bf16"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict[tuple, tuple[int, list[float]]] = {}
    with open(args.out, "a") as handle:
        def emit(record: dict) -> None:
            line = json.dumps({**header, **record})
            handle.write(line + "\n")
            handle.flush()
            print(line, flush=True)

        for state_dtype in args.states:
            bench_states(state_dtype, args, configs, emit, summary)
            torch.cuda.empty_cache()
    print("\nmedian over rounds, ms (GB/s of the one-pass traffic):", flush=True)
    for (state_dtype, name, config), (nbytes, times) in sorted(
            summary.items(), key=lambda kv: (kv[0][0], statistics.median(kv[1][1]))):
        ms = statistics.median(times)
        rate = f"({nbytes / ms / 1e6:6.0f})" if name != "slot_table" else ""
        print(f"  {state_dtype:5s} {name:10s} {config:50s} {ms:8.4f} {rate}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
