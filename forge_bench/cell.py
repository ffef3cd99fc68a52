"""Run ONE cell in this process and write its ONE row.

Order: availability -> predicted memory (GPU) -> parity gate (where the arm claims a reference
algorithm) -> build the full model -> warm-up -> ``repeats`` x ``timed_steps`` timed steps
(CUDA events on a GPU, wall clock on a CPU) with the peak-memory counters reset at the start of
the timed window and NVML read just before and after it. The allocator's peak before that reset
(model build, tile tuning, warm-up) joins the window's in ``peak_process_gib``: whether a run fits
is decided by its highest peak, which may come before the window.

The runner (runner.py) starts this module as ``python -m forge_bench.cell`` in a fresh process
per cell (``main``: the per-cell child's entry; ``forge-bench cell`` runs the same from a shell).
An out-of-memory error on the first attempt exits with ``EXIT_OOM_RETRY`` and no row;
the runner then retries once in a new process (the whole cache freed) and this module writes
the ``oom`` row if the second attempt fails too. Any other exception propagates: the process
dies with the traceback on stderr and the runner writes the ``crashed`` row.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional

import torch
import typer
from forge_core import native_hooks

from forge_bench import families
from forge_bench import lanes
from forge_bench import methods as methods_mod
from forge_bench import models as models_mod
from forge_bench import memory_model, results, telemetry, turns
from forge_bench.arm import Arm, ArmUnavailable, TrainConfig
from forge_bench.peer_probes import hide_peer_packages_except
from forge_bench.suite import Cell, Suite, load_suite
from forge_bench.units import GIB

EXIT_OOM_RETRY = 75      # "out of memory, please retry me in a fresh process"
MAX_ATTEMPTS = 2
BATCH_POOL = 4           # distinct synthetic batches the timed steps cycle through
PARITY_BATCH_SEED = 10_000


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _chain(exc: BaseException | None):
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error, also when another error followed it: an allocation that fails inside a
    CUDA graph capture leaves the capture with unjoined side-stream work, and capture_end's error
    is what reaches the cell (Llama-3.1-8B b4 s2048 with forge_bf16_cce: without this, a 'crashed' row)."""
    return any(isinstance(e, torch.OutOfMemoryError)
               or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower()) for e in _chain(exc))


def capture_failure(exc: BaseException) -> str:
    """Why a CUDA graph capture failed, naming the first error when a later one (capture_end's
    'capturing stream has unjoined work') followed it."""
    chain = list(_chain(exc))
    first, last = chain[-1], chain[0]

    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")

    return line(first) if first is last else f"{line(first)} (then {line(last)})"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


class Diverged(RuntimeError):
    """A non-finite loss."""


def _check_finite(losses: list[torch.Tensor], where: str) -> list[float]:
    values = [float(x) for x in torch.stack([l.float().reshape(()) for l in losses]).cpu()]
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise Diverged(f"non-finite loss {values[bad[0]]} at {where} step {bad[0] + 1}")
    return values


# --- the parity gate ---------------------------------------------------------------------

@dataclass
class ParityResult:
    rms_rel: float            # the worst weight matrix's rms(W - W_ref) / rms(W_ref)
    rms_rel_global: float     # over all parameters together
    worst_param: str
    model_label: str
    steps: int


def _reference_optimizer(kind: str, model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind in families.FAMILIES:    # the family's unfused optimizer, stepped eagerly
        return families.unfused_optimizer(kind, model, dataclasses.replace(cfg, capturable=False))
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                 foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=False)
    raise ValueError(f"unknown parity reference {kind!r} (expected 'adamw', 'sgd' or an optimizer family)")


def run_parity(suite: Suite, cell: Cell, method: methods_mod.Method) -> ParityResult:
    """``steps`` steps of the arm vs the fp32 torch reference from the same initial weights.

    Big models are gated on a reduced-depth twin (same widths, ``parity.max_layers`` layers), so
    every Linear shape of the model is exercised. The reference runs first and its final weights
    are parked on the host, so the gate never holds both models on the device at once.
    """
    spec, device = suite.spec, suite.spec.device
    cfg = suite.spec.train_config(cuda_graph=cell.cuda_graph)   # the capturable optimizers, run eagerly
    twin_layers = models_mod.reduced_depth(cell.model, spec.parity.max_layers)
    label = cell.model if twin_layers is None else f"{cell.model} (reduced to {twin_layers} layers)"
    arm_model = models_mod.build_model(cell.model, cell.dtype, device, seed=spec.seed, num_layers=twin_layers)
    batches = [models_mod.make_batch(cell.model, cell.batch, cell.seq, device, seed=PARITY_BATCH_SEED + i)
               for i in range(spec.parity.steps)]

    # the reference is the plain transformers model in fp32; lean activations go on the arm only
    ref_model = copy.deepcopy(arm_model).float()
    models_mod.apply_activations(arm_model, cell.activations)
    models_mod.apply_activation_checkpointing(arm_model, cell.activation_checkpointing)
    ref_opt = _reference_optimizer(method.parity_reference, ref_model, cfg)
    ref_losses = []
    for batch in batches:
        loss = ref_model(**batch).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.detach())
    _check_finite(ref_losses, "parity reference")
    reference = {name: p.detach().to("cpu", copy=True) for name, p in ref_model.named_parameters()}
    del ref_model, ref_opt, ref_losses
    _free_memory(device)

    params_before = dict(arm_model.named_parameters())
    torch.manual_seed(spec.seed)
    arm = method.build(arm_model, cfg)
    losses = [arm.step(batch) for batch in batches]
    _check_finite(losses, "parity")
    _sync(device)

    params_after = dict(arm_model.named_parameters())
    per_tensor: dict[str, tuple[float, int]] = {}
    diff_sq, ref_sq = 0.0, 0.0
    for name, ref in reference.items():
        got = params_after.get(name, params_before.get(name))
        if got is None:
            raise RuntimeError(f"parity: the arm's model has no parameter {name!r} any more")
        ref = ref.to(got.device)              # compare where the weights live (fast on a GPU)
        got = got.detach().float()
        d = float((got - ref).pow(2).sum())
        r = float(ref.pow(2).sum())
        ndim = ref.ndim
        del ref, got
        diff_sq += d
        ref_sq += r
        if r > 0:
            rel = math.sqrt(d / r)
            per_tensor[name] = (rel if math.isfinite(rel) else float("inf"), ndim)
    # The gate reads the worst weight MATRIX: the tensors an optimizer kernel can get wrong at
    # scale. Vectors (norms, zero-initialised biases) are tiny, and in bf16 Adam's sign-like first
    # steps on their near-zero gradients make their relative error large for every correct arm;
    # they still count in the global figure kept in ``extra``.
    matrices = {k: v for k, (v, ndim) in per_tensor.items() if ndim >= 2} or {k: v for k, (v, _) in per_tensor.items()}
    worst_name = max(matrices, key=matrices.get) if matrices else ""
    worst = matrices.get(worst_name, 0.0)
    del arm, arm_model, losses, batches, reference, params_before, params_after
    _free_memory(device)
    return ParityResult(worst, math.sqrt(diff_sq / ref_sq) if ref_sq else float("nan"), worst_name, label,
                        spec.parity.steps)


# --- timing --------------------------------------------------------------------------------

FLOOR_METHOD = "no_optimizer"  # its cell also measures the floor terms (floor.py, gpu_measure.floor_terms)


@dataclass
class Timing:
    run_ms: list[list[float]]
    losses: list[float]
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    peak_reason: str | None
    memory_breakdown: dict[str, int]
    n_params: int
    n_fused_params: int
    settings: dict[str, Any]
    nvml: dict[str, Any] = field(default_factory=dict)
    floor_terms: dict[str, Any] | None = None
    host_ms: list[float] = field(default_factory=list)
    energy: dict[str, float] = field(default_factory=dict)    # telemetry.window_energy of the timed window
    peak_process_gib: float | None = None   # the allocator's peak from the model's build to the window's end
    first_step_s: float | None = None       # the first training step's wall time: tile tuning and compiles included
    build_to_first_step_s: float | None = None   # from the model's build to the first step's end
    launches_per_step: dict[str, float] | None = None   # fused-kernel launches per eager timed step, by path
    turns: dict[str, Any] | None = None     # the group's other cells and this cell's turns (``--interleave``)
    cpus: list[int] = field(default_factory=list)   # the CPUs the timed window ran on (``lanes.pin_threads``)


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def timing_columns(run_ms: list[list[float]], tokens_per_step: int) -> dict[str, Any]:
    """Per-run medians and IQR/median spreads, the median of medians, tail percentiles."""
    medians = [statistics.median(r) for r in run_ms]
    spreads = [(_percentile(r, 75) - _percentile(r, 25)) / statistics.median(r) for r in run_ms]
    every = [x for r in run_ms for x in r]
    median = statistics.median(medians)
    return {
        "step_ms_median": median,
        "step_ms_run_medians": medians,
        "step_ms_run_spreads": spreads,
        "step_ms_spread_max": max(spreads),
        "step_ms_p10": _percentile(every, 10),
        "step_ms_p90": _percentile(every, 90),
        "step_ms_all": every,
        "tokens_per_s": tokens_per_step / (median / 1000.0),
    }


GRAPH_EAGER_WARMUP = 3   # eager steps before a capture: tile tuning, compilation, optimizer state


class GraphedStep:
    """An arm's whole training step (forward, backward, optimizer) captured once in a CUDA graph.

    Calling it copies the batch into the captured input tensors and replays the graph: every
    kernel the eager step would launch, with no per-kernel host cost. The arm must have been built
    capturable and stepped eagerly (on a side stream) first, as torch's CUDA-graph docs require.
    """

    def __init__(self, arm: Arm, example: Mapping[str, torch.Tensor],
                 capture_stream: torch.cuda.Stream | None = None) -> None:
        self.inputs = {name: tensor.clone() for name, tensor in example.items()}
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=capture_stream):
                self.loss = arm.step(self.inputs)
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture of the step failed: {capture_failure(exc)}") from exc

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        for name, tensor in batch.items():
            self.inputs[name].copy_(tensor, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()


def eager_steps(arm: Arm, batches: list, count: int, side_stream: bool) -> list[torch.Tensor]:
    """``count`` eager steps over the batch pool; on a side stream when the step is captured next (a
    CUDA graph capture must follow side-stream warm-up, as torch's CUDA-graph docs require)."""
    if not side_stream:
        return [arm.step(batches[i % BATCH_POOL]) for i in range(count)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses = [arm.step(batches[i % BATCH_POOL]) for i in range(count)]
    torch.cuda.current_stream().wait_stream(side)
    return losses


def run_timing(suite: Suite, cell: Cell, method: methods_mod.Method, gate: turns.TurnGate | None = None) -> Timing:
    spec, device = suite.spec, suite.spec.device
    on_cuda = device.startswith("cuda")
    graphed = on_cuda and cell.cuda_graph
    if on_cuda:
        # The process peak counts from here: the model's build, tile tuning, warm-up, capture and the
        # timed window; the parity gate before it is not part of a training run.
        torch.cuda.reset_peak_memory_stats()
    before_window = 0     # the allocator's peak before the window's counters are reset, bytes
    build_started = time.perf_counter()
    model = models_mod.build_model(cell.model, cell.dtype, device, seed=spec.seed)
    models_mod.apply_activations(model, cell.activations)
    models_mod.apply_activation_checkpointing(model, cell.activation_checkpointing)
    n_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(spec.seed)
    arm = method.build(model, spec.train_config(cuda_graph=cell.cuda_graph))
    batches = [models_mod.make_batch(cell.model, cell.batch, cell.seq, device, seed=spec.seed + i)
               for i in range(BATCH_POOL)]

    eager_warmup = GRAPH_EAGER_WARMUP if graphed else spec.warmup_steps
    # The first step alone, synced: what a user waits for before training moves (tile tuning or the
    # tune-cache lookups, compiles, the optimizer's state allocation); then the rest, in the same order.
    first_started = time.perf_counter()
    warm = eager_steps(arm, batches, min(1, eager_warmup), side_stream=graphed)
    _sync(device)
    first_ended = time.perf_counter()
    replayed = on_cuda and method.compile_mode == "reduce-overhead"
    if replayed:
        # torch.compile's CUDA graphs are recorded in the warm-up steps after the first (which compiled) and
        # replays allocate nothing: the step's peak is the graphs' pool, counted from here.
        before_window = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    warm += eager_steps(arm, batches[1:] + batches[:1], max(0, eager_warmup - 1), side_stream=graphed)
    if warm:
        _check_finite(warm, "warm-up")
    del warm
    breakdown = {k: int(v) for k, v in arm.memory_breakdown().items()}
    _sync(device)

    step = arm.step
    if graphed:
        # Replays allocate nothing: the step's peak is the allocator's peak while the graph is
        # captured (its activations, gradients and temporaries are allocated then, in the graph's pool).
        # The eager steps left their activations' and gradients' blocks cached in the allocator's
        # general pool; the capture allocates from a pool of its own, so hand them back first (an
        # 8B model with fp32 moments does not fit twice).
        gc.collect()
        torch.cuda.empty_cache()
        before_window = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step = GraphedStep(arm, batches[0])
        warm = [step(batches[i % BATCH_POOL]) for i in range(max(0, spec.warmup_steps - eager_warmup))]
        if warm:
            _check_finite(warm, "graph warm-up")
        del warm
        _sync(device)

    nvml_before = telemetry.nvml_snapshot(torch.device(device).index or 0) if on_cuda else None
    if on_cuda and not graphed and not replayed:
        before_window = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    counted = gate is not None and on_cuda and nvml_before.get("energy_j") is not None
    counter = telemetry.EnergyCounter(torch.device(device).index or 0) if counted else None
    # The window runs on the CPUs the sweep gave this cell's lane, the same for every cell compared (D114).
    cpus = lanes.pin_threads(lanes.cpus_from_env()) if on_cuda else []
    # Python's cyclic GC pauses land inside steps at random: on the H100 they widen the IQR of a
    # Llama-8B step by ~40%. Collect once, then keep it off for the timed window only.
    gc.collect()
    gc.disable()
    kernels = sys.modules.get("forge_core.kernels")     # loaded by a FORGE arm only: no import here
    if kernels is not None:
        kernels.reset_launch_paths()
    window_start = time.perf_counter()
    try:
        window = turns.timed_repeats(step, batches, cell.timed_repeats(spec), spec.timed_steps, on_cuda, gate,
                                     counter.read_j if counter is not None else None)
    finally:
        gc.enable()
        if counter is not None:
            counter.close()
    run_ms, host_ms, losses, step_index = window.run_ms, window.host_ms, window.losses, window.steps
    if on_cuda:
        peak_alloc = torch.cuda.max_memory_allocated() / GIB
        peak_reserved = torch.cuda.max_memory_reserved() / GIB
        peak_process = max(before_window / GIB, peak_alloc)
        peak_reason = None
        nvml_after = telemetry.nvml_snapshot(torch.device(device).index or 0)
        energy = (telemetry.window_energy(nvml_before, nvml_after, time.perf_counter() - window_start, step_index)
                  if window.energy_j is None else
                  telemetry.window_energy({"energy_j": 0.0}, {"energy_j": window.energy_j}, window.seconds, step_index))
        nvml = telemetry.nvml_columns(nvml_before, nvml_after)
    else:
        energy = {}
        peak_alloc = peak_reserved = peak_process = None
        peak_reason = "CPU run: torch keeps no peak-memory counter for CPU tensors"
        nvml = telemetry.cpu_nvml_columns()
    values = _check_finite(losses, "timed")
    launches = kernels.launch_paths() if kernels is not None and not graphed else {}
    launches_per_step = ({path: count / step_index for path, count in launches.items()}
                         if step_index and any(launches.values()) else None)
    settings = {**dict(method.settings), **dict(getattr(arm, "settings", {}) or {})}
    terms = None
    if on_cuda and method.name == FLOOR_METHOD:
        # The floor of a FORGE step needs the wgrad GEMM time and the copy bandwidth measured in
        # the same run as the no_optimizer step (forge_bench/floor.py); measured after the timed window.
        # Imported here: gpu_measure loads forge_core.kernels (Triton), which no other torch-arm cell loads.
        from forge_bench import gpu_measure

        terms = gpu_measure.floor_terms(model, cell.batch * cell.seq, models_mod.torch_dtype(cell.dtype),
                                      torch.device(device))
    return Timing(run_ms, values, peak_alloc, peak_reserved, peak_reason, breakdown, n_params,
                  int(getattr(arm, "n_fused_params", 0) or 0), settings, nvml, terms, host_ms, energy,
                  peak_process_gib=peak_process,
                  first_step_s=first_ended - first_started if eager_warmup else None,
                  build_to_first_step_s=first_ended - build_started if eager_warmup else None,
                  launches_per_step=launches_per_step, turns=gate.extra() if gate is not None else None,
                  cpus=cpus)


# --- memory prediction ---------------------------------------------------------------------

def predicted_bytes(cell: Cell, method: methods_mod.Method) -> dict[str, int]:
    """A low estimate of what the cell needs: weights + states + gradients + activations
    (``memory_model.predicted_bytes`` at the cell's model, shape, dtype and activations)."""
    return memory_model.predicted_bytes(cell.model, method.bytes_per_param, cell.batch, cell.seq, cell.dtype,
                                        cell.activations, cell.activation_checkpointing)


def oom_prediction(cell: Cell, method: methods_mod.Method, device: str) -> str | None:
    """A reason when free device memory clearly cannot hold the cell, else None."""
    if not device.startswith("cuda"):
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    need = predicted_bytes(cell, method)
    if need["total"] <= free:
        return None
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in need.items() if k != "total")
    return f"needs at least {need['total'] / GIB:.1f} GiB ({parts}) but {free / GIB:.1f} GiB is free"


# --- the row -------------------------------------------------------------------------------

def base_row(suite: Suite, cell: Cell, method: methods_mod.Method | None, run_id: str, attempt: int) -> dict[str, Any]:
    spec = suite.spec
    return {
        "run_id": run_id, "suite_name": suite.name, "suite_hash": suite.sha256, "cell_id": cell.cell_id,
        "model": cell.model, "method": cell.method, "method_family": method.family if method else None,
        "method_settings": dict(method.settings) if method else None,
        "batch": cell.batch, "seq": cell.seq, "dtype": cell.dtype, "device_type": spec.device_type,
        "attempts": attempt, "warmup_steps": spec.warmup_steps, "timed_steps": spec.timed_steps,
        "repeats": cell.timed_repeats(spec),
        "parity_steps": spec.parity.steps if (spec.parity.enabled and method and method.parity_reference) else 0,
        "parity_tolerance": (method.parity_tolerance or spec.parity.tolerance) if method else None,
        "timing_method": ("cuda_graph_replay" if cell.cuda_graph else "cuda_events") if spec.device_type == "cuda"
                         else "wall_clock",
        "activations": cell.activations,
        "world_size": cell.world_size,
        "strategy": method.strategy if method else None,
        "bucket_cap_mb": ((cell.bucket_cap_mb or TrainConfig().bucket_cap_mb)
                          if (method and method.strategy == "dp") else None),
        **telemetry.environment(spec.device),
        "driver_version": telemetry.driver_version() if spec.device_type == "cuda" else None,
    }


SPAWNED_AT_ENV = "FORGE_BENCH_SPAWNED_AT"
"""The sweep's ``time.time()`` when it started the cell process (``runner.spawn_cell``): the cell's
``extra.phase_s.startup`` is the time from there to ``run_cell`` (interpreter, imports, CUDA)."""


def _spawned_at() -> float | None:
    try:
        return float(os.environ[SPAWNED_AT_ENV])
    except (KeyError, ValueError):
        return None


def _finish(row: dict[str, Any], t_start: float, extra: dict[str, Any]) -> dict[str, Any]:
    row["finished_at"] = _now()
    row["wall_s"] = time.time() - t_start
    if not extra.get("phase_s", True):
        extra.pop("phase_s")          # none measured: the row says nothing rather than {}
    row["extra"] = extra or None
    return row


def _tuned_kernel_configs() -> tuple[dict[str, str], Path | None]:
    """The fused kernel's tile per weight shape in this cell process ({} when no FORGE kernel ran),
    and the FORGE_TUNE_CACHE file its cached tiles came from (None without one)."""
    kernels = sys.modules.get("forge_core.kernels")   # only when already loaded: never import Triton for a torch arm
    if kernels is None:
        return {}, None
    from forge_core.kernels.tune_cache import ENV

    cache_file = os.environ.get(ENV, "").strip()
    return kernels.describe_tuned_configs(), Path(cache_file) if cache_file else None


def run_cell(suite: Suite, cell: Cell, out_dir: str | Path, run_id: str, attempt: int = 1) -> int:
    """Measure ``cell`` and write its row; returns the process exit code (0, or EXIT_OOM_RETRY)."""
    t_start = time.time()
    clock = time.perf_counter()
    started = _now()
    method = methods_mod.METHODS.get(cell.method)
    row = base_row(suite, cell, method, run_id, attempt)
    row["started_at"] = started
    phases: dict[str, float] = {}
    extra: dict[str, Any] = {"phase_s": phases}
    spawned = _spawned_at()
    if spawned is not None:
        phases["startup"] = max(0.0, t_start - spawned)
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        extra["cuda_alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    switches = telemetry.forge_switches()
    if switches:
        extra["forge_env"] = switches
    if cell.activation_checkpointing:
        extra["activation_checkpointing"] = True
    machine_boot = telemetry.boot_id()
    if machine_boot is not None:
        extra["boot_id"] = machine_boot   # the report's time ratios need one host (ratios.py)
    extra.update(lanes.lane_extra())      # GPUs and neighbours of a cell run beside others (--gpus)
    device = suite.spec.device

    reason = None
    if method is None:
        reason = f"method {cell.method!r} is not registered in this process"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        reason = f"suite device is {device} but no CUDA device is visible"
    else:
        reason = method.unavailable_reason(device, cell.cuda_graph, cell.world_size)
    if reason:
        row.update(status="unavailable", reason=reason)
        results.write_row(out_dir, _finish(row, t_start, extra))
        return 0

    row["torch_threads"] = torch.get_num_threads()
    gate = turns.TurnGate.from_env()     # the sweep's pipes when this cell takes turns with others (--interleave)
    try:
        predicted = oom_prediction(cell, method, device)
        if predicted and gate is not None:
            print(f"forge_bench.cell: does not fit beside the other cells of its group ({predicted}); "
                  "to be run alone", file=sys.stderr)
            return EXIT_OOM_RETRY
        if predicted:
            row.update(status="oom_predicted", reason=predicted)
            results.write_row(out_dir, _finish(row, t_start, extra))
            return 0
        phases["prepare"] = time.perf_counter() - clock      # identity columns, the device's first use, the prediction

        if row["parity_steps"]:
            parity_started = time.perf_counter()
            parity = run_parity(suite, cell, method)
            phases["parity"] = time.perf_counter() - parity_started
            row.update(parity_rms_rel=parity.rms_rel, parity_model=parity.model_label)
            extra.update(parity_rms_rel_global=parity.rms_rel_global, parity_worst_param=parity.worst_param)
            if not parity.rms_rel <= row["parity_tolerance"]:
                row.update(status="parity_fail",
                           reason=f"parity rms-rel {parity.rms_rel:.3g} > tolerance {row['parity_tolerance']:.3g} "
                                  f"after {parity.steps} steps vs fp32 {method.parity_reference} "
                                  f"(worst: {parity.worst_param})")
                results.write_row(out_dir, _finish(row, t_start, extra))
                return 0

        timing_started = time.perf_counter()
        timing = run_timing(suite, cell, method, gate)
        measured = time.perf_counter()
        phases["timing"] = measured - timing_started
    except ArmUnavailable as exc:
        # The arm cannot run on this model (a fact only its build can see): a row, not a crash.
        row.update(status="unavailable", reason=str(exc).strip().splitlines()[0][:1000])
        results.write_row(out_dir, _finish(row, t_start, extra))
        return 0
    except Diverged as exc:
        row.update(status="diverged", reason=str(exc))
        results.write_row(out_dir, _finish(row, t_start, extra))
        return 0
    except BaseException as exc:
        if not is_oom(exc):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        del exc
        _free_memory(device)
        if attempt < MAX_ATTEMPTS or gate is not None:     # taking turns: run alone next
            print(f"forge_bench.cell: out of memory on attempt {attempt}: {message}", file=sys.stderr)
            return EXIT_OOM_RETRY
        row.update(status="oom", reason=f"out of memory on attempt {attempt} of {MAX_ATTEMPTS} "
                                        f"(each in a fresh process): {message}"[:1000])
        results.write_row(out_dir, _finish(row, t_start, extra))
        return 0

    gib = {k: v / GIB for k, v in timing.memory_breakdown.items()}
    row.update(
        status="ok", n_params=timing.n_params, n_fused_params=timing.n_fused_params,
        method_settings=timing.settings,
        peak_allocated_gib=timing.peak_allocated_gib, peak_reserved_gib=timing.peak_reserved_gib,
        peak_process_gib=timing.peak_process_gib, peak_reason=timing.peak_reason,
        mem_weights_gib=gib.get("weights"), mem_optimizer_states_gib=gib.get("optimizer_states"),
        mem_gradients_gib=gib.get("gradients"),
        loss_first=timing.losses[0], loss_last=timing.losses[-1],
        **timing_columns(timing.run_ms, cell.batch * cell.seq), **timing.nvml,
    )
    extra["memory_breakdown_bytes"] = timing.memory_breakdown
    if timing.host_ms:
        # Host time for the Python call of each step to return. When it is close to the GPU step
        # time the step is launch-bound and its jitter is the host's, not the GPU's.
        extra["host_return_ms_median"] = statistics.median(timing.host_ms)
    extra.update(timing.energy)
    if timing.first_step_s is not None:
        extra["first_step_s"] = timing.first_step_s
        extra["build_to_first_step_s"] = timing.build_to_first_step_s
        if method.compile_mode is not None:
            # a compiled twin's first step traces and compiles: the time beyond one timed step is the compile
            extra["compile_s"] = max(0.0, timing.first_step_s - row["step_ms_median"] / 1000.0)
    if timing.floor_terms is not None:
        extra["floor_terms"] = timing.floor_terms
    if timing.turns is not None:
        extra["turns"] = timing.turns
    if timing.cpus:
        extra["cpus"] = timing.cpus
    if timing.launches_per_step is not None:
        extra["fused_launches_per_step"] = timing.launches_per_step
    native_status = native_hooks.status()
    if native_status is not None:
        extra["native_hooks"] = native_status
    kernel_configs, tune_cache_file = _tuned_kernel_configs()
    if kernel_configs:
        extra["kernel_configs"] = kernel_configs
        if tune_cache_file is not None:
            extra["tune_cache"] = str(tune_cache_file)     # where "(tune cache)" tiles came from
    phases["finish"] = time.perf_counter() - measured     # the model freed, the row's columns formed
    results.write_row(out_dir, _finish(row, t_start, extra))
    return 0


def pin_cpu_threads(suite: Suite, threads: int | None = None) -> None:
    """On a CPU suite, run torch on ``threads`` threads (None: the suite's ``cpu_threads``, default 1).
    Why: torch takes every core by default, and on a shared 2-core machine a tiny-Llama step took
    48 ms with 2 threads against 9.6 ms with 1 (CPU step times moved up to 36x between runs); one
    thread makes a CPU cell's time depend far less on what else the machine runs."""
    if suite.spec.device_type == "cpu":
        torch.set_num_threads(threads or suite.spec.cpu_threads)


def run_cell_process(suite: Suite, cell: Cell, out_dir: str | Path, run_id: str, attempt: int = 1,
                     threads: int | None = None) -> int:
    """``run_cell`` in a process that runs this one cell: the peer packages other arms use are hidden
    first (``peer_probes.hide_peer_packages_except``: transformers would import torchao for every
    model otherwise) and a CPU cell's torch threads pinned (``pin_cpu_threads``). Never call it in a
    process that goes on to build other arms."""
    method = methods_mod.METHODS.get(cell.method)
    hide_peer_packages_except(method.requires if method is not None else ())
    pin_cpu_threads(suite, threads)
    return run_cell(suite, cell, out_dir, run_id, attempt)


def main(
    suite: Annotated[Path, typer.Option(help="suite YAML file")],
    cell_id: Annotated[str, typer.Option(help="the cell's id")],
    out: Annotated[Path, typer.Option(help="results folder")],
    run_id: Annotated[str, typer.Option(help="run id to record")],
    attempt: Annotated[int, typer.Option(help="attempt number (OOM retry)")] = 1,
    parent_pid: Annotated[Optional[int],
                          typer.Option(help="die with this process (the sweep): set by the runner")] = None,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads on a CPU device "
                                                               "(default: the suite's cpu_threads)")] = None,
) -> None:
    """Run one cell of a suite in this process and write its row: the sweep's per-cell child."""
    if parent_pid is not None:
        lanes.die_with_parent(parent_pid)
    loaded = load_suite(suite)
    code = run_cell_process(loaded, loaded.cell(cell_id), out, run_id, attempt, threads)
    if parent_pid is not None:
        exit_now(code)
    raise typer.Exit(code)


def exit_now(code: int) -> None:
    """End the sweep's cell process once its row is written, without the interpreter's teardown.

    Why: the next cell starts only when this process has exited, and tearing down torch, transformers
    and Triton took about 1 s a cell on a CPU (D82) with nothing left to save: the row is on disk, the
    tune cache is written at each choice, the driver frees the GPU's memory at the exit either way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # plain Python tracebacks on stderr: the runner keeps their last lines in a crashed row
    child = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    child.command()(main)
    child()
