"""The contract every optimizer rule file satisfies.

A rule is one file in ``forge_core/rules/``: its plain-torch reference (the spec) and its
Triton epilogue (what the fused kernel runs on each weight tile after the fp32 gradient tile
is accumulated). Adding a rule = one file + one line in ``forge_core/rules/__init__.py``.

Three regimes (docs/design.md, section 1; ``Rule.regime``):

* regime 1 (``layer_sums == 0``): the state step and the weight update are coordinate-wise; the
  fused kernel's epilogue updates W and the states of its tile.
* regime 2: the weight update reads the whole matrix. In the kernel (``layer_sums > 0``, LAMB): the
  epilogue updates the states only and returns per-element terms whose sums over the layer the
  kernel accumulates; a second elementwise pass (``apply``) then writes W from the stored states
  and those sums. In plain torch (``layer_update``, Muon): ``forge_core.layer_step`` runs the
  rule's own GEMM and whole-matrix update inside the layer's backward.
* regime 3 (deferred: Adafactor, AdaLomo, SM3, Adam-mini, LARS): the layer's G is formed, stepped
  by ``reference`` and freed inside that layer's backward (``forge_core.layer_step``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..dtensors import is_dtensor


@dataclass(frozen=True)
class Rule:
    name: str
    """Registry key, e.g. "adamw"."""
    state_names: tuple[str, ...]
    """Every per-weight state tensor the rule may hold, in the order the epilogue takes them, e.g.
    ("exp_avg", "exp_avg_sq"). A rule whose states depend on its hyper-parameters holds the subset
    ``state_names_for(hp)`` (in this order)."""
    defaults: Mapping[str, Any]
    """Hyper-parameters and their defaults, ``lr`` included (what a param_group holds)."""
    reference: Callable[..., None]
    """``reference(weight32, grad32, states32: dict[str, Tensor], hp: Mapping, step: int) -> None``:
    updates fp32 weight and fp32 states in place (``states32`` holds the states of
    ``state_names_for(hp)``). This is the spec the kernel is tested against."""
    fallback_optimizer: Callable[..., torch.optim.Optimizer]
    """``fallback_optimizer(params_or_groups, capturable=False, **hp)``: the torch optimizer that steps
    the parameters FORGE does not fuse (biases, norms, embeddings, tied weights) with the same
    hyper-parameters; ``capturable=True`` makes it safe to replay in a CUDA graph."""
    epilogue: Any = None
    """The ``@triton.jit`` epilogue of the full state set ``state_names``:
    ``epilogue(w, g, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7, FAST) -> (w, s0, s1, s2)`` on fp32
    tiles, where ``s0``/``s1``/``s2`` are the states in order (a slot past the rule's states is a
    dummy that is neither read meaningfully nor stored), ``c0..c7`` are the floats returned by
    ``kernel_scalars`` and ``FAST`` (a ``tl.constexpr``) is true on the GPU, where hardware
    approximations (``libdevice``) may replace IEEE operations; the CPU interpreter has no
    ``libdevice`` and passes false. A regime-2 epilogue returns ``(w, s0, s1, s2, t0, ...)``: W as
    it came (the kernel does not store it) and one fp32 term tile per layer sum. Elementwise
    operations only: the Gluon kernel runs the same function on tensors with layouts, where
    ``tl.zeros_like`` and reductions inside it do not compile."""
    kernel_scalars: Callable[[Mapping[str, Any], int], tuple[float, ...]] | None = None
    """``kernel_scalars(hp, step) -> tuple`` of at most 8 floats the epilogue reads (lr, decay
    factors, bias corrections...), computed on the host in float64 so that a new step or a new
    ``lr`` is a new runtime argument, never a recompilation."""
    kernel_scalars_on_device: Callable[[Mapping[str, Any], torch.Tensor], tuple[Any, ...]] | None = None
    """``kernel_scalars_on_device(hp, step) -> tuple`` of the same values as ``kernel_scalars`` for a
    float64 ``step`` tensor (0-d, on the weights' device), each a Python float or a 0-d tensor computed
    with torch ops on that device: no host sync, so the step count can live on the GPU and a CUDA
    graph can replay the computation (``fuse(..., capturable=True)``). None: the rule is not capturable."""
    sqrt_domain_states: frozenset[str] = field(default_factory=frozenset)
    """States stored as sqrt(value) when quantized to int8 / fp8 (second moments), see forge_core/state.py."""
    floored_states: frozenset[str] = field(default_factory=frozenset)
    """States stored as they are whose int8 / fp8 codes are floored at the smallest positive code, as a
    sqrt-domain state's are: a non-negative denominator kept as it is (Adamax's ``exp_inf``), which a
    zero code would turn into ``eps`` (forge_core/state.py says why)."""
    signed_states: frozenset[str] = field(default_factory=frozenset)
    """States that can be negative (first moments); the others are non-negative."""
    nonzero_code_states: frozenset[str] | None = None
    """The int8 states an untied embedding keeps at a non-zero code for every non-zero value
    (``forge_core.dense.EmbeddingState``); None: ``signed_states``. RMSprop's ``grad_avg`` is left out:
    raised to a code step it would push the centered variance ``square_avg - grad_avg^2`` of a rarely
    touched row below zero."""
    state_names_for: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    """``state_names_for(hp)``: the states a weight holds under these hyper-parameters (a subset of
    ``state_names``, in its order), fixed when the optimizer state is allocated (``fuse``): SGD without
    momentum holds none, RMSprop holds ``momentum_buffer`` only with momentum and ``grad_avg`` only when
    centered. None: always ``state_names``."""
    epilogues: Mapping[tuple[str, ...], Any] | None = None
    """The epilogue per state set, where the sets of ``state_names_for`` need different ones (RMSprop);
    a set not listed runs ``epilogue``."""
    initial_state: Callable[[str, Mapping[str, Any]], float] | None = None
    """``initial_state(name, hp) -> float``: the value a state starts at (Adagrad's
    ``initial_accumulator_value``); None: every state starts at zero, as torch's moments do."""
    layer_sums: int = 0
    """Regime 2: how many per-layer sums the epilogue returns terms for (LAMB: 2, ||W||^2 and
    ||r||^2); 0 for a coordinate-wise rule."""
    apply: Any = None
    """Regime 2: the ``@triton.jit`` second pass, ``apply(w, s0, s1, s2, sum0, sum1, c0..c7, FAST) -> w``
    on fp32 tiles (the stored states, decoded; the layer's sums), run over the whole weight after the
    fused kernel; it reads the same ``kernel_scalars``."""
    state_dtypes: frozenset[str] | None = None
    """The state formats the rule can store (None: every one of forge_core.state.STATE_DTYPES)."""
    format_refusal: Callable[[Mapping[str, Any], str], str | None] | None = None
    """``format_refusal(hp, state_dtype)``: why these hyper-parameters cannot be stepped with states of this
    format (one line), or None (``format_problem``; centered RMSprop with int8 / fp8 states). None: any."""
    refusals: Mapping[str, str] = field(default_factory=dict)
    """Options the rule refuses at ``fuse`` time, each with why: keys "capturable", "accumulate_steps",
    "stochastic_rounding" (see ``option_problem``)."""

    regime: int = 1
    """Where the rule's step runs (docs/design.md, section 1): 1 = in the fused kernel's epilogue
    (a coordinate-wise state step); 2 = a whole-matrix weight update after the layer's accumulate
    (Muon's Newton-Schulz, LAMB's trust ratio); 3 = deferred: the layer's gradient is formed,
    stepped and freed inside that layer's backward (Adafactor, SM3, Adam-mini, LARS, AdaLomo)."""
    layer_update: Callable[..., None] | None = None
    """A regime-2 rule stepped in plain torch (``forge_core.layer_step``): ``layer_update(x2, dy2,
    weight, states, hp, step, *, grad_accum, first_micro_batch, last_micro_batch)`` with the layer's
    flattened input and output gradient, the weight and its stored states, updated in place. A
    regime-3 rule leaves it None: the layer path forms G and runs ``reference``."""
    matrix_step: Callable[..., None] | None = None
    """A regime-3 rule's ``reference`` for a 2-D weight with its passes over G in Triton kernels:
    ``matrix_step(weight, grad, states, hp, step, kernels)``, where ``kernels`` is the module
    that runs them (``forge_core.kernels.matrix_steps``, handed in so a rule imports no kernel
    module) and ``states`` are ``matrix_step_states``: a layer-sized state as stored, fp32 or bf16,
    which the kernels round once (no fp32 copy of it), a smaller one in fp32. The layer path takes it
    where those kernels run (a CUDA G, or the CPU interpreter); the same arithmetic as
    ``reference``, to rounding. None: ``reference`` always."""
    state_shapes: Callable[[tuple[int, ...], Mapping[str, Any], str], dict[str, tuple[int, ...]]] | None = None
    """``state_shapes(parameter_shape, hp, name) -> {state name: shape}`` for a rule whose states are
    not parameter-shaped (row / column / block statistics); ``name`` is the parameter's or module's
    qualified name (Adam-mini partitions by it). None: ``state_names``, each of the parameter's shape."""
    hidden_weights_only: bool = False
    """Fuse hidden-layer weights only: the output head (``model.get_output_embeddings()``) stays with
    the fallback optimizer, as torch.optim.Muon's users step it with AdamW."""
    fallback_hyperparameters: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """Our param group's values -> the fallback optimizer's (Muon's ``adamw_*`` keys become AdamW's
    ``lr``, ``betas``, ...). None: the same keys."""
    forge_fallback: Callable[..., torch.optim.Optimizer] | None = None
    """``forge_fallback(params_or_groups, capturable=False, matrix_kernels=None, **hp)``: what a
    ``ForgeOptimizer`` steps its unfused parameters with, where that should not be the unfused arm's
    ``fallback_optimizer``: the factored rules' ``RuleOptimizer``, which reads no norm on the host
    (torch.optim.Adafactor reads two per parameter: 133 syncs in an eager Llama-3.1-8B step) and
    steps 2-D parameters (the embedding) with ``matrix_step`` on ``matrix_kernels``. None:
    ``fallback_optimizer``."""
    layer_capturable: bool = False
    """Regimes 2 and 3: the layer update runs device ops only (no host sync; the step may be a 0-d
    device tensor), so ``fuse(..., capturable=True)`` can capture it in a CUDA graph."""
    state_accumulates: Callable[[Mapping[str, Any]], bool] | None = None
    """``state_accumulates(hp)``: True when ``layer_update`` takes the earlier micro-batches of
    ``accumulate_steps`` into its own state (Muon without Nesterov: the momentum buffer), so no fp32
    gradient accumulator is kept. None: never."""

    def keeps_nonzero_codes(self, name: str) -> bool:
        """Whether an untied embedding's int8 state ``name`` keeps a non-zero code for every non-zero value
        (a regime-2 rule's moments never do: its second pass reads them as ``ParamState`` stores them)."""
        kept = self.signed_states if self.nonzero_code_states is None else self.nonzero_code_states
        return name in kept and not self.layer_sums

    def shapes_of_states(self, shape: tuple[int, ...], hp: Mapping[str, Any], name: str = "") -> dict[str, tuple[int, ...]]:
        """The states a parameter of ``shape`` called ``name`` holds, and their shapes (``state_shapes``)."""
        if self.state_shapes is None:
            return {state: tuple(shape) for state in self.state_names}
        return {state: tuple(size) for state, size in self.state_shapes(tuple(shape), hp, name).items()}

    def fallback_values(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """A param group's values (not its ``params``) as the fallback optimizer's group takes them
        (``fallback_hyperparameters``; the same keys when None)."""
        values = {key: value for key, value in group.items() if key != "params"}
        return self.fallback_hyperparameters(values) if self.fallback_hyperparameters is not None else values

    def resolve_hp(self, hp: Mapping[str, Any]) -> dict[str, Any]:
        """This rule's hyper-parameters from ``hp`` (a param_group holds more keys, e.g. ``params``),
        with defaults filled in for any that are missing."""
        return {key: hp.get(key, default) for key, default in self.defaults.items()}

    def states_for(self, hp: Mapping[str, Any] | None) -> tuple[str, ...]:
        """The states a weight holds under ``hp`` (None: ``state_names``, every state)."""
        if hp is None or self.state_names_for is None:
            return self.state_names
        names = tuple(self.state_names_for(self.resolve_hp(hp)))
        if any(name not in self.state_names for name in names):
            raise ValueError(f"rule {self.name!r}: state_names_for gave {names}, not a subset of {self.state_names}")
        return names

    def state_set_problem(self, held: tuple[str, ...], hp: Mapping[str, Any]) -> str | None:
        """Why ``hp`` cannot update a weight holding the states ``held`` (fixed when they were allocated,
        at ``fuse``: SGD's momentum raised from 0, RMSprop's momentum or centered switched), or None."""
        if self.state_names_for is None:    # no hyper-parameter picks the states (the per-layer rules' shapes
            return None                     # come from ``state_shapes`` instead)
        wanted = self.states_for(hp)
        if wanted == tuple(held):
            return None
        return (f"rule {self.name!r}: these hyper-parameters need the states {list(wanted)}, but fuse allocated "
                f"{list(held)} from its hyper-parameters; the state set is fixed at fuse time (fuse again with the "
                "new values)")

    def epilogue_for(self, names: tuple[str, ...]) -> Any:
        """The epilogue that runs a weight holding the states ``names``."""
        if self.epilogues is not None and tuple(names) in self.epilogues:
            return self.epilogues[tuple(names)]
        return self.epilogue

    def kernel_name(self, names: tuple[str, ...]) -> str:
        """The rule's name in a tuning key: the name alone for the full state set, else with the
        states held (``"sgd[]"``, ``"rmsprop[square_avg,grad_avg]"``): each set compiles its own
        kernel, and ``parse_kernel_name`` reads it back (tune-cache re-keying)."""
        names = tuple(names)
        return self.name if names == self.state_names else f"{self.name}[{','.join(names)}]"

    def initial_value(self, name: str, hp: Mapping[str, Any] | None) -> float:
        """The value state ``name`` starts at under ``hp`` (the defaults when None)."""
        if self.initial_state is None:
            return 0.0
        return float(self.initial_state(name, self.resolve_hp(hp or {})))

    def format_problem(self, hp: Mapping[str, Any], state_dtype: str) -> str | None:
        """Why a weight with these hyper-parameters cannot keep ``state_dtype`` states (``format_refusal``), or
        None; ``fuse`` raises it as a ValueError."""
        return self.format_refusal(self.resolve_hp(hp), state_dtype) if self.format_refusal is not None else None

    def option_problem(self, *, state_dtype: str = "fp32", accumulate_steps: int = 1, capturable: bool = False,
                       stochastic_rounding: bool = False) -> str | None:
        """Why this rule cannot run with these ``fuse`` options (one line naming the rule and the option),
        or None."""
        if self.state_dtypes is not None and state_dtype not in self.state_dtypes:
            return (f"rule {self.name!r} cannot store state_dtype={state_dtype!r}; "
                    f"it takes {sorted(self.state_dtypes)}")
        checks = (("capturable", capturable), ("accumulate_steps", accumulate_steps != 1),
                  ("stochastic_rounding", stochastic_rounding))
        for option, asked in checks:
            if asked and option in self.refusals:
                return f"rule {self.name!r} does not support {option}: {self.refusals[option]}"
        if capturable and self.kernel_scalars_on_device is None and not self.layer_capturable:
            return f"rule {self.name!r} does not support capturable=True (it has no kernel_scalars_on_device)"
        return None


def _as_fp32(value: torch.Tensor) -> torch.Tensor:
    return value if value.dtype == torch.float32 else value.float()


def fp32_states(stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The states ``Rule.reference`` takes from ``stored``: each in fp32, itself when stored so
    (stepped in place), else a copy (rounded back once by the caller)."""
    return {name: _as_fp32(value) for name, value in stored.items()}


def matrix_step_states(stored: Mapping[str, torch.Tensor], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The states ``Rule.matrix_step`` takes from ``stored`` (a parameter of ``shape``): one of the
    parameter's shape as stored (its kernel reads and rounds it in place), a smaller one as
    ``fp32_states`` gives it."""
    return {name: value if tuple(value.shape) == tuple(shape) else _as_fp32(value) for name, value in stored.items()}


def parse_kernel_name(text: str) -> tuple[str, tuple[str, ...] | None]:
    """(rule name, states) of a ``Rule.kernel_name``; states None for the bare name (the full set)."""
    if text.endswith("]") and "[" in text:
        name, states = text[:-1].split("[", 1)
        return name, tuple(s for s in states.split(",") if s)
    return text, None


KERNEL_SCALARS = 8
"""How many floats a rule may hand the fused kernel (``kernel_scalars`` / ``kernel_scalars_on_device``)."""
MAX_STATES = 3
"""How many state tensors the kernels take per weight (``Rule.state_names``)."""


def check_scalar_count(rule_name: str, count: int) -> None:
    """A clear error for a rule that returns more kernel scalars than the kernel takes."""
    if count > KERNEL_SCALARS:
        raise ValueError(f"rule {rule_name!r} returned {count} kernel scalars; at most {KERNEL_SCALARS}")


def known_hyperparameters(hp: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``hp`` a rule knows: a param_group also carries keys of its own
    (``params``, a scheduler's ``initial_lr``) that the fallback torch optimizer must not get."""
    return {key: hp[key] for key in defaults if key in hp}


def all_cuda(params: Any) -> bool:
    """Whether every parameter (of a list or of param-group dicts) is a floating CUDA tensor."""
    flat = []
    for item in params:
        flat.extend(item["params"] if isinstance(item, dict) else [item])
    return bool(flat) and all(isinstance(p, torch.Tensor) and p.is_cuda and p.is_floating_point() for p in flat)


def torch_fused_flag(params: Any) -> dict[str, bool]:
    """``{"fused": True}`` when every parameter is a floating CUDA tensor (torch's fused AdamW / SGD
    take one kernel launch per few tensors instead of foreach's per-op launches: on a host-bound
    Llama-8B step the fallback embedding update alone cost ~8 ms of foreach kernels), else ``{}``
    so torch picks its default (CPU tensors, or a mix); ``{"foreach": False}`` for a mix of DTensors
    (tensor-parallel shards) and plain tensors, which torch's multi-tensor kernels refuse."""
    flat = []
    for item in params:
        flat.extend(item["params"] if isinstance(item, dict) else [item])
    sharded = [is_dtensor(p) for p in flat]
    if any(sharded) and not all(sharded):
        return {"foreach": False}    # a multi-tensor kernel refuses a list mixing DTensors and tensors
    return {"fused": True} if all_cuda(flat) else {}


def capturable_flag(params: Any, capturable: bool) -> dict[str, bool]:
    """``{"capturable": True}`` for torch's optimizers that take the flag, when asked and every parameter
    is on CUDA (torch refuses it for CPU tensors), else ``{}``."""
    return {"capturable": True} if capturable and all_cuda(params) else {}
