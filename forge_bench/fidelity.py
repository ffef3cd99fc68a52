"""``forge-bench fidelity``: how far each low-precision update path drifts from fp32 (paper App. E).

The problem: one linear layer ``W`` of shape ``(V, H)`` (an LM head: V classes over an H-wide
input, ``W`` drawn from N(0, 0.02^2)) trained for ``steps`` AdamW steps on a fixed sequence of
batches of ``BT`` tokens (inputs N(0, 1), uniformly random labels, softmax cross-entropy). Every
arm starts from the same ``W`` and sees the same batches; its final ``W`` is compared with the
fp32 run's (fp32 weights, inputs, gradient and moments, torch's AdamW):

* ``rms_rel`` = rms(W - W_fp32) / rms(W_fp32), ``max_abs_dw`` = max |W - W_fp32|, and
  ``rms_rel_update`` = rms(W - W_fp32) / rms(W_fp32 - W_0), the error against how far fp32 moved.

The arms:

* ``adamw_bf16``: the standard bf16 path: bf16 weights and inputs, the weight gradient
  computed and stored in bf16, torch's AdamW with its moments in the weight's dtype (bf16).
* ``forge_bf16`` / ``forge_int8`` (``forge_fp8`` where forge_core has that state dtype): bf16
  weights and inputs, the fused update with those moments (its gradient tile is fp32 and never
  rounded).
* ``forge_fp32``: bf16 weights, fp32 moments: what is left when the moments lose nothing.
* ``forge_bf16_sr``: ``forge_bf16`` with stochastic rounding of the weight store.

The last two separate the error's sources: when every bf16-weight arm sits at about the same
distance, the rounding of the weight itself to bf16 at every step dominates, and neither a
gradient nor moments kept in more precision can bring the weight closer to fp32 (a step smaller
than half a bf16 ulp of its weight is lost by either path); stochastic rounding keeps those steps in
expectation.

Rows: one per arm and shape (``SCHEMA``), ``fidelity_<V>x<H>_bt<BT>.parquet`` in ``--out``.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
from typing import Any, Callable, Iterator, Optional

import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from forge_bench import telemetry
from forge_bench.run_rows import KIND_COLUMN

PAPER_SHAPE = (1024, 4096, 2048)          # V, H, BT of App. E
INIT_STD = 0.02

_F, _I, _S = pa.float64(), pa.int64(), pa.string()
COLUMNS: list[tuple[str, pa.DataType, str]] = [
    (KIND_COLUMN, _S, "'fidelity'"),
    ("arm", _S, "adamw_bf16 | forge_fp32 | forge_bf16 | forge_bf16_sr | forge_int8 | forge_fp8"),
    ("weight_dtype", _S, "the arm's weight dtype"),
    ("state_dtype", _S, "the arm's moment storage"),
    ("gradient", _S, "how the weight gradient reaches the update: bf16 (stored) | fp32 tile (fused)"),
    ("vocab", _I, "V: rows of W"),
    ("hidden", _I, "H: columns of W"),
    ("tokens", _I, "BT: tokens per step"),
    ("steps", _I, "AdamW steps"),
    ("lr", _F, "learning rate"),
    ("beta1", _F, "AdamW beta1"),
    ("beta2", _F, "AdamW beta2"),
    ("eps", _F, "AdamW eps"),
    ("weight_decay", _F, "AdamW weight decay"),
    ("seed", _I, "seed of W_0 and the batches"),
    ("rms_rel", _F, "rms(W - W_fp32) / rms(W_fp32) after the last step"),
    ("max_abs_dw", _F, "max |W - W_fp32| after the last step"),
    ("rms_rel_update", _F, "rms(W - W_fp32) / rms(W_fp32 - W_0): the error against fp32's own movement"),
    ("fp32_update_rms", _F, "rms(W_fp32 - W_0)"),
    ("final_loss", _F, "the arm's loss at the last step"),
    ("fp32_final_loss", _F, "the fp32 run's loss at the last step"),
    ("backend", _S, "forge_core backend of a FORGE arm (triton | reference); null for torch"),
    ("device_name", _S, "torch.cuda.get_device_name or the CPU model"),
    ("device_count", _I, "visible CUDA devices"),
    ("torch_version", _S, "torch.__version__"),
    ("cuda_version", _S, "torch.version.cuda"),
    ("triton_version", _S, "triton.__version__"),
    ("transformers_version", _S, "transformers.__version__"),
    ("python_version", _S, "platform.python_version"),
    ("git_commit", _S, "HEAD of the source tree"),
    ("source_dirty", pa.bool_(), "uncommitted changes in forge_core/forge_bench"),
    ("source_hash", _S, "sha256 of the forge_core + forge_bench sources (16 hex)"),
    ("hostname", _S, "machine name"),
    ("finished_at", _S, "UTC ISO time the row was written"),
]
SCHEMA = pa.schema([pa.field(name, typ) for name, typ, _ in COLUMNS])


def arms() -> list[str]:
    """The arms this forge_core can run (``forge_fp8`` only where its state dtype exists)."""
    import forge_core

    names = ["adamw_bf16", "forge_fp32", "forge_bf16", "forge_bf16_sr", "forge_int8"]
    return names + (["forge_fp8"] if "fp8" in forge_core.STATE_DTYPES else [])


def _batches(vocab: int, hidden: int, tokens: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(tokens, hidden, generator=generator),
             torch.randint(0, vocab, (tokens,), generator=generator)) for _ in range(steps)]


def _train(head: nn.Linear, step_fn: Callable[[], None], batches, dtype: torch.dtype,
           device: torch.device) -> float:
    """Run the steps; ``step_fn`` is the arm's optimizer step. Returns the last loss."""
    loss = torch.zeros(())
    for x, labels in batches:
        x, labels = x.to(device=device, dtype=dtype), labels.to(device)
        loss = F.cross_entropy(head(x).float(), labels)
        loss.backward()
        step_fn()
    return float(loss.detach())


def run_arm(arm: str, initial: torch.Tensor, batches, hyper: dict[str, Any], device: torch.device,
            backend: str = "auto") -> tuple[torch.Tensor, float, Optional[str]]:
    """Train a copy of ``initial`` with ``arm``; return (final fp32 weight, last loss, FORGE backend)."""
    import forge_core

    vocab, hidden = initial.shape
    dtype = torch.float32 if arm == "fp32" else torch.bfloat16
    head = nn.Linear(hidden, vocab, bias=False).to(device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(initial)
    if arm in ("fp32", "adamw_bf16"):
        optimizer = torch.optim.AdamW(head.parameters(), foreach=False, **hyper)
        used_backend = None
    elif arm.startswith("forge_"):
        state = arm.split("_")[1]
        optimizer = forge_core.fuse(head, "adamw", state_dtype=state, stochastic_rounding=arm.endswith("_sr"),
                                    probe_inputs=False, backend=backend, overlap=False, **hyper)
        if not optimizer.fused_parameters():
            raise RuntimeError(f"{arm}: the head was not fused")
        used_backend = optimizer.backend
    else:
        raise ValueError(f"unknown fidelity arm {arm!r}; known: fp32, {', '.join(arms())}")

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    loss = _train(head, step, batches, dtype, device)
    return head.weight.detach().float().cpu(), loss, used_backend


AUTOTUNE_ENV = "FORGE_AUTOTUNE"


@contextlib.contextmanager
def untuned_kernel() -> Iterator[None]:
    """The fused kernel on its default tile inside the block (``FORGE_AUTOTUNE=0``), unless the caller
    set ``FORGE_AUTOTUNE`` itself. A tile changes the speed, not what fidelity measures (the tiles sum
    the same fp32 products over the tokens, in an order that moves the result by fp32 rounding), and
    tuning compiles and times each candidate: 20-30 s per arm on an H100."""
    if AUTOTUNE_ENV in os.environ:
        yield
        return
    os.environ[AUTOTUNE_ENV] = "0"
    try:
        yield
    finally:
        os.environ.pop(AUTOTUNE_ENV, None)


def measure(vocab: int, hidden: int, tokens: int, *, steps: int = 20, lr: float = 1e-3,
            betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
            seed: int = 0, device: str = "cpu", arm_names: Optional[list[str]] = None,
            backend: str = "auto", on_arm: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """One row per arm (``SCHEMA``) for a ``(vocab, hidden)`` head trained ``steps`` steps on
    ``tokens`` tokens each, against the fp32 run."""
    for value, what in ((vocab, "vocab"), (hidden, "hidden"), (tokens, "tokens"), (steps, "steps")):
        if value < 1:
            raise ValueError(f"{what} must be at least 1, got {value}")
    chosen = arm_names or arms()
    unknown = sorted(set(chosen) - set(arms()))
    if unknown:
        raise ValueError(f"unknown fidelity arm(s) {unknown}; known here: {', '.join(arms())}")
    where = torch.device(device)
    hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(vocab, hidden, generator=generator) * INIT_STD
    batches = _batches(vocab, hidden, tokens, steps, seed)
    reference, reference_loss, _ = run_arm("fp32", initial, batches, hyper, where)
    moved = reference - initial
    environment = telemetry.environment(device)
    rows = []
    for arm in chosen:
        if on_arm is not None:
            on_arm(arm)
        with untuned_kernel():
            weight, loss, used_backend = run_arm(arm, initial, batches, hyper, where, backend)
        error = (weight - reference).double()
        rows.append({
            KIND_COLUMN: "fidelity", "arm": arm, "weight_dtype": "bfloat16",
            "state_dtype": "bf16" if arm == "adamw_bf16" else arm.split("_")[1],
            "gradient": "bf16 (stored)" if arm == "adamw_bf16" else "fp32 tile (fused)",
            "vocab": vocab, "hidden": hidden, "tokens": tokens, "steps": steps, "lr": lr, "beta1": betas[0],
            "beta2": betas[1], "eps": eps, "weight_decay": weight_decay, "seed": seed,
            "rms_rel": float(error.norm() / reference.double().norm()),
            "max_abs_dw": float(error.abs().max()),
            "rms_rel_update": float(error.norm() / moved.double().norm()) if float(moved.norm()) > 0 else math.nan,
            "fp32_update_rms": float(moved.double().pow(2).mean().sqrt()),
            "final_loss": loss, "fp32_final_loss": reference_loss, "backend": used_backend,
            **{k: v for k, v in environment.items() if k in SCHEMA.names},
            "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        })
    return rows


def file_name(vocab: int, hidden: int, tokens: int, lr: float) -> str:
    return f"fidelity_{vocab}x{hidden}_bt{tokens}_lr{lr:g}.parquet"


__all__ = ["AUTOTUNE_ENV", "COLUMNS", "PAPER_SHAPE", "SCHEMA", "arms", "file_name", "measure", "run_arm",
           "untuned_kernel"]
