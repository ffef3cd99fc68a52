"""The model zoo's registry: each model's name, the public model it mirrors, and its family.

Kept apart from ``models.py`` (which builds the models, and so imports torch and transformers)
because the report reads it too: the report groups models by ``family`` (a scaling figure of
tiny-Llama against tiny-GPT-2 would plot two architectures as one curve) and never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class ModelSpec:
    """A zoo entry: which config file, which public model it mirrors, and its family (models of one
    family share the architecture and differ in size: the report's scaling section compares them)."""
    name: str
    source: str          # the public model whose config values the file holds
    description: str
    family: str

    @property
    def config_path(self) -> Path:
        return CONFIG_DIR / f"{self.name}.json"


MODEL_ZOO: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B (tied embeddings)", "llama"),
        ModelSpec("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "Llama 3.2 3B (tied embeddings)", "llama"),
        ModelSpec("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "Llama 3.1 8B: the paper's headline model", "llama"),
        ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B", "Qwen 2.5 7B (q/k/v biases)", "qwen2.5"),
        ModelSpec("mistral-7b", "mistralai/Mistral-7B-v0.3", "Mistral 7B v0.3 (32768 vocab, no sliding window)",
                  "mistral"),
        ModelSpec("gpt2-xl", "openai-community/gpt2-xl", "GPT-2 XL 1.5B (Conv1D layers, tied embeddings)", "gpt2"),
        ModelSpec("tiny-llama", "-", "2-layer Llama with 128-wide hidden: CPU smoke and tests", "llama"),
        ModelSpec("tiny-gpt2", "-", "2-layer GPT-2 with 128-wide hidden, tied embeddings: CPU smoke and tests", "gpt2"),
    )
}


def model_family(name: str) -> str:
    """The family of a zoo model; a model the zoo does not know (a plugin's, or a row of another
    tree) is a family of its own."""
    spec = MODEL_ZOO.get(name)
    return spec.family if spec is not None else name
