"""Model zoo: the shipped configs are the public models' shapes; builds are fast and seeded."""
from __future__ import annotations

import pytest
import torch

from forge_bench import models

# Parameter counts of the public checkpoints (tied embeddings counted once).
PUBLIC_PARAM_COUNTS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_248_023_552,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAM_COUNTS))
def test_public_models_have_the_published_parameter_count(name):
    assert models.param_count(name) == PUBLIC_PARAM_COUNTS[name]


def test_llama8b_shapes_and_settings():
    cfg = models.load_config("llama-3.1-8b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 14336, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 128256)
    assert cfg.tie_word_embeddings is False
    m = models.build_model("llama-3.1-8b", "bfloat16", "meta")
    assert m.config._attn_implementation == "sdpa"
    q = m.model.layers[0].self_attn
    assert tuple(q.q_proj.weight.shape) == (4096, 4096) and tuple(q.k_proj.weight.shape) == (1024, 4096)
    assert models.load_config("llama-3.2-1b").tie_word_embeddings is True


def test_reduced_depth_twin_keeps_every_width():
    assert models.reduced_depth("llama-3.1-8b", 2) == 2
    assert models.reduced_depth("tiny-llama", 2) is None
    full = models.build_model("llama-3.1-8b", "bfloat16", "meta")
    twin = models.build_model("llama-3.1-8b", "bfloat16", "meta", num_layers=2)
    assert len(twin.model.layers) == 2
    shapes = lambda m: {tuple(p.shape) for p in m.parameters()}
    assert shapes(twin) == shapes(full)


def test_build_is_seeded_in_dtype_without_dropout():
    a = models.build_model("tiny-gpt2", "bfloat16", "cpu", seed=3)
    b = models.build_model("tiny-gpt2", "bfloat16", "cpu", seed=3)
    c = models.build_model("tiny-gpt2", "bfloat16", "cpu", seed=4)
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert a.training
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.transformer.h[0].attn.c_attn.weight, c.transformer.h[0].attn.c_attn.weight)
    assert all(m.p == 0.0 for m in a.modules() if isinstance(m, torch.nn.Dropout))
    batch = models.make_batch("tiny-gpt2", 2, 16, "cpu")
    loss = a(**batch).loss
    assert torch.isfinite(loss)


def test_make_batch_is_deterministic_and_checked():
    x = models.make_batch("tiny-llama", 3, 40, "cpu", seed=1)
    y = models.make_batch("tiny-llama", 3, 40, "cpu", seed=1)
    assert x["input_ids"].shape == (3, 40) and torch.equal(x["input_ids"], y["input_ids"])
    assert torch.equal(x["labels"], x["input_ids"])
    assert int(x["input_ids"].max()) < models.vocab_size("tiny-llama")
    with pytest.raises(models.ModelError, match="at most 256 tokens"):
        models.make_batch("tiny-gpt2", 1, 512, "cpu")


def test_unknown_model_and_dtype():
    with pytest.raises(models.ModelError, match="known: .*llama-3.1-8b"):
        models.get_model_spec("llama-5")
    with pytest.raises(models.ModelError, match="dtype"):
        models.torch_dtype("float8")


def test_activation_estimate_scales_with_tokens():
    one = models.activation_bytes_estimate("llama-3.1-8b", 1, 512, 2)
    four = models.activation_bytes_estimate("llama-3.1-8b", 4, 512, 2)
    assert four == 4 * one
    assert 1 * 2**30 < one < 20 * 2**30


def test_lean_activation_estimate_stays_below_what_lean_keeps():
    """lean keeps 92 KiB per token and layer of Llama-3.1-8B at bf16 (norm inputs 8 + 8, q 8, k 2,
    v 2, attention output 8 KiB, gate 28, up 28 KiB): the estimate must stay below it."""
    hf = models.activation_bytes_estimate("llama-3.1-8b", 1, 512, 2)
    lean = models.activation_bytes_estimate("llama-3.1-8b", 1, 512, 2, "lean")
    logits = 512 * models.vocab_size("llama-3.1-8b") * (2 + 4 + 4)
    assert lean < hf
    assert (lean - logits) / (32 * 512) <= 92 * 1024
