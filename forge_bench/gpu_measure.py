"""GPU measurements shared by the cells and the kernel benchmark: CUDA-graph timing, NVML energy
of a replay window, the copy bandwidth, and the floor terms of a no_optimizer cell.

Every time here is a replay of a CUDA graph (``forge_core.kernels.graph_timing``, the same timing
the kernel choice uses for a captured step): no host launch cost, no first-call compile. Importing
this module loads ``forge_core.kernels`` (Triton), so a cell imports it only where it measures the
floor (``cell.run_timing``), never for a torch arm's step.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from typing import Callable, Sequence

import torch
from torch import nn
from triton.testing import do_bench

from forge_core.kernels.graph_timing import captured, replay_ms

from forge_bench.floor import state_traffic_bytes
from forge_bench.telemetry import EnergyCounter, open_energy_counter


def time_graph_ms(call: Callable[[object], None], sets: Sequence[object], replays: int = 20) -> float:
    """Median ms of one ``call(set)``: capture a CUDA graph running ``call`` once on each set,
    replay it ``replays`` times between CUDA events, divide by the number of sets."""
    graph = captured(call, sets)
    ms = replay_ms(graph, len(sets), replays)
    del graph
    return ms


def graph_energy(graph: "torch.cuda.CUDAGraph", calls_per_replay: int, ms_per_call: float,
                 counter: EnergyCounter, seconds: float = 0.5) -> dict:
    """Joules per call, mean board power and median SM clock over back-to-back replays lasting about
    ``seconds``. Why: the Llama-8B step runs at the board's 700 W cap, where a kernel costs the
    step its energy, not its time alone (and sustained replays of one kernel reach the cap too)."""
    replays = max(1, math.ceil(seconds * 1e3 / max(ms_per_call * calls_per_replay, 1e-3)))
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    started_j, started_s = counter.read_j(), time.perf_counter()
    for _ in range(replays):
        graph.replay()
    done.record()
    clocks = []
    while not done.query():                  # sample the SM clock while the replays run
        clocks.append(counter.sm_clock_mhz())
        time.sleep(0.01)
    done.synchronize()
    joules, elapsed = counter.read_j() - started_j, time.perf_counter() - started_s
    return {"j": joules / (replays * calls_per_replay), "w": joules / elapsed,
            "sm_mhz": statistics.median(clocks) if clocks else None}


def measure_graph(call: Callable[[object], None], sets: Sequence[object], counter: EnergyCounter | None = None,
                  replays: int = 20) -> dict:
    """``time_graph_ms``'s median ms, plus ``graph_energy``'s columns when an NVML counter is given."""
    graph = captured(call, sets)
    result = {"ms": replay_ms(graph, len(sets), replays)}
    if counter is not None:
        try:
            result.update(graph_energy(graph, len(sets), result["ms"], counter))
        except Exception as exc:     # a counter that stops answering costs the joules, not the timing
            result["energy_error"] = f"{type(exc).__name__}: {exc}"[:200]
    del graph
    return result


def fused_linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(Dout, Din) of every nn.Linear whose weight is trainable and appears once in the model.

    Tied or shared weights are stepped by the fallback optimizer, not the fused kernel, so they
    belong to neither the wgrad term nor the state traffic."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    shapes = []
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad and uses[id(module.weight)] == 1:
            shapes.append((module.out_features, module.in_features))
    return shapes


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate, bytes read + written per second (median of do_bench)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def copy_energy(device: torch.device, counter: EnergyCounter, nbytes: int = 1 << 30) -> dict[str, float]:
    """Joules per byte read + written by a device-to-device copy over ~0.5 s of graph replays, and
    the idle board's power measured just before (clocks still up from the copy bandwidth run)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    started_j, started_s = counter.read_j(), time.perf_counter()
    time.sleep(0.5)
    idle_w = (counter.read_j() - started_j) / (time.perf_counter() - started_s)
    copied = measure_graph(lambda _: dst.copy_(src), [None], counter)
    del src, dst
    return {"copy_j_per_byte": copied["j"] / (2 * nbytes), "copy_w": copied["w"],
            "copy_sm_mhz": copied["sm_mhz"], "idle_w": idle_w,
            "copy_graph_bytes_per_s": 2 * nbytes / (copied["ms"] * 1e-3)}


def measure_wgrad_ms(shapes: list[tuple[int, int]], tokens: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[float, dict[str, float]]:
    """Sum over ``shapes`` of the cuBLAS time of ``dY^T X`` at ``tokens`` rows (each unique shape
    timed once, median of do_bench, random data), and the per-shape times."""
    per_shape: dict[str, float] = {}
    total = 0.0
    for (dout, din), count in Counter(shapes).items():
        dy = torch.randn(tokens, dout, dtype=dtype, device=device)
        x = torch.randn(tokens, din, dtype=dtype, device=device)
        ms = do_bench(lambda: dy.t() @ x, warmup=10, rep=50, return_mode="median")
        per_shape[f"{dout}x{din}"] = ms
        total += ms * count
        del dy, x
    return total, per_shape


def floor_terms(model: nn.Module, tokens: int, dtype: torch.dtype, device: torch.device,
                state_dtypes: tuple[str, ...] = ("fp32", "bf16", "int8")) -> dict:
    """What the floor formula (``floor.py``) needs, measured now on ``device``: the wgrad time, the
    copy bandwidth and the state bytes per state dtype. JSON-ready."""
    shapes = fused_linear_shapes(model)
    weight_bytes = torch.finfo(dtype).bits / 8
    wgrad_ms, per_shape = measure_wgrad_ms(shapes, tokens, dtype, device)
    bandwidth = measure_copy_bandwidth(device)
    traffic = {sd: state_traffic_bytes(shapes, weight_bytes, sd) for sd in state_dtypes}
    return {
        **energy_terms(device),
        "grad_bytes": float(sum(dout * din for dout, din in shapes)) * weight_bytes,
        "tokens": tokens,
        "n_fused_weights": len(shapes),
        "fused_params": int(sum(a * b for a, b in shapes)),
        "wgrad_ms": wgrad_ms,
        "wgrad_ms_per_shape": per_shape,
        "copy_bytes_per_s": bandwidth,
        "state_bytes": traffic,
        "traffic_ms": {sd: b / bandwidth * 1e3 for sd, b in traffic.items()},
    }


def energy_terms(device: torch.device) -> dict:
    """The power floor's terms (copy joules per byte, idle power, power limit), or the reason they
    are missing: the time floor never depends on them."""
    counter, why_not = open_energy_counter(device.index if device.index is not None else torch.cuda.current_device())
    if counter is None:
        return {"energy_reason": why_not}
    try:
        terms = copy_energy(device, counter)
        terms["power_limit_w"] = counter.power_limit_w()
    except Exception as exc:       # a counter that stops answering: keep the time floor's terms
        return {"energy_reason": f"copy energy not measured: {type(exc).__name__}: {exc}"[:300]}
    finally:
        counter.close()
    return terms
