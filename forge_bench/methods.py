"""The arms a sweep compares: one registry entry per method.

Every entry says what it is, which packages it needs, and has an availability check that
returns ``None`` when the arm can run here or a one-line reason when it cannot (that reason
becomes an ``unavailable`` row, never a crash). ``build`` turns a model into an ``Arm``: an
object that runs one full training step (forward, backward, optimizer) on a batch.

Peers (bitsandbytes, torchao, optimi, GaLore, APOLLO, LOMO, FlashOptim) are entries here too;
their adapters live in ``forge_bench/peers.py`` so this file stays a readable registry.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    """What every arm gets: the shared optimizer hyper-parameters of a sweep."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9            # SGD arms
    device: str = "cuda"
    capturable: bool = False         # the step will be captured in a CUDA graph (optimizers keep steps on the GPU)


class Arm(Protocol):
    """One built method on one model."""
    settings: Mapping[str, Any]  # recorded in the row's method_settings

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One training step on ``batch`` (model inputs incl. labels); returns the loss (detached)."""
        ...

    def memory_breakdown(self) -> Mapping[str, int]:
        """Analytic bytes: {"weights", "optimizer_states", "gradients"} as the arm holds them."""
        ...


@dataclass(frozen=True)
class Method:
    name: str
    family: str                                   # "baseline" | "forge" | "peer"
    description: str
    build: Callable[[nn.Module, TrainConfig], Arm]
    requires: tuple[str, ...] = ()                # importable module names
    needs_cuda: bool = False
    extra_check: Callable[[], str | None] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    # The parity gate (forge_bench/cell.py). ``parity_reference`` names the torch optimizer the
    # arm claims to reproduce ("adamw" or "sgd", run in fp32 with the same hyper-parameters);
    # None means the arm claims no reference algorithm and the gate does not apply to it.
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

    def unavailable_reason(self, device: str, cuda_graph: bool = False) -> str | None:
        """None when this arm can run on ``device`` (timed as a CUDA graph replay when ``cuda_graph``);
        otherwise why not, in one line."""
        if cuda_graph and not self.graphable:
            return (f"{self.name}: its step cannot be captured in a CUDA graph (host-side state or syncs per "
                    "step); run it in an eager grid")
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{self.name}: Python package '{module}' is not installed"
        if self.needs_cuda and (not device.startswith("cuda") or not torch.cuda.is_available()):
            return f"{self.name}: needs a CUDA device (device={device}, cuda available={torch.cuda.is_available()})"
        if self.extra_check is not None:
            return self.extra_check()
        return None


class ArmUnavailable(RuntimeError):
    """Raised by a ``build`` that cannot run on the given model (a fact about the model, which the
    device-only availability check cannot see): the cell records an ``unavailable`` row with this
    one-line message instead of crashing."""


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
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

# --- registry entries below (baselines and FORGE arms: forge_bench harness; peers: forge_bench/peers.py) ---


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each once (tied weights appear once in ``parameters()``)."""
    return [p for p in model.parameters() if p.requires_grad]


def _tensor_bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return _tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


class TorchArm:
    """A model plus an optional stock torch optimizer: forward, backward, step, free the grads.

    Gradients are freed (``set_to_none``) after the optimizer step, so the peak holds the whole
    gradient pool at the backward-to-optimizer boundary, as in any standard training loop.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, settings: Mapping[str, Any]):
        self.model = model
        self.optimizer = optimizer
        self.settings = dict(settings)
        self.n_fused_params = 0

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**batch).loss
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return loss.detach()

    def memory_breakdown(self) -> Mapping[str, int]:
        params = _unique_parameters(self.model)
        weights = _tensor_bytes(self.model.parameters())
        return {
            "weights": weights,
            "optimizer_states": _optimizer_state_bytes(self.optimizer),
            "gradients": _tensor_bytes(params),  # one grad per trainable weight, weight dtype
        }


def _build_no_optimizer(model: nn.Module, cfg: TrainConfig) -> TorchArm:
    return TorchArm(model, None, {"optimizer": None})


def _adamw_builder(impl: str) -> Callable[[nn.Module, TrainConfig], TorchArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> TorchArm:
        flags = {"foreach": impl == "foreach", "fused": impl == "fused"}
        if cfg.capturable:
            flags["capturable"] = True   # step counts on the GPU: torch's own CUDA-graph mode
        optimizer = torch.optim.AdamW(_unique_parameters(model), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                      weight_decay=cfg.weight_decay, **flags)
        settings = {"optimizer": "torch.optim.AdamW", "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps,
                    "weight_decay": cfg.weight_decay, **flags}
        return TorchArm(model, optimizer, settings)
    return build


def _build_sgd(model: nn.Module, cfg: TrainConfig) -> TorchArm:
    optimizer = torch.optim.SGD(_unique_parameters(model), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay, foreach=True)
    settings = {"optimizer": "torch.optim.SGD", "lr": cfg.lr, "momentum": cfg.momentum,
                "weight_decay": cfg.weight_decay, "foreach": True}
    return TorchArm(model, optimizer, settings)


class ForgeArm:
    """A model whose eligible Linear weights are updated inside their weight-gradient kernel."""

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any]):
        self.model = model
        self.optimizer = optimizer
        self.settings = dict(settings)
        self.n_fused_params = int(sum(p.numel() for p in optimizer.fused_parameters()))

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**batch).loss
        loss.backward()              # fused weights are updated here, their G never stored
        self.optimizer.step()        # the fallback optimizer: tied/excluded weights, norms, biases
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def memory_breakdown(self) -> Mapping[str, int]:
        return {k: int(v) for k, v in self.optimizer.memory_breakdown().items()}


def _forge_missing() -> str | None:
    try:
        forge_core = importlib.import_module("forge_core")
    except Exception as exc:
        return f"forge_core cannot be imported: {type(exc).__name__}: {exc}"
    if not callable(getattr(forge_core, "fuse", None)):
        return "forge_core.fuse is not available in this checkout"
    return None


def _forge_builder(state_dtype: str, overlap: bool = True) -> Callable[[nn.Module, TrainConfig], ForgeArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> ForgeArm:
        import forge_core

        optimizer = forge_core.fuse(model, "adamw", lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, state_dtype=state_dtype, capturable=cfg.capturable,
                                    overlap=overlap)
        settings = {"optimizer": "forge_core.fuse(adamw)", "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps,
                    "weight_decay": cfg.weight_decay, "state_dtype": state_dtype, "overlap": overlap,
                    "backend": getattr(optimizer, "backend", "auto")}
        if cfg.capturable:
            settings["capturable"] = True
        row_embeddings = optimizer.row_gradient_names()
        if row_embeddings:
            settings["row_gradient_embeddings"] = row_embeddings   # no dense .grad (forge_core.embedding)
        return ForgeArm(model, optimizer, settings)
    return build


# --- the chunked LM-head loss (forge_core.chunked_lm_head_cross_entropy) -----------------------

# Config keys by which some causal LMs transform lm_head(hidden) before the loss (Gemma-2 soft-capping,
# Cohere / Granite scaling): the chunked loss computes lm_head(hidden) only, so such models are refused.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """(base model returning hidden states, LM head) of a transformers causal LM whose logits are
    exactly ``lm_head(base(...)[0])``; ArmUnavailable (one line) for any other model."""
    kind = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        raise ArmUnavailable(f"chunked loss: {kind} has no nn.Linear LM head (get_output_embeddings() gave "
                             f"{type(head).__name__})")
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ArmUnavailable(f"chunked loss: {kind} has no separate base model (model.base_model) that returns "
                             "hidden states")
    config = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        value = getattr(config, key, None)
        if value is not None and value != 1:
            raise ArmUnavailable(f"chunked loss: {kind} applies {key}={value} to its logits; the chunked loss "
                                 "computes lm_head(hidden) only")
    return base, head


class ChunkedCausalLMLoss:
    """A batch -> the HF causal-LM loss, via the base model's hidden states and the chunked LM-head
    loss (no logits tensor; a FORGE-fused head is updated inside its backward)."""

    def __init__(self, model: nn.Module, chunk_size: int | None = None) -> None:
        self.base, self.head = causal_lm_parts(model)
        self.chunk_size = chunk_size
        self.settings: dict[str, Any] = {"loss": "chunked_ce",
                                         "chunk_size": chunk_size if chunk_size is not None else "auto"}

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import forge_core
        from forge_core import lm_head_loss

        labels = batch["labels"]
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        output = self.base(**inputs)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        chunk = self.chunk_size or forge_core.default_chunk_size(labels.numel(), self.head.weight.shape[0])
        self.settings["chunk_size"] = chunk     # the resolved width, recorded in the row
        # whether the backward reads the forward's logits or recomputes them (one more vocab GEMM)
        self.settings["keep_logits"] = forge_core.keeps_logits(labels.numel(), self.head.weight.shape[0],
                                                               lm_head_loss.logits_dtype(hidden, self.head))
        return forge_core.chunked_lm_head_cross_entropy(hidden, self.head, labels, chunk_size=chunk)


class ChunkedLossTorchArm(TorchArm):
    """TorchArm with the chunked LM-head loss: the head's gradient is still formed (torch optimizers
    need it), the logits are not."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, settings: Mapping[str, Any],
                 loss: ChunkedCausalLMLoss):
        super().__init__(model, optimizer, settings)
        self.loss = loss
        self.settings = loss.settings | self.settings   # one dict: the step records the chunk size in it
        loss.settings = self.settings

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = self.loss(batch)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return loss.detach()


class ChunkedLossForgeArm(ForgeArm):
    """ForgeArm with the chunked LM-head loss: a fused (untied) head is updated chunk by chunk, so
    neither its logits nor its weight gradient exists; a tied head gets an ordinary gradient."""

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any], loss: ChunkedCausalLMLoss):
        super().__init__(model, optimizer, settings)
        self.loss = loss
        self.settings = loss.settings | self.settings
        loss.settings = self.settings

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _forge_cce_builder(state_dtype: str) -> Callable[[nn.Module, TrainConfig], ChunkedLossForgeArm]:
    fuse_build = _forge_builder(state_dtype)

    def build(model: nn.Module, cfg: TrainConfig) -> ChunkedLossForgeArm:
        loss = ChunkedCausalLMLoss(model)          # refuses an unsuitable model before anything is fused
        arm = fuse_build(model, cfg)
        return ChunkedLossForgeArm(arm.model, arm.optimizer, arm.settings, loss)
    return build


def _build_adamw_fused_cce(model: nn.Module, cfg: TrainConfig) -> ChunkedLossTorchArm:
    loss = ChunkedCausalLMLoss(model)
    arm = _adamw_builder("fused")(model, cfg)
    return ChunkedLossTorchArm(arm.model, arm.optimizer, arm.settings, loss)


# bytes per parameter for oom_predicted: (optimizer states, gradients at the boundary)
_FORGE_STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / 64}

register(Method("no_optimizer", "baseline", "forward + backward only, no optimizer step: the floor",
                _build_no_optimizer, bytes_per_param=lambda b: (0.0, float(b)), graphable=True))
register(Method("adamw_foreach", "baseline", "torch.optim.AdamW(foreach=True), states in the weight dtype",
                _adamw_builder("foreach"), parity_reference="adamw", bytes_per_param=lambda b: (2.0 * b, float(b)),
                graphable=True))
register(Method("adamw_fused", "baseline", "torch.optim.AdamW(fused=True), states in the weight dtype",
                _adamw_builder("fused"), needs_cuda=True, parity_reference="adamw",
                bytes_per_param=lambda b: (2.0 * b, float(b)), graphable=True))
register(Method("sgd", "baseline", "torch.optim.SGD with momentum (foreach)", _build_sgd,
                parity_reference="sgd", bytes_per_param=lambda b: (float(b), float(b)), graphable=True))
for _state_dtype, _tolerance in (("fp32", None), ("bf16", None), ("int8", None)):
    register(Method(f"forge_{_state_dtype}", "forge",
                    f"FORGE fused wgrad + AdamW update, {_state_dtype} moments (forge_core.fuse)",
                    _forge_builder(_state_dtype), requires=("forge_core", "triton"), extra_check=_forge_missing,
                    settings={"state_dtype": _state_dtype}, parity_reference="adamw", parity_tolerance=_tolerance,
                    bytes_per_param=lambda b, s=_state_dtype: (_FORGE_STATE_BYTES[s], 0.0), graphable=True))
for _state_dtype in ("bf16", "int8"):
    # The A/B arm for forge_core.overlap: the same FORGE step with each update in line on the
    # backward's stream (what every FORGE arm did before overlap became fuse()'s default).
    register(Method(f"forge_{_state_dtype}_inline", "forge",
                    f"FORGE as forge_{_state_dtype}, each fused update in line on the backward's stream "
                    "(fuse(overlap=False)): measures what the side-stream overlap buys",
                    _forge_builder(_state_dtype, overlap=False), requires=("forge_core", "triton"),
                    extra_check=_forge_missing, settings={"state_dtype": _state_dtype, "overlap": False},
                    parity_reference="adamw",
                    bytes_per_param=lambda b, s=_state_dtype: (_FORGE_STATE_BYTES[s], 0.0), graphable=True))
    register(Method(f"forge_{_state_dtype}_cce", "forge",
                    f"FORGE fused wgrad + AdamW update, {_state_dtype} moments, with the vocab-chunked LM-head "
                    "cross-entropy: no logits tensor, an untied LM head updated chunk by chunk (no weight gradient)",
                    _forge_cce_builder(_state_dtype), requires=("forge_core", "triton"), extra_check=_forge_missing,
                    settings={"state_dtype": _state_dtype, "loss": "chunked_ce", "chunk_size": "auto"},
                    parity_reference="adamw",
                    bytes_per_param=lambda b, s=_state_dtype: (_FORGE_STATE_BYTES[s], 0.0), graphable=True))
register(Method("adamw_fused_cce", "baseline",
                "torch.optim.AdamW(fused=True) with the vocab-chunked LM-head cross-entropy (no logits tensor; "
                "every gradient still formed): what the loss alone saves",
                _build_adamw_fused_cce, needs_cuda=True, extra_check=_forge_missing,
                settings={"loss": "chunked_ce", "chunk_size": "auto"}, parity_reference="adamw",
                bytes_per_param=lambda b: (2.0 * b, float(b)), graphable=True))

# --- peer entries below this line (forge_bench/peers.py adapters) ---

from forge_bench import peers as _peers  # noqa: E402  (peers.py needs nothing from this module at import)

_PEER_ENTRIES: tuple[tuple[str, str, Callable[[nn.Module, TrainConfig], Arm], str, str, bool,
                           Callable[[int], tuple[float, float]], dict[str, Any]], ...] = (
    # name, description, builder, requires (import name), probe, needs_cuda, bytes/param, key settings
    ("bnb_adamw8bit", "bitsandbytes AdamW8bit: block-wise 8-bit moments",
     _peers.build_bnb_adamw8bit, "bitsandbytes", "bitsandbytes", False, _peers.bytes_8bit_blockwise,
     {"optim_bits": 8}),
    ("bnb_paged_adamw8bit", "bitsandbytes PagedAdamW8bit: 8-bit moments in CUDA managed memory",
     _peers.build_bnb_paged_adamw8bit, "bitsandbytes", "bitsandbytes", True, _peers.bytes_8bit_blockwise,
     {"optim_bits": 8, "paged": True}),
    ("torchao_adamw8bit", "torchao.optim.AdamW8bit: 8-bit block-quantized moments (torch.compile step)",
     _peers.build_torchao_adamw8bit, "torchao", "torchao", False, _peers.bytes_8bit_blockwise,
     {"state_format": "8bit"}),
    ("torchao_adamw4bit", "torchao.optim.AdamW4bit: 4-bit block-quantized moments (torch.compile step)",
     _peers.build_torchao_adamw4bit, "torchao", "torchao", False, _peers.bytes_4bit_blockwise,
     {"state_format": "4bit"}),
    ("torchao_adamw_fp8", "torchao.optim.AdamWFp8: FP8 (e4m3) block-scaled moments (torch.compile step)",
     _peers.build_torchao_adamw_fp8, "torchao", "torchao_fp8", False, _peers.bytes_8bit_blockwise,
     {"state_format": "fp8"}),
    ("optimi_adamw_kahan", "optimi AdamW on bf16 weights with Kahan summation",
     _peers.build_optimi_adamw, "optimi", "optimi", False, _peers.bytes_optimi_kahan,
     {"kahan_sum": True, "weights": "bf16"}),
    ("optimi_adamw_kahan_release", "optimi AdamW, bf16 + Kahan, with gradient release (update in backward hooks)",
     _peers.build_optimi_adamw_release, "optimi", "optimi", False, _peers.bytes_optimi_kahan_release,
     {"kahan_sum": True, "weights": "bf16", "gradient_release": True}),
    ("galore_adamw", "GaLore AdamW: rank-128 SVD projection of attention/MLP gradients",
     _peers.build_galore_adamw, "galore_torch", "galore_torch", False, _peers.bytes_low_rank,
     {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}),
    ("galore_adamw_rsvd", "GaLore AdamW as galore_adamw, projections from a randomized SVD (torch.svd_lowrank): "
     "the full SVDs of an 8B model's first step take minutes; later steps do the same work",
     _peers.build_galore_adamw_rsvd, "galore_torch", "galore_torch", False, _peers.bytes_low_rank,
     {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std", "projection_svd": "svd_lowrank"}),
    ("apollo_adamw", "APOLLO AdamW: channel-wise scaling from a rank-256 random projection",
     _peers.build_apollo_adamw, "apollo_torch", "apollo_torch", False, _peers.bytes_low_rank,
     {"rank": 256, "scale": 1.0, "scale_type": "channel", "proj": "random", "update_proj_gap": 200}),
    ("lomo", "LOMO: SGD applied inside backward (lomo-optim fused_backward)",
     _peers.build_lomo, "lomo_optim", "lomo_optim", False, _peers.bytes_in_backward,
     {"update": "sgd in backward"}),
    ("adalomo", "AdaLomo: factored adaptive update inside backward (lomo-optim; its states are created with .cuda())",
     _peers.build_adalomo, "lomo_optim", "lomo_optim", True, _peers.bytes_in_backward,
     {"update": "factored adaptive in backward"}),
    ("flashoptim_adamw", "FlashOptim FlashAdamW: bf16 weights + 8-bit correction, 8-bit moments, fused Triton step",
     _peers.build_flashoptim_adamw, "flashoptim", "flashoptim", True, _peers.bytes_flashoptim,
     {"master_weight_bits": 24}),
    ("flashoptim_adamw_release", "FlashOptim FlashAdamW with gradient release (update in backward hooks)",
     _peers.build_flashoptim_adamw_release, "flashoptim", "flashoptim", True, _peers.bytes_flashoptim_release,
     {"master_weight_bits": 24, "gradient_release": True}),
)

for (_name, _description, _builder, _module, _probe, _needs_cuda, _bytes, _key_settings) in _PEER_ENTRIES:
    register(Method(_name, "peer", _description, _builder, requires=(_module,), needs_cuda=_needs_cuda,
                    extra_check=_peers.availability_check(_probe), settings=_key_settings,
                    bytes_per_param=_bytes))
