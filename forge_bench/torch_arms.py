"""The baseline and FORGE arms: a model plus a stock torch optimizer, or plus ``forge_core.fuse``.

Each ``build_*`` / ``*_builder`` here turns a model and the sweep's ``TrainConfig`` into an ``Arm``
(``arm.py``); the registry entries that name them live in ``methods.py``. The chunked LM-head loss
(``forge_core.chunked_lm_head_cross_entropy``) wraps either kind of arm so that no logits tensor
exists.

``forge_core`` is imported inside the FORGE builders, not here: a cell of a torch arm never imports
Triton (its row records no kernel tiles, and its process starts without compiling anything).
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Mapping

import torch
from torch import nn

from forge_bench.arm import ArmUnavailable, TrainConfig, parameter_bytes, trainable_parameters

# bytes per parameter of the FORGE arms' optimizer states, for oom_predicted and the capability
# arithmetic (no gradient pool): two moments in the state dtype, plus an fp32 scale per 64-element
# block for int8 and fp8 (forge_core.state)
FORGE_STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / 64, "fp8": 2.0 + 2 * 4 / 64}


def forge_bytes_per_param(state_dtype: str) -> Callable[[int], tuple[float, float]]:
    """``Method.bytes_per_param`` of a FORGE arm with ``state_dtype`` moments."""
    return lambda weight_bytes: (FORGE_STATE_BYTES[state_dtype], 0.0)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the tensors a stock torch optimizer keeps in its state (0 without one)."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, Fp32MomentsAdamW):
        optimizer = optimizer.inner
    return parameter_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


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
        loss = self.loss_of(batch)
        loss.backward()
        self.finish_step()
        return loss.detach()

    def loss_of(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The forward and the loss of one step (what a compiled twin compiles: ``compiled_arms``)."""
        return self.model(**batch).loss

    def finish_step(self) -> None:
        """What follows the backward: the optimizer's step, then the gradients freed."""
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)

    def memory_breakdown(self) -> Mapping[str, int]:
        params = trainable_parameters(self.model)
        weights = parameter_bytes(self.model.parameters())
        return {
            "weights": weights,
            "optimizer_states": optimizer_state_bytes(self.optimizer),
            "gradients": parameter_bytes(params),  # one grad per trainable weight, weight dtype
        }


def build_no_optimizer(model: nn.Module, cfg: TrainConfig) -> TorchArm:
    return TorchArm(model, None, {"optimizer": None})


def adamw_builder(impl: str) -> Callable[[nn.Module, TrainConfig], TorchArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> TorchArm:
        flags = {"foreach": impl == "foreach", "fused": impl == "fused"}
        if cfg.capturable:
            flags["capturable"] = True   # step counts on the GPU: torch's own CUDA-graph mode
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                      weight_decay=cfg.weight_decay, **flags)
        settings = {"optimizer": "torch.optim.AdamW", "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps,
                    "weight_decay": cfg.weight_decay, **flags}
        return TorchArm(model, optimizer, settings)
    return build


class Fp32MomentsAdamW(torch.optim.Optimizer):
    """torch's AdamW on bf16 weights with fp32 moments: the step runs on fp32 copies of each weight
    and gradient and stores the result rounded to the weight's dtype.

    torch's AdamW keeps its moments in the parameter's dtype and refuses fp32 moments beside bf16
    weights, so this is how "fused AdamW with fp32 states" exists for bf16 weights (the convergence
    arm ``adamw_fused_fp32_states``): the same arithmetic as FORGE with fp32 moments. The fp32
    copies are scratch, overwritten from the weights every step (they are not master weights).
    ``param_groups`` are the bf16 weights', so a scheduler that sets ``lr`` there is followed."""

    def __init__(self, params: list[nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, fused: bool) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.pairs = [(p, torch.empty_like(p, dtype=torch.float32)) for group in self.param_groups
                      for p in group["params"]]
        self.inner = torch.optim.AdamW([s for _, s in self.pairs], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, fused=fused, foreach=not fused)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for key in ("lr", "betas", "eps", "weight_decay"):
            self.inner.param_groups[0][key] = self.param_groups[0][key]
        for weight, scratch in self.pairs:
            scratch.grad = None if weight.grad is None else weight.grad.float()
            scratch.copy_(weight)
        self.inner.step()
        for weight, scratch in self.pairs:
            if weight.grad is not None:
                weight.copy_(scratch)
            scratch.grad = None
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"inner": self.inner.state_dict(), "param_groups": [
            {k: v for k, v in group.items() if k != "params"} for group in self.param_groups]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        self.inner.load_state_dict(state_dict["inner"])
        for ours, saved in zip(self.param_groups, state_dict["param_groups"]):
            ours.update(saved)


def build_adamw_fp32_states(model: nn.Module, cfg: TrainConfig) -> TorchArm:
    fused = cfg.device.startswith("cuda")
    optimizer = Fp32MomentsAdamW(trainable_parameters(model), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, fused=fused)
    settings = {"optimizer": "torch.optim.AdamW on fp32 copies (fp32 moments, weights stored in their dtype)",
                "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
                "fused": fused, "state_dtype": "fp32"}
    return TorchArm(model, optimizer, settings)


def build_sgd(model: nn.Module, cfg: TrainConfig) -> TorchArm:
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=cfg.lr, momentum=cfg.momentum,
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
        loss = self.loss_of(batch)
        loss.backward()              # fused weights are updated here, their G never stored
        self.finish_step()
        return loss.detach()

    def loss_of(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The forward and the loss of one step (what a compiled twin compiles: ``compiled_arms``)."""
        return self.model(**batch).loss

    def finish_step(self) -> None:
        """What follows the backward: the fallback optimizer's step (tied / excluded weights, norms,
        biases), then the gradients freed."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def memory_breakdown(self) -> Mapping[str, int]:
        return {k: int(v) for k, v in self.optimizer.memory_breakdown().items()}


def forge_problem() -> str | None:
    """The availability check of every FORGE arm: None, or why forge_core cannot run here."""
    try:
        forge_core = importlib.import_module("forge_core")
    except Exception as exc:
        return f"forge_core cannot be imported: {type(exc).__name__}: {exc}"
    if not callable(getattr(forge_core, "fuse", None)):
        return "forge_core.fuse is not available in this checkout"
    return None


def forge_builder(state_dtype: str, overlap: bool = False) -> Callable[[nn.Module, TrainConfig], ForgeArm]:
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
        left_out = not_fused_summary(optimizer.excluded_modules)
        if left_out:
            settings["not_fused"] = left_out         # the coverage table's "left to the fallback" column
        return ForgeArm(model, optimizer, settings)
    return build


GALORE_SETTINGS = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "svd": "randomized"}
"""FORGE with GaLore's projection as the galore_adamw_rsvd peer runs GaLore alone (its README's
rank, gap and scale; the randomized SVD), so that the composability table compares like with like."""


def forge_galore_builder(state_dtype: str) -> Callable[[nn.Module, TrainConfig], ForgeArm]:
    """FORGE composed with GaLore: each hidden weight's G projected and stepped in its backward."""
    def build(model: nn.Module, cfg: TrainConfig) -> ForgeArm:
        import forge_core

        if cfg.capturable:
            raise ArmUnavailable("forge_galore: the projection refresh is a host decision; it cannot be captured")
        optimizer = forge_core.fuse(model, "galore_adamw", lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, state_dtype=state_dtype, **GALORE_SETTINGS)
        settings = {"optimizer": "forge_core.fuse(galore_adamw)", "lr": cfg.lr, "betas": list(cfg.betas),
                    "eps": cfg.eps, "weight_decay": cfg.weight_decay, "state_dtype": state_dtype, **GALORE_SETTINGS}
        left_out = not_fused_summary(optimizer.excluded_modules)
        if left_out:
            settings["not_fused"] = left_out
        return ForgeArm(model, optimizer, settings)
    return build


def not_fused_summary(excluded: Mapping[str, str]) -> dict[str, str]:
    """``fuse``'s left-out modules, one entry per module kind: layer indices become ``*`` and the
    count is appended ("backbone.layers.*.mixer.out_proj (48): the model reads its .weight ...")."""
    kinds: dict[str, list[str]] = {}
    for name, reason in excluded.items():
        kinds.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", name), []).append(reason)
    return {f"{kind} ({len(reasons)})": reasons[0] for kind, reasons in kinds.items()}


# --- the chunked LM-head loss (forge_core.chunked_lm_head_cross_entropy) -----------------------

# Config keys by which some causal LMs transform lm_head(hidden) before the loss (Gemma-2 soft-capping,
# Cohere / Granite scaling): the chunked loss computes lm_head(hidden) only, so such models are refused.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


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
    for key in LOGIT_TRANSFORMS:
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

    def loss_of(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(batch)


class ChunkedLossForgeArm(ForgeArm):
    """ForgeArm with the chunked LM-head loss: a fused (untied) head is updated chunk by chunk, so
    neither its logits nor its weight gradient exists; a tied head gets an ordinary gradient."""

    def __init__(self, model: nn.Module, optimizer: Any, settings: Mapping[str, Any], loss: ChunkedCausalLMLoss):
        super().__init__(model, optimizer, settings)
        self.loss = loss
        self.settings = loss.settings | self.settings
        loss.settings = self.settings

    def loss_of(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(batch)


def forge_cce_builder(state_dtype: str) -> Callable[[nn.Module, TrainConfig], ChunkedLossForgeArm]:
    fuse_build = forge_builder(state_dtype)

    def build(model: nn.Module, cfg: TrainConfig) -> ChunkedLossForgeArm:
        loss = ChunkedCausalLMLoss(model)          # refuses an unsuitable model before anything is fused
        arm = fuse_build(model, cfg)
        return ChunkedLossForgeArm(arm.model, arm.optimizer, arm.settings, loss)
    return build


def build_adamw_fused_cce(model: nn.Module, cfg: TrainConfig) -> ChunkedLossTorchArm:
    loss = ChunkedCausalLMLoss(model)
    arm = adamw_builder("fused")(model, cfg)
    return ChunkedLossTorchArm(arm.model, arm.optimizer, arm.settings, loss)


# bytes per parameter for oom_predicted: (optimizer states, gradients at the boundary)
