"""The model zoo: transformers causal LMs built from config files shipped in the package.

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
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ATTN_IMPLEMENTATION = "sdpa"
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}
_DROPOUT_KEYS = ("attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout",
                 "attention_dropout", "hidden_dropout", "dropout")
_LAYER_KEYS = ("num_hidden_layers", "n_layer")


@dataclass(frozen=True)
class ModelSpec:
    """A zoo entry: which config file and which public model it mirrors."""
    name: str
    source: str          # the public model whose config values the file holds
    description: str

    @property
    def config_path(self) -> Path:
        return CONFIG_DIR / f"{self.name}.json"


MODEL_ZOO: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B (tied embeddings)"),
        ModelSpec("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "Llama 3.2 3B (tied embeddings)"),
        ModelSpec("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "Llama 3.1 8B: the paper's headline model"),
        ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B", "Qwen 2.5 7B (q/k/v biases)"),
        ModelSpec("mistral-7b", "mistralai/Mistral-7B-v0.3", "Mistral 7B v0.3 (32768 vocab, no sliding window)"),
        ModelSpec("gpt2-xl", "openai-community/gpt2-xl", "GPT-2 XL 1.5B (Conv1D layers, tied embeddings)"),
        ModelSpec("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3 8B (q/k norms, untied head)"),
        ModelSpec("qwen3-14b", "Qwen/Qwen3-14B", "Qwen3 14B: the Muon capability cell on an 80 GB card"),
        ModelSpec("qwen3-32b", "Qwen/Qwen3-32B", "Qwen3 32B: the Muon capability cell on a 141 GB card"),
        ModelSpec("tiny-llama", "-", "2-layer Llama with 128-wide hidden: CPU smoke and tests"),
        ModelSpec("tiny-gpt2", "-", "2-layer GPT-2 with 128-wide hidden, tied embeddings: CPU smoke and tests"),
    )
}


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


def config_dict(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """The model's config as a plain dict (with the build-time changes applied)."""
    data = dict(_raw_config(name))
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


def load_config(name: str, num_layers: int | None = None):
    """A transformers ``PretrainedConfig`` for the zoo entry (optionally with fewer layers)."""
    from transformers import CONFIG_MAPPING

    data = config_dict(name, num_layers)
    model_type = data.pop("model_type")
    data.pop("architectures", None)
    return CONFIG_MAPPING[model_type](**data)


def _model_factory(name: str):
    """``_from_config`` of the config's ``architectures[0]`` class (imports only that model's
    module, unlike the Auto classes), else the causal-LM Auto class's ``from_config``."""
    import transformers

    arch = (dict(_raw_config(name)).get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config
    return cls._from_config


def num_layers(name: str) -> int:
    data = dict(_raw_config(name))
    return int(next(data[k] for k in _LAYER_KEYS if k in data))


def max_seq_len(name: str) -> int:
    """Longest sequence the model's position embeddings allow."""
    data = dict(_raw_config(name))
    return int(data.get("max_position_embeddings") or data.get("n_positions"))


def vocab_size(name: str) -> int:
    return int(dict(_raw_config(name))["vocab_size"])


def build_model(name: str, dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu",
                *, seed: int = 0, num_layers: int | None = None) -> torch.nn.Module:
    """Random-init model built directly on ``device`` in ``dtype``, in train mode.

    ``device="meta"`` builds the shapes only (parameter counts, memory estimates).
    """
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    config = load_config(name, num_layers)
    make_model = _model_factory(name)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = make_model(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
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
    """A synthetic token batch (input_ids and labels = input_ids: HF shifts labels itself)."""
    limit = max_seq_len(name)
    if seq > limit:
        raise ModelError(f"model {name!r} takes at most {limit} tokens per sequence, got seq={seq}")
    gen = torch.Generator().manual_seed(seed)
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
    layers = num_layers(name)
    tokens = batch * seq
    # lean (forge_core.lean): the two norm inputs, q and the attention output, gate and up (k, v left out)
    widths = 4 * hidden + 2 * inter if activations == "lean" else 10 * hidden + 3 * inter
    if checkpointed:
        widths = hidden
    per_layer = tokens * widths * dtype_bytes
    logits = tokens * vocab_size(name) * (dtype_bytes + 4 + 4)
    return layers * per_layer + logits
