"""MLP-Mixer (Tolstikhin et al. 2021) from plain torch modules, for the model zoo.

transformers has no MLP-Mixer, and the point of this entry is a model made only of ``nn.Linear``,
``nn.LayerNorm`` and a patch ``nn.Conv2d`` that no library wrote: ``forge_core.fuse`` must find
and fuse its Linear weights with nothing but the probe's generic pixel inputs. Its token-mixing
MLP runs its Linear layers over the patch axis (the activation transposed), which the fused
Linear takes like any other input.

The config holds the public values of Mixer-B/16 / Mixer-L/16 (``forge_bench/configs/mixer-*.json``);
the forward takes ``pixel_values`` and optional ``labels`` and returns transformers'
``ImageClassifierOutput`` (loss, logits), as ViT does, so every harness arm steps it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import ImageClassifierOutput


@dataclass
class MixerConfig:
    """The sizes of an MLP-Mixer (the names follow transformers' configs where one exists)."""
    hidden_size: int = 768
    num_hidden_layers: int = 12
    token_mixing_size: int = 384
    intermediate_size: int = 3072
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    num_labels: int = 1000
    layer_norm_eps: float = 1e-6
    model_type: str = "mlp_mixer"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MixerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"architectures", "use_cache"})
        if unknown:
            raise ValueError(f"MLP-Mixer config has unknown keys {unknown}; known: {sorted(known)}")
        config = cls(**{k: v for k, v in data.items() if k in known})
        if config.image_size % config.patch_size:
            raise ValueError(f"image_size {config.image_size} is not a multiple of patch_size {config.patch_size}")
        return config

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class MixerMlp(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MixerBlock(nn.Module):
    """Token mixing over the patch axis, then channel mixing, each pre-normed with a residual."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.token_mlp = MixerMlp(config.num_patches, config.token_mixing_size)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.channel_mlp = MixerMlp(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MlpMixerForImageClassification(nn.Module):
    """Patch embedding, ``num_hidden_layers`` Mixer blocks, a norm, mean pooling, a linear head."""

    def __init__(self, config: MixerConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                     stride=config.patch_size)
        self.blocks = nn.ModuleList(MixerBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None) -> ImageClassifierOutput:
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x.flatten(2).transpose(1, 2)                                 # (batch, patches, hidden)
        for block in self.blocks:
            x = block(x)
        logits = self.classifier(self.norm(x).mean(dim=1))
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


__all__ = ["MixerConfig", "MlpMixerForImageClassification"]
