"""The baseline and FORGE arms: each builds, steps, and reports its memory; plugins register arms."""
from __future__ import annotations

import pytest
import torch

from forge_bench import methods, models
from forge_bench.arm import ArmUnavailable, TrainConfig
from forge_bench.methods import METHODS
from forge_bench.family_table import FAMILIES, STATE_DTYPES

CORE = ("no_optimizer", "adamw_foreach", "adamw_fused", "sgd", "forge_fp32", "forge_bf16", "forge_int8")
CHUNKED_LOSS_ARMS = ("forge_bf16_cce", "forge_int8_cce", "adamw_fused_cce")


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    # the CPU Triton interpreter is far too slow for whole-model steps; kernels have their own tests
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_core_arms_are_registered_with_families():
    for name in CORE:
        assert name in METHODS
    assert {METHODS[n].family for n in CORE} == {"baseline", "forge"}
    assert METHODS["no_optimizer"].parity_reference is None
    assert METHODS["sgd"].parity_reference == "sgd"
    assert all(METHODS[n].parity_reference == "adamw" for n in CORE if "adamw" in n or n.startswith("forge"))


def test_adamw_fused_needs_cuda_with_a_reason():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    reason = METHODS["adamw_fused"].unavailable_reason("cpu")
    assert reason and "CUDA" in reason


def _arm(name, dtype="float32"):
    model = models.build_model("tiny-llama", dtype, "cpu", seed=0)
    return model, METHODS[name].build(model, TrainConfig(lr=1e-3, device="cpu"))


@pytest.mark.parametrize("name", ["no_optimizer", "adamw_foreach", "sgd"])
def test_torch_arms_step_and_account_memory(name):
    model, arm = _arm(name)
    batch = models.make_batch("tiny-llama", 2, 16, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    losses = [float(arm.step(batch)) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert moved == (name != "no_optimizer")
    assert all(p.grad is None for p in model.parameters()), "grads must be freed after each step"
    mem = arm.memory_breakdown()
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert mem["weights"] == weights and mem["gradients"] == weights
    expected_states = {"no_optimizer": 0, "adamw_foreach": 2 * weights, "sgd": weights}[name]
    assert abs(mem["optimizer_states"] - expected_states) <= 4 * 64   # + AdamW's per-tensor step counters
    assert METHODS[name].bytes_per_param(4)[1] == 4.0


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_forge_arms_fuse_and_step(state_dtype):
    name = f"forge_{state_dtype}"
    if METHODS[name].unavailable_reason("cpu"):
        pytest.skip(METHODS[name].unavailable_reason("cpu"))
    model, arm = _arm(name)
    assert arm.n_fused_params > 0
    assert arm.settings["state_dtype"] == state_dtype
    batch = models.make_batch("tiny-llama", 2, 16, "cpu")
    w = model.model.layers[0].mlp.down_proj.weight
    w0 = w.detach().clone()
    loss = arm.step(batch)
    assert torch.isfinite(loss)
    assert not torch.equal(w0, w.detach()), "a fused weight must be updated by the step"
    mem = arm.memory_breakdown()
    assert set(mem) >= {"weights", "optimizer_states", "gradients"}
    assert mem["gradients"] < mem["weights"]          # no gradient pool for fused weights


def test_plugins_register_and_bad_plugin_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(methods.PLUGINS_ENV, "forge_bench_test_arms")
    assert methods.load_plugins() == ["forge_bench_test_arms"]
    assert "test_crash" in METHODS
    assert METHODS["test_unavailable"].unavailable_reason("cpu") == "test_unavailable: needs hardware that does not exist"
    monkeypatch.setenv(methods.PLUGINS_ENV, "forge_bench_test_arms, no_such_plugin_module")
    with pytest.raises(methods.PluginError, match="no_such_plugin_module"):
        methods.load_plugins()


def test_missing_package_is_a_reason():
    m = methods.Method(name="x", family="peer", description="needs a package", build=lambda m, c: None,
                       requires=("surely_not_installed_pkg",))
    assert "surely_not_installed_pkg" in m.unavailable_reason("cpu")


def test_only_capturable_arms_run_in_cuda_graph_grids():
    core = {"no_optimizer", "adamw_foreach", "adamw_fused", "sgd", "forge_fp32", "forge_bf16", "forge_int8",
            "forge_fp8", "forge_fp8_cce", "forge_bf16_side_stream", "forge_int8_side_stream"}
    # the optimizer families (forge_bench.families): every FORGE arm, and the unfused arms whose step
    # does not read the device on the host (torch.optim.Adafactor reads two norms per weight)
    family_arms = {f"forge_{f}_{states}" for f in FAMILIES for states in STATE_DTYPES}
    family_arms |= {f"{f.name}_unfused" for f in FAMILIES.values() if f.unfused_graphable}
    assert "adafactor_unfused" not in family_arms and "forge_adafactor_bf16" in family_arms
    assert {name for name, m in METHODS.items() if m.graphable} == core | set(CHUNKED_LOSS_ARMS) | family_arms
    reason = METHODS["bnb_adamw8bit"].unavailable_reason("cuda", cuda_graph=True)
    assert reason.startswith("bnb_adamw8bit: its step cannot be captured in a CUDA graph")
    assert METHODS["sgd"].unavailable_reason("cpu", cuda_graph=True) is None


def test_capturable_config_reaches_the_torch_optimizer():
    model = torch.nn.Linear(4, 4)
    arm = METHODS["adamw_foreach"].build(model, TrainConfig(device="cpu", capturable=True))
    assert arm.optimizer.param_groups[0]["capturable"] is True and arm.settings["capturable"] is True
    arm = METHODS["adamw_foreach"].build(torch.nn.Linear(4, 4), TrainConfig(device="cpu"))
    assert arm.optimizer.param_groups[0]["capturable"] is False


# --- the chunked LM-head loss arms ---------------------------------------------------------------

@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("name", CHUNKED_LOSS_ARMS)
def test_chunked_loss_arms_train_with_the_hf_loss_value(name, model_name):
    """The step computes hidden states with the base model and the chunked loss with the LM head:
    the same loss as ``model(**batch).loss``. Tiny-llama's untied head is fused by the FORGE arms;
    GPT-2's head is tied to the embedding, so it is not fused and gets an ordinary gradient."""
    import copy

    method = METHODS[name]
    assert method.parity_reference == "adamw" and method.graphable
    assert method.settings["loss"] == "chunked_ce"
    model = models.build_model(model_name, "float32", "cpu", seed=0)
    reference = copy.deepcopy(model)
    batch = models.make_batch(model_name, 2, 16, "cpu")
    arm = method.build(model, TrainConfig(lr=1e-3, device="cpu"))   # fused AdamW also runs on a CPU
    head_before = model.get_output_embeddings().weight.detach().clone()
    loss = arm.step(batch)
    assert float(loss) == pytest.approx(float(reference(**batch).loss), rel=1e-6)
    assert arm.settings["loss"] == "chunked_ce" and arm.settings["chunk_size"] == 512    # resolved, recorded
    assert arm.settings["keep_logits"] is True              # 32 tokens: the backward reads the forward's logits
    assert all(p.grad is None for p in model.parameters()), "grads must be freed after each step"
    assert not torch.equal(head_before, model.get_output_embeddings().weight.detach())
    if name.startswith("forge"):
        fused = arm.optimizer.fused_module_names()
        assert ("lm_head" in fused) == (model_name == "tiny-llama")
        if model_name == "tiny-llama":       # GPT-2: Conv1D layers and a tied head, nothing fused
            assert arm.memory_breakdown()["gradients"] < arm.memory_breakdown()["weights"]
    second = arm.step(models.make_batch(model_name, 2, 16, "cpu", seed=1))
    assert torch.isfinite(second)


def test_chunked_loss_arms_refuse_a_model_without_an_lm_head_in_one_line():
    from torch import nn

    for model in (nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)):
        with pytest.raises(ArmUnavailable) as info:
            METHODS["forge_bf16_cce"].build(model, TrainConfig(device="cpu"))
        assert "\n" not in str(info.value) and "LM head" in str(info.value)
    config = __import__("transformers").LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, vocab_size=64)
    model = __import__("transformers").LlamaForCausalLM(config)
    model.config.logit_scale = 0.5          # e.g. Cohere: the logits are not lm_head(hidden)
    with pytest.raises(ArmUnavailable, match="logit_scale"):
        METHODS["adamw_fused_cce"].build(model, TrainConfig(device="cpu"))


def test_side_stream_arms_fuse_with_the_side_stream_and_say_so():
    for name, overlap in (("forge_bf16", False), ("forge_bf16_side_stream", True)):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        arm = METHODS[name].build(model, TrainConfig(device="cpu"))
        assert arm.settings["overlap"] is overlap
        assert all(getattr(m, "forge_updater").overlap_updates is overlap
                   for m in model.modules() if hasattr(m, "forge_updater"))


def test_every_entry_is_a_keyword_method_with_a_family_and_a_description():
    """The registry is a table of keyword ``Method(...)`` entries: positional ones are refused."""
    with pytest.raises(TypeError):
        methods.Method("x", "peer", "positional", lambda m, c: None)
    assert [m.name for m in methods.ARMS] == list(METHODS)[:len(methods.ARMS)]
    for m in methods.ARMS:
        assert m.family in ("baseline", "forge", "peer") and m.description, m.name
        assert m.bytes_per_param is not None, m.name
    with pytest.raises(ValueError, match="registered twice"):
        methods.register(methods.ARMS[0])
    with pytest.raises(KeyError, match="unknown method 'nope'"):
        methods.get_method("nope")
