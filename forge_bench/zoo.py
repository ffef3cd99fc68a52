"""The model zoo's registry: each model's name, the public model it mirrors, its family and task.

Kept apart from ``models.py`` (which builds the models, and so imports torch and transformers)
because the report reads it too: the report groups models by ``family`` (a scaling figure of
tiny-Llama against tiny-GPT-2 would plot two architectures as one curve) and never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

CAUSAL_LM = "causal_lm"
IMAGE_CLASSIFICATION = "image_classification"


@dataclass(frozen=True)
class ModelSpec:
    """A zoo entry: which config file, which public model it mirrors, its family (models of one
    family share the architecture and differ in size: the report's scaling compares them) and
    what a batch holds: token ids (``causal_lm``) or pixels and labels."""
    name: str
    source: str          # the public model whose config values the file holds
    description: str
    family: str
    task: str = CAUSAL_LM

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
        ModelSpec("gpt2", "openai-community/gpt2", "GPT-2 124M (Conv1D layers, tied embeddings): forge-bench convergence",
                  "gpt2"),
        ModelSpec("qwen3-0.6b", "Qwen/Qwen3-0.6B", "Qwen3 0.6B (tied embeddings)", "qwen3"),
        ModelSpec("qwen3-1.7b", "Qwen/Qwen3-1.7B", "Qwen3 1.7B (tied embeddings)", "qwen3"),
        ModelSpec("qwen3-4b", "Qwen/Qwen3-4B", "Qwen3 4B (tied embeddings)", "qwen3"),
        ModelSpec("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3 8B", "qwen3"),
        ModelSpec("qwen3-14b", "Qwen/Qwen3-14B", "Qwen3 14B: the Muon capability cell on an 80 GB card", "qwen3"),
        ModelSpec("qwen3-32b", "Qwen/Qwen3-32B", "Qwen3 32B: the Muon capability cell on a 141 GB card", "qwen3"),
        ModelSpec("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B",
                  "Qwen3 MoE 30B (3B active): 48 layers of 128 experts as 3-D Parameters, top 8", "qwen3-moe"),
        ModelSpec("qwen3-30b-a3b-l8", "Qwen/Qwen3-30B-A3B",
                  "Qwen3-30B-A3B's widths and experts with 8 of its 48 layers (5.6B): the MoE layout on one H100",
                  "qwen3-moe"),
        ModelSpec("vit-base-16", "google/vit-base-patch16-224", "ViT-B/16 at 224 px (197 tokens per image)", "vit",
                  IMAGE_CLASSIFICATION),
        ModelSpec("vit-large-16", "google/vit-large-patch16-224", "ViT-L/16 at 224 px (197 tokens per image)", "vit",
                  IMAGE_CLASSIFICATION),
        ModelSpec("mamba2-1.3b", "state-spaces/mamba2-1.3b", "Mamba-2 1.3B (HF Mamba2ForCausalLM, tied embeddings)",
                  "mamba2"),
        ModelSpec("mixer-b16", "Mixer-B/16 (Tolstikhin et al. 2021)",
                  "MLP-Mixer B/16 at 224 px from torch modules (196 tokens per image)", "mixer", IMAGE_CLASSIFICATION),
        ModelSpec("mixer-l16", "Mixer-L/16 (Tolstikhin et al. 2021)",
                  "MLP-Mixer L/16 at 224 px from torch modules (196 tokens per image)", "mixer", IMAGE_CLASSIFICATION),
        ModelSpec("tiny-llama", "-", "2-layer Llama with 128-wide hidden: CPU smoke and tests", "llama"),
        ModelSpec("tiny-gpt2", "-", "2-layer GPT-2 with 128-wide hidden, tied embeddings: CPU smoke and tests", "gpt2"),
        ModelSpec("tiny-qwen3", "-", "2-layer Qwen3 with 64-wide hidden: CPU tests", "qwen3"),
        ModelSpec("tiny-qwen3-moe", "-", "2-layer Qwen3-MoE, 8 experts of 32, top 2: CPU tests", "qwen3-moe"),
        ModelSpec("tiny-vit", "-", "2-layer ViT on 32 px images (17 tokens): CPU tests", "vit", IMAGE_CLASSIFICATION),
        ModelSpec("tiny-mamba2", "-", "2-layer Mamba-2 with 64-wide hidden: CPU tests", "mamba2"),
        ModelSpec("tiny-mixer", "-", "2-layer MLP-Mixer on 32 px images (16 tokens): CPU tests", "mixer",
                  IMAGE_CLASSIFICATION),
    )
}


def model_family(name: str) -> str:
    """The family of a zoo model; a model the zoo does not know (a plugin's, or a row of another
    tree) is a family of its own."""
    spec = MODEL_ZOO.get(name)
    return spec.family if spec is not None else name
