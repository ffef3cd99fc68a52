"""``fuse`` / ``unfuse``: choose which Linear weights FORGE updates inside backward, and why not.

``fuse`` walks a model, turns every eligible ``nn.Linear`` into a ``ForgeLinear`` in place (a
transformers GPT-2 ``Conv1D`` into a ``ForgeConv1D``, ``forge_core.conv1d``; a transformers MoE
experts module with 3-D ``gate_up_proj`` / ``down_proj`` into its fused form, ``forge_core.experts``)
and returns a ``ForgeOptimizer`` (``forge_core.optimizer``) that owns their optimizer state and a
standard torch optimizer (the *fallback*) for every other trainable parameter.

A Linear is NOT fused (it goes to the fallback, same hyper-parameters) when:

* its weight is frozen (``requires_grad=False``: then it is in no optimizer at all);
* its weight has no elements (``nn.Linear(16, 0)``: the fallback steps nothing, as torch does);
* its weight appears in more than one place (tied / shared: e.g. ``lm_head`` tied to
  ``embed_tokens``; the fused update would see only one consumer's gradient);
* it is not exactly ``nn.Linear`` or transformers' ``Conv1D`` (a subclass has its own forward or
  semantics);
* (experts) their layout is not the one the fused forward reproduces, or ``capturable=True`` (the
  per-expert token counts are read on the host every step), or the rule reads whole-weight norms
  (LAMB: the experts are updated expert by expert), with a warning;
* its weight is not fp32 / bf16, or not contiguous (what the kernel takes);
* the fuse-time probe finds that the model reads its ``.weight`` outside its ``forward`` (e.g. a
  library kernel or a sibling module uses the tensor directly), or calls its ``forward`` more than
  once per pass (the update would run twice per step). Those are reverted with a warning.

The probe is one forward/backward on a tiny input at ``fuse`` time. It updates nothing: fused
layers only count their calls, gradients that existed before are put back, buffers (BatchNorm
statistics and the like) are restored, and the RNG state is forked so the caller's random
stream is unchanged. Inputs: ``probe_inputs`` if given (a tensor, a tuple of positional
arguments or a dict of keyword arguments), else built from a transformers ``model.config``
(token ids of length 8, or pixel values); if neither is possible the probe is skipped with a
warning (``probe_inputs=False`` skips it on purpose, silently).

Gradient clipping: ``fuse`` marks every weight whose gradient FORGE never forms (``FUSED_MARK``) and
installs, once per process, a guard around ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_``
(``install_clipping_guard``, both in ``forge_core.clipping``) that raises when it is given such a weight;
``unfuse`` removes the marks.

Copies: ``copy.deepcopy(model)`` and ``torch.save(model)`` of a fused model give the plain model with its
weights as they are (``forge_core.module_copies``): an EMA or evaluation copy, a whole-model checkpoint.
The original's optimizer does not step the copy; ``fuse(copy, ...)`` trains it.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from collections import Counter
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from .backends import resolve_backend
from .clipping import CLIPPING_FUNCTIONS, FUSED_MARK, install_clipping_guard, mark_gradientless_weights
from .conv1d import conv1d_class, install_forge_conv1d, is_conv1d, is_forge_conv1d, remove_forge_conv1d
from .dtensors import is_dtensor
from .embedding import ForgeEmbedding, install_forge_embedding, remove_forge_embedding, row_gradient_unsupported
from .experts import (EXPERT_PARAMETERS, ExpertsWeight, experts_layout_problem, install_forge_experts,
                      is_forge_experts, looks_like_experts, remove_forge_experts)
from .layer_step import takes_layer_path
from .linear import ForgeLinear, install_forge_linear, remove_forge_linear
from .fused_weight import FusedWeight
from .optimizer import ForgeOptimizer
from .rules import Rule, get_rule
from .rules.checks import betas_pair
from .rules.rule_optimizer import unsteppable_parameter
from .state import STATE_DTYPES
from .torch_guards import install_conversion_guard

PROBE_SEQUENCE_LENGTH = 8

_CLIPPING_ERROR = (
    "max_grad_norm is not supported with fused weights: global-norm clipping needs every gradient "
    "before any weight moves, but FORGE applies each fused weight's update inside backward and its "
    "gradient never exists. Train without clipping, or leave the model unfused (a standard torch "
    "optimizer + torch.nn.utils.clip_grad_norm_)."
)


def distributed_wrapper_problem(model: nn.Module, device_mesh: Any = None) -> Optional[str]:
    """Why ``fuse`` cannot take ``model`` as it is wrapped or sharded (one line), or None.

    Why refuse: under DDP every rank would apply its local (partial) gradient to its replica inside
    backward, before any all-reduce, and the replicas drift apart; FSDP shards the weights the
    update reads. ``forge_core.distributed`` has the entry for each. Wrapper classes are looked up
    in ``sys.modules``: a model can only be wrapped by a module that was imported."""
    ddp_module = sys.modules.get("torch.nn.parallel.distributed")
    fsdp_module = sys.modules.get("torch.distributed.fsdp")
    for name, module in model.named_modules():
        label = name or "the model"
        if ddp_module is not None and isinstance(module, ddp_module.DistributedDataParallel):
            return (f"{label} is wrapped in DistributedDataParallel: fused weights would be updated from each "
                    "rank's local gradient; call forge_core.distributed.fuse_data_parallel(model, ...) on the "
                    "unwrapped model instead")
        fsdp_classes = tuple(getattr(fsdp_module, attribute) for attribute in ("FSDPModule", "FullyShardedDataParallel")
                             if fsdp_module is not None and hasattr(fsdp_module, attribute))
        if fsdp_classes and isinstance(module, fsdp_classes):
            return (f"{label} is sharded by FSDP: use forge_core.distributed.fuse_fsdp(model, ...) after "
                    "fully_shard (FSDP2)")
    for name, parameter in model.named_parameters():
        if is_dtensor(parameter) and (device_mesh is None or parameter.device_mesh != device_mesh):
            where = "without a device_mesh" if device_mesh is None else "on another device mesh than device_mesh"
            return (f"parameter {name!r} is a DTensor {where}: use forge_core.distributed.fuse_tensor_parallel"
                    "(model, device_mesh, ...) for a tensor-parallel model")
    return None


def _parameter_use_counts(model: nn.Module) -> Counter:
    """How many places in the module tree hold each Parameter (tied and shared weights count >1)."""
    counts: Counter = Counter()
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] += 1
    return counts


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # nn.Module.parameters() already removes duplicates, in order


def _select_candidates(model: nn.Module) -> tuple[dict[str, nn.Linear], dict[str, str], dict[str, str]]:
    """Split Linear-like modules into candidates and exclusions.

    Returns (candidates, quiet exclusions, warned exclusions); both exclusion maps are
    ``qualified module name -> reason``."""
    use_counts = _parameter_use_counts(model)
    conv1d = conv1d_class()
    candidates: dict[str, nn.Linear] = {}
    quiet: dict[str, str] = {}
    loud: dict[str, str] = {}
    seen_modules: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        label = name or "<root>"
        if isinstance(module, ForgeEmbedding):
            raise ValueError(f"module {label!r} is already a row-gradient embedding of an earlier fuse(): call "
                             "forge_core.unfuse(model) before fusing again")
        is_conv1d_like = conv1d is not None and isinstance(module, conv1d)
        if not isinstance(module, nn.Linear) and not is_conv1d_like:
            continue
        if isinstance(module, ForgeLinear) or is_forge_conv1d(module):
            raise ValueError(f"module {label!r} is already fused: call forge_core.unfuse(model) before fusing again")
        if id(module) in seen_modules:
            # The same module object registered under two names: shared. Drop the earlier entry too.
            for other_name, other in list(candidates.items()):
                if other is module:
                    del candidates[other_name]
                    quiet[other_name] = "module is registered in more than one place (shared)"
            quiet[label] = "module is registered in more than one place (shared)"
            continue
        seen_modules.add(id(module))
        weight = module.weight
        if type(module) is not nn.Linear and not is_conv1d(module):
            base = "transformers Conv1D" if is_conv1d_like else "nn.Linear"
            loud[label] = f"{type(module).__name__} is a subclass of {base} with its own behaviour; not fused"
        elif not weight.requires_grad:
            quiet[label] = "weight is frozen (requires_grad=False)"
        elif weight.numel() == 0:           # (torch's optimizer steps it: nothing to update, nothing to keep)
            quiet[label] = f"weight has no elements (shape {tuple(weight.shape)})"
        elif use_counts[id(weight)] > 1:
            quiet[label] = f"weight is tied / shared ({use_counts[id(weight)]} places hold this Parameter)"
        elif weight.dtype not in (torch.float32, torch.bfloat16):
            loud[label] = f"weight dtype {weight.dtype} is not supported by the fused kernel (fp32 or bf16)"
        elif not weight.is_contiguous():
            loud[label] = "weight is not contiguous"
        elif weight.device.type == "meta":
            raise ValueError(f"module {label!r} has its weight on the meta device: materialize the model before fuse()")
        else:
            candidates[label] = module
    return candidates, quiet, loud


def _select_experts(model: nn.Module, capturable: bool,
                    rule: Rule) -> tuple[dict[str, tuple[nn.Module, str]], dict[str, str]]:
    """3-D expert Parameters to fuse (``qualified parameter name -> (experts module, attribute)``)
    and the experts modules left to the fallback with why (``forge_core.experts``)."""
    use_counts = _parameter_use_counts(model)
    candidates: dict[str, tuple[nn.Module, str]] = {}
    loud: dict[str, str] = {}
    for name, module in model.named_modules():
        label = name or "<root>"
        if is_forge_experts(module):
            raise ValueError(f"module {label!r} is already fused: call forge_core.unfuse(model) before fusing again")
        if not looks_like_experts(module):
            continue
        weights = [getattr(module, attribute) for attribute in EXPERT_PARAMETERS]
        if not all(weight.requires_grad for weight in weights):
            continue                                  # frozen experts: in no optimizer (or the fallback's)
        problem = experts_layout_problem(module)
        if problem is None and any(weight.numel() == 0 for weight in weights):
            problem = "expert weights have no elements"
        if problem is None and any(use_counts[id(weight)] > 1 for weight in weights):
            problem = "expert weights are shared with another module"
        if problem is None and capturable:
            problem = ("capturable=True: the fused experts read each expert's token count on the host every "
                       "step, which a replayed CUDA graph cannot")
        if problem is None and takes_layer_path(rule):     # its step reads whole 2-D matrices
            problem = (f"rule {rule.name!r} steps whole 2-D weights, not experts block by block; its fallback "
                       "optimizer steps them")
        if problem is None and rule.layer_sums:
            problem = (f"rule {rule.name!r} reads norms of each whole 3-D weight, which the fused experts update "
                       "expert by expert")
        if problem is None and any(weight.device.type == "meta" for weight in weights):
            raise ValueError(f"module {label!r} has its experts on the meta device: materialize the model before fuse()")
        if problem is not None:
            loud[label] = problem
            continue
        for attribute in EXPERT_PARAMETERS:
            candidates[f"{label}.{attribute}"] = (module, attribute)
    return candidates, loud


def _install_all(bindings: Mapping[str, FusedWeight]) -> None:
    """Put the fused module in place for every binding (an experts module once, for both its weights)."""
    experts: dict[int, dict[str, ExpertsWeight]] = {}
    for binding in bindings.values():
        module = binding.module
        if isinstance(binding, ExpertsWeight):
            experts.setdefault(id(module), {})[binding.parameter_name] = binding
        elif is_conv1d(module):
            install_forge_conv1d(module, binding)
        else:
            install_forge_linear(module, binding)
    for updaters in experts.values():
        install_forge_experts(next(iter(updaters.values())).module, updaters)


def _remove(module: nn.Module) -> None:
    """The plain module again, whichever fused kind it is (a no-op when it is not fused any more)."""
    if isinstance(module, ForgeLinear):
        remove_forge_linear(module)
    elif is_forge_conv1d(module):
        remove_forge_conv1d(module)
    elif is_forge_experts(module):
        remove_forge_experts(module)


# ----------------------------------------------------------------------------------------------
# The bypass probe
# ----------------------------------------------------------------------------------------------

def _model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def _model_float_dtype(model: nn.Module) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _auto_probe_inputs(model: nn.Module) -> Optional[dict[str, Any]]:
    """Keyword inputs for a transformers model built from ``model.config``; None when unknown."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    accepted = signature.parameters
    device = _model_device(model)
    inputs: dict[str, Any] = {}
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and vocab_size > 0 and "input_ids" in accepted:
        # Deterministic ids; the RNG is forked around the probe anyway.
        ids = (torch.arange(PROBE_SEQUENCE_LENGTH, device=device) * 7919 + 13) % vocab_size
        inputs["input_ids"] = ids.unsqueeze(0)
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in accepted:
            inputs["decoder_input_ids"] = ids.flip(0).unsqueeze(0)
    elif "pixel_values" in accepted and isinstance(getattr(config, "image_size", None), int):
        channels = int(getattr(config, "num_channels", 3))
        size = int(config.image_size)
        inputs["pixel_values"] = torch.randn(1, channels, size, size, device=device, dtype=_model_float_dtype(model))
    else:
        return None
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    return inputs


def _call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _grad_tensors(output: Any) -> Iterable[torch.Tensor]:
    """Every floating tensor in a model output that carries a graph (nested tuples/dicts/ModelOutput)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() and output.requires_grad:
            yield output
    elif isinstance(output, Mapping):
        for value in output.values():
            yield from _grad_tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _grad_tensors(value)


def _run_probe(model: nn.Module, bindings: dict[str, FusedWeight], inputs: Any) -> tuple[dict[str, str], Optional[str]]:
    """Forward/backward once with updates off. Returns (reverted name -> reason, skip reason or None)."""
    parameters = _unique_parameters(model)
    saved_grads = [parameter.grad for parameter in parameters]
    saved_buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    cuda_devices = sorted({p.device.index or 0 for p in parameters if p.device.type == "cuda"})
    for parameter in parameters:
        parameter.grad = None
    for binding in bindings.values():
        binding.begin_probe()
    try:
        with torch.random.fork_rng(devices=cuda_devices), torch.enable_grad():
            for binding in bindings.values():
                binding.module.forge_counting_forwards = True
            output = _call_model(model, inputs)
            for binding in bindings.values():
                binding.module.forge_counting_forwards = False
            tensors = list(_grad_tensors(output))
            if not tensors:
                return {}, "the model output holds no tensor that requires grad"
            probe_loss = sum((t.float() * torch.randn_like(t, dtype=torch.float32)).sum() for t in tensors)
            probe_loss.backward()
        reverted: dict[str, str] = {}
        for name, binding in bindings.items():
            forward_calls = binding.module.forge_forward_calls
            if binding.weight.grad is not None:
                reverted[name] = ("the model reads its .weight outside its forward (a direct use of the tensor "
                                  f"that would never be trained by the fused update; forward calls: {forward_calls})")
            elif forward_calls > 1 or binding.probe_backward_calls > 1:
                reverted[name] = (f"its forward ran {forward_calls} times in one pass (its update would be "
                                  "applied more than once per step)")
        return reverted, None
    finally:
        for binding in bindings.values():
            binding.end_probe()
            binding.module.forge_counting_forwards = False
            binding.module.forge_forward_calls = 0
        for parameter, grad in zip(parameters, saved_grads):
            parameter.grad = grad
        with torch.no_grad():
            for buffer, snapshot in saved_buffers:
                buffer.copy_(snapshot)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def fuse(model: nn.Module, optimizer: str = "adamw", *, lr: Optional[float] = None,
         betas: Optional[tuple[float, float]] = None, eps: Optional[float] = None,
         weight_decay: Optional[float] = None, momentum: Optional[float] = None,
         state_dtype: str = "fp32", stochastic_rounding: bool = False, accumulate_steps: int = 1,
         max_grad_norm: Optional[float] = None, backend: str = "auto",
         probe_inputs: Any = None, capturable: bool = False, overlap: bool = False, dense_2d: bool = True,
         embedding_rows: bool = True, device_mesh: Any = None, **other_hyperparameters: Any) -> ForgeOptimizer:
    """Fuse the optimizer ``optimizer`` into the backward of ``model``'s eligible Linear layers.

    Swaps eligible ``nn.Linear`` modules in place (see the module docstring for what is excluded
    and why) and returns a ``ForgeOptimizer``: a ``torch.optim.Optimizer`` over every trainable
    parameter. ``loss.backward()`` updates fused weights layer by layer; ``opt.step()`` steps the
    rest (the fallback torch optimizer) and advances the step count.

    Hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum`` and any other of the
    rule's ``defaults``, e.g. SGD's ``dampening`` / ``nesterov``) default to the rule's defaults;
    one the rule does not have is an error; names and defaults are torch.optim's for the class of the
    same name (``optimizer``: adamw, sgd, lion, rmsprop, adagrad, adamax, nadam, radam, lamb; see
    ``forge_core.rules``). A rule's states may depend on them (SGD keeps a momentum buffer only with
    momentum; RMSprop's ``momentum`` and ``centered`` add one each): they are fixed here.
    ``state_dtype``: "fp32", "bf16", "int8" or "fp8" moments (int8 / fp8 with one fp32 scale per 64
    elements of a row, forge_core.state). A rule that cannot take a state format, ``accumulate_steps``
    or ``capturable`` raises a one-line ValueError naming the rule and the option.
    ``stochastic_rounding``: round bf16 weights stochastically when the update stores them.

    ``accumulate_steps=k``: the fused update runs on the k-th backward after each ``opt.step()``;
    the k-1 earlier micro-batches add ``dY^T X`` into an fp32 accumulator per fused weight. Memory
    cost: one fp32 buffer the size of every fused weight (4 bytes per fused parameter, counted in
    ``memory_breakdown()["gradients"]``), i.e. the gradient pool FORGE otherwise removes, in fp32.
    Scale the loss by 1/k yourself, as with unfused accumulation. ``opt.step()`` after fewer than k
    micro-batches applies what was accumulated (as unfused accumulation would).

    A ``.grad`` already present on a weight that gets fused is dropped (it could never be applied).

    ``max_grad_norm``: not supported; any value raises ValueError (see the message for why). Neither
    is a ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` call of your own over the fused
    weights (HF Trainer's default max_grad_norm=1.0): it would clip the fallback gradients alone, so
    after ``fuse`` it raises naming the weight (``install_clipping_guard``). Turn clipping off (HF
    Trainer: ``max_grad_norm=0``), or clip only parameters that get a ``.grad``.
    A model wrapped in DDP or sharded by FSDP, or with DTensor parameters, is refused (one line naming
    the ``forge_core.distributed`` entry to use: those fuse across ranks). ``device_mesh``: the 1-D
    mesh of a tensor-parallel model's DTensor weights (``forge_core.distributed.fuse_tensor_parallel``
    passes it); each rank then updates its local shards.
    ``backend``: "auto" (Triton on CUDA; on CPU Triton when TRITON_INTERPRET=1, else the torch
    reference), "triton" or "reference". ``probe_inputs``: inputs for the bypass probe when the
    model is not a transformers model (False: skip the probe).
    ``capturable``: keep the step count and the kernel scalars on the GPU (and make the fallback
    optimizer capturable), so that a whole training step can be captured in a CUDA graph and
    replayed; needs the Triton backend, ``accumulate_steps=1`` and no stochastic rounding. Warm up
    a few steps eagerly before capturing (tile tuning and the fallback's state happen on first use).
    ``overlap``: on CUDA, run each layer's fused update on a side stream so it overlaps the rest of
    the backward (``forge_core.overlap`` says why this is safe); the backward's end waits for it, so
    weights are updated when ``backward()`` returns, as without it. False (the default): in line; the side
    stream's fork, join and ``record_stream`` cost an eager step's host more than the overlap buys (D102).
    ``dense_2d``: step the 2-D fallback parameters (a vocabulary embedding, tied or excluded weights)
    in ``step()`` with the fused kernel from their ``.grad``, in the same ``state_dtype`` as the fused
    weights (``forge_core.dense.DenseWeight``); False leaves them to the torch optimizer (moments
    in the weight's dtype). A state dict loads only into an optimizer with the same setting.
    ``embedding_rows``: with ``dense_2d``, a plain ``nn.Embedding`` whose weight it steps (not tied, not
    sparse, no ``max_norm`` / ``scale_grad_by_freq``) becomes a ``ForgeEmbedding``: its backward hands
    the token ids and output gradient to the optimizer and the weight gets no ``.grad``, so the
    vocabulary-sized gradient is never written (``forge_core.embedding``); the update is the same.
    ``opt.zero_grad()`` drops what was recorded, as it drops a ``.grad``. False keeps the dense ``.grad``.
    """
    if max_grad_norm is not None:
        raise ValueError(_CLIPPING_ERROR)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse() needs an nn.Module, got {type(model).__name__}")
    problem = distributed_wrapper_problem(model, device_mesh)
    if problem is not None:
        raise ValueError(f"fuse(): {problem}")
    rule = get_rule(optimizer)
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if stochastic_rounding and takes_layer_path(rule):
        raise ValueError(f"stochastic_rounding is a fused-kernel option; optimizer {rule.name!r} steps weights "
                         "in plain torch after the layer's GEMM")
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be an integer >= 1, got {accumulate_steps!r}")
    problem = rule.option_problem(state_dtype=state_dtype, accumulate_steps=accumulate_steps, capturable=capturable,
                                  stochastic_rounding=stochastic_rounding)
    if problem is not None:
        raise ValueError(problem)
    named = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum": momentum}
    given = {key: value for key, value in named.items() if value is not None}
    given.update(other_hyperparameters)
    unknown = sorted(set(given) - set(rule.defaults))
    if unknown:
        raise ValueError(f"optimizer {rule.name!r} has no hyper-parameter(s) {unknown}; "
                         f"its hyper-parameters are {sorted(rule.defaults)}")
    hyperparameters = {**dict(rule.defaults), **given}
    for key in [key for key in hyperparameters if key.endswith("betas")]:      # (Muon's adamw_betas too)
        hyperparameters[key] = betas_pair(rule.name, hyperparameters[key], key)
    # Validate the values once, the way the fused path will read them (the rule raises on nonsense).
    rule.fallback_optimizer([{"params": []}], **hyperparameters)
    problem = rule.format_problem(hyperparameters, state_dtype)
    if problem is not None:
        raise ValueError(problem)

    candidates, quiet, loud = _select_candidates(model)
    if rule.hidden_weights_only:
        _keep_output_head_unfused(model, rule.name, candidates, quiet)
    expert_candidates, experts_left_out = _select_experts(model, capturable, rule)
    loud.update(experts_left_out)
    if rule.regime == 3:           # its fallback, a RuleOptimizer, would refuse a 3-D parameter at the first step()
        problem = unsteppable_parameter(model.named_parameters(), rule.name)
        if problem is not None:
            raise ValueError(problem)
    bindings: dict[str, FusedWeight] = {name: FusedWeight(name, module) for name, module in candidates.items()}
    bindings.update({name: ExpertsWeight(name, module, attribute)
                     for name, (module, attribute) in expert_candidates.items()})
    _install_all(bindings)

    try:
        if probe_inputs is False:
            skipped_reason: Optional[str] = "probe_inputs=False"
            inputs = None
        elif probe_inputs is not None:
            inputs, skipped_reason = probe_inputs, None
        else:
            inputs = _auto_probe_inputs(model)
            skipped_reason = None if inputs is not None else (
                "no probe_inputs given and the model has no transformers config to build them from")
        reverted: dict[str, str] = {}
        if inputs is not None and bindings:
            try:
                reverted, skipped_reason = _run_probe(model, bindings, inputs)
            except Exception as error:
                if probe_inputs is not None:
                    raise RuntimeError(f"the fuse-time probe failed on the given probe_inputs: {error}") from error
                skipped_reason = f"the probe forward on inputs built from model.config failed ({error!r})"
        if skipped_reason is not None and probe_inputs is not False and bindings:
            warnings.warn(
                f"forge_core.fuse: bypass probe skipped ({skipped_reason}); a Linear whose weight the model "
                "reads without calling its forward would not be trained. Pass probe_inputs= to check.",
                stacklevel=2)
        for name in list(reverted):            # an experts module is reverted whole: both its weights
            module = bindings[name].module
            for other, binding in bindings.items():
                if other not in reverted and binding.module is module:
                    reverted[other] = f"the other expert weight of its module was reverted ({name})"
        for name, reason in reverted.items():
            _remove(bindings.pop(name).module)
            loud[name] = reason
    except BaseException:
        for binding in bindings.values():
            _remove(binding.module)
        raise

    if loud:
        listing = "; ".join(f"{name}: {reason}" for name, reason in loud.items())
        warnings.warn(f"forge_core.fuse: {len(loud)} module(s) not fused, stepped by {rule.name}'s fallback "
                      f"optimizer instead: {listing}", stacklevel=2)
    if not bindings:
        warnings.warn("forge_core.fuse: no Linear weight was fused; every parameter is stepped by the "
                      "standard torch optimizer", stacklevel=2)

    for binding in bindings.values():
        # A .grad left on a fused weight from before fuse() could never be applied: drop it.
        binding.weight.grad = None
        binding.overlap_updates = bool(overlap) and not isinstance(binding, ExpertsWeight)  # read by the backward
    fused_ids = {id(binding.weight) for binding in bindings.values()}
    trainable = [p for p in _unique_parameters(model) if p.requires_grad]
    devices = {binding.weight.device for binding in bindings.values()}
    try:
        chosen_backend = resolve_backend(backend, devices)
        forge_optimizer = ForgeOptimizer(
            trainable, list(bindings.values()), rule=rule, hyperparameters=hyperparameters,
            state_dtype=state_dtype, stochastic_rounding=stochastic_rounding,
            accumulate_steps=accumulate_steps, backend=chosen_backend,
            excluded={**quiet, **loud}, model_parameters=_unique_parameters(model),
            fused_ids=fused_ids, capturable=capturable, dense_2d=dense_2d,
            parameter_names={id(p): name for name, p in model.named_parameters()})
        _give_embeddings_their_state(model, forge_optimizer)
        if embedding_rows:
            _install_row_embeddings(model, forge_optimizer)
        mark_gradientless_weights(forge_optimizer)
        forge_optimizer.prepare_for_compiler()
        install_clipping_guard()
        install_conversion_guard()
        return forge_optimizer
    except BaseException:
        for binding in bindings.values():
            _remove(binding.module)
        raise


def _keep_output_head_unfused(model: nn.Module, rule_name: str, candidates: dict[str, nn.Linear],
                              quiet: dict[str, str]) -> None:
    """Move the output head (``model.get_output_embeddings()``) from ``candidates`` to the quiet
    exclusions: a rule for hidden-layer weights (Muon) leaves it to its fallback optimizer."""
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    for name, module in list(candidates.items()):
        if module is head:
            del candidates[name]
            quiet[name] = f"the output head: {rule_name} fuses hidden-layer weights; its fallback steps the head"


def _give_embeddings_their_state(model: nn.Module, optimizer: ForgeOptimizer) -> None:
    """Give each weight the optimizer steps as a ``DenseWeight`` that is an embedding's and no other
    module's an ``EmbeddingState`` (its rows get gradients a few at a time; ``forge_core.dense`` says
    why that changes how its int8 first moment is stored). A tied weight's rows all get the head's
    gradient every step, as a Linear weight's do: it keeps a ``ParamState``."""
    dense_of = {id(dense.weight): dense for dense in optimizer.dense_weights()}
    use_counts = _parameter_use_counts(model)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        dense = dense_of.get(id(weight))
        if isinstance(module, nn.Embedding) and dense is not None and use_counts[id(weight)] == 1:
            dense.make_embedding_state(optimizer.param_groups[dense.group_index])


def _install_row_embeddings(model: nn.Module, optimizer: ForgeOptimizer) -> None:
    """Make each plain embedding whose weight the optimizer steps as a ``DenseWeight`` (and that no
    other module holds) record its gradient as rows."""
    dense_of = {id(dense.weight): dense for dense in optimizer.dense_weights()}
    use_counts = _parameter_use_counts(model)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        dense = dense_of.get(id(weight))
        if dense is None or use_counts[id(weight)] != 1 or row_gradient_unsupported(module) is not None:
            continue
        install_forge_embedding(module, dense)
        dense.records_rows = True
        dense.padding_idx = module.padding_idx
        if optimizer.backend == "triton":
            dense.slot_table()          # made now: a compiled backward names it among the tensors it writes


def unfuse(model: nn.Module) -> nn.Module:
    """Turn every ForgeLinear in ``model`` back into a plain ``nn.Linear`` (a ForgeConv1D into
    transformers' ``Conv1D``, a fused experts module into its own class) and every ForgeEmbedding into
    a plain ``nn.Embedding`` (same module objects,
    same Parameters, weights as trained). The optimizer returned by ``fuse`` cannot be stepped
    afterwards: its ``step()`` raises, naming unfuse. Clipping the weights works again. Returns ``model``."""
    pending = []
    optimizers: dict[int, ForgeOptimizer] = {}
    for name, module in model.named_modules():
        if isinstance(module, ForgeLinear) or is_forge_conv1d(module) or is_forge_experts(module):
            updaters = getattr(module, "forge_expert_updaters", None) or {"": getattr(module, "forge_updater", None)}
            for binding in updaters.values():
                if isinstance(binding, FusedWeight) and binding.micro_batches:
                    pending.append(name or "<root>")
                if isinstance(binding, FusedWeight):
                    if binding.optimizer is not None:
                        optimizers[id(binding.optimizer)] = binding.optimizer
                    binding.weight.__dict__.pop(FUSED_MARK, None)
                    binding.detach_from_module()
            _remove(module)
        elif isinstance(module, ForgeEmbedding):
            sink = module.forge_row_sink
            if getattr(sink, "recorded_rows", None):
                pending.append(name or "<root>")
            if isinstance(getattr(sink, "optimizer", None), ForgeOptimizer):
                optimizers[id(sink.optimizer)] = sink.optimizer
            module.weight.__dict__.pop(FUSED_MARK, None)
            remove_forge_embedding(module)
    for optimizer in optimizers.values():
        optimizer.mark_unfused()
    if pending:
        warnings.warn(f"forge_core.unfuse: {len(pending)} fused weight(s) had accumulated micro-batch gradients "
                      f"that were never applied (opt.step() not reached): {pending}", stacklevel=2)
    return model


__all__ = ["fuse", "unfuse", "install_clipping_guard", "FUSED_MARK", "CLIPPING_FUNCTIONS",
           "distributed_wrapper_problem"]
