"""A fused model can be deep-copied and pickled (``forge_core.module_copies``): the copy is the plain model
(nn.Linear, GPT-2's Conv1D, the experts' own class, nn.Embedding) with the weights as they are, whose
forward gives the same values, which the original's optimizer does not step, and which trains when
fused again or under a torch optimizer (gradient clipping included)."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import forge_core

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                      max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=96, n_positions=32, attn_pdrop=0.0,
                                     embd_pdrop=0.0, resid_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, vocab_size=96, max_position_embeddings=32,
                                         tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(config)


MODELS = {"llama": _llama, "gpt2": _gpt2, "moe": _moe}


def _fused_model(kind: str) -> tuple[nn.Module, forge_core.ForgeOptimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS[kind]().float()
    optimizer = forge_core.fuse(model, "adamw", lr=1e-2, backend="reference")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    _train_step(model, optimizer, ids)
    return model, optimizer, ids


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _assert_plain(model: nn.Module) -> None:
    for name, module in model.named_modules():
        cls = type(module)
        assert not cls.__name__.startswith("Forge") and cls.__module__.split(".")[0] != "forge_core", name
        assert not [key for key in module.__dict__ if key.startswith("forge_")], name


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_deep_copy_of_a_fused_model_is_the_plain_model_with_its_weights(kind: str) -> None:
    model, optimizer, ids = _fused_model(kind)
    twin = copy.deepcopy(model)
    _assert_plain(twin)
    assert any(type(m).__name__.startswith("Forge") for m in model.modules())        # the original stays fused
    twin.eval()
    assert torch.equal(_logits(twin, ids), _logits(model, ids))
    weights = {name: p.detach().clone() for name, p in twin.named_parameters()}
    _train_step(model, optimizer, ids)                     # the original trains on, the copy does not move
    assert all(torch.equal(p, weights[name]) for name, p in twin.named_parameters())
    assert not torch.equal(_logits(twin, ids), _logits(model, ids))
    # the copy trains under a torch optimizer, clipping included, and fuses again
    twin.train()
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    plain.step()
    again = forge_core.fuse(twin, "adamw", lr=1e-2, backend="reference")
    assert again.fused_parameters()
    _train_step(twin, again, ids)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_pickled_fused_model_loads_as_the_plain_model_without_forge_core(kind: str) -> None:
    model, _, ids = _fused_model(kind)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_plain(loaded)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    loaded(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(loaded.parameters(), 1.0)          # no weight of the plain model is marked
    modules: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str):    # noqa: ANN201 (pickle's signature)
            modules.add(module)
            return super().find_class(module, name)

    Recording(io.BytesIO(pickle.dumps(model))).load()
    assert not [module for module in modules if module.startswith("forge_core")]
    again = forge_core.fuse(loaded, "adamw", lr=1e-2, backend="reference")
    _train_step(loaded, again, ids)
