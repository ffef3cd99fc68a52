"""fuse / unfuse: which modules are fused, the bypass probe, argument errors."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import forge_core
from forge_core.linear import ForgeLinear


class BypassModel(nn.Module):
    """``shortcut.weight`` is read directly; ``shortcut.forward`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 12)
        self.shortcut = nn.Linear(12, 12)
        self.norm = nn.BatchNorm1d(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.dropout(self.body(x), p=0.5, training=self.training)
        return self.norm(hidden @ self.shortcut.weight.t())


class TwiceModel(nn.Module):
    """``block`` runs twice per forward (a weight-shared recurrence)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.embed(ids))))


def _names(opt: forge_core.ForgeOptimizer) -> set[str]:
    return set(opt.fused_module_names())


def test_bypass_probe_reverts_module_whose_weight_is_read_directly_and_disturbs_nothing() -> None:
    torch.manual_seed(0)
    model = BypassModel()
    model.norm.running_mean.normal_()
    stale = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = stale[name].clone()
    weights_before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    probe_inputs = torch.randn(4, 12)
    rng_before = torch.get_rng_state()
    with pytest.warns(UserWarning, match=r"shortcut: the model reads its \.weight outside its forward"):
        opt = forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=probe_inputs)
    assert _names(opt) == {"body"}
    assert type(model.shortcut) is nn.Linear and isinstance(model.body, ForgeLinear)
    assert "shortcut" in opt.excluded_modules
    assert any(p is model.shortcut.weight for p in opt.fallback_parameters())
    # The probe updated nothing, restored buffers, kept the RNG stream and the existing grads.
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights_before[name]), name
    assert torch.equal(torch.get_rng_state(), rng_before)
    for name, p in model.named_parameters():
        if name == "body.weight":
            assert p.grad is None  # a stale grad on a now-fused weight could never be applied
        else:
            assert torch.equal(p.grad, stale[name]), name


def test_probe_result_trains_bypassed_weight_like_plain_adamw() -> None:
    torch.manual_seed(1)
    model = BypassModel().eval()  # eval: no dropout, BN with running stats, deterministic
    reference_model = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="shortcut"):
        opt = forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=torch.randn(4, 12))
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(6, 12)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        reference_model(x).square().mean().backward()
        reference_opt.step()
        reference_opt.zero_grad()
    for (name, fused), plain in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7, msg=name)


def test_module_called_twice_per_forward_is_reverted() -> None:
    model = TwiceModel()
    with pytest.warns(UserWarning, match=r"block: its forward ran 2 times"):
        opt = forge_core.fuse(model, backend="reference", probe_inputs=(torch.randn(2, 8),))
    assert _names(opt) == {"head"}
    assert type(model.block) is nn.Linear


def test_tied_and_frozen_weights_are_excluded() -> None:
    model = TiedModel()
    model.mid.bias.requires_grad_(False)
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model.frozen = frozen
    opt = forge_core.fuse(model, backend="reference", probe_inputs={"ids": torch.tensor([[1, 2, 3]])})
    assert _names(opt) == {"mid"}
    assert "tied" in opt.excluded_modules["out"] and "frozen" in opt.excluded_modules["frozen"]
    fallback = opt.fallback_parameters()
    assert any(p is model.embed.weight for p in fallback)
    assert not any(p is model.frozen.weight or p is model.mid.bias for p in fallback + opt.fused_parameters())
    all_params = [p for group in opt.param_groups for p in group["params"]]
    assert len(all_params) == len({id(p) for p in all_params}) == 2  # embed.weight (= out.weight), mid.weight


def test_shared_module_object_is_excluded() -> None:
    shared = nn.Linear(6, 6)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(6, 2))
    opt = forge_core.fuse(model, backend="reference", probe_inputs=torch.randn(2, 6))
    assert _names(opt) == {"3"}
    assert "shared" in opt.excluded_modules["0"] and "shared" in opt.excluded_modules["2"]


def test_transformers_llama_probe_is_automatic_and_tied_head_excluded() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "probe skipped" warning: inputs come from model.config
        opt = forge_core.fuse(model, backend="reference")
    assert len(opt.fused_parameters()) == 7 and "lm_head" in opt.excluded_modules
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False}))
    assert "lm_head" in forge_core.fuse(untied, backend="reference").fused_module_names()


def test_gpt2_conv1d_is_fused_and_a_conv1d_subclass_is_excluded_with_a_warning() -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32,
                                                                  n_positions=16, bos_token_id=0, eos_token_id=0))
    opt = forge_core.fuse(model, backend="reference")
    assert any(p is model.transformer.h[0].attn.c_attn.weight for p in opt.fused_parameters())
    assert len(opt.fused_parameters()) == 4

    class OwnConv1D(transformers.pytorch_utils.Conv1D):
        pass

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32,
                                                                  n_positions=16, bos_token_id=0, eos_token_id=0))
    model.transformer.h[0].attn.c_attn.__class__ = OwnConv1D
    with pytest.warns(UserWarning, match=r"transformer\.h\.0\.attn\.c_attn: OwnConv1D is a subclass of transformers Conv1D"):
        opt = forge_core.fuse(model, backend="reference")
    assert any(p is model.transformer.h[0].attn.c_attn.weight for p in opt.fallback_parameters())


def test_probe_skipped_warning_without_inputs_or_config() -> None:
    with pytest.warns(UserWarning, match="bypass probe skipped"):
        forge_core.fuse(nn.Sequential(nn.Linear(4, 4)), backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forge_core.fuse(nn.Sequential(nn.Linear(4, 4)), backend="reference", probe_inputs=False)


def test_clipping_request_raises_and_says_why() -> None:
    with pytest.raises(ValueError, match="global-norm clipping needs every gradient"):
        forge_core.fuse(nn.Linear(4, 4), max_grad_norm=1.0, probe_inputs=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": "adafactorial"}, "unknown optimizer rule"),
    ({"momentum": 0.9}, r"has no hyper-parameter\(s\) \['momentum'\]"),
    ({"state_dtype": "fp4"}, "state_dtype must be one of"),
    ({"accumulate_steps": 0}, "accumulate_steps must be an integer >= 1"),
    ({"backend": "cuda"}, "backend must be one of"),
    ({"lr": -1.0}, "Invalid learning rate"),
])
def test_bad_arguments_raise_clear_errors(kwargs: dict, message: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=message):
        forge_core.fuse(model, probe_inputs=False, **kwargs)
    assert type(model[0]) is nn.Linear  # a failed fuse leaves the model untouched


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        forge_core.fuse(model, backend="triton", probe_inputs=False)
    assert type(model[0]) is nn.Linear
    assert forge_core.fuse(model, backend="auto", probe_inputs=False).backend == "reference"


def test_auto_backend_uses_the_interpreted_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert forge_core.fuse(nn.Sequential(nn.Linear(4, 4)), probe_inputs=False).backend == "triton"


def test_fusing_twice_is_an_error_and_unfuse_restores_plain_linear() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))
    ids_before = [id(p) for p in model.parameters()]
    opt = forge_core.fuse(model, lr=0.05, backend="reference", probe_inputs=torch.randn(2, 10))
    with pytest.raises(ValueError, match="already fused"):
        forge_core.fuse(model, probe_inputs=False)
    for _ in range(2):
        model(torch.randn(4, 10)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    trained = [p.detach().clone() for p in model.parameters()]
    assert forge_core.unfuse(model) is model
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    assert [id(p) for p in model.parameters()] == ids_before
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained))
    assert not hasattr(model[0], "forge_updater")
    # Plain torch training works again; the old ForgeOptimizer refuses to ignore the new grads.
    model(torch.randn(4, 10)).sum().backward()
    assert model[0].weight.grad is not None
    with pytest.raises(RuntimeError, match="has a .grad"):
        opt.step()
    again = forge_core.fuse(model, backend="reference", probe_inputs=False)
    assert len(again.fused_parameters()) == 2


class EmbeddingModel(nn.Module):
    """An untied embedding (its gradient is kept as rows), a LayerNorm (torch fallback) and a fused head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _fused_embedding_model() -> tuple[EmbeddingModel, forge_core.ForgeOptimizer]:
    torch.manual_seed(0)
    model = EmbeddingModel()
    opt = forge_core.fuse(model, lr=1e-2, backend="reference", probe_inputs=torch.arange(6).view(1, 6))
    model(torch.arange(12).view(2, 6) % 20).square().mean().backward()
    return model, opt


def test_clipping_fused_weights_raises_naming_the_weight_and_the_fix() -> None:
    model, opt = _fused_embedding_model()
    for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
        with pytest.raises(ValueError, match=r"^torch\.nn\.utils\.clip_grad_norm_ was given embed\.weight, an "
                                             r"embedding weight whose gradient forge_core\.fuse keeps as rows .*"
                                             r"global-norm clipping needs every gradient .*max_grad_norm=0"):
            clip(model.parameters(), 1.0)
        with pytest.raises(ValueError, match=r"clip_grad_norm_ was given head\.weight, a fused weight \(forge_core"
                                             r"\.fuse updates it inside backward; its gradient never exists\)"):
            clip(model.head.parameters(), 1.0)
    with pytest.raises(ValueError, match=r"clip_grad_value_ was given head\.weight, a fused weight .*"
                                         r"FORGE cannot clip a gradient it never forms"):
        torch.nn.utils.clip_grad_value_(model.head.weight, 0.1)
    # Parameters that get a .grad clip as before: the same norm, the same scaling.
    with_grad = [p for p in model.parameters() if p.grad is not None]
    assert {id(p) for p in with_grad} == {id(model.norm.weight), id(model.norm.bias), id(model.head.bias)}
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in with_grad]))
    grads = [p.grad.clone() for p in with_grad]
    total = torch.nn.utils.clip_grad_norm_(iter(with_grad), 1e-3)
    torch.testing.assert_close(total, expected)
    for p, before in zip(with_grad, grads):
        torch.testing.assert_close(p.grad, before * (1e-3 / (expected + 1e-6)))
    opt.step()
    opt.zero_grad()
    # unfuse removes the marks: clipping the plain model works again.
    forge_core.unfuse(model)
    model(torch.arange(12).view(2, 6) % 20).square().mean().backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 0
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    assert model.head.weight.grad.abs().max() <= 0.1


def test_an_infinite_max_norm_measures_the_existing_gradients_with_a_warning() -> None:
    """HF's Trainer calls clip_grad_norm_(model.parameters(), inf) every step for its grad_norm log,
    max_grad_norm=0 too: that clips nothing, so it runs, and says what the norm leaves out."""
    model, opt = _fused_embedding_model()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in with_grad]))
    grads = [p.grad.clone() for p in with_grad]
    with pytest.warns(UserWarning, match=r"max_norm=inf \(a norm, no clipping\) was given .*covers only the "
                                         r"gradients that exist"):
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    torch.testing.assert_close(total, expected)
    assert all(torch.equal(p.grad, before) for p, before in zip(with_grad, grads))
    with pytest.raises(ValueError, match="global-norm clipping needs every gradient"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)


def test_the_clipping_guard_is_installed_once_and_calls_the_original() -> None:
    forge_core.fuse(nn.Sequential(nn.Linear(4, 4)), backend="reference", probe_inputs=False)
    guarded = torch.nn.utils.clip_grad_norm_
    original = guarded.forge_clipping_guard_of
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is guarded
    assert not hasattr(original, "forge_clipping_guard_of")
    forge_core.fuse(nn.Sequential(nn.Linear(4, 4)), backend="reference", probe_inputs=False)
    assert torch.nn.utils.clip_grad_norm_ is guarded
    plain = nn.Linear(3, 3)
    twin = copy.deepcopy(plain)
    for module in (plain, twin):
        module(torch.ones(2, 3)).sum().backward()
    assert torch.equal(guarded(plain.parameters(), 1.0), original(twin.parameters(), 1.0))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), twin.parameters()))


def test_a_stale_optimizer_after_unfuse_refuses_to_step() -> None:
    model, opt = _fused_embedding_model()
    opt.step()
    opt.zero_grad()
    steps = opt.state_dict()["forge"]["steps_taken"]
    forge_core.unfuse(model)
    assert opt.unfused
    with pytest.raises(RuntimeError, match=r"^this ForgeOptimizer's model was unfused \(forge_core\.unfuse\): "
                                           r"its fused weights are plain weights again"):
        opt.step()
    # A backward through the plain model, then the stale step: the same error, naming the new .grad.
    model(torch.arange(12).view(2, 6) % 20).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"unfused \(forge_core\.unfuse\) and fused weight 'head' has a \.grad"):
        opt.step()
    assert opt.state_dict()["forge"]["steps_taken"] == steps
    # A model whose only FORGE module is a row-gradient embedding tells its optimizer too.
    embedding_only = nn.Sequential(nn.Embedding(10, 4))
    embedding_opt = forge_core.fuse(embedding_only, backend="reference", probe_inputs=False)
    assert embedding_opt.row_gradient_names() == ["0.weight"]
    forge_core.unfuse(embedding_only)
    with pytest.raises(RuntimeError, match="unfused"):
        embedding_opt.step()


@pytest.mark.parametrize("rule_name, key", [("adamw", "betas"), ("lion", "betas"), ("adamax", "betas"),
                                            ("nadam", "betas"), ("radam", "betas"), ("lamb", "betas"),
                                            ("adam_mini", "betas"), ("galore_adamw", "betas"), ("muon", "adamw_betas")])
def test_betas_that_are_not_a_pair_are_refused_in_one_line(rule_name: str, key: str) -> None:
    """``betas=(0.9,)`` raised a bare IndexError inside torch's optimizer (or a ValueError about unpacking)."""
    for value, shown in (((0.9,), r"\(0\.9,\)"), (0.9, "0.9"), ((0.9, 0.99, 0.999), r"\(0\.9, 0\.99, 0\.999\)")):
        model = nn.Sequential(nn.Linear(4, 4))
        with pytest.raises(ValueError, match=rf"^{rule_name}: {key} must be a pair of numbers \(beta1, beta2\), "
                                             rf"got {shown}$"):
            forge_core.fuse(model, rule_name, probe_inputs=False, **{key: value})
        assert type(model[0]) is nn.Linear
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = forge_core.fuse(model, rule_name, probe_inputs=False)
    if key == "betas" and rule_name not in ("adam_mini", "galore_adamw"):     # (their layer path reads it later)
        opt.param_groups[0]["betas"] = (0.9,)                                   # a param group edited after fuse
        with pytest.raises(ValueError, match=rf"^{rule_name}: betas must be a pair of numbers"):
            model(torch.randn(3, 4)).sum().backward()


def test_a_linear_without_elements_is_left_to_torch_and_trains_as_unfused() -> None:
    """``nn.Linear(16, 0)`` / ``nn.Linear(0, 8)`` failed at fuse with a reshape error in the probe's backward;
    torch trains such a model (its empty weights have nothing to update)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 0), nn.Linear(0, 8), nn.Linear(16, 4))

    def forward(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        hidden = net[0](x)
        return net[3](hidden).sum() + net[2](net[1](hidden)).sum()

    reference = copy.deepcopy(model)
    opt = forge_core.fuse(model, "adamw", lr=1e-2, probe_inputs=False)
    assert opt.excluded_modules == {"1": "weight has no elements (shape (0, 16))",
                                    "2": "weight has no elements (shape (8, 0))"}
    assert sorted(opt.fused_module_names()) == ["0", "3"]
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(step))
        for net, optimizer in ((model, opt), (reference, torch_opt)):
            forward(net, x).backward()
            optimizer.step()
            optimizer.zero_grad()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("convert, message", [
    (lambda m: m.to(torch.float64), r"^converting a fused model to torch\.float64: the fused update takes fp32 or "
                                    r"bf16 weights, and '0\.weight' would become torch\.float64; convert the model "
                                    r"before forge_core\.fuse \(or forge_core\.unfuse it first\)$"),
    (lambda m: m.double(), "converting a fused model to torch.float64"),
    (lambda m: m.half(), "converting a fused model to torch.float16"),
    (lambda m: m.to("meta"), r"^moving a fused model to meta: '0\.weight''s optimizer state stays on cpu"),
])
def test_converting_a_fused_model_to_what_it_cannot_update_is_refused_at_once(convert, message: str) -> None:
    """It failed only at the first backward (the kernel's "weight dtype must be bf16 or fp32"). Now the
    conversion itself is refused before anything converts: the model trains on as it was. To bf16 (before
    the first step: torch's fallback optimizer keeps its moments in the dtype they were made in) it converts
    and trains."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = forge_core.fuse(model, "adamw", lr=1e-2, probe_inputs=False)
    with pytest.raises(ValueError, match=message):
        convert(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    ids = torch.tensor([[1, 2, 3]])
    before = model[1].weight.detach().clone()
    model(ids).sum().backward()
    opt.step()
    assert not torch.equal(model[1].weight, before)
    fresh = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fresh_opt = forge_core.fuse(fresh, "adamw", lr=1e-2, probe_inputs=False)
    fresh.to(torch.bfloat16)                         # a dtype the fused update takes
    before = fresh[1].weight.detach().clone()
    fresh(ids).float().sum().backward()
    fresh_opt.step()
    assert fresh[1].weight.dtype == torch.bfloat16 and not torch.equal(fresh[1].weight, before)
    plain = nn.Linear(2, 2)
    assert plain.to(torch.float64).weight.dtype == torch.float64      # a model without fused modules: torch's own


@pytest.mark.parametrize("rule_name", ["adafactor", "adalomo", "sm3", "adam_mini", "lars", "galore_adamw"])
def test_a_per_layer_rule_refuses_a_3d_parameter_at_fuse(rule_name: str) -> None:
    """The regime-3 rules step what they do not fuse with a RuleOptimizer, which takes 1-D and 2-D parameters:
    a model with 3-D MoE experts (or a convolution) fused with one failed at its first step(), after a warning
    that the fallback steps them. Refused at fuse, the model untouched; frozen, the parameter is no obstacle."""
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.experts = nn.Parameter(torch.randn(2, 4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("bi,eoi->bo", self.lin(x), self.experts)

    model = Experts()
    with pytest.raises(ValueError, match=rf"^optimizer '{rule_name}' cannot step 'experts' of shape \(2, 4, 4\): its "
                                         "per-layer step and the fallback that steps what it does not fuse take 1-D "
                                         r"and 2-D parameters \(freeze it, or use another optimizer\)$"):
        forge_core.fuse(model, rule_name, probe_inputs=False)
    assert type(model.lin) is nn.Linear
    model.experts.requires_grad_(False)
    opt = forge_core.fuse(model, rule_name, probe_inputs=False)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
