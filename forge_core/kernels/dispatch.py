"""``fused_wgrad_update``: one fused step of a weight, on the kernel and tile chosen for it.

The first call of a weight and activation layout checks its arguments, takes the tile the tuner
chose (``tuning``), lets the Gluon kernel take the weight where it is faster (``ws_choice``), and
keeps the resulting plan (``PLANS``); later calls with the same layout launch that plan directly.
A regime-2 rule (LAMB) runs three launches per step: its per-layer sums zeroed, the fused kernel
(states and sums), and the second pass (``layer_apply``: W).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Mapping

import torch
import triton

from ..state import ParamState
from ..traced import graph_capturing
from . import hopper_ws, launch, layer_apply, tuning, ws_choice
from .device import interpreting, triton_available
from .direct_launch import direct_launch_enabled
from .launch import kernel_meta, kernel_scalars, kernel_states, launch_scalars
from .reference import check_arguments, flatten_tokens
from .tile_config import INTERPRETER_CONFIG, TileConfig, check_config
from .tuning import ws_identity

PLANS: "weakref.WeakKeyDictionary[ParamState, dict]" = weakref.WeakKeyDictionary()
"""Per ParamState: {signature: launch.LaunchPlan or WsPlan}. Weak keys: a plan never keeps a dropped
optimizer's tensors alive through this table, and copying or pickling a ParamState never drags
plans along. ``hopper_ws.PROGRAM_CAP`` is read when a plan is made: clear this after changing it."""


def fused_wgrad_update(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                       hp: Mapping[str, Any], step: int, *, grad_accum: torch.Tensor | None = None,
                       stochastic_rounding: bool = False, seed: int = 0, config: TileConfig | None = None,
                       device_scalars: torch.Tensor | None = None) -> None:
    """One optimizer step of ``state.rule`` on ``weight`` with G = dY^T X, G never materialized.

    ``x``: (..., Din), ``dy``: (..., Dout), same dtype (bf16 / fp16 / fp32); ``weight`` (Dout, Din)
    bf16 or fp32, updated in place with ``state``. fp32 inputs use IEEE fp32 products unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set. ``seed`` drives stochastic rounding (vary it
    per step). ``config`` pins a tile configuration (benchmarks); otherwise one is tuned per shape.
    ``device_scalars``: a float32 tensor of ``NUM_SCALARS`` on the weight's device holding the rule's
    kernel scalars (``rule.kernel_scalars_on_device``); the kernel reads them there and ``hp`` / ``step``
    are not used, so the launch can be captured in a CUDA graph and replayed at later steps.
    """
    in_memory = device_scalars is not None
    signature = _plan_signature(x, dy, weight, state, grad_accum, stochastic_rounding, config, in_memory)
    plans = PLANS.get(state)
    cached = plans.get(signature) if plans is not None and signature is not None else None
    if cached is not None:
        # Same weight, states, layouts and dtypes as a call that passed every check below.
        x2, dy2 = flatten_tokens(x, x.shape[-1], "x"), flatten_tokens(dy, dy.shape[-1], "dy")
        scalars = device_scalars if in_memory else kernel_scalars(state.rule, hp, step)
        if isinstance(cached, WsPlan):
            cached.run(x2, dy2, scalars)
        elif state.layer_sums is not None:
            _regime_two_step(cached, x2, dy2, weight, state, scalars, int(seed) & 0x7FFFFFFF, grad_accum)
        else:
            launch.run_plan(cached, x2, dy2, scalars, int(seed) & 0x7FFFFFFF, grad_accum)
        return
    if not triton_available():
        raise RuntimeError("fused_wgrad_update needs a CUDA device or TRITON_INTERPRET=1; "
                           "use reference_wgrad_update on this machine")
    x2, dy2 = check_arguments(x, dy, weight, state, grad_accum)
    if weight.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"fused_wgrad_update: tensors are on {weight.device}, the Triton kernel needs CUDA")
    rule = state.rule
    states, scales = kernel_states(state)
    scalars = launch_scalars("fused_wgrad_update", rule, hp, step, device_scalars, weight, stochastic_rounding)
    stochastic = bool(stochastic_rounding) and weight.dtype == torch.bfloat16
    ieee = x2.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    meta = kernel_meta(state, x2.dtype, grad_accum=grad_accum is not None, stochastic=stochastic, ieee=ieee,
                       scalars_in_memory=in_memory)
    seed = int(seed) & 0x7FFFFFFF
    if config is None:
        if tuning.use_fixed_config():
            config = INTERPRETER_CONFIG
        else:
            key = (tuple(weight.shape), x2.shape[0], x2.dtype, weight.dtype, state.kernel_name, state.state_dtype,
                   grad_accum is not None, stochastic, ieee, str(weight.device))   # one tuning for both scalar sources
            config = tuning.tuned_config(key, state.state_dtype, x2, dy2, weight, states, scales, grad_accum, scalars,
                                         seed, meta)
            gluon_plan = ws_plan(key, state.state_dtype, x2, dy2, weight, states, scales, grad_accum, stochastic,
                                 scalars, seed, meta, config)
            if gluon_plan is not None:
                gluon_plan.run(x2, dy2, scalars)
                if signature is not None:
                    PLANS[state] = {signature: gluon_plan}
                return
    check_config(config, state.state_dtype)
    plan = launch.make_plan(config, x2, dy2, weight, states, scales, grad_accum, meta, state.layer_sums)
    if state.layer_sums is not None:
        compiled = _regime_two_step(plan, x2, dy2, weight, state, scalars, seed, grad_accum)
    else:
        compiled = launch.run_plan(plan, x2, dy2, scalars, seed, grad_accum)
    if signature is not None and _plans_cacheable(config):      # one layout per weight is the steady state
        launch.go_direct(plan, compiled)
        PLANS[state] = {signature: plan}


def _regime_two_step(plan: launch.LaunchPlan, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
                     state: ParamState, scalars: tuple[float, ...] | torch.Tensor, seed: int,
                     grad_accum: torch.Tensor | None) -> Any:
    """A regime-2 rule's step: the layer's sums zeroed, the fused kernel (states, sums), the second pass
    (W); device ops only, so a CUDA graph can capture it. Returns the fused kernel's compiled handle."""
    state.layer_sums.zero_()
    compiled = launch.run_plan(plan, x2, dy2, scalars, seed, grad_accum)
    states, scales = kernel_states(state)
    layer_apply.apply_layer(weight, state, states, scales, scalars, seed, plan.kwargs)
    return compiled


@dataclasses.dataclass
class WsPlan:
    """A weight whose update the tuner gave to the warp-specialized Gluon kernel (``ws_choice``):
    its config and tensors, checked once (``hopper_ws.unsupported_reason``) when it was chosen."""
    config: hopper_ws.WsConfig
    weight: torch.Tensor
    states: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    epilogue: Any
    sqrt_domain: tuple[int, int]
    direct: Callable[[torch.Tensor, torch.Tensor, Any], bool] | None = None
    """From the second launch: the Gluon kernel launched without its JIT (``hopper_ws.direct_launcher``)."""
    launched: bool = False

    def run(self, x2: torch.Tensor, dy2: torch.Tensor, scalars: tuple[float, ...] | torch.Tensor) -> None:
        """One launch: direct from the second on, through the JIT before (or when the direct one declines)."""
        if self.direct is not None and self.direct(x2, dy2, scalars):
            launch.LAUNCH_PATHS["direct"] += 1
            return
        launch.LAUNCH_PATHS["jit"] += 1
        compiled = hopper_ws.launch(x2, dy2, self.weight, self.states, self.epilogue, scalars, self.config,
                                    check=False, scales=self.scales, sqrt_domain=self.sqrt_domain)
        if not self.launched:
            self.launched = True
            if direct_launch_enabled():
                self.direct = hopper_ws.direct_launcher(compiled, x2, dy2, self.weight, self.states, self.scales,
                                                        self.epilogue, scalars, self.config, self.sqrt_domain)


def ws_plan(key: tuple, state_dtype: str, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor,
            states: list[torch.Tensor], scales: list[torch.Tensor | None], grad_accum: torch.Tensor | None,
            stochastic: bool, scalars: tuple[float, ...] | torch.Tensor, seed: int, meta: Mapping[str, Any],
            triton_config: TileConfig) -> WsPlan | None:
    """A plan on the Gluon kernel when it beats the tuned Triton tile on this call (``ws_choice``),
    else None. Both are timed on scratch copies of the weight and states."""
    if interpreting() or not tuning.autotune_enabled() or not isinstance(triton_config, TileConfig):
        return None
    if x2.shape[0] == 0:            # a zero-token flush: nothing to time, the default Triton tile runs it
        return None
    candidates = ws_choice.candidates_for(x2, dy2, weight, states, scales, state_dtype, grad_accum, stochastic,
                                          meta["NUM_SUMS"])
    if not candidates:
        return None
    sqrt_domain = (meta["S0_SQRT"], meta["S1_SQRT"])

    def plan_on(config, weight, states, scales) -> WsPlan | None:
        return WsPlan(config, weight, states, scales, meta["EPILOGUE"], sqrt_domain) if config is not None else None

    # A launch with scalars in device memory is made to be captured in a CUDA graph, where the
    # host's launch cost is gone: time both kernels in graphs then. Otherwise (eager) as the caller
    # pays: do_bench, launch cost included. Through its JIT the Gluon kernel's launch costs the
    # host 180-240 us (H100 host), which would lose it eager choices it wins on the GPU; its plans
    # launch directly from their second call (hopper_ws.direct_launcher: ~20 us), in the timing too.
    graphed = isinstance(scalars, torch.Tensor)
    choice_key = key + ("graph" if graphed else "eager",)
    if choice_key in ws_choice.CHOSEN:          # chosen before (this process): no identity to compute
        return plan_on(ws_choice.CHOSEN[choice_key], weight, states, scales)
    gpu = tuning.device_name(weight)
    identity = ws_identity(meta["EPILOGUE"], triton_config, triton.__version__, gpu, graphed)
    known, config = ws_choice.stored(choice_key, candidates, identity, gpu)
    if known:                                   # chosen before, or kept on disk: no scratch copies
        return plan_on(config, weight, states, scales)
    if graph_capturing():
        # Timing synchronizes, which a capture cannot hold: an eager update recorded as a graph of itself
        # (forge_core.update_graphs) would lose its recording and the kernels timed after it their capture.
        # The eager call's choice stands in (the Triton tile where there is none), and is not kept as this mode's.
        return plan_on(ws_choice.CHOSEN.get(key + ("eager",)), weight, states, scales)
    scratch = tuning.scratch_copies(weight, states, scales)
    if scratch is None:
        return None
    scratch_weight, scratch_states, scratch_scales = scratch

    # One plan for the Triton tile and one per Gluon candidate, so that their timed launches after
    # the first are direct, as in the steps that follow (through the JIT, each would pay 100-240 us
    # of host time an eager step does not pay).
    triton_plan = launch.make_plan(triton_config, x2, dy2, scratch_weight, scratch_states, scratch_scales, None, meta)

    def run_triton() -> None:
        compiled = launch.run_plan(triton_plan, x2, dy2, scalars, seed)
        if triton_plan.direct is None:
            launch.go_direct(triton_plan, compiled)

    candidate_plans = {c: plan_on(c, scratch_weight, scratch_states, scratch_scales) for c in candidates}

    def run_ws(config: hopper_ws.WsConfig) -> None:
        candidate_plans[config].run(x2, dy2, scalars)

    m, n = weight.shape
    config = ws_choice.measure(choice_key, candidates, run_triton, run_ws,
                               ws_choice.graph_time_ms if graphed else tuning.bench_ms, identity, {
        "shape": f"{m}x{n}", "tokens": x2.shape[0], "device": gpu, "triton": triton.__version__,
        "triton_tile": dataclasses.asdict(triton_config)})
    return plan_on(config, weight, states, scales)


def _plans_cacheable(config: TileConfig | None) -> bool:
    """Whether a plan built with ``config`` may be kept: not the untuned default (``FORGE_AUTOTUNE=0``),
    which ``tuning.tuned_config`` does not keep either. Read when a plan is stored, not per launch (two
    environment reads cost ~5 us a launch on the H100 hosts); a plan kept before the variable changed
    stays in use for its weight."""
    return config is not None or tuning.use_fixed_config() or tuning.autotune_enabled()


_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (lambda: torch.backends.cuda.matmul.allow_tf32)
"""The cuBLAS TF32 flag without ``torch.backends.cuda.matmul.__getattr__`` (2 us a call)."""


def _plan_signature(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state: ParamState,
                    grad_accum: torch.Tensor | None, stochastic_rounding: bool, config: TileConfig | None,
                    scalars_in_memory: bool = False):
    """What a cached launch plan depends on; None when the arguments cannot key one.

    The weight by storage address (``param.data = ...`` swaps it under the same Parameter), the
    state tensors by identity (internal tensors: a load replaces or copies into them, never
    re-points them), the activations by shape, strides, dtype and device. No environment read: this
    runs once per fused layer and backward (see ``_plans_cacheable``)."""
    try:
        # the activations' 16-byte alignment too: it decides the TMA path (tma_inputs)
        return (x.shape, x.stride(), x.dtype, x.device, dy.shape, dy.stride(), dy.dtype, weight.data_ptr(),
                x.data_ptr() % 16 == 0, dy.data_ptr() % 16 == 0,
                tuple(map(id, state.values.values())), tuple(map(id, state.scales.values())),
                None if grad_accum is None else (grad_accum.shape, grad_accum.stride(), grad_accum.dtype,
                                                 grad_accum.device),
                bool(stochastic_rounding), config, _allow_tf32(), scalars_in_memory)
    except (AttributeError, RuntimeError):       # not a plain tensor (a subclass without storage)
        return None
