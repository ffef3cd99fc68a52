"""The optimizer families of the paper's App. I as arms: each fused and unfused.

Per family (a ``forge_core`` rule name): ``<family>_unfused``, the optimizer as a practitioner runs
it (torch.optim's class where torch has one, forge_core's reference optimizer where it has none;
Muon: torch.optim.Muon on the hidden weights and torch.optim.AdamW on the rest), and
``forge_<family>_fp32`` / ``forge_<family>_bf16``, ``forge_core.fuse(model, family)`` with fp32 or
bf16 states. Every arm claims the family's algorithm, so the parity gate runs each against the
unfused optimizer in fp32 (``unfused_optimizer`` on the fp32 reference model). The table lists the
regime-1 families of the fused kernel too: an arm whose rule this forge_core lacks is
``unavailable`` with that reason, so the registry picks a rule up by its name once it exists.

Hyper-parameters come from the sweep's ``TrainConfig`` where a family has the name (``lr``,
``betas``, ``eps``, ``weight_decay``; ``momentum`` for LARS, the one SGD-like family) and from
the rule's defaults otherwise (torch.optim's defaults where torch has the class). Muon's AdamW
takes the sweep's ``lr``, ``betas``, ``eps`` and ``weight_decay``; Adam-mini partitions queries
and keys by the model's head width.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from forge_bench.arm import ArmUnavailable, TrainConfig, trainable_parameters
from forge_bench.family_table import FAMILIES, STATE_DTYPES, family_of
from forge_bench.torch_arms import ForgeArm, TorchArm

STATE_BYTES = {"fp32": 4.0, "bf16": 2.0}


def family_problem(name: str) -> Callable[[], str | None]:
    """An availability check: None, or why this forge_core cannot run the family's rule."""
    def check() -> str | None:
        try:
            forge_core = importlib.import_module("forge_core")
        except Exception as exc:
            return f"forge_core cannot be imported: {type(exc).__name__}: {exc}"
        if name not in forge_core.RULES:
            return f"forge_core has no rule {name!r} in this checkout (known: {', '.join(sorted(forge_core.RULES))})"
        return None
    return check


def _same_kind(default: Any, value: Any) -> bool:
    """Whether a sweep value can stand in for a rule default (Adafactor's ``eps`` pair is not a float)."""
    if default is None or isinstance(default, bool):
        return False
    if isinstance(default, tuple):
        return isinstance(value, tuple) and len(value) == len(default)
    return isinstance(default, (int, float)) and isinstance(value, (int, float))


def head_dim_of(model: nn.Module) -> int | None:
    """The attention head width of a transformers model (``head_dim``, else hidden / heads)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return int(hidden) // int(heads) if hidden and heads else None


def family_hyperparameters(name: str, cfg: TrainConfig, model: nn.Module | None = None) -> dict[str, Any]:
    """The hyper-parameters every arm of family ``name`` runs with (module docstring)."""
    import forge_core

    family = family_of(name)
    defaults = forge_core.get_rule(name).defaults
    sweep = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    hp = {key: value for key, value in sweep.items() if key in defaults and _same_kind(defaults[key], value)}
    if family.takes_momentum and "momentum" in defaults:
        hp["momentum"] = cfg.momentum
    if name == "muon":
        hp.update(adamw_lr=cfg.lr, adamw_betas=tuple(cfg.betas), adamw_eps=cfg.eps,
                  adamw_weight_decay=cfg.weight_decay)
    if name == "adam_mini" and model is not None:
        hp["head_dim"] = head_dim_of(model)
    return hp


class OptimizerChain:
    """Several torch optimizers stepped as one: torch.optim.Muon on the hidden weights and
    torch.optim.AdamW on the rest, as torch.optim.Muon's documentation pairs them."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @property
    def state(self) -> dict[Any, Any]:
        merged: dict[Any, Any] = {}
        for optimizer in self.optimizers:
            merged.update(optimizer.state)
        return merged

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self, closure: Any = None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def unfused_optimizer(name: str, model: nn.Module, cfg: TrainConfig) -> Any:
    """The unfused optimizer of family ``name`` over ``model``'s trainable parameters (the unfused
    arm's, and the parity gate's reference when ``model`` is the fp32 twin)."""
    import forge_core
    from forge_core.rules.muon import hidden_and_other_parameters
    from forge_core.rules.rule_optimizer import RuleOptimizer

    family = family_of(name)
    hp = family_hyperparameters(name, cfg, model)
    capture = {"capturable": True} if cfg.capturable else {}
    if name == "muon":
        hidden, other = hidden_and_other_parameters(model)
        muon_hp = {key: value for key, value in hp.items() if not key.startswith("adamw_")}
        adamw = torch.optim.AdamW(other, lr=hp["adamw_lr"], betas=hp["adamw_betas"], eps=hp["adamw_eps"],
                                  weight_decay=hp["adamw_weight_decay"], **capture)
        return OptimizerChain([torch.optim.Muon(hidden, **muon_hp), adamw])
    params = trainable_parameters(model)
    if family.torch_class is not None:
        return getattr(torch.optim, family.torch_class)(params, **hp, **capture)
    rule = forge_core.get_rule(name)
    if rule.regime == 3:         # the reference optimizers take names (Adam-mini partitions by them)
        names = {id(p): n for n, p in model.named_parameters()}
        return RuleOptimizer(params, rule, parameter_names=names, capturable=cfg.capturable, **hp)
    return rule.fallback_optimizer(params, capturable=cfg.capturable, **hp)


def _jsonable(hp: Mapping[str, Any]) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in hp.items()}


def unfused_builder(name: str) -> Callable[[nn.Module, TrainConfig], TorchArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> TorchArm:
        family = family_of(name)
        optimizer = unfused_optimizer(name, model, cfg)
        settings = {"optimizer": family.unfused, "family": name, "fused": False,
                    **_jsonable(family_hyperparameters(name, cfg, model))}
        return TorchArm(model, optimizer, settings)
    return build


def capture_problem(rule: Any) -> str | None:
    """Why ``fuse(..., capturable=True)`` would refuse ``rule`` (None: it captures)."""
    if rule.epilogue is None and rule.layer_update is None and rule.regime != 3:
        return f"rule {rule.name!r} has neither a kernel epilogue nor a layer step"
    if rule.epilogue is None and not rule.layer_capturable:
        return f"rule {rule.name!r} syncs with the host in its layer step"
    if rule.epilogue is not None and rule.kernel_scalars_on_device is None:
        return f"rule {rule.name!r} computes its kernel scalars on the host"
    return None


def forge_builder(name: str, state_dtype: str) -> Callable[[nn.Module, TrainConfig], ForgeArm]:
    def build(model: nn.Module, cfg: TrainConfig) -> ForgeArm:
        import forge_core

        rule = forge_core.get_rule(name)
        arm = f"forge_{name}_{state_dtype}"
        if rule.state_dtypes is not None and state_dtype not in rule.state_dtypes:
            raise ArmUnavailable(f"{arm}: {name} keeps its states in {', '.join(sorted(rule.state_dtypes))}")
        if cfg.capturable and capture_problem(rule):
            raise ArmUnavailable(f"{arm}: cannot be captured in a CUDA graph: {capture_problem(rule)}")
        hp = family_hyperparameters(name, cfg, model)
        optimizer = forge_core.fuse(model, name, state_dtype=state_dtype, capturable=cfg.capturable, **hp)
        settings = {"optimizer": f"forge_core.fuse({name})", "family": name, "fused": True,
                    "state_dtype": state_dtype, **_jsonable(hp), "backend": getattr(optimizer, "backend", "auto")}
        if cfg.capturable:
            settings["capturable"] = True
        return ForgeArm(model, optimizer, settings)
    return build


def unfused_bytes(name: str) -> Callable[[int], tuple[float, float]]:
    """``Method.bytes_per_param`` of the unfused arm: states and a gradient in the weight dtype."""
    states = family_of(name).states
    return lambda weight_bytes: (states * weight_bytes, float(weight_bytes))


def forge_bytes(name: str, state_dtype: str) -> Callable[[int], tuple[float, float]]:
    """``Method.bytes_per_param`` of a FORGE arm: states in ``state_dtype``, no gradient pool."""
    states = family_of(name).states * STATE_BYTES[state_dtype]
    return lambda weight_bytes: (states, 0.0)


def method_entries(forge_needs: tuple[str, ...]) -> list[dict[str, Any]]:
    """The keyword arguments of one ``methods.Method`` per arm: per family the unfused arm, then
    FORGE with fp32 and with bf16 states."""
    entries: list[dict[str, Any]] = []
    for family in FAMILIES.values():
        check = family_problem(family.name)
        entries.append(dict(
            name=f"{family.name}_unfused", family="baseline",
            description=f"{family.label} unfused: {family.unfused}; every gradient formed, states in the weight dtype",
            build=unfused_builder(family.name), requires=forge_needs, extra_check=check,
            settings={"family": family.name, "fused": False}, parity_reference=family.name,
            bytes_per_param=unfused_bytes(family.name), graphable=family.unfused_graphable))
        for state_dtype in STATE_DTYPES:
            entries.append(dict(
                name=f"forge_{family.name}_{state_dtype}", family="forge",
                description=f"FORGE {family.label} (regime {family.regime}), {state_dtype} states (forge_core.fuse)",
                build=forge_builder(family.name, state_dtype), requires=forge_needs, extra_check=check,
                settings={"family": family.name, "fused": True, "state_dtype": state_dtype},
                parity_reference=family.name, bytes_per_param=forge_bytes(family.name, state_dtype), graphable=True))
    return entries


__all__ = ["FAMILIES", "OptimizerChain", "family_hyperparameters", "forge_builder", "method_entries",
           "unfused_builder", "unfused_optimizer"]
