"""Peer arms (forge_bench/peers.py, their probes in peer_probes.py, their registry entries in methods.py), on CPU.

Arms whose package runs on CPU take a few real steps on a tiny Llama; an arm whose package is
missing must answer with a reason instead of crashing; CUDA-only arms must say so.
"""
from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from forge_bench import peer_probes, peers
from forge_bench.arm import TrainConfig
from forge_bench.methods import METHODS

PEER_NAMES = {
    "bnb_adamw8bit", "bnb_paged_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit", "torchao_adamw_fp8",
    "optimi_adamw_kahan", "optimi_adamw_kahan_release", "galore_adamw", "galore_adamw_rsvd", "apollo_adamw", "lomo",
    "adalomo", "flashoptim_adamw", "flashoptim_adamw_release",
}
# Arms whose package runs on CPU (checked by hand: see docs/peers.md) and the module they import.
CPU_ARMS = {
    "bnb_adamw8bit": "bitsandbytes",
    "torchao_adamw8bit": "torchao",
    "torchao_adamw4bit": "torchao",
    "torchao_adamw_fp8": "torchao",
    "optimi_adamw_kahan": "optimi",
    "optimi_adamw_kahan_release": "optimi",
    "galore_adamw": "galore_torch",
    "galore_adamw_rsvd": "galore_torch",
    "apollo_adamw": "apollo_torch",
    "lomo": "lomo_optim",
}
# Arms that cannot run without CUDA, whatever is installed.
CUDA_ONLY_ARMS = {"bnb_paged_adamw8bit", "adalomo", "flashoptim_adamw", "flashoptim_adamw_release"}
ADAM_ARMS = {"bnb_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit", "torchao_adamw_fp8",
             "optimi_adamw_kahan", "optimi_adamw_kahan_release", "galore_adamw", "galore_adamw_rsvd", "apollo_adamw"}

CFG = TrainConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, device="cpu")


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(config).to(torch.bfloat16).train()


def tiny_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def projection_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The attention/MLP weights: every peer must move them (bf16 norms may round back)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if "proj" in name}


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao compiles its step; on 2 CPU cores that costs minutes, so tests run it eagerly.

    The same optimizer code runs, only uncompiled (the GPU sweep runs it compiled).
    """
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")   # read by torch.compile at each call


def test_every_peer_is_registered_with_a_cost_model():
    registered = {name for name, m in METHODS.items() if m.family == "peer"}
    assert PEER_NAMES <= registered
    for name in PEER_NAMES:
        method = METHODS[name]
        assert method.description and method.requires and method.extra_check is not None
        states, grads = method.bytes_per_param(2)
        assert states >= 0.0 and grads >= 0.0, name


@pytest.mark.parametrize("name", sorted(PEER_NAMES))
def test_missing_package_gives_a_reason_not_a_crash(name, monkeypatch):
    method = METHODS[name]
    missing = set(method.requires)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda mod, *a, **k: None if mod.split(".")[0] in missing else real_find_spec(mod, *a, **k))
    peer_probes.peer_problem.cache_clear()
    try:
        reason = method.unavailable_reason("cuda")
        assert reason is not None and "not installed" in reason and method.requires[0] in reason
        # the probe itself (what extra_check runs) says the same, with the pip name
        probe_reason = peer_probes.run_probe(method.extra_check.__name__.removeprefix("check_"))
        assert probe_reason is not None and "not installed" in probe_reason
    finally:
        peer_probes.peer_problem.cache_clear()


@pytest.mark.parametrize("name", sorted(CUDA_ONLY_ARMS))
def test_cuda_only_arms_say_so_on_cpu(name):
    reason = METHODS[name].unavailable_reason("cpu")
    assert reason is not None
    assert "not installed" in reason or "needs a CUDA device" in reason


def test_import_failure_reports_the_first_line(tmp_path, monkeypatch):
    (tmp_path / "forge_broken_peer.py").write_text(textwrap.dedent("""
        raise ImportError("libbroken.so.13: cannot open shared object file\\nsecond line never shown")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = peer_probes.import_problem(peer_probes.PeerPackage("forge_broken_peer", "forge-broken-peer", "0", "X"))
    assert reason == "forge-broken-peer failed to import: ImportError: libbroken.so.13: cannot open shared object file"


def test_too_old_version_and_missing_symbol_are_reported():
    too_old = peer_probes.import_problem(peer_probes.PeerPackage("torch", "torch", "999.0", "optim"))
    assert too_old is not None and "too old" in too_old and "999.0" in too_old
    no_symbol = peer_probes.import_problem(peer_probes.PeerPackage("torch", "torch", "1.0", "optim.NoSuchOptimizer"))
    assert no_symbol is not None and "no torch.optim.NoSuchOptimizer" in no_symbol
    absent = peer_probes.import_problem(peer_probes.PeerPackage("forge_no_such_package", "forge-no-such", "0", "X"))
    assert absent == "Python package 'forge_no_such_package' (pip: forge-no-such) is not installed"


def test_probe_runs_in_a_child_process():
    expected = peer_probes.run_probe("lomo_optim")
    assert peer_probes.probe_in_child("lomo_optim") == expected
    usage = subprocess.run([sys.executable, "-m", "forge_bench.peer_probes", "probe", "nope"],
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


@pytest.mark.parametrize("name", sorted(CPU_ARMS))
def test_cpu_arm_trains_a_tiny_llama(name, eager_torchao):
    method = METHODS[name]
    reason = method.unavailable_reason("cpu")
    if importlib.util.find_spec(CPU_ARMS[name]) is None:
        assert reason is not None and "not installed" in reason
        return
    assert reason is None, reason
    model = tiny_llama()
    before = projection_weights(model)
    arm = method.build(model, CFG)
    losses = [float(arm.step(tiny_batch())) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses          # lr 1e-2 on one repeated batch: it must learn
    after = projection_weights(model)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"{name} left these weights untouched: {unchanged}"
    assert all(p.grad is None for p in model.parameters()), "gradients must be freed after the step"

    memory = arm.memory_breakdown()
    assert set(memory) >= {"weights", "optimizer_states", "gradients"}
    assert memory["weights"] == sum(p.numel() * p.element_size() for p in model.parameters())
    settings = arm.settings
    assert settings["package_version"] != "unknown" and settings["weights_dtype"] == "bfloat16"
    assert settings["lr"] == CFG.lr and settings["weight_decay"] == CFG.weight_decay
    if name in ADAM_ARMS:
        assert settings["betas"] == list(CFG.betas) and settings["eps"] == CFG.eps


def _weights_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_state_accounting_matches_each_method(eager_torchao):
    """States: Kahan AdamW holds 3 bf16 tensors a weight, 8-bit ~1 byte a moment, LOMO none."""
    if importlib.util.find_spec("optimi") is not None:
        model = tiny_llama()
        arm = METHODS["optimi_adamw_kahan"].build(model, CFG)
        arm.step(tiny_batch())
        assert arm.memory_breakdown()["optimizer_states"] >= 3 * _weights_bytes(model)
        release = METHODS["optimi_adamw_kahan_release"].build(tiny_llama(), CFG)
        assert release.memory_breakdown()["gradients"] == max(
            p.numel() * p.element_size() for p in release.model.parameters())
    if importlib.util.find_spec("bitsandbytes") is not None:
        model = tiny_llama()
        arm = METHODS["bnb_adamw8bit"].build(model, CFG)
        arm.step(tiny_batch())
        quantized = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
        small = sum(p.numel() for p in model.parameters() if p.numel() < 4096)
        states = arm.memory_breakdown()["optimizer_states"]
        assert 2 * quantized + 8 * small <= states < 2 * quantized + 8 * small + 64 * 1024
    if importlib.util.find_spec("lomo_optim") is not None:
        model = tiny_llama()
        arm = METHODS["lomo"].build(model, CFG)
        arm.step(tiny_batch())
        sizes = sorted((p.numel() * p.element_size() for p in model.parameters()), reverse=True)
        assert arm.memory_breakdown() == {"weights": _weights_bytes(model), "optimizer_states": 0,
                                          "gradients": sizes[0] + sizes[1]}


def test_low_rank_arms_project_attention_and_mlp_only():
    model = tiny_llama()
    names = [name for name, _ in peers.low_rank_targets(model)]
    assert len(names) == 2 * 7                      # q, k, v, o, gate, up, down per layer
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in names)
    with pytest.raises(ValueError, match="no attention/MLP linear layer"):
        peers.low_rank_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"rank": 2})


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None or importlib.util.find_spec("apollo_torch") is None,
                    reason="galore-torch / apollo-torch not installed")
def test_low_rank_states_shrink_with_rank():
    """With a rank below the layer width, the projected moments are smaller than full AdamW's."""
    for build in (lambda m: peers.build_galore_adamw(m, CFG, rank=8),
                  lambda m: peers.build_apollo_adamw(m, CFG, rank=8)):
        model = tiny_llama()
        arm = build(model)
        for _ in range(2):
            assert math.isfinite(float(arm.step(tiny_batch())))
        full_adam_states = 2 * _weights_bytes(model)
        assert arm.memory_breakdown()["optimizer_states"] < full_adam_states / 2
        assert arm.settings["rank"] == 8


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch not installed")
@pytest.mark.parametrize("shape, kind", [((40, 24), "right"), ((24, 40), "left")])
def test_randomized_galore_projection_spans_the_same_subspace(shape, kind):
    """On a gradient of rank <= the projection rank, the randomized SVD finds the same singular
    subspace as galore-torch's full SVD: the projectors P^T P (right) / P P^T (left) agree."""
    from galore_torch.galore_projector import GaLoreProjector

    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(shape[0], 3, generator=generator) @ torch.randn(3, shape[1], generator=generator)
    grad = grad.to(torch.bfloat16)
    projector = GaLoreProjector(rank=3)
    full = projector.get_orthogonal_matrix(grad, 3, kind)
    fast = peers.randomized_orthogonal_matrix(projector, grad, 3, kind)
    assert fast.shape == full.shape and fast.dtype == full.dtype == torch.bfloat16
    operator = (lambda p: p.float().t() @ p.float()) if kind == "right" else (lambda p: p.float() @ p.float().t())
    torch.testing.assert_close(operator(fast), operator(full), atol=3e-2, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch not installed")
def test_galore_rsvd_arm_keeps_the_package_svd_for_everyone_else():
    from galore_torch.galore_projector import GaLoreProjector

    package_svd = GaLoreProjector.get_orthogonal_matrix
    arm = peers.build_galore_adamw_rsvd(tiny_llama(), CFG)
    for _ in range(2):
        assert math.isfinite(float(arm.step(tiny_batch())))
    assert GaLoreProjector.get_orthogonal_matrix is package_svd
    assert arm.settings["projection_svd"] == "torch.svd_lowrank" and arm.settings["rank"] == 128


def test_lomo_refuses_clip_grad_norm():
    if importlib.util.find_spec("lomo_optim") is None:
        pytest.skip("lomo-optim not installed")
    with pytest.raises(ValueError, match="second backward"):
        peers.build_lomo(tiny_llama(), CFG, clip_grad_norm=1.0)


def test_paged_state_bytes_count_only_large_tensors():
    params = [torch.zeros(400, 400), torch.zeros(100, 100), torch.zeros(64)]
    assert peers.bnb_paged_bytes(params) == 2 * 400 * 400


def test_torchao_kind_is_checked():
    with pytest.raises(ValueError, match="torchao optimizer kind"):
        peers.build_torchao_adamw(tiny_llama(), CFG, kind="2bit")


def test_model_without_labels_gives_a_clear_error():
    with pytest.raises(ValueError, match="labels"):
        peers.model_loss(tiny_llama(), {"input_ids": tiny_batch()["input_ids"]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(PEER_NAMES))
def test_every_peer_trains_on_cuda(name):
    """On the GPU machine (wheels from scripts/fetch_wheels.sh): every peer runs, or says why not."""
    method = METHODS[name]
    reason = method.unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    model = tiny_llama().cuda()
    before = projection_weights(model)
    arm = method.build(model, TrainConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, device="cuda"))
    batch = {k: v.cuda() for k, v in tiny_batch().items()}
    losses = [float(arm.step(batch)) for _ in range(3)]
    torch.cuda.synchronize()
    assert all(math.isfinite(v) for v in losses), losses
    after = projection_weights(model)
    assert not [n for n in before if torch.equal(before[n], after[n])]
    memory = arm.memory_breakdown()
    assert memory["weights"] > 0 and memory["optimizer_states"] >= 0


def test_probe_stays_in_process_without_cuda_or_in_a_cell(monkeypatch):
    """The child-process probe is only for a CUDA parent that has not touched the GPU."""
    calls = []
    monkeypatch.setattr(peer_probes, "probe_in_child", lambda name: calls.append(name) or "child")
    monkeypatch.setattr(peer_probes, "run_probe", lambda name: "in-process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    peer_probes.peer_problem.cache_clear()
    try:
        assert peer_probes.peer_problem("optimi") == "child" and calls == ["optimi"]
        peer_probes.peer_problem.cache_clear()
        monkeypatch.setattr(peer_probes, "in_cell_process", lambda: True)
        assert peer_probes.peer_problem("optimi") == "in-process"
        peer_probes.peer_problem.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(peer_probes, "in_cell_process", lambda: False)
        assert peer_probes.peer_problem("optimi") == "in-process"
        with pytest.raises(KeyError, match="unknown peer probe"):
            peer_probes.peer_problem("nope")
    finally:
        peer_probes.peer_problem.cache_clear()


def test_a_cell_process_imports_only_its_own_arms_peer_package():
    """transformers imports torchao while it loads any model class whenever torchao is installed; a
    cell process hides the peer packages its arm does not use, so a baseline cell loads none of
    them, and importing the registry loads none either."""
    code = textwrap.dedent("""
        import importlib.util, sys
        from forge_bench import methods, models, peer_probes
        peers = sorted({p.module for p in peer_probes.PACKAGES.values()})
        assert not [m for m in peers if sys.modules.get(m) is not None], "the registry imported a peer package"
        hidden = peer_probes.hide_peer_packages_except(methods.METHODS["adamw_foreach"].requires)
        model = models.build_model("tiny-llama", "float32", "cpu", seed=0)
        arm = methods.METHODS["adamw_foreach"].build(model, methods.TrainConfig(device="cpu"))
        arm.step(models.make_batch("tiny-llama", 2, 8, "cpu"))
        assert not [m for m in peers if sys.modules.get(m) is not None]
        assert all(importlib.util.find_spec(m) is None for m in hidden)
        print("HIDDEN", ",".join(hidden))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    hidden = done.stdout.split("HIDDEN ", 1)[1].split()[0].split(",")
    assert "torchao" in hidden or importlib.util.find_spec("torchao") is None
    assert "Failed to load" not in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch not installed")
def test_hiding_keeps_what_a_peer_package_imports_itself():
    """galore_torch imports bitsandbytes in its __init__: a GaLore cell keeps bitsandbytes importable."""
    code = textwrap.dedent("""
        import torch
        from forge_bench import methods, models, peer_probes
        hidden = peer_probes.hide_peer_packages_except(methods.METHODS["galore_adamw"].requires)
        assert "bitsandbytes" not in hidden and "torchao" in hidden, hidden
        assert methods.METHODS["galore_adamw"].unavailable_reason("cpu") is None
        model = models.build_model("tiny-llama", "float32", "cpu", seed=0)
        arm = methods.METHODS["galore_adamw"].build(model, methods.TrainConfig(device="cpu"))
        print("LOSS", float(arm.step(models.make_batch("tiny-llama", 2, 8, "cpu"))))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOSS" in done.stdout


def test_hiding_keeps_the_arms_own_package_and_any_package_already_imported():
    code = textwrap.dedent("""
        import sys
        import torch   # imported before: never hidden
        from forge_bench import peer_probes
        hidden = peer_probes.hide_peer_packages_except(("lomo_optim",))
        assert "lomo_optim" not in hidden and "torchao" in hidden, hidden
        assert sys.modules["torchao"] is None and "lomo_optim" not in sys.modules
        try:
            import torchao
        except ImportError:
            print("REFUSED")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout
