"""``forge-bench convergence``: does FORGE train as well as AdamW on real text?

GPT-2 (the 124M config, ``forge_bench/configs/gpt2.json``, with the byte vocabulary of
``forge_bench.corpus``) is trained from scratch on the Python standard library's sources by each
arm and seed, every arm of a seed from the same initial weights and on the same batches: the
paired runs differ only in the optimizer. The arms are registry entries (``forge_bench.methods``):
by default fused AdamW with bf16 moments (``adamw_fused``) and with fp32 moments
(``adamw_fused_fp32_states``), FORGE with bf16, int8 and fp8 moments, and bitsandbytes' AdamW8bit:
one arm per moment format. Weights are bf16 in every arm.

Schedule: linear warm-up over ``warmup`` steps to ``lr``, then a cosine decay to ``min_lr_ratio *
lr`` at the last step. The decay is what makes the loss flatten at the end of a short run, so the
end-of-run values compare optimizers at rest rather than mid-descent.

Each run (arm, seed) writes ONE parquet row (``SCHEMA``: the whole curve in list columns) to
``OUT/convergence_<arm>_seed<seed>.parquet``: at every checkpoint (``completed`` false) and at the
end (``completed`` true). Checkpoints (model, optimizer, curve so far) go to
``OUT/checkpoints/<arm>_seed<seed>.pt`` every ``checkpoint_every`` steps; running the same command
again skips completed runs and continues the others from their checkpoint. A run's batches are a
function of (seed, step) alone, so a resumed run sees the batches it would have seen. The rows
record a hash of the settings: an ``OUT`` holding runs of other settings is refused.

A study may run every (arm, seed) twice, into two folders (``repeat_into``): the same settings,
initial weights and batches, so how far the two runs of one arm and seed end apart is the
run-to-run floor a delta between arms is read against (``forge_bench.report.training``). The runs
go seed by seed, each arm's run in every folder before the next arm: a study stopped early has
its first seeds of every arm, each with its repeat.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from forge_bench import lanes, models, telemetry
from forge_bench.arm import TrainConfig
from forge_bench.corpus import Corpus, build_corpus, train_batch, validation_batches
from forge_bench.methods import get_method, load_plugins
from forge_bench.results import PACKED_ROWS
from forge_bench.run_rows import KIND_COLUMN, write_rows

DEFAULT_ARMS = ("adamw_fused", "adamw_fused_fp32_states", "forge_bf16", "forge_int8", "forge_fp8", "bnb_adamw8bit",
                "forge_bf16_compile")
"""One arm per moment format, the 8-bit peer, and FORGE bf16 with the model under torch.compile."""
BASELINES = ("adamw_fused", "adamw_foreach")       # what the report's deltas are against, in order of preference
SMOOTHING_FRACTION = 0.1                           # the smoothed end-of-run train loss: mean of the last 10% of steps
WARMUP_STEPS = 40                                  # ConvergenceSpec.warmup of a run of 400 steps or more


def default_warmup(steps: int) -> int:
    """The warm-up ``forge-bench convergence`` uses unless given: ``WARMUP_STEPS``, or a tenth of a
    shorter run (a 20-step check warms up for 2 steps instead of refusing its own default)."""
    return min(WARMUP_STEPS, max(0, steps // 10))


class ConvergenceError(ValueError):
    """Settings that cannot run, or an output folder that holds runs of other settings."""


@dataclasses.dataclass(frozen=True)
class ConvergenceSpec:
    """Everything that decides a run's curve (hashed into ``spec_hash``), plus where it runs."""
    model: str = "gpt2"
    steps: int = 4000      # last-20% fall of the validation loss: 0.08 nats at 400 steps, 0.035 at 2000, 0.005-0.011 at 4000
    batch: int = 16
    seq: int = 512
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = WARMUP_STEPS   # the command's default is default_warmup(steps): a tenth of a shorter run
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 250
    corpus_max_bytes: Optional[int] = None
    dtype: str = "bfloat16"

    def check(self) -> None:
        for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConvergenceError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0 or self.warmup >= self.steps:
            raise ConvergenceError(f"warmup must be in [0, steps), got {self.warmup} for {self.steps} steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConvergenceError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.seq >= models.max_seq_len(self.model) + 1:
            raise ConvergenceError(f"seq {self.seq} too long for {self.model!r} (at most {models.max_seq_len(self.model)})")
        if models.is_image_model(self.model):
            raise ConvergenceError(f"{self.model!r} is an image model; convergence trains causal LMs")

    @property
    def spec_hash(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def lr_at(self, step: int) -> float:
        """The learning rate of (0-based) ``step``: linear warm-up, then cosine to ``min_lr_ratio * lr``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        floor = self.min_lr_ratio * self.lr
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


_F, _I, _S, _B = pa.float64(), pa.int64(), pa.string(), pa.bool_()
COLUMNS: list[tuple[str, pa.DataType, str]] = [
    (KIND_COLUMN, _S, "'convergence'"),
    ("arm", _S, "method registry key"),
    ("seed", _I, "seed of the initial weights and of the batch order (shared by every arm)"),
    ("status", _S, "ok | diverged (a non-finite loss stopped the run) | unavailable (the arm cannot run here)"),
    ("reason", _S, "why the status is not ok"),
    ("completed", _B, "the run reached its last step (false: a checkpoint's row; the run resumes from it)"),
    ("model", _S, "model zoo key (vocabulary replaced by the tokenizer's)"),
    ("n_params", _I, "parameters of the model"),
    ("n_fused_params", _I, "parameters FORGE fused (0 for other arms)"),
    ("tokenizer", _S, "bytes (256 ids)"),
    ("corpus", _S, "python-stdlib-bytes"),
    ("corpus_digest", _S, "sha256 over the corpus files' names and bytes (16 hex): compare runs on one digest"),
    ("corpus_train_tokens", _I, "tokens of the training split"),
    ("corpus_val_tokens", _I, "tokens of the validation split"),
    ("batch", _I, "sequences per step"),
    ("seq", _I, "tokens per sequence"),
    ("steps", _I, "planned steps"),
    ("steps_done", _I, "steps taken so far"),
    ("lr", _F, "peak learning rate"),
    ("min_lr_ratio", _F, "the cosine decay's end, as a fraction of lr"),
    ("warmup", _I, "linear warm-up steps"),
    ("beta1", _F, "AdamW beta1"),
    ("beta2", _F, "AdamW beta2"),
    ("eps", _F, "AdamW eps"),
    ("weight_decay", _F, "AdamW weight decay"),
    ("eval_every", _I, "steps between validation evaluations"),
    ("eval_batches", _I, "validation batches per evaluation (fixed windows, the same for every run)"),
    ("dtype", _S, "weight dtype of every arm"),
    ("spec_hash", _S, "hash of the settings that decide the curve (ConvergenceSpec)"),
    ("train_loss", pa.list_(_F), "training loss of every step, in order"),
    ("val_step", pa.list_(_I), "steps (1-based: after that many updates) of the validation evaluations"),
    ("val_loss", pa.list_(_F), "mean validation loss at each val_step, nats per byte"),
    ("final_val_loss", _F, "validation loss after the last step"),
    ("final_train_loss_smoothed", _F, "mean training loss over the last 10% of the steps"),
    ("tokens_per_s", _F, "training tokens per second of the steps of this process (evaluation and checkpoints excluded, "
                         "and the steps before its first evaluation or checkpoint: tile tuning and compiles)"),
    ("train_wall_s", _F, "seconds of training steps, summed over resumes"),
    ("gpus", _S, "the GPU a run started by `--gpus` had (its CUDA_VISIBLE_DEVICES); null for a run of a "
                 "study in one process"),
    ("runs_beside", _I, "runs of the study already running beside it when it started (`--gpus`: they share the "
                        "host's CPU, which an eager step's tokens/s depends on); null for a run of a study in one "
                        "process"),
    ("device_name", _S, "torch.cuda.get_device_name or the CPU model"),
    ("device_count", _I, "visible CUDA devices"),
    ("torch_version", _S, "torch.__version__"),
    ("cuda_version", _S, "torch.version.cuda"),
    ("triton_version", _S, "triton.__version__"),
    ("transformers_version", _S, "transformers.__version__"),
    ("python_version", _S, "platform.python_version (the corpus is this Python's standard library)"),
    ("git_commit", _S, "HEAD of the source tree"),
    ("source_dirty", _B, "uncommitted changes in forge_core/forge_bench"),
    ("source_hash", _S, "sha256 of the forge_core + forge_bench sources (16 hex)"),
    ("hostname", _S, "machine name"),
    ("finished_at", _S, "UTC ISO time the row was written"),
]
SCHEMA = pa.schema([pa.field(name, typ) for name, typ, _ in COLUMNS])


def row_path(out: Path, arm: str, seed: int) -> Path:
    return out / f"convergence_{arm}_seed{seed}.parquet"


def checkpoint_path(out: Path, arm: str, seed: int) -> Path:
    return out / "checkpoints" / f"{arm}_seed{seed}.pt"


def read_row(path: Path) -> Optional[dict[str, Any]]:
    """The row a run wrote (None when it has none)."""
    if not path.exists():
        return None
    rows = pq.read_table(path).to_pylist()
    return rows[0] if rows else None


@dataclasses.dataclass
class RunState:
    """A run's progress: what a checkpoint holds besides the model and optimizer."""
    step: int = 0
    train_loss: list[float] = dataclasses.field(default_factory=list)
    val_step: list[int] = dataclasses.field(default_factory=list)
    val_loss: list[float] = dataclasses.field(default_factory=list)
    train_wall_s: float = 0.0


def _save_checkpoint(path: Path, model: torch.nn.Module, optimizer: Any, state: RunState, spec_hash: str) -> None:
    """model + optimizer + progress, written to a temporary name then renamed (a kill leaves the last one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.part")
    torch.save({"spec_hash": spec_hash, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "progress": dataclasses.asdict(state)}, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, model: torch.nn.Module, optimizer: Any, spec_hash: str) -> RunState:
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved.get("spec_hash") != spec_hash:
        raise ConvergenceError(f"{path} was saved by a run with other settings (spec {saved.get('spec_hash')}, "
                               f"these {spec_hash}): use another --out")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return RunState(**saved["progress"])


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: str) -> float:
    """Mean loss over the validation batches (no update: a fused layer's forward is a plain one here)."""
    losses = [model(**{k: v.to(device) for k, v in batch.items()}).loss.float() for batch in batches]
    return float(torch.stack(losses).mean())


def _smoothed_tail(losses: list[float]) -> float:
    tail = max(1, int(round(len(losses) * SMOOTHING_FRACTION)))
    return float(sum(losses[-tail:]) / tail)


def _row(spec: ConvergenceSpec, arm: str, seed: int, corpus: Corpus, state: RunState, *, status: str,
         reason: Optional[str], completed: bool, n_params: int, n_fused: int, tokens_per_s: Optional[float],
         environment: Mapping[str, Any]) -> dict[str, Any]:
    lane = lanes.lane_extra()
    return {
        KIND_COLUMN: "convergence", "arm": arm, "seed": seed, "status": status, "reason": reason,
        "completed": completed, "model": spec.model, "n_params": n_params, "n_fused_params": n_fused,
        "tokenizer": "bytes", "corpus": corpus.name, "corpus_digest": corpus.digest,
        "corpus_train_tokens": int(corpus.train.numel()), "corpus_val_tokens": int(corpus.val.numel()),
        "batch": spec.batch, "seq": spec.seq, "steps": spec.steps, "steps_done": state.step, "lr": spec.lr,
        "min_lr_ratio": spec.min_lr_ratio, "warmup": spec.warmup, "beta1": spec.betas[0], "beta2": spec.betas[1],
        "eps": spec.eps, "weight_decay": spec.weight_decay, "eval_every": spec.eval_every,
        "eval_batches": spec.eval_batches, "dtype": spec.dtype, "spec_hash": spec.spec_hash,
        "train_loss": list(state.train_loss), "val_step": list(state.val_step), "val_loss": list(state.val_loss),
        "final_val_loss": state.val_loss[-1] if completed and state.val_loss else None,
        "final_train_loss_smoothed": _smoothed_tail(state.train_loss) if completed and state.train_loss else None,
        "tokens_per_s": tokens_per_s, "train_wall_s": state.train_wall_s,
        "gpus": lane.get("gpus"), "runs_beside": lane.get("cells_beside"),
        **{k: v for k, v in environment.items() if k in SCHEMA.names},
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def run_one(spec: ConvergenceSpec, arm: str, seed: int, corpus: Corpus, val: list[dict[str, torch.Tensor]],
            out: Path, device: str, environment: Mapping[str, Any],
            on_step: Callable[[int, Optional[float]], None] = lambda step, loss: None) -> dict[str, Any]:
    """Train (or continue) one run to its last step; write and return its row."""
    path = row_path(out, arm, seed)
    method = get_method(arm)
    empty = RunState()
    reason = method.unavailable_reason(device)
    if reason is not None:
        row = _row(spec, arm, seed, corpus, empty, status="unavailable", reason=reason, completed=True, n_params=0,
                   n_fused=0, tokens_per_s=None, environment=environment)
        write_rows(path, [row], SCHEMA)
        return row
    # the byte ids replace the vocabulary (and its special ids, which no byte stream uses)
    model = models.build_model(spec.model, spec.dtype, device, seed=seed,
                               overrides={"vocab_size": corpus.vocab_size, "bos_token_id": 0, "eos_token_id": 0})
    n_params = sum(p.numel() for p in model.parameters())
    built = method.build(model, TrainConfig(lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                            weight_decay=spec.weight_decay, device=device))
    optimizer = built.optimizer
    n_fused = int(getattr(built, "n_fused_params", 0) or 0)
    checkpoint = checkpoint_path(out, arm, seed)
    state = _load_checkpoint(checkpoint, model, optimizer, spec.spec_hash) if checkpoint.exists() else RunState()
    on_step(state.step, state.train_loss[-1] if state.train_loss else None)
    pending: list[torch.Tensor] = []
    status, why = "ok", None
    window_start, window_steps, rates = None, 0, []

    def flush() -> bool:
        """Move the pending losses to the host (one sync); False on a non-finite loss."""
        nonlocal pending
        if pending:
            state.train_loss.extend(float(v) for v in torch.stack(pending).float().cpu())
            pending = []
        return all(math.isfinite(v) for v in state.train_loss[-max(1, spec.eval_every):])

    def close_window() -> None:
        nonlocal window_start, window_steps
        if window_start is not None and window_steps:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - window_start
            state.train_wall_s += seconds
            rates.append((window_steps * spec.batch * spec.seq, seconds))
        window_start, window_steps = None, 0

    while state.step < spec.steps:
        for group in optimizer.param_groups:
            group["lr"] = spec.lr_at(state.step)
        batch = {k: v.to(device, non_blocking=True) for k, v in
                 train_batch(corpus, spec.batch, spec.seq, seed, state.step).items()}
        if window_start is None:
            window_start = time.perf_counter()
        pending.append(built.step(batch))
        window_steps += 1
        state.step += 1
        at_eval = state.step % spec.eval_every == 0 or state.step == spec.steps
        at_checkpoint = state.step % spec.checkpoint_every == 0 and state.step < spec.steps
        if at_eval or at_checkpoint:
            close_window()
            if not flush():
                status, why = "diverged", f"non-finite training loss by step {state.step}"
                break
            if at_eval:
                state.val_step.append(state.step)
                state.val_loss.append(evaluate(model, val, device))
            on_step(state.step, state.train_loss[-1])
            if at_checkpoint:
                _save_checkpoint(checkpoint, model, optimizer, state, spec.spec_hash)
                write_rows(path, [_row(spec, arm, seed, corpus, state, status="ok", reason=None, completed=False,
                                       n_params=n_params, n_fused=n_fused, tokens_per_s=None,
                                       environment=environment)], SCHEMA)
        else:
            on_step(state.step, None)
    close_window()
    flush()
    timed = rates[1:] if len(rates) > 1 else rates      # the process's first window holds its tuning and compiles
    tokens, seconds = sum(t for t, _ in timed), sum(s for _, s in timed)
    row = _row(spec, arm, seed, corpus, state, status=status, reason=why, completed=True, n_params=n_params,
               n_fused=n_fused, tokens_per_s=tokens / seconds if seconds > 0 else None, environment=environment)
    write_rows(path, [row], SCHEMA)
    if checkpoint.exists():
        checkpoint.unlink()       # the row holds the whole curve; a finished run needs no checkpoint
    return row


def check_folder(out: Path, spec: ConvergenceSpec) -> None:
    """Refuse an output folder that holds rows of other settings (a re-run must continue, not mix),
    or whose runs ``forge-bench pack`` packed into one file (a finished study, which nothing resumes)."""
    if (out / PACKED_ROWS).exists():
        raise ConvergenceError(f"{out}: its runs are packed into {PACKED_ROWS} (a finished study); use another --out")
    for path in sorted(out.glob("convergence_*.parquet")):
        row = read_row(path)
        if row is not None and row.get("spec_hash") != spec.spec_hash:
            raise ConvergenceError(f"{out} holds runs of other settings ({path.name}: spec {row.get('spec_hash')}, "
                                   f"these {spec.spec_hash}); use another --out")


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One unfinished run of a study: its folder, arm, seed, and the steps its checkpoint holds."""
    folder: Path
    arm: str
    seed: int
    done: int


def plan_study(folders: list[Path], spec: ConvergenceSpec, arms: list[str], seeds: list[int]) -> list[PlannedRun]:
    """Every run of ``arms`` x ``seeds`` in each of ``folders`` (the study and its repeats) still to
    finish: seed by seed, each arm in every folder before the next arm."""
    load_plugins()
    for arm in arms:
        get_method(arm)            # an unknown arm is a one-line error before anything runs
    spec.check()
    if len({folder.resolve() for folder in folders}) < len(folders):
        raise ConvergenceError(f"a repeat needs a folder of its own: {', '.join(map(str, folders))} name one "
                               "folder twice")
    for folder in folders:
        check_folder(folder, spec)
    todo = []
    for seed in seeds:
        for arm in arms:
            for folder in folders:
                row = read_row(row_path(folder, arm, seed))
                if row is not None and row.get("completed"):
                    continue
                todo.append(PlannedRun(folder, arm, seed, int(row["steps_done"]) if row else 0))
    return todo


def plan(out: Path, spec: ConvergenceSpec, arms: list[str], seeds: list[int]) -> list[tuple[str, int, int]]:
    """(arm, seed, steps already done) of every run in ``out`` still to finish, in order."""
    return [(run.arm, run.seed, run.done) for run in plan_study([out], spec, arms, seeds)]


def run_all(out: Path, spec: ConvergenceSpec, arms: list[str], seeds: list[int], device: str,
            on_run: Callable[[Path, str, int, int], Callable[[int, Optional[float]], None]] = (
                lambda folder, arm, seed, done: (lambda step, loss: None)),
            repeat_into: Optional[Path] = None) -> list[dict[str, Any]]:
    """Every unfinished run of ``arms`` x ``seeds`` (``plan_study``) in ``out`` and, with
    ``repeat_into``, again in that folder, one after the other in this process (tile tuning and
    compilation are paid once). ``on_run(folder, arm, seed, steps done)`` returns the run's step
    callback (the CLI's progress bar)."""
    todo = plan_study([out] + ([repeat_into] if repeat_into is not None else []), spec, arms, seeds)
    if any(run.arm.startswith("forge_") for run in todo) and not os.environ.get("FORGE_TUNE_CACHE"):
        os.environ["FORGE_TUNE_CACHE"] = str(out / "tune_cache.json")     # a resumed run tunes nothing again
    corpus = build_corpus(max_bytes=spec.corpus_max_bytes)
    val = validation_batches(corpus, spec.batch, spec.seq, spec.eval_batches)
    environment = telemetry.environment(device)
    rows = []
    for run in todo:
        rows.append(run_one(spec, run.arm, run.seed, corpus, val, run.folder, device, environment,
                            on_run(run.folder, run.arm, run.seed, run.done)))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


__all__ = ["BASELINES", "COLUMNS", "ConvergenceError", "ConvergenceSpec", "DEFAULT_ARMS", "PlannedRun", "SCHEMA",
           "WARMUP_STEPS", "checkpoint_path", "default_warmup", "evaluate", "plan", "plan_study", "read_row", "row_path",
           "run_all", "run_one"]
