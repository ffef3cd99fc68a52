"""The arms a sweep compares: one keyword ``Method(...)`` registry entry per arm.

Every entry says what it is, which packages it needs, and has an availability check that
returns ``None`` when the arm can run here or a one-line reason when it cannot (that reason
becomes an ``unavailable`` row, never a crash). ``build`` turns a model into an ``Arm``
(``arm.py``): an object that runs one full training step (forward, backward, optimizer) on a batch.

The builders live apart so this file stays a readable table: the torch baselines and the FORGE
arms in ``torch_arms.py``, the peers (bitsandbytes, torchao, optimi, GaLore, APOLLO, LOMO,
FlashOptim) in ``peers.py`` with their availability probes in ``peer_probes.py``. Importing this
module imports no peer package: a builder or a probe does, when it runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from forge_bench import families, peers
from forge_bench.arm import Arm, ArmUnavailable, TrainConfig
from forge_bench.compiled_arms import compiled_twins
from forge_bench.dist_arms import (STRATEGIES, build_ddp_adamw_fused, build_fsdp2_adamw, build_tp_adamw,
                                   forge_dp_builder, forge_fsdp2_builder, forge_tp_builder)
from forge_bench.peer_probes import availability_check
from forge_bench.torch_arms import (GALORE_SETTINGS, adamw_builder, build_adamw_fp32_states, build_adamw_fused_cce,
                                    build_no_optimizer, build_sgd, forge_builder, forge_bytes_per_param,
                                    forge_cce_builder, forge_galore_builder, forge_problem)

__all__ = ["METHODS", "Arm", "ArmUnavailable", "Method", "PluginError", "TrainConfig", "get_method",
           "load_plugins", "register"]


@dataclass(frozen=True, kw_only=True)
class Method:
    """One arm: how to build it, what it needs to run, and what the harness may assume about it."""
    name: str
    family: str                                   # "baseline" | "forge" | "peer"
    description: str
    build: Callable[[nn.Module, TrainConfig], Arm]
    requires: tuple[str, ...] = ()                # importable module names
    needs_cuda: bool = False
    extra_check: Callable[[], str | None] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    # The parity gate (forge_bench/cell.py). ``parity_reference`` names the optimizer the arm
    # claims to reproduce, run in fp32 with the same hyper-parameters: "adamw" or "sgd" (torch's),
    # or an optimizer family of ``forge_bench.families`` (its unfused optimizer); None means the
    # arm claims no reference algorithm and the gate does not apply to it.
    parity_reference: str | None = None
    # Bound on parity_rms_rel for this arm when it must differ from the suite's (lossy states);
    # None: the suite's ``parity.tolerance``.
    parity_tolerance: float | None = None
    # For ``oom_predicted``: (optimizer-state bytes, gradient bytes alive at the optimizer
    # boundary) per parameter, given the weight dtype's bytes. None: unknown, counted as 0.
    bytes_per_param: Callable[[int], tuple[float, float]] | None = None
    # Whether a whole training step of this arm can be captured in one CUDA graph (built with
    # ``TrainConfig.capturable``): no host sync and no host-side state that changes per step.
    graphable: bool = False
    # A distributed arm's strategy ("dp", "fsdp2", "tp": forge_bench/dist_arms.py): its cell is one
    # torchrun process tree of ``world_size`` ranks (forge_bench/dist_cell.py). None: one process.
    strategy: str | None = None
    # The torch.compile mode of a compiled twin ("default", "reduce-overhead": forge_bench/compiled_arms.py),
    # None for an eager arm; the cell then reports the compile time (compile_s) apart from the step time.
    compile_mode: str | None = None

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"method {self.name!r}: strategy must be one of {STRATEGIES} or None, got {self.strategy!r}")

    def unavailable_reason(self, device: str, cuda_graph: bool = False, world_size: int = 1) -> str | None:
        """None when this arm can run on ``device`` (timed as a CUDA graph replay when ``cuda_graph``) with
        ``world_size`` ranks; otherwise why not, in one line."""
        if cuda_graph and not self.graphable:
            return (f"{self.name}: its step cannot be captured in a CUDA graph (host-side state or syncs per "
                    "step); run it in an eager grid")
        if self.strategy is None and world_size != 1:
            return f"{self.name}: runs in one process; world_size must be 1, got {world_size}"
        if self.strategy is not None:
            problem = distributed_problem(device, world_size)
            if problem is not None:
                return f"{self.name}: {problem}"
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{self.name}: Python package '{module}' is not installed"
        if self.needs_cuda and (not device.startswith("cuda") or not torch.cuda.is_available()):
            return f"{self.name}: needs a CUDA device (device={device}, cuda available={torch.cuda.is_available()})"
        if self.extra_check is not None:
            return self.extra_check()
        return None


def distributed_problem(device: str, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run on ``device`` here (one line), or None: torch.distributed
    with NCCL and one visible GPU per rank, or gloo on the CPU."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if device.startswith("cuda"):
        if not dist.is_nccl_available():
            return "NCCL is not available in this torch build"
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < world_size:
            return f"needs {world_size} CUDA devices, {visible} visible"
    elif not dist.is_gloo_available():
        return "gloo (torch.distributed on the CPU) is not available in this torch build"
    return None


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to ``METHODS`` (a plugin module calls this at import time); a name twice is an error."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered arm ``name``; KeyError (one line, listing the known names) otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(sorted(METHODS))}") from None


PLUGINS_ENV = "FORGE_BENCH_PLUGINS"


class PluginError(ImportError):
    """A module named in FORGE_BENCH_PLUGINS could not be imported."""


def load_plugins() -> list[str]:
    """Import the comma-separated modules named in ``$FORGE_BENCH_PLUGINS``.

    A plugin module registers extra arms with ``register(Method(...))`` at import time. The
    runner, every cell process and the CLI call this, so an arm a plugin adds is known
    everywhere a cell can be planned or run (tests use it for arms that crash, hang or OOM).
    """
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for module_name in names:
        try:
            importlib.import_module(module_name)
        except Exception as exc:  # any import failure is the same user error
            raise PluginError(f"{PLUGINS_ENV}: cannot import plugin module {module_name!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
    return names


# --- the registry ---------------------------------------------------------------------------------

FORGE_NEEDS = ("forge_core", "triton")


def _bytes_torch_adamw(weight_bytes: int) -> tuple[float, float]:
    """Two moments and one gradient per parameter, all in the weight dtype."""
    return 2.0 * weight_bytes, float(weight_bytes)


ARMS: tuple[Method, ...] = (
    # the torch baselines
    Method(name="no_optimizer", family="baseline",
           description="forward + backward only, no optimizer step: the floor",
           build=build_no_optimizer, bytes_per_param=lambda b: (0.0, float(b)), graphable=True),
    Method(name="adamw_foreach", family="baseline",
           description="torch.optim.AdamW(foreach=True), states in the weight dtype",
           build=adamw_builder("foreach"), parity_reference="adamw", bytes_per_param=_bytes_torch_adamw,
           graphable=True),
    Method(name="adamw_fused", family="baseline",
           description="torch.optim.AdamW(fused=True), states in the weight dtype",
           build=adamw_builder("fused"), needs_cuda=True, parity_reference="adamw",
           bytes_per_param=_bytes_torch_adamw, graphable=True),
    Method(name="adamw_fused_fp32_states", family="baseline",
           description="torch.optim.AdamW (fused on CUDA) with fp32 moments for bf16 weights, on fp32 copies",
           build=build_adamw_fp32_states, parity_reference="adamw",
           bytes_per_param=lambda b: (8.0, float(b) + 8.0)),
    Method(name="sgd", family="baseline", description="torch.optim.SGD with momentum (foreach)",
           build=build_sgd, parity_reference="sgd", bytes_per_param=lambda b: (float(b), float(b)), graphable=True),
    # FORGE: the fused wgrad + AdamW update, one arm per state dtype
    Method(name="forge_fp32", family="forge",
           description="FORGE fused wgrad + AdamW update, fp32 moments (forge_core.fuse)",
           build=forge_builder("fp32"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "fp32"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("fp32"), graphable=True),
    Method(name="forge_bf16", family="forge",
           description="FORGE fused wgrad + AdamW update, bf16 moments (forge_core.fuse)",
           build=forge_builder("bf16"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "bf16"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("bf16"), graphable=True),
    Method(name="forge_int8", family="forge",
           description="FORGE fused wgrad + AdamW update, int8 moments (forge_core.fuse)",
           build=forge_builder("int8"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "int8"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("int8"), graphable=True),
    Method(name="forge_fp8", family="forge",
           description="FORGE fused wgrad + AdamW update, fp8 (e4m3) moments with per-64 block scales (forge_core.fuse)",
           build=forge_builder("fp8"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "fp8"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("fp8"), graphable=True),
    # per state dtype: the A/B arm of forge_core.overlap (each update on a side stream), then FORGE with
    # the vocab-chunked LM-head loss
    Method(name="forge_bf16_side_stream", family="forge",
           description="FORGE as forge_bf16, each fused update on a side CUDA stream beside the rest of the backward "
                       "(fuse(overlap=True)): measures what the overlap costs or buys",
           build=forge_builder("bf16", overlap=True), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "bf16", "overlap": True}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("bf16"), graphable=True),
    Method(name="forge_bf16_cce", family="forge",
           description="FORGE fused wgrad + AdamW update, bf16 moments, with the vocab-chunked LM-head "
                       "cross-entropy: no logits tensor, an untied LM head updated chunk by chunk (no weight gradient)",
           build=forge_cce_builder("bf16"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "bf16", "loss": "chunked_ce", "chunk_size": "auto"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("bf16"), graphable=True),
    Method(name="forge_int8_side_stream", family="forge",
           description="FORGE as forge_int8, each fused update on a side CUDA stream beside the rest of the backward "
                       "(fuse(overlap=True)): measures what the overlap costs or buys",
           build=forge_builder("int8", overlap=True), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "int8", "overlap": True}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("int8"), graphable=True),
    Method(name="forge_int8_cce", family="forge",
           description="FORGE fused wgrad + AdamW update, int8 moments, with the vocab-chunked LM-head "
                       "cross-entropy: no logits tensor, an untied LM head updated chunk by chunk (no weight gradient)",
           build=forge_cce_builder("int8"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "int8", "loss": "chunked_ce", "chunk_size": "auto"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("int8"), graphable=True),
    Method(name="forge_fp8_cce", family="forge",
           description="FORGE fused wgrad + AdamW update, fp8 (e4m3) moments, with the vocab-chunked LM-head "
                       "cross-entropy: no logits tensor, an untied LM head updated chunk by chunk (no weight gradient)",
           build=forge_cce_builder("fp8"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "fp8", "loss": "chunked_ce", "chunk_size": "auto"}, parity_reference="adamw",
           bytes_per_param=forge_bytes_per_param("fp8"), graphable=True),
    # the chunked loss on its own, without FORGE
    Method(name="adamw_fused_cce", family="baseline",
           description="torch.optim.AdamW(fused=True) with the vocab-chunked LM-head cross-entropy (no logits "
                       "tensor; every gradient still formed): what the loss alone saves",
           build=build_adamw_fused_cce, needs_cuda=True, extra_check=forge_problem,
           settings={"loss": "chunked_ce", "chunk_size": "auto"}, parity_reference="adamw",
           bytes_per_param=_bytes_torch_adamw, graphable=True),
    # across GPUs (forge_bench/dist_arms.py): torch's recipes and FORGE's on the same layouts; one
    # torchrun process tree per cell. No parity gate: tests/test_distributed.py gates the distributed
    # arithmetic against single-process FORGE. bytes_per_param is the whole model's (one rank); a
    # distributed cell predicts no memory.
    Method(name="ddp_adamw_fused", family="baseline",
           description="DistributedDataParallel (bucket_cap_mb, gradient_as_bucket_view) + torch.optim.AdamW(fused=True)",
           build=build_ddp_adamw_fused, strategy="dp", settings={"strategy": "dp"}, bytes_per_param=_bytes_torch_adamw),
    Method(name="fsdp2_adamw", family="baseline",
           description="FSDP2 (fully_shard per decoder block and the model) + torch.optim.AdamW(foreach=True)",
           build=build_fsdp2_adamw, strategy="fsdp2", settings={"strategy": "fsdp2"}, bytes_per_param=_bytes_torch_adamw),
    Method(name="tp_adamw", family="baseline",
           description="tensor parallel (Llama plan: q/k/v/gate/up colwise, o/down rowwise) + torch.optim.AdamW(foreach=True)",
           build=build_tp_adamw, strategy="tp", settings={"strategy": "tp"}, bytes_per_param=_bytes_torch_adamw),
    *(Method(name=f"forge_dp_{state}", family="forge",
             description=f"FORGE data parallel, {state} moments: each layer's gradient through a rotating "
                         "bucket, all-reduced, then the fused update (forge_core.distributed.fuse_data_parallel)",
             build=forge_dp_builder(state), requires=FORGE_NEEDS, extra_check=forge_problem, strategy="dp",
             settings={"strategy": "dp", "state_dtype": state}, bytes_per_param=forge_bytes_per_param(state))
      for state in ("bf16", "int8")),
    *(Method(name=f"forge_fsdp2_{state}", family="forge",
             description=f"FORGE on FSDP2, {state} moments: each reduce-scattered gradient shard updates its "
                         "weight shard as it arrives (forge_core.distributed.fuse_fsdp)",
             build=forge_fsdp2_builder(state), requires=FORGE_NEEDS, extra_check=forge_problem, strategy="fsdp2",
             settings={"strategy": "fsdp2", "state_dtype": state}, bytes_per_param=forge_bytes_per_param(state))
      for state in ("bf16", "int8")),
    *(Method(name=f"forge_tp_{state}", family="forge",
             description=f"FORGE tensor parallel, {state} moments: the fused kernel on each rank's weight shards "
                         "(forge_core.distributed.fuse_tensor_parallel)",
             build=forge_tp_builder(state), requires=FORGE_NEEDS, extra_check=forge_problem, strategy="tp",
             settings={"strategy": "tp", "state_dtype": state}, bytes_per_param=forge_bytes_per_param(state))
      for state in ("bf16", "int8")),
    # the peers: each builder imports its package when it runs; each check probes it (peer_probes)
    Method(name="bnb_adamw8bit", family="peer", description="bitsandbytes AdamW8bit: block-wise 8-bit moments",
           build=peers.build_bnb_adamw8bit, requires=("bitsandbytes",),
           extra_check=availability_check("bitsandbytes"), settings={"optim_bits": 8},
           bytes_per_param=peers.bytes_8bit_blockwise),
    Method(name="bnb_paged_adamw8bit", family="peer",
           description="bitsandbytes PagedAdamW8bit: 8-bit moments in CUDA managed memory",
           build=peers.build_bnb_paged_adamw8bit, requires=("bitsandbytes",), needs_cuda=True,
           extra_check=availability_check("bitsandbytes"), settings={"optim_bits": 8, "paged": True},
           bytes_per_param=peers.bytes_8bit_blockwise),
    Method(name="torchao_adamw8bit", family="peer",
           description="torchao.optim.AdamW8bit: 8-bit block-quantized moments (torch.compile step)",
           build=peers.build_torchao_adamw8bit, requires=("torchao",), extra_check=availability_check("torchao"),
           settings={"state_format": "8bit"}, bytes_per_param=peers.bytes_8bit_blockwise),
    Method(name="torchao_adamw4bit", family="peer",
           description="torchao.optim.AdamW4bit: 4-bit block-quantized moments (torch.compile step)",
           build=peers.build_torchao_adamw4bit, requires=("torchao",), extra_check=availability_check("torchao"),
           settings={"state_format": "4bit"}, bytes_per_param=peers.bytes_4bit_blockwise),
    Method(name="torchao_adamw_fp8", family="peer",
           description="torchao.optim.AdamWFp8: FP8 (e4m3) block-scaled moments (torch.compile step)",
           build=peers.build_torchao_adamw_fp8, requires=("torchao",),
           extra_check=availability_check("torchao_fp8"), settings={"state_format": "fp8"},
           bytes_per_param=peers.bytes_8bit_blockwise),
    Method(name="optimi_adamw_kahan", family="peer", description="optimi AdamW on bf16 weights with Kahan summation",
           build=peers.build_optimi_adamw, requires=("optimi",), extra_check=availability_check("optimi"),
           settings={"kahan_sum": True, "weights": "bf16"}, bytes_per_param=peers.bytes_optimi_kahan),
    Method(name="optimi_adamw_kahan_release", family="peer",
           description="optimi AdamW, bf16 + Kahan, with gradient release (update in backward hooks)",
           build=peers.build_optimi_adamw_release, requires=("optimi",), extra_check=availability_check("optimi"),
           settings={"kahan_sum": True, "weights": "bf16", "gradient_release": True},
           bytes_per_param=peers.bytes_optimi_kahan_release),
    Method(name="galore_adamw", family="peer",
           description="GaLore AdamW: rank-128 SVD projection of attention/MLP gradients",
           build=peers.build_galore_adamw, requires=("galore_torch",), extra_check=availability_check("galore_torch"),
           settings={"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
           bytes_per_param=peers.bytes_low_rank),
    Method(name="galore_adamw_rsvd", family="peer",
           description="GaLore AdamW as galore_adamw, projections from a randomized SVD (torch.svd_lowrank): the "
                       "full SVDs of an 8B model's first step take minutes; later steps do the same work",
           build=peers.build_galore_adamw_rsvd, requires=("galore_torch",),
           extra_check=availability_check("galore_torch"),
           settings={"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std",
                     "projection_svd": "svd_lowrank"},
           bytes_per_param=peers.bytes_low_rank),
    Method(name="forge_galore_bf16", family="forge",
           description="FORGE composed with GaLore: each hidden weight's G projected to rank 128 (randomized SVD) "
                       "and stepped by AdamW in its backward, bf16 moments and projections",
           build=forge_galore_builder("bf16"), requires=FORGE_NEEDS, extra_check=forge_problem,
           settings={"state_dtype": "bf16", **GALORE_SETTINGS}, bytes_per_param=peers.bytes_in_backward),
    Method(name="apollo_adamw", family="peer",
           description="APOLLO AdamW: channel-wise scaling from a rank-256 random projection",
           build=peers.build_apollo_adamw, requires=("apollo_torch",), extra_check=availability_check("apollo_torch"),
           settings={"rank": 256, "scale": 1.0, "scale_type": "channel", "proj": "random", "update_proj_gap": 200},
           bytes_per_param=peers.bytes_low_rank),
    Method(name="lomo", family="peer", description="LOMO: SGD applied inside backward (lomo-optim fused_backward)",
           build=peers.build_lomo, requires=("lomo_optim",), extra_check=availability_check("lomo_optim"),
           settings={"update": "sgd in backward"}, bytes_per_param=peers.bytes_in_backward),
    Method(name="adalomo", family="peer",
           description="AdaLomo: factored adaptive update inside backward (lomo-optim; its states are created "
                       "with .cuda())",
           build=peers.build_adalomo, requires=("lomo_optim",), needs_cuda=True,
           extra_check=availability_check("lomo_optim"), settings={"update": "factored adaptive in backward"},
           bytes_per_param=peers.bytes_in_backward),
    Method(name="flashoptim_adamw", family="peer",
           description="FlashOptim FlashAdamW: bf16 weights + 8-bit correction, 8-bit moments, fused Triton step",
           build=peers.build_flashoptim_adamw, requires=("flashoptim",), needs_cuda=True,
           extra_check=availability_check("flashoptim"), settings={"master_weight_bits": 24},
           bytes_per_param=peers.bytes_flashoptim),
    Method(name="flashoptim_adamw_release", family="peer",
           description="FlashOptim FlashAdamW with gradient release (update in backward hooks)",
           build=peers.build_flashoptim_adamw_release, requires=("flashoptim",), needs_cuda=True,
           extra_check=availability_check("flashoptim"),
           settings={"master_weight_bits": 24, "gradient_release": True},
           bytes_per_param=peers.bytes_flashoptim_release),
    # the optimizer families of the paper's App. I (forge_bench/families.py): per family the unfused
    # optimizer (<family>_unfused), then FORGE with fp32 and bf16 states (forge_<family>_<states>)
    *(Method(**entry) for entry in families.method_entries(FORGE_NEEDS)),
)

COMPILED_ARMS = ("no_optimizer", "adamw_foreach", "adamw_fused", "adamw_fused_cce", "forge_bf16", "forge_int8",
                 "forge_bf16_cce", "forge_int8_cce")
"""The arms with compiled twins (``forge_bench.compiled_arms``): ``<arm>_compile`` and ``<arm>_compile_ro``."""
ARMS = ARMS + compiled_twins(ARMS, COMPILED_ARMS)

for _method in ARMS:
    register(_method)
