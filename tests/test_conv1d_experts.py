"""GPT-2's Conv1D and 3-D MoE experts fused: the same weights as torch's AdamW unfused (fp32).

Tiny transformers models at random init (no download): a 2-layer GPT-2 whose four Conv1D weights
per block are fused, and a 1-layer Qwen3-MoE whose experts are two 3-D Parameters, with so few
tokens that most experts see none (the paper's Remark 1: they still decay, as torch's step of the
whole Parameter on its zero gradient rows does).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import forge_core
import forge_core.experts
from forge_core.conv1d import is_forge_conv1d
from forge_core.experts import ExpertsWeight, is_forge_experts
from forge_core.kernels import triton_available

transformers = pytest.importorskip("transformers")

HYPERPARAMETERS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=96, n_positions=32,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).float()


def _tiny_moe(experts: int = 8, top_k: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=experts, num_experts_per_tok=top_k, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(config).float()


def _batches(steps: int, vocab: int, tokens: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (1, tokens), generator=generator) for _ in range(steps)]


def _device(backend: str) -> str:
    """Where a backend's model lives: the Triton kernel on a GPU where there is one (else the interpreter)."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    device = next(model.parameters()).device
    for ids in batches:
        ids = ids.to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _backends() -> list[str]:
    return ["reference"] + (["triton"] if triton_available() else [])


def _assert_close_to_reference(model, reference, initial, optimizer) -> None:
    """Each fused weight: rms(W - W_ref) / rms(W_ref) < 1e-5, and max |W - W_ref| within 5% of the
    largest update (docs/design.md, section 10: what "equal" means)."""
    fused = {id(p) for p in optimizer.fused_parameters()}
    for (name, ours), (_, theirs), start in zip(model.named_parameters(), reference.named_parameters(), initial):
        if id(ours) in fused:
            ours, theirs = ours.detach().double(), theirs.detach().double()
            rms_rel = float((ours - theirs).norm() / theirs.norm())
            largest_update = float((theirs - start.double()).abs().max())
            assert largest_update > 0, f"{name} did not move"
            assert rms_rel < 1e-5, f"{name}: rms-rel {rms_rel:.3e}"
            assert float((ours - theirs).abs().max()) <= 0.05 * largest_update, name


@pytest.mark.parametrize("backend", _backends())
def test_gpt2_conv1d_fused_equals_torch_adamw(backend: str) -> None:
    model = _tiny_gpt2().to(_device(backend))
    reference = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # nothing left out loudly: every Conv1D fuses
        optimizer = forge_core.fuse(model, backend=backend, **HYPERPARAMETERS)
    conv_names = [n for n, m in model.named_modules() if is_forge_conv1d(m)]
    assert len(conv_names) == 8 and sorted(optimizer.fused_module_names()) == sorted(conv_names)
    outside_embeddings = sum(p.numel() for n, p in model.named_parameters() if ".wte." not in n and ".wpe." not in n)
    assert sum(p.numel() for p in optimizer.fused_parameters()) / outside_embeddings >= 0.9
    batches = _batches(2, 96, 8)
    _train(model, optimizer, batches)
    _train(reference, torch.optim.AdamW(reference.parameters(), **HYPERPARAMETERS), batches)
    assert all(p.grad is None for p in optimizer.fused_parameters())
    _assert_close_to_reference(model, reference, initial, optimizer)
    forge_core.unfuse(model)
    assert not any(is_forge_conv1d(m) for m in model.modules())
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"


@pytest.mark.parametrize("backend, block", [(b, 1) for b in _backends()] + [("reference", 4)])
def test_moe_experts_fused_equal_torch_adamw_and_unreached_experts_decay(backend: str, block: int,
                                                                          monkeypatch) -> None:
    """``block``: each expert's rows padded with zero rows to a multiple of it (64 on a GPU)."""
    monkeypatch.setattr(forge_core.experts, "token_block", lambda device: block)
    model = _tiny_moe().to(_device(backend))
    reference = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = forge_core.fuse(model, backend=backend, **HYPERPARAMETERS)
    experts = model.model.layers[0].mlp.experts
    assert is_forge_experts(experts)
    bindings = experts.forge_expert_updaters
    assert sorted(bindings) == ["down_proj", "gate_up_proj"]
    assert all(isinstance(b, ExpertsWeight) and b.parameter_name == name for name, b in bindings.items())
    assert {id(experts.gate_up_proj), id(experts.down_proj)} <= {id(p) for p in optimizer.fused_parameters()}
    reached: list[set[int]] = []
    original_update = ExpertsWeight.update_experts

    def record(self: ExpertsWeight, x, grad_output, ends, bounds) -> None:
        if self.parameter_name == "gate_up_proj":
            reached.append({e for e, (start, end) in enumerate(bounds) if end > start})
        original_update(self, x, grad_output, ends, bounds)

    monkeypatch.setattr(ExpertsWeight, "update_experts", record)
    batches = _batches(2, 64, 3)
    before = experts.gate_up_proj.detach().clone()
    _train(model, optimizer, batches)
    _train(reference, torch.optim.AdamW(reference.parameters(), **HYPERPARAMETERS), batches)
    assert all(0 < len(r) < 8 for r in reached), reached            # some experts saw no token
    never = [e for e in range(8) if all(e not in r for r in reached)]
    assert never and not torch.equal(experts.gate_up_proj[never[0]], before[never[0]])   # decayed anyway
    assert experts.gate_up_proj.grad is None
    _assert_close_to_reference(model, reference, initial, optimizer)
    forge_core.unfuse(model)
    assert not is_forge_experts(experts) and type(experts).__name__ == "Qwen3MoeExperts"


@pytest.mark.parametrize("backend", _backends())
def test_moe_experts_accumulate_micro_batches_like_torch(backend: str) -> None:
    """Two micro-batches per step: experts reached in either get the sum, the rest decay (on the
    Triton backend the grouped launch adds each expert's accumulated rows)."""
    model = _tiny_moe().to(_device(backend))
    reference = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = forge_core.fuse(model, backend=backend, accumulate_steps=2, **HYPERPARAMETERS)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **HYPERPARAMETERS)
    batches = _batches(4, 64, 3)
    for first, second in (batches[:2], batches[2:]):
        for m, opt in ((model, optimizer), (reference, reference_optimizer)):
            for ids in (first, second):
                ids = ids.to(next(m.parameters()).device)
                (m(input_ids=ids, labels=ids).loss / 2).backward()
            opt.step()
            opt.zero_grad()
    _assert_close_to_reference(model, reference, initial, optimizer)


def test_capturable_fuse_leaves_experts_to_the_fallback_with_a_reason() -> None:
    if not triton_available():
        pytest.skip("capturable needs the Triton backend")
    model = _tiny_moe().to(_device("triton"))
    with pytest.warns(UserWarning, match="capturable=True"):
        optimizer = forge_core.fuse(model, capturable=True, **HYPERPARAMETERS)
    assert "model.layers.0.mlp.experts" in optimizer.excluded_modules
    assert not is_forge_experts(model.model.layers[0].mlp.experts)


def test_triton_backend_steps_each_expert_weight_in_one_launch_like_one_launch_per_expert(monkeypatch) -> None:
    """The grouped launch (``kernels.grouped_wgrad_update``) runs once per expert weight and backward,
    and gives the weights that stepping each expert alone gives."""
    if not triton_available():
        pytest.skip("the grouped launch needs the Triton backend")
    from forge_core.optimizer import ForgeOptimizer

    calls: list[int] = []
    grouped = forge_core.kernels.grouped_wgrad_update

    def counted(*args, **kwargs):
        calls.append(args[4].numel())                # ends: one per expert
        return grouped(*args, **kwargs)

    monkeypatch.setattr(forge_core.kernels, "grouped_wgrad_update", counted)
    batches = _batches(3, 64, 5)
    model = _tiny_moe().to(_device("triton"))
    alone = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    _train(model, forge_core.fuse(model, backend="triton", **HYPERPARAMETERS), batches)
    assert calls == [8] * (2 * len(batches))
    monkeypatch.setattr(ForgeOptimizer, "apply_grouped_update", lambda *args, **kwargs: False)
    optimizer = forge_core.fuse(alone, backend="triton", **HYPERPARAMETERS)
    _train(alone, optimizer, batches)
    assert len(calls) == 2 * len(batches)
    _assert_close_to_reference(alone, model, initial, optimizer)
