"""FORGE composed with GaLore (``forge_core/rules/galore_adamw.py``): the reference is galore_torch's
GaLoreAdamW, the fused path (G formed, projected and freed in each layer's backward) equals the
reference on the unfused gradient, the head and the vectors are stepped without a projection, the
moments are of rank r, resume is bit-identical, and what the rule cannot take is refused."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import forge_core
from forge_core.layer_step import track_gradient_residency
from forge_core.rules import get_rule
from forge_core.rules.galore_adamw import orthogonal_basis, state_shapes
from forge_core.rules.rule_optimizer import RuleOptimizer

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
LOW_RANK = {"rank": 4, "update_proj_gap": 3, "scale": 0.25}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", [(37, 23), (19, 41)])
def test_the_reference_is_galore_torchs_adamw(shape: tuple[int, int]) -> None:
    """Both orientations (m >= n: right singular vectors; m < n: left), a projection refreshed twice,
    a vector beside it without one; 7 steps, fp32, within 1e-5."""
    galore_torch = pytest.importorskip("galore_torch")
    generator = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(*shape, generator=generator))
    vector = nn.Parameter(torch.randn(shape[0], generator=generator))
    ours_weight, ours_vector = copy.deepcopy(weight), copy.deepcopy(vector)
    theirs = galore_torch.GaLoreAdamW([{"params": [vector]}, {"params": [weight], **LOW_RANK, "proj_type": "std"}],
                                      no_deprecation_warning=True, **HP)
    ours = RuleOptimizer([{"params": [ours_vector], "rank": 0}, {"params": [ours_weight]}], get_rule("galore_adamw"),
                         **LOW_RANK, **HP)
    for _ in range(7):
        gradients = torch.randn(*shape, generator=generator), torch.randn(shape[0], generator=generator)
        for params in ((weight, vector), (ours_weight, ours_vector)):
            for parameter, gradient in zip(params, gradients):
                parameter.grad = gradient.clone()
        theirs.step()
        ours.step()
    assert _relative_error(ours_weight.detach(), weight.detach()) <= 1e-5
    assert _relative_error(ours_vector.detach(), vector.detach()) <= 1e-5
    moments = ours.state[ours_weight]["exp_avg"].shape
    assert moments == ((shape[0], 4) if shape[0] >= shape[1] else (4, shape[1]))


def test_state_shapes_and_the_randomized_basis() -> None:
    assert state_shapes((4096, 1024), {"rank": 128}, "") == {
        "projector": (128, 1024), "exp_avg": (4096, 128), "exp_avg_sq": (4096, 128)}
    assert state_shapes((1024, 4096), {"rank": 128}, "") == {
        "projector": (1024, 128), "exp_avg": (128, 4096), "exp_avg_sq": (128, 4096)}
    assert state_shapes((6, 5), {"rank": 128}, "")["projector"] == (5, 5)           # rank capped at min(m, n)
    assert state_shapes((37,), {"rank": 4}, "") == {"exp_avg": (37,), "exp_avg_sq": (37,)}
    generator = torch.Generator().manual_seed(1)
    low_rank = torch.randn(60, 3, generator=generator) @ torch.randn(3, 40, generator=generator)
    for svd in ("full", "randomized"):
        basis = orthogonal_basis(low_rank, 3, svd)                                    # 60 >= 40: rows span G's rows
        assert basis.shape == (3, 40)
        assert torch.allclose(basis @ basis.t(), torch.eye(3), atol=1e-5)
        assert _relative_error(low_rank @ basis.t() @ basis, low_rank) <= 1e-4


class Block(nn.Module):
    """Odd widths, a head the rule leaves to its fallback (``get_output_embeddings``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(30, 45)
        self.down = nn.Linear(45, 17, bias=False)
        self.norm = nn.LayerNorm(17)
        self.head = nn.Linear(17, 11, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.down(torch.tanh(self.up(x)))))


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(3, 23, 30, generator=generator) for _ in range(count)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for x in batches:
        (model(x) - x[..., :11]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _fuse(model: nn.Module, **kwargs) -> forge_core.ForgeOptimizer:
    return forge_core.fuse(model, "galore_adamw", probe_inputs=torch.zeros(2, 30), **{**LOW_RANK, **HP, **kwargs})


def test_fused_equals_the_reference_on_the_unfused_gradient() -> None:
    """Hidden weights projected in their backward; the head and the vectors by AdamW without a
    projection, in both (the twin's head and vectors in a rank-0 group)."""
    model, twin = Block(), Block()
    opt = _fuse(model)
    assert sorted(opt.fused_module_names()) == ["down", "up"]
    hidden = [twin.up.weight, twin.down.weight]
    rest = [p for p in twin.parameters() if all(p is not h for h in hidden)]
    reference = RuleOptimizer([{"params": hidden}, {"params": rest, "rank": 0}], get_rule("galore_adamw"),
                              **LOW_RANK, **HP)
    batches = _batches(7)
    with track_gradient_residency() as residency:
        _train(model, opt, batches)
    _train(twin, reference, batches)
    for (name, a), b, c in zip(model.named_parameters(), twin.parameters(), Block().parameters()):
        assert _relative_error(a.detach(), b.detach()) <= 1e-5, name
        assert not torch.equal(a, c), name
    assert residency.formed == 2 * len(batches) and residency.peak_bytes == 4 * 45 * 30
    states = opt.state_dict()["state"]
    shapes = sorted(tuple(s["exp_avg"].shape) for s in states.values() if "projector" in s)
    assert shapes == [(4, 45), (45, 4)]             # up (45 x 30): m >= n, (m, r); down (17 x 45): (r, n)


def test_the_randomized_basis_is_seeded_and_leaves_the_random_stream_alone() -> None:
    generator = torch.Generator().manual_seed(2)
    grad = torch.randn(50, 30, generator=generator)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = orthogonal_basis(grad, 4, "randomized")
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(7)
    assert torch.equal(orthogonal_basis(grad, 4, "randomized"), first)


@pytest.mark.parametrize("state_dtype, svd", [("fp32", "full"), ("bf16", "full"), ("bf16", "randomized")])
def test_state_dict_resume_is_bit_identical(state_dtype: str, svd: str) -> None:
    batches = _batches(6)
    straight, source = Block(), Block()
    straight_opt = _fuse(straight, state_dtype=state_dtype, svd=svd)
    _train(straight, straight_opt, batches)
    first = _fuse(source, state_dtype=state_dtype, svd=svd)
    _train(source, first, batches[:4])                       # the projection refreshed at step 4
    buffer = io.BytesIO()
    torch.save({"model": source.state_dict(), "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = Block(seed=3)
    resumed_opt = _fuse(resumed, state_dtype=state_dtype, svd=svd)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, batches[4:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("options, message", [
    ({"capturable": True}, "does not support capturable: the projection is refreshed every update_proj_gap steps"),
    ({"state_dtype": "int8"}, "cannot store state_dtype='int8'"),
    ({"rank": -1}, "rank must be an integer >= 0"),
    ({"svd": "qr"}, "svd must be one of ('full', 'randomized')"),
    ({"update_proj_gap": 0}, "update_proj_gap must be an integer >= 1"),
])
def test_refusals_are_one_line(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        _fuse(Block(), **options)
    assert message in str(error.value) and "\n" not in str(error.value)


LLAMA_8B_SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096),
                   "down_proj": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_per_layer_path_equals_galore_torch_at_llama_8b_shapes() -> None:
    """Five steps per Llama-3.1-8B projection shape from 512 tokens of bf16 activations, rank 128, a
    refresh at step 4: the per-layer path against galore_torch's GaLoreAdamW fed the same fp32 G (the
    path's own GEMM, ``weight_gradient``), within 1e-4 (the SVD's own fp32 rounding on the GPU)."""
    galore_torch = pytest.importorskip("galore_torch")
    from forge_core.layer_step import LayerState, layer_wgrad_update
    from forge_core.wgrad_gemm import weight_gradient

    generator = torch.Generator(device="cuda").manual_seed(0)
    low_rank = {"rank": 128, "update_proj_gap": 3, "scale": 0.25}
    for name, (rows, cols) in LLAMA_8B_SHAPES.items():
        weight = nn.Parameter(torch.randn(rows, cols, device="cuda", generator=generator) * 0.02)
        twin = nn.Parameter(weight.detach().clone())
        state = LayerState(weight, get_rule("galore_adamw"), "fp32", {**HP, **low_rank}, name)
        theirs = galore_torch.GaLoreAdamW([{"params": [twin], **low_rank, "proj_type": "std"}],
                                          no_deprecation_warning=True, **HP)
        for step in range(1, 6):
            x = torch.randn(512, cols, device="cuda", generator=generator).bfloat16()
            dy = (torch.randn(512, rows, device="cuda", generator=generator) * 1e-3).bfloat16()
            layer_wgrad_update(x, dy, weight, state, {**HP, **low_rank}, step)
            twin.grad = weight_gradient(dy, x)
            theirs.step()
        assert _relative_error(weight.detach(), twin.detach()) <= 1e-4, name
