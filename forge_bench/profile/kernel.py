"""The kernel benchmark: the fused wgrad + AdamW kernel per Llama-3.1-8B Linear shape.

For each shape, token count BT and state dtype it times, on one CUDA device:

* ``fused``: ``forge_core.kernels.fused_wgrad_update`` (bf16 X, dY and W; AdamW; tuned first);
* ``baseline``: what it replaces, cuBLAS ``dY^T X`` into a bf16 gradient plus torch's fused AdamW
  (``torch._fused_adamw_``) on that bf16 weight with bf16 moments; ``gemm`` and ``adamw`` alone too;
* ``roofline``: ``max(gemm_ms, state_bytes / copy_bandwidth)`` with the cuBLAS time of the same
  GEMM and the device-to-device copy rate measured in the same process; state bytes are W and
  the two moments (and int8 scales) read and written once (``forge_bench.floor``).

Every time is the median over replays of a CUDA graph that runs the operation once on each of
several independent input sets (weights, states, activations), enough sets that they do not fit
in L2 together, so a replay measures HBM traffic, not cache hits, and no launch gaps.

Energy (where NVML has the board's energy counter): each operation's joules per call over ~0.5 s
of back-to-back replays, the copy's joules per byte and the idle board's power, and the energy
roofline ``gemm_j + state_bytes x copy_j_per_byte``. The Llama-8B step runs at the H100's 700 W
cap, where a kernel's energy, not its time alone, is what it costs the step.

``run(out_dir, shapes=None, bts=None, state_dtypes=None, quick=False)`` writes ``kernel_bench.parquet``
and ``kernel_bench.png`` and returns the DataFrame; ``forge-bench kernel --out DIR [--quick]`` runs it
from a shell.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pandas as pd
import torch
import triton
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from forge_core import kernels
from forge_core.rules import get_rule
from forge_core.state import ParamState

from forge_bench.floor import copy_dynamic_j_per_byte, state_traffic_bytes
from forge_bench.gpu_measure import copy_energy, measure_copy_bandwidth, measure_graph
from forge_bench.png import compact_png
from forge_bench.telemetry import EnergyCounter, open_energy_counter

LLAMA_8B_SHAPES: dict[str, tuple[int, int]] = {
    "q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096),
    "gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}
BTS = (512, 2048, 8192)
STATE_DTYPES = ("fp32", "bf16", "int8")
QUICK_SHAPES = ("q", "k", "gate", "down")
QUICK_BTS = (512, 8192)
ADAMW_HP = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
L2_EVICT_BYTES = 200 * 2 ** 20      # input sets per graph replay until they exceed ~4x H100 L2


def require_cuda() -> torch.device:
    """The CUDA device, or a one-line error saying why the benchmark cannot run."""
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU; torch.cuda.is_available() is False here")
    return torch.device("cuda")


def _sets_needed(bytes_per_set: float) -> int:
    return max(1, min(16, math.ceil(L2_EVICT_BYTES / max(bytes_per_set, 1.0))))


def _random(shape, dtype, device, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def bench_shape(dout: int, din: int, tokens: int, state_dtypes: Iterable[str], device: torch.device,
                copy_bytes_per_s: float, counter: "EnergyCounter | None" = None,
                copy: Mapping[str, float] | None = None) -> list[dict]:
    """Rows for one (Dout, Din, BT): baseline and GEMM once, the fused kernel per state dtype.

    With an NVML ``counter`` (``telemetry.open_energy_counter``) each operation's joules per call
    too, and with ``copy`` (``floor.copy_energy``) the energy roofline: the GEMM's joules plus the
    state bytes at the copy's joules per byte (energies add where times overlap)."""
    bf16 = torch.bfloat16
    flops = 2.0 * tokens * dout * din
    activation_bytes = tokens * (dout + din) * 2

    # what FORGE replaces: bf16 G from cuBLAS, then torch's fused AdamW on bf16 W / m / v
    n_sets = _sets_needed(dout * din * 2 * 4 + activation_bytes)
    base_sets = []
    for _ in range(n_sets):
        weight = _random((dout, din), bf16, device, 0.02)
        base_sets.append(dict(x=_random((tokens, din), bf16, device), dy=_random((tokens, dout), bf16, device, 0.01),
                              weight=weight, grad=torch.empty_like(weight), exp_avg=torch.zeros_like(weight),
                              exp_avg_sq=torch.zeros_like(weight),
                              step=torch.ones((), device=device, dtype=torch.float32)))

    def gemm(s):
        torch.matmul(s["dy"].t(), s["x"], out=s["grad"])

    def adamw(s):
        torch._fused_adamw_([s["weight"]], [s["grad"]], [s["exp_avg"]], [s["exp_avg_sq"]], [], [s["step"]],
                            amsgrad=False, lr=ADAMW_HP["lr"], beta1=ADAMW_HP["betas"][0],
                            beta2=ADAMW_HP["betas"][1], weight_decay=ADAMW_HP["weight_decay"],
                            eps=ADAMW_HP["eps"], maximize=False, grad_scale=None, found_inf=None)

    def baseline(s):
        gemm(s)
        adamw(s)

    gemm_m = measure_graph(gemm, base_sets, counter)
    adamw_m = measure_graph(adamw, base_sets, counter)
    baseline_m = measure_graph(baseline, base_sets, counter)
    gemm_ms, adamw_ms, baseline_ms = gemm_m["ms"], adamw_m["ms"], baseline_m["ms"]
    del base_sets
    torch.cuda.empty_cache()

    rows = []
    rule = get_rule("adamw")
    for state_dtype in state_dtypes:
        state_bytes = state_traffic_bytes([(dout, din)], 2.0, state_dtype)
        n_sets = _sets_needed(state_bytes / 2 + activation_bytes)
        sets = []
        for _ in range(n_sets):
            weight = _random((dout, din), bf16, device, 0.02)
            state = ParamState(weight, rule, state_dtype)
            state.store("exp_avg", _random((dout, din), torch.float32, device, 1e-3))
            state.store("exp_avg_sq", _random((dout, din), torch.float32, device, 1e-3).square())
            sets.append(dict(x=_random((tokens, din), bf16, device), dy=_random((tokens, dout), bf16, device, 0.01),
                             weight=weight, state=state))

        # the step's scalars in device memory, as FORGE's capturable optimizer passes them: the
        # benchmark replays CUDA graphs, and the kernel choice (forge_core.kernels.ws_choice) is
        # then made on graph timings, as it is for a captured training step
        values = rule.kernel_scalars(ADAMW_HP, 10)
        scalars = torch.zeros(kernels.NUM_SCALARS, dtype=torch.float32, device=device)
        scalars[:len(values)] = torch.tensor(values, dtype=torch.float64)

        def fused(s, scalars=scalars):
            kernels.fused_wgrad_update(s["x"], s["dy"], s["weight"], s["state"], ADAMW_HP, 10, device_scalars=scalars)

        started = time.perf_counter()
        fused(sets[0])               # tunes (on scratch copies) for this key
        torch.cuda.synchronize()
        tune_s = time.perf_counter() - started
        fused_m = measure_graph(fused, sets, counter)
        fused_ms = fused_m["ms"]
        config = [c for k, c in kernels.tuned_configs().items() if k[0] == (dout, din) and k[1] == tokens
                  and k[5] == state_dtype]
        traffic_ms = state_bytes / copy_bytes_per_s * 1e3
        roofline_ms = max(gemm_ms, traffic_ms)
        rows.append(dict(
            dout=dout, din=din, tokens=tokens, state_dtype=state_dtype,
            fused_ms=fused_ms, baseline_ms=baseline_ms, gemm_ms=gemm_ms, adamw_ms=adamw_ms,
            traffic_ms=traffic_ms, roofline_ms=roofline_ms, ratio_to_roofline=fused_ms / roofline_ms,
            speedup_vs_baseline=baseline_ms / fused_ms,
            fused_tflops=flops / (fused_ms * 1e-3) / 1e12, gemm_tflops=flops / (gemm_ms * 1e-3) / 1e12,
            fused_gbps=(state_bytes + activation_bytes) / (fused_ms * 1e-3) / 1e9,
            state_bytes=state_bytes, copy_gbps=copy_bytes_per_s / 1e9, tune_s=tune_s,
            config=str(config[-1]) if config else "", input_sets=n_sets,
            **energy_columns(fused_m, gemm_m, adamw_m, baseline_m, state_bytes, copy)))
        del sets
        torch.cuda.empty_cache()
    return rows


def energy_columns(fused: dict, gemm: dict, adamw: dict, baseline: dict, state_bytes: float,
                    copy: Mapping[str, float] | None) -> dict:
    """Joules per call of each operation; with the copy's energy (``floor.copy_energy``) the fused
    kernel's ratio to its energy roofline and ``dynamic_energy_ratio``: its joules above idle power
    against the GEMM's plus the state copy's (each above idle), what it spends beyond the work it
    must do, however long each ran. {} without a counter (the rows then have no energy columns)."""
    if any("j" not in measured for measured in (fused, gemm, adamw, baseline)):
        return {}                    # no counter, or one whose window failed (``energy_error``)
    columns = dict(fused_j=fused["j"], fused_w=fused["w"], fused_sm_mhz=fused["sm_mhz"], gemm_j=gemm["j"],
                   gemm_w=gemm["w"], adamw_j=adamw["j"], baseline_j=baseline["j"])
    if copy:
        traffic_j = state_bytes * copy["copy_j_per_byte"]
        floor_j = gemm["j"] + traffic_j
        idle_w = copy["idle_w"]
        traffic_dynamic_j = state_bytes * copy_dynamic_j_per_byte(copy["copy_j_per_byte"], copy["copy_w"], idle_w)
        work_dynamic_j = gemm["j"] - idle_w * gemm["ms"] * 1e-3 + traffic_dynamic_j
        columns.update(traffic_j=traffic_j, energy_roofline_j=floor_j, energy_ratio_to_roofline=fused["j"] / floor_j,
                       dynamic_energy_ratio=(fused["j"] - idle_w * fused["ms"] * 1e-3) / work_dynamic_j)
    return columns


def plot(frame, path: Path) -> None:
    """Ratio to roofline (top), speed-up over cuBLAS + fused AdamW (middle) and, with energy columns,
    the energy ratio (bottom) per shape and BT. Agg canvas, no pyplot state."""
    energy = "energy_ratio_to_roofline" in frame and frame["energy_ratio_to_roofline"].notna().any()
    fig = Figure(figsize=(14, 12 if energy else 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(3 if energy else 2, 1)
    # one slot per (shape, BT) that any state dtype has (a frame merged from runs of different
    # --state-dtypes / --bts need not have every pair for every dtype), in first-seen order
    keys = list(dict.fromkeys(zip(frame["shape"], frame["tokens"])))
    labels = [f"{shape} {tokens}" for shape, tokens in keys]
    slot = {key: index for index, key in enumerate(keys)}
    positions = range(len(labels))
    width = 0.8 / max(1, frame.state_dtype.nunique())
    for offset, (state_dtype, part) in enumerate(frame.groupby("state_dtype", sort=False)):
        xs = [slot[key] + offset * width for key in zip(part["shape"], part["tokens"])]
        axes[0].bar(xs, part.ratio_to_roofline, width, label=f"{state_dtype} states")
        axes[1].bar(xs, part.speedup_vs_baseline, width, label=f"{state_dtype} states")
        if energy:
            axes[2].bar(xs, part.energy_ratio_to_roofline, width, label=f"{state_dtype} states")
    axes[0].axhline(1.15, color="k", ls="--", lw=1, label="target 1.15x")
    axes[0].set_ylabel("fused time / roofline")
    axes[1].axhline(1.0, color="k", lw=1)
    axes[1].set_ylabel("(cuBLAS dY^T X + fused AdamW) / fused")
    if energy:
        axes[2].axhline(1.0, color="k", lw=1)
        axes[2].set_ylabel("fused J / (GEMM J + copy J of state bytes)")
    for ax in axes:
        ax.set_xticks([p + width * (frame.state_dtype.nunique() - 1) / 2 for p in positions])
        ax.set_xticklabels(labels, fontsize=7, rotation=60, ha="right")
        ax.set_xlabel("shape, tokens (BT)")
        ax.legend(fontsize=8)
    device = frame.device.iloc[0] if "device" in frame else ""
    fig.suptitle(f"FORGE fused wgrad + AdamW, Llama-3.1-8B Linear shapes ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    compact_png(path)


def run(out_dir: str | Path, shapes: Sequence[str] | None = None, bts: Sequence[int] | None = None,
        state_dtypes: Sequence[str] | None = None, quick: bool = False) -> pd.DataFrame:
    """Run the benchmark; write ``kernel_bench.parquet`` and ``kernel_bench.png`` under ``out_dir``.
    ``quick``: ``QUICK_SHAPES`` x ``QUICK_BTS`` where shapes / BTs are not given (CI)."""
    device = require_cuda()
    shapes = list(shapes or (QUICK_SHAPES if quick else LLAMA_8B_SHAPES))
    unknown = [s for s in shapes if s not in LLAMA_8B_SHAPES]
    if unknown:
        raise ValueError(f"unknown shape names {unknown}; known: {list(LLAMA_8B_SHAPES)}")
    state_dtypes = list(state_dtypes or STATE_DTYPES)
    bad = [s for s in state_dtypes if s not in STATE_DTYPES]
    if bad:
        raise ValueError(f"unknown state dtypes {bad}; known: {list(STATE_DTYPES)}")
    bts = [int(b) for b in (bts or (QUICK_BTS if quick else BTS))]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copy_bytes_per_s = measure_copy_bandwidth(device)
    counter, no_energy = open_energy_counter(torch.cuda.current_device())
    run_columns = {"energy_reason": no_energy}
    copied = None
    try:
        if counter is not None:
            copied = copy_energy(device, counter)
            run_columns = {"copy_j_per_gb": copied["copy_j_per_byte"] * 1e9, "copy_w": copied["copy_w"],
                           "copy_sm_mhz": copied["copy_sm_mhz"], "idle_w": copied["idle_w"],
                           "copy_graph_gbps": copied["copy_graph_bytes_per_s"] / 1e9}
        else:
            print(f"kernel_bench: timings only ({no_energy})", file=sys.stderr)
        rows = _bench_all(shapes, bts, state_dtypes, device, copy_bytes_per_s, counter, copied, run_columns, out)
    finally:
        if counter is not None:
            counter.close()
    frame = _frame(rows, device)
    frame.to_parquet(out / "kernel_bench.parquet", index=False)
    plot(frame, out / "kernel_bench.png")
    return frame


def _bench_all(shapes: Sequence[str], bts: Sequence[int], state_dtypes: Sequence[str], device: torch.device,
               copy_bytes_per_s: float, counter: "EnergyCounter | None", copied: Mapping[str, float] | None,
               run_columns: Mapping[str, object], out: Path) -> list[dict]:
    """Every (shape, BT): one ``bench_shape`` per distinct weight shape, the parquet rewritten after
    each so a cut-off run keeps its rows."""
    measured: dict[tuple[int, int, int], list[dict]] = {}
    rows = []
    for name in shapes:
        dout, din = LLAMA_8B_SHAPES[name]
        for tokens in bts:
            key = (dout, din, tokens)
            if key not in measured:       # q/o, k/v, gate/up share a shape: measure once
                measured[key] = bench_shape(dout, din, tokens, state_dtypes, device, copy_bytes_per_s,
                                            counter, copied)
                for row in measured[key]:
                    energy = (f"  energy {row['fused_j'] * 1e3:.1f} mJ ratio {row['energy_ratio_to_roofline']:.2f}"
                              if "energy_ratio_to_roofline" in row else "")
                    print(f"{name:8s} {dout:6d}x{din:<6d} BT={tokens:5d} {row['state_dtype']:4s} "
                          f"fused {row['fused_ms']:.3f} ms  roofline {row['roofline_ms']:.3f}  "
                          f"ratio {row['ratio_to_roofline']:.2f}  vs baseline x{row['speedup_vs_baseline']:.2f}"
                          + energy, flush=True)
            rows.extend(dict(row, shape=name, **run_columns) for row in measured[key])
            frame = _frame(rows, device)
            frame.to_parquet(out / "kernel_bench.parquet", index=False)   # after every shape: a cut-off run keeps rows
    return rows


def _frame(rows: list[dict], device: torch.device) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    frame["device"] = torch.cuda.get_device_name(device)
    frame["torch_version"] = torch.__version__
    frame["triton_version"] = triton.__version__
    return frame[["shape"] + [c for c in frame.columns if c != "shape"]]


