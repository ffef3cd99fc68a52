"""The parquet result schema and its atomic, kill-safe storage.

Layout: a results folder holds one small parquet file per finished cell
(``<cell_id>.parquet``), each written to a temporary name and then ``os.replace``d into place.
A ``kill -9`` at any moment therefore leaves every finished row readable and no partial file
under a ``*.parquet`` name; ``--resume`` skips the cell ids already present, so no row is lost
or duplicated. ``load_results`` concatenates every row under a folder (recursively), and reads a
folder whose rows ``forge-bench pack`` moved into one ``rows.parquet`` (``PACKED_ROWS``: a finished
record, which no sweep resumes) the same way.

A row file that does not read as parquet (truncated or overwritten by something else) is never
taken for a finished cell: ``scan_rows`` reports it, the sweep moves it aside to
``<cell_id>.parquet.corrupt`` (``set_aside``; nothing is deleted) and runs its cell again, and
``load_table`` names it (and skips it, for the report).

Schema history (``schema_version``):
  1: first version.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
PACKED_ROWS = "rows.parquet"
"""The one file of a packed folder's rows (``forge_bench.pack``)."""

STATUSES = (
    "ok",            # measured; timing and memory are valid
    "parity_fail",   # the fp32 parity gate failed: no timing recorded
    "oom",           # out of memory, after one retry with the cache freed
    "oom_predicted", # skipped: free memory clearly cannot hold the cell
    "timeout",       # killed at the per-cell timeout
    "crashed",       # the cell process died; ``stderr_tail`` holds why
    "diverged",      # NaN/Inf loss
    "unavailable",   # the method cannot run here (missing package, no CUDA...); ``reason`` says why
)

_F = pa.float64()
_I = pa.int64()
_S = pa.string()

# (name, type, doc). The doc is the column's meaning; docs/results_schema.md is generated from it.
COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("schema_version", _I, "version of this schema"),
    ("run_id", _S, "one id per sweep run (kept across --resume); ratios only within one run_id"),
    ("suite_name", _S, "suite file stem"),
    ("suite_hash", _S, "sha256 of the suite file's bytes (first 16 hex)"),
    ("cell_id", _S, "stable id of the cell: hash of model, batch, seq, method, dtype, suite hash"),
    ("model", _S, "model zoo key"),
    ("method", _S, "method registry key"),
    ("method_family", _S, "baseline | forge | peer"),
    ("method_settings", _S, "JSON of the arm's settings (lr, betas, state dtype, ranks ...); an optimizer-family "
                         "arm's name its `family`, whether it is `fused` and its `state_dtype` (the App. I table "
                         "pairs rows by them)"),
    ("batch", _I, "sequences per step"),
    ("seq", _I, "tokens per sequence"),
    ("dtype", _S, "model weight dtype: bfloat16 | float32 | float16"),
    ("device_type", _S, "cuda | cpu"),
    ("n_params", _I, "parameters in the model"),
    ("n_fused_params", _I, "parameters whose update FORGE fused (0 for non-FORGE arms)"),
    ("status", _S, "one of STATUSES"),
    ("reason", _S, "why the status is not ok (null when ok)"),
    ("attempts", _I, "process attempts used for this cell (OOM retry counts)"),
    ("stderr_tail", _S, "last lines of the cell process's stderr when it crashed"),
    ("timing_method", _S, "cuda_events (eager steps) | cuda_graph_replay (the step captured in one CUDA graph, "
                          "CUDA events around each replay; peak memory from the capture) | wall_clock"),
    ("activations", _S, "hf (the transformers model as it is) | lean (forge_core.lean_activations on every "
                        "arm of the grid: norms and SwiGLU keep less for backward)"),
    ("world_size", _I, "ranks of the cell (a distributed arm's torchrun process tree; 1 for one process)"),
    ("strategy", _S, "a distributed arm's layout: dp | fsdp2 | tp (null: one process)"),
    ("bucket_cap_mb", _F, "a data-parallel arm's gradient bucket, MB (null: not data parallel)"),
    ("warmup_steps", _I, "untimed steps before the timed window"),
    ("timed_steps", _I, "steps per timed run"),
    ("repeats", _I, "timed runs (the cell's grid's where it sets them, else the suite's)"),
    ("step_ms_median", _F, "median over runs of each run's median step time, ms"),
    ("step_ms_run_medians", pa.list_(_F), "each run's median step time, ms"),
    ("step_ms_run_spreads", pa.list_(_F), "each run's IQR / median (fraction)"),
    ("step_ms_spread_max", _F, "max over runs of IQR / median (fraction)"),
    ("step_ms_p10", _F, "10th percentile of all timed steps, ms"),
    ("step_ms_p90", _F, "90th percentile of all timed steps, ms"),
    ("step_ms_all", pa.list_(_F), "every timed step, ms, in order"),
    ("tokens_per_s", _F, "tokens of the global batch / median step time (batch * seq, times world_size for the "
                         "data-split strategies dp and fsdp2)"),
    ("peak_allocated_gib", _F, "torch.cuda.max_memory_allocated over the timed window, GiB (2^30); with several "
                               "ranks the largest rank's (each rank's in extra.peak_allocated_gib_per_rank)"),
    ("peak_reserved_gib", _F, "torch.cuda.max_memory_reserved over the timed window, GiB (2^30); with several ranks "
                              "the largest rank's"),
    ("peak_process_gib", _F, "torch.cuda.max_memory_allocated over the whole measurement, GiB (2^30): the larger of "
                             "the peak from the model's build to the timed window (tile tuning, warm-up, a CUDA "
                             "graph's capture) and the window's own; the parity gate before it is left out; a distributed "
                             "cell's is the largest rank's, from the rank's start. Null on a CPU and in rows written "
                             "before the column existed"),
    ("peak_reason", _S, "why the peak is null (CPU run, ...)"),
    ("mem_weights_gib", _F, "analytic: parameter bytes, GiB"),
    ("mem_optimizer_states_gib", _F, "analytic: optimizer state bytes (moments, scales), GiB"),
    ("mem_gradients_gib", _F, "analytic: bytes of gradients alive at the optimizer boundary, GiB"),
    ("parity_rms_rel", _F, "rms(W - W_ref) / rms(W_ref) after the parity steps vs an fp32 reference"),
    ("parity_steps", _I, "steps of the parity gate (0 = gate off)"),
    ("parity_tolerance", _F, "the gate's bound on parity_rms_rel"),
    ("parity_model", _S, "what the gate ran on (the model or its reduced-depth twin)"),
    ("loss_first", _F, "loss of the first timed step"),
    ("loss_last", _F, "loss of the last timed step"),
    ("device_name", _S, "torch.cuda.get_device_name or the CPU model"),
    ("device_count", _I, "visible CUDA devices"),
    ("driver_version", _S, "NVIDIA driver (NVML)"),
    ("cuda_version", _S, "torch.version.cuda"),
    ("torch_version", _S, "torch.__version__"),
    ("triton_version", _S, "triton.__version__"),
    ("transformers_version", _S, "transformers.__version__"),
    ("python_version", _S, "platform.python_version"),
    ("git_commit", _S, "HEAD of the source tree (null outside git)"),
    ("source_dirty", pa.bool_(), "uncommitted changes in forge_core/forge_bench"),
    ("source_hash", _S, "sha256 of forge_core + forge_bench sources (first 16 hex)"),
    ("hostname", _S, "machine name"),
    ("sm_clock_mhz_before", _F, "NVML SM clock before the timed window"),
    ("sm_clock_mhz_after", _F, "NVML SM clock after the timed window"),
    ("mem_clock_mhz_before", _F, "NVML memory clock before"),
    ("mem_clock_mhz_after", _F, "NVML memory clock after"),
    ("sm_clock_max_mhz", _F, "NVML max SM clock"),
    ("temperature_c_before", _F, "GPU temperature before, C"),
    ("temperature_c_after", _F, "GPU temperature after, C"),
    ("power_w_before", _F, "GPU power draw before, W"),
    ("power_w_after", _F, "GPU power draw after, W"),
    ("throttle_reasons_before", _S, "NVML clock-event reasons before (names, comma-separated)"),
    ("throttle_reasons_after", _S, "NVML clock-event reasons after"),
    ("nvml_reason", _S, "why NVML fields are null"),
    ("started_at", _S, "UTC ISO time the cell started"),
    ("finished_at", _S, "UTC ISO time the row was written"),
    ("wall_s", _F, "seconds the cell took, process start to row"),
    ("torch_threads", _I, "torch.get_num_threads() in the cell process: a CPU cell pins it (the suite's "
                          "cpu_threads, default 1, or sweep --threads), since CPU step times move with it"),
    ("extra", _S, "JSON of anything else the cell measured: boot_id (the machine boot: time ratios need one), forge_env (the FORGE_* variables the cell ran with, FORGE_BENCH_* left out), native_hooks (\"loaded\", or why FORGE's C++ update hook is not in use, where a fused arm asked for it), "
                  "kernel_configs (the fused kernel's tile per weight shape; '(tune cache)' when read from a tune cache or the shipped choices), tune_cache (that file), cuda_alloc_conf, memory_breakdown_bytes, "
                  "first_step_s (the first training step's wall time, tuning and compiles included) and build_to_first_step_s (from the model's build to its end), compile_s (a compiled twin's first step beyond one timed step: Dynamo's trace and Inductor's compile; its mode and graph breaks are in method_settings: compile_mode, graph_breaks), phase_s (seconds of the cell process: startup, from the sweep's spawn to the cell's start; prepare, from there to the gate (identity columns, the device's first use, the memory prediction); parity, the gate; timing, the measurement with its build and warm-up; finish, from the measurement to the row's write), "
                  "host_return_ms_median, fused_launches_per_step (an eager FORGE step's fused-kernel launches by path: direct, or through Triton's JIT, which costs ~0.2 ms of host time each, or graph: replays of recorded updates, of which recorded were recorded at that step and native replayed by the C++ hook), energy_j_per_step and power_w_mean (NVML energy counter over the timed window, or over the cell's own turns), floor_terms, parity_rms_rel_global / parity_worst_param, "
                  "turns (sweep --interleave: peers, the other cells of its group, and windows, each turn's [start, end] in epoch seconds), "
                  "activation_checkpointing (true when the grid checkpoints every decoder layer), a distributed cell's peak_allocated_gib_per_rank, peak_reserved_gib_per_rank, step_ms_median_per_rank, "
                  "memory_breakdown_bytes_per_rank and tokens_per_step, "
                  "or a kernel benchmark's fields"),
]

SCHEMA = pa.schema([pa.field(name, typ) for name, typ, _ in COLUMNS])
COLUMN_NAMES = [name for name, _, _ in COLUMNS]


class ResultsError(RuntimeError):
    """A results folder or row is not what the schema says."""


def normalize_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Fill missing columns with None, reject unknown ones, JSON-encode dict settings."""
    unknown = set(row) - set(COLUMN_NAMES)
    if unknown:
        raise ResultsError(f"row has columns not in schema v{SCHEMA_VERSION}: {sorted(unknown)}")
    out = {name: row.get(name) for name in COLUMN_NAMES}
    out["schema_version"] = SCHEMA_VERSION
    for key in ("method_settings", "extra"):
        if out[key] is not None and not isinstance(out[key], str):
            out[key] = json.dumps(out[key], sort_keys=True, default=str)
    if out["status"] not in STATUSES:
        raise ResultsError(f"status {out['status']!r} is not one of {STATUSES}")
    return out


def row_path(results_dir: Path, cell_id: str) -> Path:
    return Path(results_dir) / f"{cell_id}.parquet"


def write_row(results_dir: str | os.PathLike, row: Mapping[str, Any]) -> Path:
    """Atomically write one cell's row: temp file in the same folder, fsync, os.replace."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    norm = normalize_row(row)
    if not norm["cell_id"]:
        raise ResultsError("row has no cell_id")
    return write_table_atomically(pa.Table.from_pylist([norm], schema=SCHEMA), row_path(results_dir, norm["cell_id"]))


def write_table_atomically(table: pa.Table, path: Path, compression: str = "snappy") -> Path:
    """Write ``table`` to ``path`` as parquet through a temp file in the same folder, fsync and
    ``os.replace``: a reader (or a killed writer) never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".parquet.part")
    try:
        with os.fdopen(fd, "wb") as fh:
            pq.write_table(table, fh, compression=compression)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# columns of schema v1 that some stored rows lack: they read as null there
LATER_COLUMNS = ("activations", "torch_threads", "world_size", "strategy", "bucket_cap_mb", "peak_process_gib")


def iter_result_files(path: str | os.PathLike) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*.parquet") if not p.name.startswith(".tmp-"))


def read_parquet(path: Path) -> pa.Table:
    """The table in ``path``; ResultsError (one line naming the file) when it is not readable
    parquet: truncated by a full disk or a copy cut short, or not parquet at all."""
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ResultsError(f"{path}: not a readable parquet file ({first[:200]})") from None


def load_table(path: str | os.PathLike, on_foreign: Callable[[Path, str], None] | None = None) -> pa.Table:
    """Every row under ``path`` (a folder, searched recursively, or one parquet file).

    A parquet file of another kind (e.g. the kernel benchmark's) or one that does not read as
    parquet at all is a ResultsError, unless ``on_foreign`` is given: then it is called with the
    file and why, and the file is skipped (a results folder may hold both kinds; ``forge-bench
    report`` names and skips the others)."""
    path = Path(path)
    if not path.exists():
        raise ResultsError(f"{path}: no such file or folder")
    files = iter_result_files(path)
    if not files:
        raise ResultsError(f"{path}: no parquet result files found")
    tables = []
    for f in files:
        try:
            t = read_parquet(f)
        except ResultsError as exc:
            if on_foreign is None:
                raise
            on_foreign(f, str(exc).removeprefix(f"{f}: "))
            continue
        for name in LATER_COLUMNS:
            if name not in t.column_names:   # a row without the column: null there
                t = t.append_column(name, pa.nulls(t.num_rows, SCHEMA.field(name).type))
        missing = [c for c in COLUMN_NAMES if c not in t.column_names]
        if missing:
            reason = f"not a forge-bench v{SCHEMA_VERSION} result file (missing {missing[:5]})"
            if on_foreign is None:
                raise ResultsError(f"{f}: {reason}")
            on_foreign(f, reason)
            continue
        tables.append(t.select(COLUMN_NAMES).cast(SCHEMA))
    if not tables:
        raise ResultsError(f"{path}: no forge-bench v{SCHEMA_VERSION} result files among its {len(files)} parquet files")
    return pa.concat_tables(tables)


CHECKPOINTED = "checkpointed"
"""The ``activations`` a report gives a row whose grid ran activation checkpointing (``extra``'s
``activation_checkpointing``): its memory and time compare only with rows checkpointed too."""


def _checkpointed(extra: object) -> bool:
    if not isinstance(extra, str) or "activation_checkpointing" not in extra:
        return False
    try:
        return bool(json.loads(extra).get("activation_checkpointing"))
    except (ValueError, AttributeError):
        return False


def with_activations(frame):
    """``frame`` with its ``activations`` filled: rows from before the column existed are hf, and a
    checkpointed grid's rows are ``CHECKPOINTED``."""
    framed = frame.assign(activations=frame["activations"].fillna("hf") if "activations" in frame else "hf")
    if "extra" in framed:
        framed["activations"] = framed["activations"].where(~framed["extra"].map(_checkpointed), CHECKPOINTED)
    return framed


def load_results(path: str | os.PathLike, on_foreign: Callable[[Path, str], None] | None = None):
    """The rows under ``path`` as a pandas DataFrame (``on_foreign``: as in ``load_table``)."""
    return load_table(path, on_foreign).to_pandas()


CORRUPT_SUFFIX = ".corrupt"


@dataclass
class RowScan:
    """What a results folder's row files say: each readable file's cell id and status (None for a
    parquet file without one), and each unreadable file with why."""
    statuses: dict[str, str | None] = field(default_factory=dict)
    unreadable: dict[Path, str] = field(default_factory=dict)


def scan_rows(results_dir: str | os.PathLike) -> RowScan:
    """Read every ``<cell_id>.parquet`` directly in ``results_dir`` (each is one small row)."""
    scan = RowScan()
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        return scan
    for path in sorted(results_dir.glob("*.parquet")):
        if path.name.startswith(".tmp-"):
            continue
        try:
            table = read_parquet(path)
        except ResultsError as exc:
            scan.unreadable[path] = str(exc).removeprefix(f"{path}: ")
            continue
        status = table.column("status")[0].as_py() if "status" in table.column_names and table.num_rows else None
        scan.statuses[path.stem] = status
    return scan


def completed_cell_ids(results_dir: str | os.PathLike) -> set[str]:
    """Cell ids that already have a readable row (what ``--resume`` skips)."""
    return set(scan_rows(results_dir).statuses)


def set_aside(path: Path) -> Path:
    """Rename an unreadable row file to ``<name>.corrupt`` (``.corrupt.1``, ... when taken), out of
    every reader's way, and return the new path: the user's bytes are kept, never deleted."""
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}.{n}")
    os.replace(path, target)
    return target


def schema_markdown() -> str:
    lines = [f"# forge-bench result schema, version {SCHEMA_VERSION}", "",
             "| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {t} | {d} |" for n, t, d in COLUMNS]
    return "\n".join(lines) + "\n"


def rows_as_dicts(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [normalize_row(r) for r in rows]
