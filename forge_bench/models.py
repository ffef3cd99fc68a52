"""The model zoo: transformers models built from config files shipped in the package.

No download, no hub: every model is a ``forge_bench/configs/<name>.json`` holding the public
config values of the real model (hidden size, layers, heads, kv heads, intermediate size,
vocabulary, rope theta, tied embeddings ...). Weights are random with a fixed seed, created
directly on the target device in the suite's dtype (``torch.device`` context), so an 8B model
builds in seconds on a GPU.

Two deliberate departures from the published configs, both applied at build time:
* dropout is switched off (GPT-2 ships 0.1): the sweep compares optimizers, and the parity gate
  needs the arm and the fp32 reference to see the same forward;
* ``use_cache`` is off (training never uses the KV cache).

``reduced_depth`` gives the twin used by the parity gate of big models: the same widths (so
every Linear shape of the full model is present) with fewer layers.

Most entries are causal LMs (a batch is token ids, labels = the ids). Image classifiers (ViT, and
the MLP-Mixer built from torch modules in ``forge_bench.mixer``) take synthetic pixels and class
labels; their ``seq`` is the tokens one image makes (patches, plus ViT's class token), so a suite
names it like a sequence length and the rows stay comparable in tokens per step.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping

import torch

from forge_bench.mixer import MixerConfig, MlpMixerForImageClassification
# the registry (names, sources, families, tasks) is torch-free, for the report: forge_bench/zoo.py
from forge_bench.zoo import IMAGE_CLASSIFICATION, MODEL_ZOO, ModelSpec

ATTN_IMPLEMENTATION = "sdpa"
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}
_DROPOUT_KEYS = ("attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout",
                 "attention_dropout", "hidden_dropout", "dropout")
_LAYER_KEYS = ("num_hidden_layers", "n_layer")


class ModelError(ValueError):
    """An unknown model or a shape the model cannot take."""


def get_model_spec(name: str) -> ModelSpec:
    try:
        return MODEL_ZOO[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_ZOO))}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


@lru_cache(maxsize=None)
def _raw_config(name: str) -> tuple[tuple[str, Any], ...]:
    path = get_model_spec(name).config_path
    with open(path) as fh:
        data = json.load(fh)
    if "model_type" not in data:
        raise ModelError(f"{path}: config has no 'model_type'")
    return tuple(data.items())


def config_dict(name: str, num_layers: int | None = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The model's config as a plain dict (with the build-time changes applied, then ``overrides``:
    e.g. ``{"vocab_size": 256}`` for a byte-level tokenizer)."""
    data = {**dict(_raw_config(name)), **dict(overrides or {})}
    for key in _DROPOUT_KEYS:
        if key in data:
            data[key] = 0.0
    data["use_cache"] = False
    if num_layers is not None:
        key = next((k for k in _LAYER_KEYS if k in data), None)
        if key is None:
            raise ModelError(f"model {name!r}: config has no layer count to reduce")
        data[key] = min(int(num_layers), int(data[key]))
    return data


def load_config(name: str, num_layers: int | None = None, overrides: Mapping[str, Any] | None = None):
    """A transformers ``PretrainedConfig`` for the zoo entry (optionally with fewer layers, and
    ``overrides`` of its values); a ``MixerConfig`` for the MLP-Mixer."""
    from transformers import CONFIG_MAPPING

    data = config_dict(name, num_layers, overrides)
    model_type = data.pop("model_type")
    data.pop("architectures", None)
    if model_type == MixerConfig.model_type:
        return MixerConfig.from_dict(data)
    return CONFIG_MAPPING[model_type](**data)


def _build_mixer(config: MixerConfig, dtype: torch.dtype, **_ignored: Any) -> torch.nn.Module:
    return MlpMixerForImageClassification(config).to(dtype)


# architectures built here rather than by transformers
LOCAL_ARCHITECTURES = {"MlpMixerForImageClassification": _build_mixer}


def _model_factory(name: str):
    """``_from_config`` of the config's ``architectures[0]`` class (imports only that model's
    module, unlike the Auto classes), else the causal-LM Auto class's ``from_config``."""
    import transformers

    arch = (dict(_raw_config(name)).get("architectures") or [None])[0]
    if arch in LOCAL_ARCHITECTURES:
        return LOCAL_ARCHITECTURES[arch]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config
    return cls._from_config


def num_layers(name: str) -> int:
    data = dict(_raw_config(name))
    return int(next(data[k] for k in _LAYER_KEYS if k in data))


def is_image_model(name: str) -> bool:
    return get_model_spec(name).task == IMAGE_CLASSIFICATION


def image_tokens(name: str) -> int:
    """Tokens one image makes: its patches, plus the class token where the model has one (ViT)."""
    data = dict(_raw_config(name))
    patches = (int(data["image_size"]) // int(data["patch_size"])) ** 2
    return patches + (0 if data["model_type"] == MixerConfig.model_type else 1)


def max_seq_len(name: str) -> int:
    """Longest sequence the model's position embeddings allow (an image model: its tokens per image)."""
    if is_image_model(name):
        return image_tokens(name)
    data = dict(_raw_config(name))
    return int(data.get("max_position_embeddings") or data.get("n_positions") or 1 << 20)


def vocab_size(name: str) -> int:
    """The output width: the vocabulary of a causal LM, the classes of an image classifier."""
    data = dict(_raw_config(name))
    return int(data["num_labels"] if is_image_model(name) else data["vocab_size"])


def build_model(name: str, dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu",
                *, seed: int = 0, num_layers: int | None = None,
                overrides: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """Random-init model built directly on ``device`` in ``dtype``, in train mode.

    ``device="meta"`` builds the shapes only (parameter counts, memory estimates). ``overrides``
    replace config values (``forge-bench convergence`` sets the vocabulary to its tokenizer's).
    """
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    config = load_config(name, num_layers, overrides)
    make_model = _model_factory(name)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    # sdpa attention where the architecture has attention (Mamba-2 has none and refuses the argument)
    attention = {} if getattr(make_model, "__self__", None) is not None and \
        not getattr(make_model.__self__, "_supports_sdpa", True) else {"attn_implementation": ATTN_IMPLEMENTATION}
    with torch.device(device):
        model = make_model(config, dtype=dtype, **attention)
    model.train()
    return model


# transformers model types whose decoder blocks forge_core.lean_activations can make lean
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


def has_lean_blocks(name: str) -> bool:
    """Whether ``activations: lean`` applies: Llama-style RMSNorm + SiLU-gated MLP blocks."""
    data = dict(_raw_config(name))
    return data.get("model_type") in LEAN_MODEL_TYPES and data.get("hidden_act", "silu") == "silu"


def apply_activations(model: torch.nn.Module, activations: str) -> dict[str, int] | None:
    """``lean``: forge_core.lean_activations on ``model`` (module counts); ``hf``: nothing (None)."""
    if activations == "hf":
        return None
    if activations != "lean":
        raise ModelError(f"unknown activations {activations!r}; known: hf, lean")
    from forge_core.lean import lean_activations

    report = lean_activations(model)
    return {"norms": report.norms, "mlps": report.mlps, "scopes": report.scopes}


def apply_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> bool:
    """transformers' gradient checkpointing on ``model`` when ``enabled`` (non-reentrant: the forward
    runs with grad enabled, so a FORGE-fused Linear's update still runs once, in the backward of
    its recomputed layer). Returns whether it was applied."""
    if not enabled:
        return False
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelError(f"{type(model).__name__} does not support gradient checkpointing")
    options = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)   # older transformers: gradient_checkpointing_enable
    if callable(enable):
        enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    return True


def reduced_depth(name: str, max_layers: int) -> int | None:
    """Layer count of the parity twin: None (the model itself) when it is already that shallow."""
    return None if num_layers(name) <= max_layers else max_layers


def make_batch(name: str, batch: int, seq: int, device: str | torch.device, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A synthetic token batch (input_ids and labels = input_ids: HF shifts labels itself); for an
    image model, ``batch`` images of uniform noise and one class label each (``seq`` must be the
    tokens per image)."""
    limit = max_seq_len(name)
    if is_image_model(name) and seq != limit:
        raise ModelError(f"model {name!r} makes {limit} tokens per image, got seq={seq}")
    if seq > limit:
        raise ModelError(f"model {name!r} takes at most {limit} tokens per sequence, got seq={seq}")
    gen = torch.Generator().manual_seed(seed)
    if is_image_model(name):
        data = dict(_raw_config(name))
        size, channels = int(data["image_size"]), int(data.get("num_channels", 3))
        pixels = torch.rand((batch, channels, size, size), generator=gen) * 2 - 1
        labels = torch.randint(0, vocab_size(name), (batch,), generator=gen, dtype=torch.long)
        return {"pixel_values": pixels.to(device), "labels": labels.to(device)}
    ids = torch.randint(0, vocab_size(name), (batch, seq), generator=gen, dtype=torch.long)
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids.clone()}


@lru_cache(maxsize=None)
def param_count(name: str, num_layers: int | None = None) -> int:
    """Parameters of the model (tied weights counted once), from a meta-device build."""
    model = build_model(name, "bfloat16", "meta", num_layers=num_layers)
    return sum(p.numel() for p in model.parameters())


def activation_bytes_estimate(name: str, batch: int, seq: int, dtype_bytes: int, activations: str = "hf",
                              checkpointed: bool = False) -> int:
    """A deliberately low estimate of the activations a training step keeps for backward.

    Per token and layer: the saved inputs of the attention and MLP projections, the attention
    output and norms (about 10 hidden-wide and 3 intermediate-wide tensors; 4 and 2 with lean
    activations); plus the logits in
    the model dtype and their fp32 upcast and gradient at the loss. Low on purpose: it only feeds
    ``oom_predicted``, which must skip a cell only when it clearly cannot fit. With activation
    checkpointing each layer keeps only its hidden-wide input (the layer being recomputed is left out).
    """
    data = dict(_raw_config(name))
    hidden = int(data.get("hidden_size") or data.get("n_embd"))
    inter = int(data.get("intermediate_size") or data.get("n_inner") or 4 * hidden)
    if data.get("num_experts"):        # a MoE layer keeps every routed copy of its tokens' expert activations
        inter = int(data["moe_intermediate_size"]) * int(data.get("num_experts_per_tok", 1))
    layers = num_layers(name)
    tokens = batch * seq
    # lean (forge_core.lean): the two norm inputs, q and the attention output, gate and up (k, v left out)
    widths = 4 * hidden + 2 * inter if activations == "lean" else 10 * hidden + 3 * inter
    if checkpointed:
        widths = hidden
    per_layer = tokens * widths * dtype_bytes
    logits = (batch if is_image_model(name) else tokens) * vocab_size(name) * (dtype_bytes + 4 + 4)
    return layers * per_layer + logits
