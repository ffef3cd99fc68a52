"""The model zoo beyond Llama: each family built small, fused, stepped twice, its fused share checked.

The full-size entries are only built on the meta device (parameter counts against the public
models'); the suites that time them on a GPU must load.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import forge_core
from forge_bench import models
from forge_bench.suite import load_suite
from forge_bench.torch_arms import not_fused_summary

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent

# model -> (least fused share of all parameters, what stays unfused)
TINY = {
    "tiny-qwen3": (0.70, "the embedding"),
    "tiny-qwen3-moe": (0.75, "the embedding and the routers"),
    "tiny-vit": (0.75, "the patch convolution, norms and biases"),
    "tiny-mamba2": (0.55, "the tied embedding, the convolution, A, D, dt"),
    "tiny-mixer": (0.70, "the patch convolution, norms and biases"),
    "tiny-gpt2": (0.75, "the tied embedding and the positions"),
}


def _two_steps(name: str, **fuse_kwargs) -> tuple[torch.nn.Module, forge_core.ForgeOptimizer, list[float]]:
    model = models.build_model(name, "float32", "cpu", seed=0)
    seq = models.max_seq_len(name) if models.is_image_model(name) else 12
    optimizer = forge_core.fuse(model, backend="reference", lr=1e-3, **fuse_kwargs)
    losses = []
    for step in range(2):
        batch = models.make_batch(name, 2 if models.is_image_model(name) else 1, seq, "cpu", seed=step)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return model, optimizer, losses


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_zoo_model_fuses_and_trains(name: str) -> None:
    least_share, _unfused = TINY[name]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="forge_core.fuse")   # nothing left out loudly on the CPU path
        model, optimizer, losses = _two_steps(name)
    n_params = sum(p.numel() for p in model.parameters())
    fused = sum(p.numel() for p in optimizer.fused_parameters())
    assert fused / n_params >= least_share, f"{name}: fused {fused} of {n_params}"
    assert all(math.isfinite(v) for v in losses)
    assert all(p.grad is None for p in optimizer.fused_parameters())


def test_mamba2_fast_path_bypass_is_caught_by_the_probe_and_reported(monkeypatch) -> None:
    """With mamba_ssm installed, Mamba-2's training forward hands ``out_proj.weight`` to a fused scan
    kernel instead of calling ``out_proj``: the probe must leave out_proj to the fallback and the
    arm's coverage must say so. Here a stand-in for that kernel reads the weight the same way."""
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    if not hasattr(modeling, "mamba2_split_conv1d_scan_combined"):
        pytest.skip("this transformers' Mamba-2 has no fused training path to stand in for")

    def fast_path(zxbcdt, *args, outproj_weight=None, outproj_bias=None, **kwargs):
        return F.linear(zxbcdt[..., :outproj_weight.shape[1]], outproj_weight, outproj_bias)

    monkeypatch.setattr(modeling, "mamba2_split_conv1d_scan_combined", fast_path)
    with pytest.warns(UserWarning, match=r"out_proj: the model reads its \.weight outside its forward"):
        model, optimizer, losses = _two_steps("tiny-mamba2")
    fused = optimizer.fused_module_names()
    assert fused and all("in_proj" in n for n in fused if ".mixer." in n)
    assert not any("out_proj" in n for n in fused)
    summary = not_fused_summary(optimizer.excluded_modules)
    assert any(key.startswith("backbone.layers.*.mixer.out_proj (2)") for key in summary), summary
    assert all(math.isfinite(v) for v in losses)


def test_moe_arm_records_what_it_left_out_and_counts_experts_as_fused() -> None:
    model, optimizer, _ = _two_steps("tiny-qwen3-moe")
    names = optimizer.fused_module_names()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.experts.down_proj" in names
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    fused = sum(p.numel() for p in optimizer.fused_parameters())
    assert fused > experts


@pytest.mark.parametrize("name, billions", [
    ("qwen3-0.6b", 0.596), ("qwen3-1.7b", 1.721), ("qwen3-4b", 4.022), ("qwen3-8b", 8.191), ("qwen3-14b", 14.768),
    ("qwen3-30b-a3b", 30.532), ("vit-base-16", 0.0866), ("vit-large-16", 0.3043), ("mamba2-1.3b", 1.344),
    ("mixer-b16", 0.0599), ("mixer-l16", 0.2082),
])
def test_full_size_configs_have_the_public_parameter_counts(name: str, billions: float) -> None:
    assert models.param_count(name) / 1e9 == pytest.approx(billions, rel=2e-3)


def test_image_batches_carry_pixels_and_labels_and_refuse_another_token_count() -> None:
    batch = models.make_batch("vit-base-16", 3, 197, "cpu")
    assert batch["pixel_values"].shape == (3, 3, 224, 224) and batch["labels"].shape == (3,)
    assert models.max_seq_len("mixer-b16") == 196
    with pytest.raises(models.ModelError, match="makes 197 tokens per image"):
        models.make_batch("vit-base-16", 1, 512, "cpu")


COMPILED_TWINS = {f"{arm}_{suffix}" for arm in ("adamw_fused", "forge_bf16", "forge_int8")
                  for suffix in ("compile", "compile_ro")}


@pytest.mark.parametrize("suite, more", [("zoo.yaml", COMPILED_TWINS),
                                         ("qwen3_scaling.yaml", {"forge_bf16_side_stream", "forge_int8_side_stream"})])
def test_zoo_suites_load(suite: str, more: set[str]) -> None:
    """The zoo's suites compare fused AdamW with FORGE bf16 / int8, eager and compiled (and the scaling suite's
    smallest model FORGE on its side stream)."""
    loaded = load_suite(REPO / "suites" / suite)
    assert {cell.method for cell in loaded.cells} == {"adamw_fused", "forge_bf16", "forge_int8"} | more


def test_the_eager_suite_pairs_fused_adamw_and_forge_on_every_model_of_the_zoo() -> None:
    """``suites/eager.yaml`` holds every model of models.yaml and zoo.yaml at batch 1 (and Qwen3-0.6B), each
    with fused AdamW and FORGE bf16, eager: the whole Qwen3-30B-A3B only at 8 layers, where fused AdamW fits."""
    eager = load_suite(REPO / "suites" / "eager.yaml").cells
    zoo = [*load_suite(REPO / "suites" / "models.yaml").cells, *load_suite(REPO / "suites" / "zoo.yaml").cells]
    wanted = {cell.model for cell in zoo} - {"qwen3-30b-a3b"}
    assert {cell.model for cell in eager} == wanted | {"qwen3-0.6b"}
    for model in wanted:
        cells = [cell for cell in eager if cell.model == model and cell.method != "forge_bf16_side_stream"]
        assert {cell.method for cell in cells} == {"adamw_fused", "forge_bf16"}
        assert all(not cell.cuda_graph and cell.batch * cell.seq <= 600 for cell in cells)
