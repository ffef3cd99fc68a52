"""Peer arms: the memory-saving optimizers a practitioner would pick instead of FORGE.

One builder per peer turns a model and the sweep's ``TrainConfig`` into an ``Arm`` (``arm.py``):
``step(batch)`` runs forward, backward and the peer's update the way the peer's own documentation
sets it up, ``memory_breakdown()`` counts the bytes the arm holds, and ``settings`` records every
knob so a result row says exactly what ran. The registry entries that name these builders live in
``methods.py``; whether a peer can run here is ``peer_probes.py``'s question.

Each builder imports its peer's package when it runs, never at module import: a process loads
only the packages of the arms it builds. Nothing here copies a peer's code: the adapters only call
the peers' public APIs.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from forge_bench.arm import TrainConfig, parameter_bytes, trainable_parameters
from forge_bench.peer_probes import installed_version
from forge_bench.units import GIB

# GaLore and APOLLO project the weights of the attention and MLP blocks (their scripts select
# nn.Linear modules whose qualified name contains one of these words).
LOW_RANK_TARGET_WORDS = ("attn", "mlp")
# bitsandbytes keeps a state tensor in CUDA managed memory only from this many elements up
# (bitsandbytes.optim.optimizer.Optimizer8bit.get_state_buffer).
BNB_PAGED_MIN_NUMEL = 100_000


# ----------------------------------------------------------------------------------------------
# Byte accounting
# ----------------------------------------------------------------------------------------------

def _plain_tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """Every plain tensor reachable from an optimizer-state value.

    Quantized states are tensor subclasses (torchao) whose real storage is their inner tensors
    (``__tensor_flatten__``); GaLore/APOLLO keep projection matrices inside projector objects.
    """
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            for inner_name in names:
                yield from _plain_tensors(getattr(obj, inner_name), depth + 1)
        else:
            yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _plain_tensors(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _plain_tensors(value, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        for value in vars(obj).values():
            yield from _plain_tensors(value, depth + 1)


def tensor_bytes(values: Iterable[Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensors reachable from ``values`` (each storage counted once)."""
    skip = {t.data_ptr() for t in exclude}
    seen: set[tuple[int, int]] = set()
    total = 0
    for value in values:
        for tensor in _plain_tensors(value):
            if tensor.numel() == 0:
                continue
            key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            if key in seen or tensor.data_ptr() in skip:
                continue
            seen.add(key)
            total += key[1]
    return int(total)


def _largestparameter_bytes(model: nn.Module, count: int) -> int:
    sizes = sorted((p.numel() * p.element_size() for p in trainable_parameters(model)), reverse=True)
    return int(sum(sizes[:count]))


def _weights_dtype(model: nn.Module) -> str:
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    return "+".join(dtypes)


# ----------------------------------------------------------------------------------------------
# Arms
# ----------------------------------------------------------------------------------------------

def model_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The language-model loss of ``batch`` (which must carry ``labels``)."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise ValueError("the model returned no loss: the batch must hold 'labels'")
    return loss


class PeerArm:
    """A model and a peer optimizer in the standard loop: forward, backward, step, free grads.

    ``gradient_bytes`` is the analytic gradient residency at the backward/optimizer boundary
    (the whole pool for these arms); ``before_first_step`` runs once between the first backward
    and the first optimizer step (the paged arm checks free GPU memory there).
    """

    n_fused_params = 0   # FORGE-style in-kernel updates: none for a peer

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any], *,
                 gradient_bytes: int | None = None,
                 before_first_step: Callable[[], None] | None = None,
                 after_first_step: Callable[[], None] | None = None):
        self.model = model
        self.optimizer = optimizer
        self.settings: dict[str, Any] = dict(settings)
        self._gradient_bytes = (parameter_bytes(trainable_parameters(model))
                                if gradient_bytes is None else int(gradient_bytes))
        self._before_first_step = before_first_step
        self._after_first_step = after_first_step
        self.steps_done = 0

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = model_loss(self.model, batch)
        loss.backward()
        if self.steps_done == 0 and self._before_first_step is not None:
            self._before_first_step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.steps_done == 0 and self._after_first_step is not None:
            self._after_first_step()
        self.steps_done += 1
        return loss.detach()

    def optimizer_state_bytes(self) -> int:
        return tensor_bytes(self.optimizer.state.values(), exclude=self.model.parameters())

    def memory_breakdown(self) -> Mapping[str, int]:
        return {
            "weights": parameter_bytes(self.model.parameters()),
            "optimizer_states": self.optimizer_state_bytes(),
            "gradients": self._gradient_bytes,
        }


class FusedBackwardArm(PeerArm):
    """LOMO / AdaLomo: the update happens inside backward, one parameter at a time.

    Their documented loop replaces ``loss.backward(); optimizer.step()`` by
    ``optimizer.fused_backward(loss, lr)``; the gradients are freed as soon as each parameter
    is updated, so at most the gradients of two parameters are alive at once (the one being
    produced and the previous one, which the next hook consumes).
    """

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any], lr: float,
                 state_tensors: Callable[[], Iterable[Any]]):
        super().__init__(model, optimizer, settings, gradient_bytes=_largestparameter_bytes(model, 2))
        self.lr = lr
        self._state_tensors = state_tensors

    def step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss = model_loss(self.model, batch)
        self.optimizer.fused_backward(loss, self.lr)
        self.steps_done += 1
        return loss.detach()

    def optimizer_state_bytes(self) -> int:
        return tensor_bytes(self._state_tensors(), exclude=self.model.parameters())


class GradientReleaseArm(PeerArm):
    """Per-parameter update in a post-accumulate-grad hook, gradient freed right after.

    The peer's hooks do the work during ``backward``; the loop still calls ``step`` and
    ``zero_grad`` as their documentation shows (no-ops once every gradient is released).
    """

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any]):
        super().__init__(model, optimizer, settings, gradient_bytes=_largestparameter_bytes(model, 1))


def _common_adam_settings(cfg: TrainConfig) -> dict[str, Any]:
    return {"lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}


def _settings(distribution: str, optimizer: str, model: nn.Module, **extra: Any) -> dict[str, Any]:
    return {"package": distribution, "package_version": installed_version(distribution),
            "optimizer": optimizer, "weights_dtype": _weights_dtype(model), **extra}


# --- bitsandbytes -------------------------------------------------------------------------------

def bnb_paged_bytes(params: Iterable[torch.Tensor]) -> int:
    """Managed-memory bytes PagedAdamW8bit asks for: two uint8 states per large tensor."""
    return int(sum(2 * p.numel() for p in params if p.numel() >= BNB_PAGED_MIN_NUMEL))


def _managed_memory_guard(params: list[nn.Parameter], margin_bytes: int = int(GIB)) -> Callable[[], None]:
    """Refuse to ask CUDA for more managed memory than the card has free (it can hang the GPU)."""

    def guard() -> None:
        device = next((p.device for p in params if p.device.type == "cuda"), None)
        if device is None:
            return
        wanted = bnb_paged_bytes(params)
        torch.cuda.synchronize(device)
        free, _total = torch.cuda.mem_get_info(device)
        if wanted + margin_bytes > free:
            raise RuntimeError(
                f"PagedAdamW8bit would ask for {wanted / GIB:.2f} GiB of CUDA managed memory but only "
                f"{free / GIB:.2f} GiB is free (margin {margin_bytes / GIB:.1f} GiB): refusing")

    return guard


def build_bnb_adamw8bit(model: nn.Module, cfg: TrainConfig, *, paged: bool = False) -> PeerArm:
    """bitsandbytes AdamW8bit (block-wise 8-bit moments); ``paged``: states in CUDA managed memory."""
    import bitsandbytes as bnb

    params = trainable_parameters(model)
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    optimizer = cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    settings = _settings("bitsandbytes", f"bitsandbytes.optim.{cls.__name__}", model,
                         **_common_adam_settings(cfg), optim_bits=8, min_8bit_size=4096,
                         block_wise=True, paged=paged,
                         state_dtype="uint8 (dynamic map) + fp32 absmax per block")
    guard = None
    if paged:
        settings["paged_min_numel"] = BNB_PAGED_MIN_NUMEL
        settings["paged_state_bytes"] = bnb_paged_bytes(params)
        settings["note"] = ("paged states live in CUDA managed memory: torch.cuda.max_memory_allocated "
                            "does not see them; memory_breakdown counts them")
        guard = _managed_memory_guard(params)
    return PeerArm(model, optimizer, settings, before_first_step=guard)


def build_bnb_paged_adamw8bit(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    return build_bnb_adamw8bit(model, cfg, paged=True)


# --- torchao ------------------------------------------------------------------------------------

_TORCHAO_OPTIMIZERS = {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}


def build_torchao_adamw(model: nn.Module, cfg: TrainConfig, *, kind: str = "8bit",
                        bf16_stochastic_round: bool = False) -> PeerArm:
    """torchao.optim low-bit AdamW (states quantized per block; the step is torch.compile'd)."""
    if kind not in _TORCHAO_OPTIMIZERS:
        raise ValueError(f"torchao optimizer kind must be one of {sorted(_TORCHAO_OPTIMIZERS)}, got {kind!r}")
    from torchao import optim as ao_optim

    cls = getattr(ao_optim, _TORCHAO_OPTIMIZERS[kind])
    optimizer = cls(trainable_parameters(model), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                    weight_decay=cfg.weight_decay, bf16_stochastic_round=bf16_stochastic_round)
    settings = _settings("torchao", f"torchao.optim.{cls.__name__}", model, **_common_adam_settings(cfg),
                         state_format=kind, block_size=optimizer.block_size,
                         bf16_stochastic_round=bf16_stochastic_round, amsgrad=False,
                         quantized_min_numel=4096)
    return PeerArm(model, optimizer, settings)


def build_torchao_adamw8bit(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    return build_torchao_adamw(model, cfg, kind="8bit")


def build_torchao_adamw4bit(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    return build_torchao_adamw(model, cfg, kind="4bit")


def build_torchao_adamw_fp8(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    return build_torchao_adamw(model, cfg, kind="fp8")


# --- optimi -------------------------------------------------------------------------------------

def _to_bf16(model: nn.Module) -> bool:
    """Cast the weights to bf16 (the documented low-precision setup); True when a cast happened."""
    if all(p.dtype == torch.bfloat16 for p in model.parameters()):
        return False
    model.to(dtype=torch.bfloat16)
    return True


def build_optimi_adamw(model: nn.Module, cfg: TrainConfig, *, gradient_release: bool = False) -> PeerArm:
    """optimi AdamW on bf16 weights with Kahan-summation compensation buffers."""
    import optimi

    cast = _to_bf16(model)
    optimizer = optimi.AdamW(trainable_parameters(model), lr=cfg.lr, betas=tuple(cfg.betas),
                             weight_decay=cfg.weight_decay, eps=cfg.eps, kahan_sum=True,
                             gradient_release=gradient_release)
    settings = _settings("torch-optimi", "optimi.AdamW", model, **_common_adam_settings(cfg),
                         kahan_sum=True, decouple_lr=False, cast_to_bf16=cast,
                         state_dtype="bf16 (moments and Kahan compensation in the weight dtype)",
                         implementation="auto (Triton on CUDA when available, else foreach)",
                         gradient_release=gradient_release)

    if gradient_release:
        optimi.prepare_for_gradient_release(model, optimizer)
        return GradientReleaseArm(model, optimizer, settings)
    arm = PeerArm(model, optimizer, settings)

    def record_implementation() -> None:
        """optimi picks Triton / foreach on its first step; record what it picked."""
        group = optimizer.param_groups[0]
        arm.settings["triton"] = group.get("triton")
        arm.settings["foreach"] = group.get("foreach")   # None: optimi's own default

    arm._after_first_step = record_implementation
    return arm


def build_optimi_adamw_release(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    return build_optimi_adamw(model, cfg, gradient_release=True)


# --- GaLore and APOLLO ---------------------------------------------------------------------------

def low_rank_targets(model: nn.Module, words: tuple[str, ...] = LOW_RANK_TARGET_WORDS) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of the attention/MLP projection layers, as GaLore's and APOLLO's scripts pick.

    Their scripts take ``nn.Linear`` modules whose name holds "attn" or "mlp"; GPT-2's
    ``Conv1D`` layers play the same role (2-D weight) and are taken too.
    """
    conv1d: tuple[type, ...] = ()
    try:
        from transformers.pytorch_utils import Conv1D
        conv1d = (Conv1D,)
    except Exception:
        pass
    chosen: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, *conv1d)) or not any(w in name for w in words):
            continue
        weight = module.weight
        if weight.requires_grad and weight.dim() == 2 and id(weight) not in seen:
            seen.add(id(weight))
            chosen.append((f"{name}.weight", weight))
    return chosen


def low_rank_groups(model: nn.Module, extra: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    targets = low_rank_targets(model)
    if not targets:
        raise ValueError("no attention/MLP linear layer found (module names containing "
                         f"{' or '.join(LOW_RANK_TARGET_WORDS)}): nothing to project")
    target_ids = {id(p) for _, p in targets}
    regular = [p for p in trainable_parameters(model) if id(p) not in target_ids]
    groups: list[dict[str, Any]] = []
    if regular:
        groups.append({"params": regular})
    groups.append({"params": [p for _, p in targets], **extra})
    return groups, [name for name, _ in targets]


def build_galore_adamw(model: nn.Module, cfg: TrainConfig, *, rank: int = 128, update_proj_gap: int = 200,
                       scale: float = 0.25, proj_type: str = "std") -> PeerArm:
    """GaLore AdamW: gradients of the attention/MLP weights projected to rank ``rank`` (SVD)."""
    from galore_torch import GaLoreAdamW

    low_rank = {"rank": rank, "update_proj_gap": update_proj_gap, "scale": scale, "proj_type": proj_type}
    groups, names = low_rank_groups(model, low_rank)
    optimizer = GaLoreAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, no_deprecation_warning=True)
    settings = _settings("galore-torch", "galore_torch.GaLoreAdamW", model, **_common_adam_settings(cfg),
                         **low_rank, correct_bias=True, projected_params=len(names),
                         projected_numel=int(sum(p.numel() for _, p in low_rank_targets(model))),
                         target_words=list(LOW_RANK_TARGET_WORDS), layerwise=False,
                         note=("the SVD that refreshes a projection runs on step 0 and every "
                               f"{update_proj_gap} steps; a timing window after warm-up excludes it"))
    return PeerArm(model, optimizer, settings)


RSVD_OVERSAMPLING = 10   # extra columns of the randomized range finder (Halko et al.'s usual choice)
RSVD_ITERATIONS = 2      # power iterations (torch.svd_lowrank's default)


def randomized_orthogonal_matrix(projector: Any, weights: torch.Tensor, rank: int, type: str) -> Any:
    """galore_torch's ``GaLoreProjector.get_orthogonal_matrix`` contract (the rank-``rank`` left or
    right singular vectors of a gradient, in its dtype) from ``torch.svd_lowrank`` instead of a full
    ``torch.linalg.svd``."""
    matrix = weights.data.float()
    columns = min(rank + RSVD_OVERSAMPLING, *matrix.shape)
    u, _, v = torch.svd_lowrank(matrix, q=columns, niter=RSVD_ITERATIONS)
    left, right = u[:, :rank], v[:, :rank].t()
    if type == "right":
        return right.to(weights.dtype)
    if type == "left":
        return left.to(weights.dtype)
    if type == "full":
        return [left.to(weights.dtype), right.to(weights.dtype)]
    raise ValueError("type should be left, right or full")


def build_galore_adamw_rsvd(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    """GaLore AdamW with its projections from a randomized SVD (``torch.svd_lowrank``).

    galore-torch refreshes each projection with a full SVD of the gradient on step 0 and every
    ``update_proj_gap`` steps; on Llama-3.1-8B that is 224 SVDs of up to 14336 x 4096, minutes of GPU
    time in one step (longer than a whole benchmark cell). The steps in between, the ones a timing window
    after warm-up measures, do the same work whichever SVD made the projection."""
    from galore_torch import galore_projector

    arm = build_galore_adamw(model, cfg)
    projector_class = galore_projector.GaLoreProjector
    package_step = arm.optimizer.step

    def step_with_randomized_svd(*args: Any, **kwargs: Any) -> Any:
        # The projector objects are created inside GaLoreAdamW.step: swap the SVD for the call only,
        # so any other GaLore optimizer in this process keeps the package's own.
        full_svd = projector_class.get_orthogonal_matrix
        projector_class.get_orthogonal_matrix = randomized_orthogonal_matrix
        try:
            return package_step(*args, **kwargs)
        finally:
            projector_class.get_orthogonal_matrix = full_svd

    arm.optimizer.step = step_with_randomized_svd
    arm.settings.update(projection_svd="torch.svd_lowrank", svd_oversampling=RSVD_OVERSAMPLING,
                        svd_power_iterations=RSVD_ITERATIONS)
    return arm


def build_apollo_adamw(model: nn.Module, cfg: TrainConfig, *, rank: int = 256, scale: float = 1.0,
                       scale_type: str = "channel", proj: str = "random", update_proj_gap: int = 200,
                       proj_type: str = "std") -> PeerArm:
    """APOLLO AdamW: channel-wise update scaling from a rank-``rank`` random projection."""
    from apollo_torch import APOLLOAdamW

    low_rank = {"rank": rank, "proj": proj, "scale_type": scale_type, "scale": scale,
                "update_proj_gap": update_proj_gap, "proj_type": proj_type}
    groups, names = low_rank_groups(model, low_rank)
    optimizer = APOLLOAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    settings = _settings("apollo-torch", "apollo_torch.APOLLOAdamW", model, **_common_adam_settings(cfg),
                         **low_rank, scale_front=optimizer.scale_front,
                         norm_growth_limiter=not optimizer.disable_nl, projected_params=len(names),
                         target_words=list(LOW_RANK_TARGET_WORDS), layerwise=False)
    return PeerArm(model, optimizer, settings)


# --- LOMO and AdaLomo ---------------------------------------------------------------------------

def build_lomo(model: nn.Module, cfg: TrainConfig, *, clip_grad_norm: float | None = None) -> FusedBackwardArm:
    """LOMO: plain SGD applied inside backward by gradient hooks (no optimizer state)."""
    if clip_grad_norm is not None:
        raise ValueError("clip_grad_norm needs LOMO's second backward pass (grad_norm), not supported here")
    from lomo_optim import Lomo

    optimizer = Lomo(model, lr=cfg.lr, clip_grad_norm=None, clip_grad_value=None,
                     weight_decay=cfg.weight_decay)
    settings = _settings("lomo-optim", "lomo_optim.Lomo", model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                         clip_grad_norm=None, clip_grad_value=None, update="sgd inside backward (grad hooks)",
                         loss_scaler="dynamic only for fp16 losses", betas=None, eps=None)
    return FusedBackwardArm(model, optimizer, settings, cfg.lr, state_tensors=lambda: ())


def build_adalomo(model: nn.Module, cfg: TrainConfig, *, loss_scale: float = 2.0 ** 10,
                  eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                  decay_rate: float = -0.8) -> FusedBackwardArm:
    """AdaLomo: factored second moment (Adafactor-style) applied inside backward."""
    from lomo_optim import AdaLomo

    optimizer = AdaLomo(model, lr=cfg.lr, loss_scale=loss_scale, eps=eps, clip_threshold=clip_threshold,
                        decay_rate=decay_rate, clip_grad_norm=None, clip_grad_value=None,
                        weight_decay=cfg.weight_decay)
    settings = _settings("lomo-optim", "lomo_optim.AdaLomo", model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                         loss_scale=loss_scale, eps=list(eps), clip_threshold=clip_threshold,
                         decay_rate=decay_rate, clip_grad_norm=None, clip_grad_value=None,
                         state_dtype="fp32 row/column second-moment factors", betas=None,
                         update="factored adaptive update inside backward (grad hooks)")

    def states() -> Iterable[Any]:
        return (optimizer.exp_avg_sq, optimizer.exp_avg_sq_row, optimizer.exp_avg_sq_col)

    return FusedBackwardArm(model, optimizer, settings, cfg.lr, state_tensors=states)


# --- FlashOptim ---------------------------------------------------------------------------------

def build_flashoptim_adamw(model: nn.Module, cfg: TrainConfig, *, master_weight_bits: int | None = 24,
                           gradient_release: bool = False) -> PeerArm:
    """FlashOptim FlashAdamW: bf16 weights + 8-bit correction bits, 8-bit moments, fused Triton step."""
    import flashoptim

    flashoptim.cast_model(model, dtype=torch.bfloat16)
    optimizer = flashoptim.FlashAdamW(trainable_parameters(model), lr=cfg.lr, betas=tuple(cfg.betas),
                                      eps=cfg.eps, weight_decay=cfg.weight_decay,
                                      master_weight_bits=master_weight_bits)
    settings = _settings("flashoptim", "flashoptim.FlashAdamW", model, **_common_adam_settings(cfg),
                         master_weight_bits=master_weight_bits, quantize=True, fused=True, decouple_lr=False,
                         cast_model="flashoptim.cast_model(bfloat16)", gradient_release=gradient_release)
    if gradient_release:
        settings["release_handle"] = "flashoptim.enable_gradient_release"
        arm: PeerArm = GradientReleaseArm(model, optimizer, settings)
        arm.release_handle = flashoptim.enable_gradient_release(model, optimizer)
        return arm
    return PeerArm(model, optimizer, settings)


def build_flashoptim_adamw_release(model: nn.Module, cfg: TrainConfig) -> PeerArm:
    return build_flashoptim_adamw(model, cfg, gradient_release=True)


# ----------------------------------------------------------------------------------------------
# Bytes per parameter for the runner's OOM prediction: (optimizer states, gradients at the
# optimizer boundary) given the weight dtype's bytes. Lower bounds where the true figure
# depends on layer shapes (low-rank states), so a prediction never refuses a cell that fits.
# ----------------------------------------------------------------------------------------------

def bytes_8bit_blockwise(weight_bytes: int) -> tuple[float, float]:
    return 2.0 + 2 * 4 / 256, float(weight_bytes)


def bytes_4bit_blockwise(weight_bytes: int) -> tuple[float, float]:
    return 1.0 + 2 * 4 / 128, float(weight_bytes)


def bytes_optimi_kahan(weight_bytes: int) -> tuple[float, float]:
    return 3.0 * 2, 2.0           # bf16 moments + bf16 compensation; bf16 gradients


def bytes_optimi_kahan_release(weight_bytes: int) -> tuple[float, float]:
    return 3.0 * 2, 0.0


def bytes_low_rank(weight_bytes: int) -> tuple[float, float]:
    return 0.0, float(weight_bytes)


def bytes_in_backward(weight_bytes: int) -> tuple[float, float]:
    return 0.0, 0.0


def bytes_flashoptim(weight_bytes: int) -> tuple[float, float]:
    return 2.0 + 1.0, 2.0         # int8 moments + 8-bit correction bits; bf16 gradients


def bytes_flashoptim_release(weight_bytes: int) -> tuple[float, float]:
    return 2.0 + 1.0, 0.0
