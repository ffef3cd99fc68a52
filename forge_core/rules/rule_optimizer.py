"""``RuleOptimizer``: a torch.optim.Optimizer that steps every parameter with a rule's reference.

What it is for: the unfused form of a rule that torch has no class for (AdaLomo, SM3, Adam-mini,
LARS; the harness's unfused arm and the parity gate's reference), the fallback that steps what
FORGE does not fuse (embeddings, norms, biases) with the same rule, and Adafactor's fallback in a
capturable optimizer (torch's Adafactor reads norms on the host). The arithmetic is the rule's
``reference``, the same function the fused path runs on a layer's G: fused and unfused differ only
in how G is summed. A bf16 parameter of a regime-3 rule is stepped in place, op by op in fp32, as
the fused path steps it.

States follow torch's conventions: created at a parameter's first step, zero, in the parameter's
dtype (so ``load_state_dict``'s cast to the parameter dtype is a no-op), of the shapes the rule
asks for (``Rule.shapes_of_states``, keyed by the parameter's name when ``parameter_names`` gives
one); ``step`` a float32 tensor, on the CPU (eager) or on the parameter's device (capturable: then
the references get it as a tensor and nothing syncs with the host). The math runs in fp32.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from .base import Rule, fp32_states, known_hyperparameters, matrix_step_states


STEPPED_DIMS = (1, 2)
"""The parameter ranks a ``RuleOptimizer`` steps (the regime-3 references take vectors and matrices)."""


def unsteppable_parameter(named_parameters: Iterable[tuple[str, torch.Tensor]], rule_name: str) -> Optional[str]:
    """Why a ``RuleOptimizer`` of ``rule_name`` could not step one of these trainable parameters (one line naming
    it), or None. ``fuse`` asks before anything is swapped: a 3-D one (MoE experts, a convolution) left to the
    fallback failed at the first ``step()``."""
    for name, parameter in named_parameters:
        if parameter.requires_grad and parameter.dim() not in STEPPED_DIMS:
            return (f"optimizer {rule_name!r} cannot step {name!r} of shape {tuple(parameter.shape)}: its per-layer "
                    "step and the fallback that steps what it does not fuse take 1-D and 2-D parameters (freeze it, "
                    "or use another optimizer)")
    return None


class RuleOptimizer(torch.optim.Optimizer):
    """``rule.reference`` on every parameter with a gradient (1-D and 2-D parameters)."""

    def __init__(self, params: Any, rule: Rule, *, capturable: bool = False,
                 parameter_names: Optional[Mapping[int, str]] = None, matrix_kernels: Any = None,
                 **hyperparameters: Any) -> None:
        unknown = sorted(set(hyperparameters) - set(rule.defaults))
        if unknown:
            raise ValueError(f"{rule.name}: unknown hyper-parameter(s) {unknown}; known: {sorted(rule.defaults)}")
        defaults = {**rule.resolve_hp(hyperparameters), "capturable": bool(capturable)}
        self.rule = rule
        self.parameter_names: dict[int, str] = dict(parameter_names or {})
        self.matrix_kernels = matrix_kernels if rule.matrix_step is not None else None
        """The kernels ``rule.matrix_step`` runs a 2-D parameter's step on (where they take its
        gradient: ``runs_here``), reading the gradient in its own dtype; None: ``reference`` always."""
        super().__init__(params, defaults)
        probe = torch.zeros(1)
        rule.reference(probe.clone(), probe.clone(), {name: torch.zeros(size) for name, size in
                                                      rule.shapes_of_states((1,), defaults, "").items()}, defaults, 1)

    def _new_state(self, parameter: torch.Tensor, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if parameter.dim() not in STEPPED_DIMS:
            raise ValueError(f"{self.rule.name}: parameters must be 1-D or 2-D, got shape {tuple(parameter.shape)}")
        device = parameter.device if group["capturable"] else torch.device("cpu")
        state = {"step": torch.zeros((), dtype=torch.float32, device=device)}
        name = self.parameter_names.get(id(parameter), "")
        for key, shape in self.rule.shapes_of_states(tuple(parameter.shape), group, name).items():
            state[key] = torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if parameter.grad.is_sparse:
                    raise RuntimeError(f"{self.rule.name} does not support sparse gradients")
                state = self.state[parameter]
                if not state:
                    state.update(self._new_state(parameter, group))
                state["step"] += 1
                step = state["step"] if group["capturable"] else int(state["step"].item())
                self._step_one(parameter, state, group, step)
        return loss

    def _step_one(self, parameter: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any], step: Any) -> None:
        stored = {key: value for key, value in state.items() if key != "step"}
        kernels = self.matrix_kernels
        if kernels is not None and parameter.dim() == 2 and kernels.runs_here(parameter.grad, parameter):
            # the gradient is only read (no fp32 copy of it: an embedding's is 2 GB at Llama-3.1-8B)
            states32 = matrix_step_states(stored, tuple(parameter.shape))
            self.rule.matrix_step(parameter, parameter.grad, states32, group, step, kernels)
        else:
            states32 = fp32_states(stored)
            # the parameter in its own dtype: a regime-3 reference steps a bf16 weight op by op in fp32
            # (forge_core.layer_step.deferred_update does the same), a regime-1 one needs fp32
            weight = parameter if parameter.dtype == torch.float32 or self.rule.regime == 3 else parameter.float()
            self.rule.reference(weight, parameter.grad.to(torch.float32, copy=True), states32, group, step)
            if weight.data_ptr() != parameter.data_ptr():
                parameter.copy_(weight)
        self._store(state, states32)

    @staticmethod
    def _store(state: dict[str, Any], states32: Mapping[str, torch.Tensor]) -> None:
        for key, value in states32.items():
            if value.data_ptr() != state[key].data_ptr():
                state[key].copy_(value)


def reference_rule(*, fallback_overrides: Optional[Mapping[str, Any]] = None, **fields: Any) -> Rule:
    """A regime-3 rule torch has no class for: ``Rule(**fields)`` whose fallback optimizer (what FORGE
    does not fuse, and the harness's unfused arm) is a ``RuleOptimizer`` on the rule's own reference,
    with ``fallback_overrides`` over the group's values (at construction and at every step); states in
    fp32 or bf16, as the per-layer path stores them."""
    overrides = dict(fallback_overrides or {})

    def forge_fallback(params: Any, capturable: bool = False, matrix_kernels: Any = None,
                       **hp: Any) -> torch.optim.Optimizer:
        return RuleOptimizer(params, rule, capturable=capturable, matrix_kernels=matrix_kernels,
                             **{**known_hyperparameters(hp, rule.defaults), **overrides})

    def fallback_optimizer(params: Any, capturable: bool = False, **hp: Any) -> torch.optim.Optimizer:
        return forge_fallback(params, capturable=capturable, **hp)      # the reference on every parameter

    if fields.get("matrix_step") is not None:      # a ForgeOptimizer's fallback takes the kernels too
        fields["forge_fallback"] = forge_fallback
    if overrides:          # kept on every step too, when the optimizer syncs the fallback's groups with its own
        fields["fallback_hyperparameters"] = lambda hp: {**hp, **overrides}
    rule = Rule(fallback_optimizer=fallback_optimizer, regime=3, state_dtypes=frozenset({"fp32", "bf16"}), **fields)
    return rule


__all__ = ["STEPPED_DIMS", "RuleOptimizer", "reference_rule", "unsteppable_parameter"]
