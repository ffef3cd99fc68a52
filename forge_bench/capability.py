"""The capability arithmetic (paper App. O): the largest model of a family each arm can train on
a GPU of a given memory, from the harness's analytic memory model (``memory_model.py``).

For every GPU of ``GPUS``, arm of ``CAPABILITY_ARMS`` and model family (its zoo models whose names
give their size, ``qwen3-0.6b`` ... ``qwen3-32b``), the largest model whose predicted step
(weights + optimizer states + gradients + activations at one batch x seq) fits the GPU's usable
memory, and the smallest one that does not. The memory model is a low estimate, so a predicted
boundary is an upper bound on what fits: the report's "Capability (App. O)" section sets it beside
the boundary measured in a sweep's rows (``report/capability.py``).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from forge_bench import memory_model, zoo
from forge_bench.methods import METHODS
from forge_bench.models import ModelError, param_count
from forge_bench.torch_arms import FORGE_STATE_BYTES, forge_bytes_per_param
from forge_bench.units import GIB


GPUS: dict[str, float] = {"A100-40": 40.0, "A100-80": 80.0, "H100": 80.0, "H200": 141.0, "B200": 192.0,
                          "B300": 288.0}
"""Each GPU's nominal HBM, in the vendor's GB, taken as GiB (2^30 bytes): the stacks are binary-sized
and a card reports about its nominal figure in GiB (the H100 80GB HBM3: 79.2 GiB to torch)."""

USABLE_FRACTION = 0.95
"""The share of the nominal HBM a training step's tensors may take. The rest: the share the driver
keeps (the H100 80GB reports 79.2 of 80 GiB), the CUDA context and library handles outside torch's
allocator (about 0.5 GiB), and the allocator's fragmentation: peak reserved minus peak allocated
is 0.3-1.4 GiB in the CUDA-graph rows of tests/fixtures/h100 and up to 3.7 GiB in its eager rows.
Together about 4 GiB of an 80 GiB card."""

CAPABILITY_ARMS = ("adamw_foreach", "adamw_fused", "forge_bf16", "forge_int8", "forge_fp8", "no_optimizer")
"""vanilla AdamW (foreach), fused AdamW, FORGE with bf16 / int8 / fp8 moments, and the no-optimizer floor."""

SIZED_NAME = re.compile(r"^(?P<family>.+)-(?P<size>\d+(?:\.\d+)?)b$")
DEFAULT_FAMILIES = ("qwen3", "llama")


class CapabilityError(ValueError):
    """An unknown GPU, arm or model family, or a bad option: the message is one line."""


def gpu_capacity_gib(gpu: str) -> float:
    """The nominal HBM of ``gpu`` (a key of ``GPUS``), GiB."""
    try:
        return GPUS[gpu]
    except KeyError:
        raise CapabilityError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}") from None


def arm_bytes_per_param(arm: str) -> memory_model.BytesPerParam | None:
    """The arm's ``Method.bytes_per_param``; a ``forge_<state>`` arm with no registry entry from its
    state bytes (``torch_arms.FORGE_STATE_BYTES``), so every state format has a prediction."""
    method = METHODS.get(arm)
    if method is not None:
        return method.bytes_per_param
    state = arm.removeprefix("forge_")
    if arm.startswith("forge_") and state in FORGE_STATE_BYTES:
        return forge_bytes_per_param(state)
    known = sorted(set(METHODS) | {f"forge_{s}" for s in FORGE_STATE_BYTES})
    raise CapabilityError(f"unknown arm {arm!r}; known: {', '.join(known)}")


def family_models(family: str) -> list[str]:
    """The zoo's models of ``family`` whose names give their size, smallest first."""
    sized = [(float(m["size"]), name) for name, spec in zoo.MODEL_ZOO.items()
             if spec.family == family and (m := SIZED_NAME.match(name))]
    if not sized:
        families = sorted({spec.family for name, spec in zoo.MODEL_ZOO.items() if SIZED_NAME.match(name)})
        raise CapabilityError(f"no sized models of family {family!r}; families: {', '.join(families)}")
    return [name for _, name in sorted(sized)]


@dataclass(frozen=True)
class Boundary:
    """One GPU x arm x family: the largest model predicted to fit, and the smallest predicted not to."""
    gpu: str
    hbm_gib: float
    usable_gib: float
    family: str
    method: str
    largest_fit: str | None
    largest_fit_params: int | None
    largest_fit_gib: float | None
    first_miss: str | None
    first_miss_gib: float | None
    params_bound_b: float        # billions of parameters whose weights, states and gradients fill the usable memory
    batch: int
    seq: int
    dtype: str
    activations: str
    checkpointed: bool

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def params_bound(usable_bytes: float, bytes_per_param: memory_model.BytesPerParam | None, dtype: str) -> float:
    """Billions of parameters whose weights, optimizer states and gradients alone fill ``usable_bytes``:
    the paper's per-parameter arithmetic, activations left out."""
    weight = memory_model.dtype_bytes(dtype)
    states, grads = bytes_per_param(weight) if bytes_per_param else (0.0, 0.0)
    return usable_bytes / (weight + states + grads) / 1e9


def boundaries(gpus: Sequence[str] = tuple(GPUS), arms: Sequence[str] = CAPABILITY_ARMS,
               families: Sequence[str] = DEFAULT_FAMILIES, models: Sequence[str] | None = None,
               batch: int = 1, seq: int = 512, dtype: str = "bfloat16", activations: str = "hf",
               checkpointed: bool = False, usable_fraction: float = USABLE_FRACTION) -> list[Boundary]:
    """One ``Boundary`` per GPU x arm x family. ``models`` (one list, taken as one family named by
    the first model's zoo family) replaces the families' sized models."""
    if batch < 1 or seq < 1:
        raise CapabilityError(f"batch and seq must be at least 1, got batch={batch} seq={seq}")
    if not 0.0 < usable_fraction <= 1.0:
        raise CapabilityError(f"usable fraction must be in (0, 1], got {usable_fraction}")
    capacities = {gpu: gpu_capacity_gib(gpu) for gpu in gpus}
    per_arm = {arm: arm_bytes_per_param(arm) for arm in arms}
    if models:
        for name in models:
            if name not in zoo.MODEL_ZOO:
                raise CapabilityError(f"unknown model {name!r}; known: {', '.join(sorted(zoo.MODEL_ZOO))}")
        groups = {zoo.model_family(models[0]): sorted(models, key=param_count)}
    else:
        groups = {family: family_models(family) for family in families}
    out = []
    for family, members in groups.items():
        for arm, per_param in per_arm.items():
            try:
                need = {m: memory_model.predicted_bytes(m, per_param, batch, seq, dtype, activations,
                                                         checkpointed)["total"] for m in members}
            except ModelError as exc:
                raise CapabilityError(str(exc)) from None
            for gpu, capacity in capacities.items():
                usable = capacity * GIB * usable_fraction
                fits = [m for m in members if need[m] <= usable]
                largest = fits[-1] if fits else None
                miss = next((m for m in members if need[m] > usable
                             and (largest is None or param_count(m) > param_count(largest))), None)
                out.append(Boundary(gpu, capacity, usable / GIB, family, arm, largest,
                                    None if largest is None else param_count(largest),
                                    None if largest is None else need[largest] / GIB,
                                    miss, None if miss is None else need[miss] / GIB,
                                    params_bound(usable, per_param, dtype), batch, seq, dtype, activations,
                                    checkpointed))
    return out


def gpu_of_device(device_name: str) -> str | None:
    """The ``GPUS`` key of a row's ``device_name`` ("NVIDIA H100 80GB HBM3" -> "H100"), None for
    another device. A100s by their memory (40 or 80 GB in the name)."""
    name = str(device_name).upper()
    for gpu in ("B300", "B200", "H200", "H100"):
        if gpu in name:
            return gpu
    if "A100" in name:
        return "A100-80" if "80GB" in name.replace(" ", "") else "A100-40"
    return None


def fmt_gib(value: float | None) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


__all__ = ["Boundary", "CAPABILITY_ARMS", "CapabilityError", "DEFAULT_FAMILIES", "GPUS", "USABLE_FRACTION",
           "arm_bytes_per_param", "boundaries", "family_models", "fmt_gib", "gpu_capacity_gib", "gpu_of_device",
           "params_bound"]
