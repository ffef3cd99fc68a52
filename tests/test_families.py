"""The regime-1 rules (RMSprop, Adagrad, Adamax, NAdam, RAdam, SGD without momentum) and LAMB (regime 2)
against torch.optim's class of the same name (LAMB: its reference), through ``forge_core.fuse``.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, tests/conftest.py); on a GPU machine
the kernel tests run their tensors on the GPU (``DEVICE``), the interpreter being off there. A tiny model
holds one fused Linear weight (37 x 45, 19 tokens: every tile ragged), its bias (the torch fallback
optimizer) and an embedding (the row update, or the dense reference step). "Equal" is the largest
difference over the largest magnitude of the torch tensor, at most 1e-5, for every weight and state
(an element that crosses zero has no useful relative error of its own).
GPU tests (``gpu`` mark) run each rule's fused kernel at Llama-3.1-8B shapes against the torch class,
and the Gluon kernel against the Triton tile for the rules it takes.
"""
from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

import forge_core
from forge_core.kernels import fused_wgrad_update, hopper_ws, reference_wgrad_update
from forge_core.kernels.launch import kernel_scalars
from forge_core.rules import get_rule
from forge_core.rules import nadam, radam
from forge_core.rules.lamb import Lamb
from forge_core.dense import EmbeddingState
from forge_core.kernels.row_update import row_update
from forge_core.state import ParamState, quantize_blockwise

TOKENS, DIN, DOUT, VOCAB = 19, 45, 37, 23
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"      # the CPU runs the kernels interpreted
TORCH_CLASS = {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad, "adamax": torch.optim.Adamax,
               "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam, "sgd": torch.optim.SGD, "lamb": Lamb}
CASES = {
    "rmsprop": dict(lr=1e-2, alpha=0.9, weight_decay=1e-2),
    "rmsprop_momentum": dict(lr=1e-2, momentum=0.9),
    "rmsprop_centered": dict(lr=1e-2, alpha=0.95, centered=True, weight_decay=1e-2),
    "rmsprop_momentum_centered": dict(lr=1e-2, momentum=0.8, centered=True),
    "adagrad": dict(lr=5e-2, lr_decay=1e-2, weight_decay=1e-2, initial_accumulator_value=0.1, eps=1e-10),
    "adamax": dict(lr=2e-2, betas=(0.8, 0.99), weight_decay=1e-2),
    "nadam": dict(lr=1e-2, weight_decay=1e-2, momentum_decay=1e-2),
    "nadam_decoupled": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    # 8 steps: rho_t <= 5 up to step 6, > 5 from step 7 (both branches; asserted below)
    "radam": dict(lr=1e-2, weight_decay=1e-2),
    "radam_decoupled": dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, decoupled_weight_decay=True),
    "sgd": dict(lr=0.1, weight_decay=1e-2),            # momentum 0: no state at all
    "lamb": dict(lr=1e-2, weight_decay=1e-2),
    "lamb_clipped": dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.0, trust_clip=True),
}


@pytest.fixture(autouse=True)
def _untuned_tile(monkeypatch):
    """The untuned default tile on the GPU: these shapes are too small for tuning to tell anything, and
    tuning every rule's kernel would take most of the file's time (the interpreter has one fixed tile)."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")


def _rule_name(case: str) -> str:
    return case.split("_")[0]


def _steps(case: str) -> int:
    return 8 if case.startswith("radam") else 5


class Tiny(nn.Module):
    """An embedding (row update), one fused Linear weight and its bias (the torch fallback optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIN)
        self.lin = nn.Linear(DIN, DOUT)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


def _batches(count: int, seed: int = 3, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and output gradients drawn on the CPU (the same values on every machine), on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (TOKENS,), generator=generator).to(device),
             torch.randn(TOKENS, DOUT, generator=generator).to(device))
            for _ in range(count)]


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, target = batch
    (model(ids) * target).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _torch_optimizer(rule_name: str, params, hp: dict) -> torch.optim.Optimizer:
    extra = {} if rule_name == "lamb" else {"foreach": False}
    return TORCH_CLASS[rule_name](params, **hp, **extra)


def _drawn(generator: torch.Generator, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Standard normal tensors drawn on the CPU (the same values on every machine), on ``DEVICE``."""
    return [torch.randn(shape, generator=generator).to(DEVICE) for shape in shapes]


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    scale = theirs.float().abs().max().item()
    return (ours.float() - theirs.float()).abs().max().item() / max(scale, 1e-30)


def _fused_states(opt: forge_core.ForgeOptimizer) -> dict[int, dict[str, torch.Tensor]]:
    """Per parameter index, the kernel-stepped weights' states as fp32 (dequantized)."""
    index = {id(p): i for i, p in enumerate(opt.param_groups[0]["params"])}
    owners = list(opt._bindings) + list(opt.dense_weights())
    return {index[id(owner.weight)]: {name: owner.state.dequantize(name) for name in owner.state.state_names}
            for owner in owners}


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_states_equal_the_torch_class(case: str, backend: str) -> None:
    rule_name, hp = _rule_name(case), CASES[case]
    torch.manual_seed(0)
    model = Tiny().to(DEVICE)
    twin = copy.deepcopy(model)
    opt = forge_core.fuse(model, rule_name, backend=backend, probe_inputs=False, **hp)
    reference = _torch_optimizer(rule_name, twin.parameters(), hp)
    assert opt.fused_module_names() == ["lin"] and len(opt.dense_weights()) == 1
    for batch in _batches(_steps(case), device=DEVICE):
        _step(model, opt, batch)
        _step(twin, reference, batch)
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters()):
        assert _relative(ours, theirs) <= 1e-5, name
    states = _fused_states(opt)
    for index, held in states.items():
        theirs = reference.state[list(twin.parameters())[index]]
        for name, value in held.items():
            assert _relative(value, theirs[name]) <= 1e-5, (index, name)
        # the same states as torch keeps (NAdam's mu_product is a function of the step here)
        assert set(held) == {k for k, v in theirs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def test_radam_cases_take_both_branches() -> None:
    for case in ("radam", "radam_decoupled"):
        beta2 = CASES[case].get("betas", (0.9, 0.999))[1]
        branches = [radam.rectified(beta2, step) for step in range(1, _steps(case) + 1)]
        assert not branches[0] and branches[-1], (case, branches)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_radam_from_a_later_step_equals_torch(backend: str) -> None:
    """One weight at steps 40-44 (the rectified branch, with rect_t well below 1), the states and step
    count loaded into both optimizers first."""
    hp = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2)
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(DOUT, DIN, generator=generator).to(DEVICE)
    exp_avg = (torch.randn(DOUT, DIN, generator=generator) * 1e-2).to(DEVICE)
    exp_avg_sq = (torch.rand(DOUT, DIN, generator=generator) * 1e-3).to(DEVICE)
    state = ParamState(weight, get_rule("radam"), "fp32")
    state.store("exp_avg", exp_avg)
    state.store("exp_avg_sq", exp_avg_sq)
    fused = weight.clone()
    param = nn.Parameter(weight.clone())
    opt = torch.optim.RAdam([param], foreach=False, **hp)
    opt.state[param].update(step=torch.tensor(39.0), exp_avg=exp_avg.clone(), exp_avg_sq=exp_avg_sq.clone())
    update = fused_wgrad_update if backend == "triton" else reference_wgrad_update
    for step in range(40, 45):
        x, dy = _drawn(generator, (TOKENS, DIN), (TOKENS, DOUT))
        update(x, dy, fused, state, hp, step)
        param.grad = dy.t() @ x
        opt.step()
    assert _relative(fused, param.detach()) <= 1e-5
    assert _relative(state.dequantize("exp_avg"), opt.state[param]["exp_avg"]) <= 1e-5
    assert _relative(state.dequantize("exp_avg_sq"), opt.state[param]["exp_avg_sq"]) <= 1e-5


def test_nadam_mu_product_is_torchs_fp32_running_product() -> None:
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.NAdam([param], betas=(0.95, 0.999), momentum_decay=0.01, foreach=False)
    for step in range(1, 61):
        param.grad = torch.ones(3)
        opt.step()
        assert nadam.mu_product(0.95, 0.01, step) == opt.state[param]["mu_product"].item(), step
    table = nadam.device_mu_products(0.95, 0.01, torch.device("cpu"))
    assert table[60].item() == nadam.mu_product(0.95, 0.01, 60)
    assert table.numel() < 3000 and nadam.mu_product(0.95, 0.01, table.numel() + 500) == table[-1].item()


def test_sgd_without_momentum_holds_no_state() -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = forge_core.fuse(model, "sgd", lr=0.1, probe_inputs=False)
    for owner in list(opt._bindings) + list(opt.dense_weights()):
        assert owner.state.state_names == () and owner.state.nbytes() == 0
    _step(model, opt, _batches(1)[0])
    assert all(set(entry) == {"step"} for entry in opt.state_dict()["state"].values())
    with_momentum = forge_core.fuse(Tiny(), "sgd", lr=0.1, momentum=0.9, probe_inputs=False)
    assert with_momentum._bindings[0].state.nbytes() == DOUT * DIN * 4


def test_a_state_set_cannot_change_after_fuse() -> None:
    model = Tiny()
    opt = forge_core.fuse(model, "sgd", lr=0.1, probe_inputs=False)
    opt.param_groups[0]["momentum"] = 0.9
    ids, target = _batches(1)[0]
    with pytest.raises(ValueError, match=r"rule 'sgd': these hyper-parameters need the states \['momentum_buffer'\]"):
        (model(ids) * target).sum().backward()


# ---- quantized states: the kernel's codec against the spec, and their distance from fp32 -----------

QUANTIZED_CASES = ["rmsprop_momentum_centered", "rmsprop_centered", "adagrad", "adamax", "nadam", "radam", "lamb"]


def _storage_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16: one bf16 step; int8 / fp8: codes within one (the kernel's fp32 sums of G, in the interpreter
    or on the GPU, may differ in order from the reference's, so a value next to a rounding boundary may go
    either way)."""
    if ours.dtype in (torch.int8, torch.float8_e4m3fn):
        if ours.dtype == torch.float8_e4m3fn:
            bits_ours, bits_ref = ours.view(torch.uint8).int(), ref.view(torch.uint8).int()
            ours = torch.where(bits_ours >= 128, -(bits_ours & 0x7F), bits_ours)
            ref = torch.where(bits_ref >= 128, -(bits_ref & 0x7F), bits_ref)
        assert (ours.int() - ref.int()).abs().max().item() <= 1, what
        assert (ours != ref).float().mean().item() < 0.02, what
    else:
        ours32, ref32 = ours.float(), ref.float()
        step = torch.maximum(ours32.abs(), ref32.abs()) * 2.0 ** -7 + 1e-6 * ref32.abs().max()
        assert torch.all((ours32 - ref32).abs() <= step * 1.01), what


@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_quantized_states_are_stored_as_the_reference_stores_them(case: str, state_dtype: str) -> None:
    """Each step from equal weights and stored states: the fused kernel and the reference store the
    same codes (state.py's spec) up to one code, the same scales, the same weight. LAMB's second pass
    writes W from the stored (rounded) moments, where its reference uses the unrounded ones: with bf16
    states the step differs by their rounding (measured: 0.5% of the largest step); int8 / fp8 round a
    small first moment next to a large block maximum much further (LAMB then is as AdamW one step later;
    test_quantized_states_stay_close_to_fp32_states bounds where it leads)."""
    rule_name, hp = _rule_name(case), CASES[case]
    rule = get_rule(rule_name)
    generator = torch.Generator().manual_seed(1)
    (weight,) = _drawn(generator, (DOUT, DIN))
    fused_w, ref_w = weight.clone(), weight.clone()
    fused_s, ref_s = ParamState(weight, rule, state_dtype, hp), ParamState(weight, rule, state_dtype, hp)
    for step in (1, 2, 3):
        x, dy = _drawn(generator, (TOKENS, DIN), (TOKENS, DOUT))
        before = ref_w.clone()
        fused_wgrad_update(x, dy, fused_w, fused_s, hp, step)
        reference_wgrad_update(x, dy, ref_w, ref_s, hp, step)
        if not rule.layer_sums:
            assert _relative(fused_w, ref_w) <= 1e-5, step
        elif state_dtype == "bf16":
            assert (fused_w - ref_w).abs().max() <= 0.01 * (ref_w - before).abs().max(), step
        for name in fused_s.state_names:
            _storage_close(fused_s.values[name], ref_s.values[name], f"{name} at step {step}")
            if fused_s.scales[name] is not None:
                torch.testing.assert_close(fused_s.scales[name], ref_s.scales[name], rtol=2e-6, atol=0)
        ref_w.copy_(fused_w)
        ref_s.load_state_dict({k: v.clone() for k, v in fused_s.state_dict().items()})


@pytest.mark.parametrize("state_dtype", ["int8", "fp8"])
def test_adamax_exp_inf_codes_are_floored_by_every_kernel(state_dtype: str) -> None:
    """Input columns over six decades, so some ``exp_inf`` values fall below half a code next to their
    block's maximum; then a step without a gradient (the step that divided a first moment by eps when
    those codes were 0). The tile kernel and the row update (an embedding's ``EmbeddingState``, dense rows)
    store the spec's floored codes (within one), no ``exp_inf`` code is 0 where its block's scale is
    normal, and no element moves by more than 1.5 lr."""
    rule, hp = get_rule("adamax"), {"lr": 1e-3}
    generator = torch.Generator().manual_seed(2)
    start = (torch.randn(DOUT, 130, generator=generator) * 0.1).to(DEVICE)
    spread = torch.logspace(-6, 0, 130)[torch.randperm(130, generator=generator)].to(DEVICE)
    x, dy = (torch.randn(TOKENS, 130, generator=generator).to(DEVICE) * spread,
             torch.randn(TOKENS, DOUT, generator=generator).to(DEVICE))
    no_x, no_dy = start.new_zeros((0, 130)), start.new_zeros((0, DOUT))
    fused_w, ref_w, row_w = start.clone(), start.clone(), start.clone()
    fused_s, ref_s = ParamState(start, rule, state_dtype), ParamState(start, rule, state_dtype)
    row_s = EmbeddingState(start, rule, state_dtype)
    for step, (xs, dys) in enumerate([(x, dy), (no_x, no_dy)], start=1):
        before = ref_w.clone()
        fused_wgrad_update(xs, dys, fused_w, fused_s, hp, step)
        reference_wgrad_update(xs, dys, ref_w, ref_s, hp, step)
        row_update(row_w, row_s, hp, step, slots=None, row_grads=(dys.t() @ xs).to(row_w.dtype),
                   keep_signed_codes=state_dtype == "int8")
        assert (ref_w - before).abs().max() <= 1.5e-3 and _relative(fused_w, ref_w) <= 1e-5, step
        for state in (fused_s, row_s):
            _storage_close(state.values["exp_inf"], ref_s.values["exp_inf"], f"exp_inf at step {step}")
            codes = state.values["exp_inf"].view(torch.uint8) if state_dtype == "fp8" else state.values["exp_inf"]
            assert not torch.any(codes == 0), step
    exact_w, exact_s = start.clone(), ParamState(start, rule, "fp32")
    reference_wgrad_update(x, dy, exact_w, exact_s, hp, 1)
    unfloored, _ = quantize_blockwise(exact_s.values["exp_inf"], sqrt_domain=False, codes=state_dtype)
    assert int((unfloored.float() == 0).sum()) > 0          # step 1 had codes the floor raised


# rms(W - W_fp32) / rms(W_fp32 - W_0) after 6 steps of one weight, at most (measured in the interpreter:
# bf16 0.04-0.23%, int8 0.4-2.5%, fp8 1.3-4.2%; LAMB the largest, its second pass reading the rounded moments)
FIDELITY = {"bf16": 0.01, "int8": 0.1, "fp8": 0.15}


@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "fp8"])
@pytest.mark.parametrize("case", ["rmsprop_momentum_centered", "adagrad", "adamax", "nadam", "radam", "lamb"])
def test_quantized_states_stay_close_to_fp32_states(case: str, state_dtype: str) -> None:
    rule_name, hp = _rule_name(case), CASES[case]
    rule = get_rule(rule_name)
    (start,) = _drawn(torch.Generator().manual_seed(5), (DOUT, DIN))
    runs = {}
    for dtype in ("fp32", state_dtype):
        weight, state = start.clone(), ParamState(start, rule, dtype, hp)
        generator = torch.Generator().manual_seed(6)
        for step in range(1, 7):
            x, dy = _drawn(generator, (TOKENS, DIN), (TOKENS, DOUT))
            fused_wgrad_update(x, dy, weight, state, hp, step)
        runs[dtype] = weight
    moved = (runs["fp32"] - start).square().mean().sqrt()
    error = (runs[state_dtype] - runs["fp32"]).square().mean().sqrt()
    assert error <= FIDELITY[state_dtype] * moved, (error / moved).item()


def test_an_embeddings_kept_int8_codes_take_the_third_state_slot() -> None:
    """RMSprop with momentum and centered on an untied embedding's int8 states (``EmbeddingState``): the
    row update keeping non-zero codes changes only the momentum buffer's zero codes (to +-1, where the
    torch spec on an ``EmbeddingState`` has them non-zero), not ``grad_avg``'s (``nonzero_code_states``),
    and is otherwise the plain row update bit for bit."""
    from forge_core.dense import EmbeddingState
    from forge_core.kernels.row_update import row_update

    rule = get_rule("rmsprop")
    hp = rule.resolve_hp(CASES["rmsprop_momentum_centered"])
    generator = torch.Generator().manual_seed(8)
    weight = (torch.randn(VOCAB, 130, generator=generator) * 0.02).to(DEVICE)
    kept_s = EmbeddingState(weight, rule, "int8", hp)
    assert kept_s.state_names == ("square_avg", "momentum_buffer", "grad_avg")
    raised_codes = 0
    for step in range(1, 4):
        ids = torch.sort(torch.randint(0, VOCAB, (9,), generator=generator)).values.unique()
        spread = torch.logspace(-5, 0, 130)[torch.randperm(130, generator=generator)]
        row_grads = torch.randn(ids.numel(), 130, generator=generator) * spread
        dense = torch.zeros(VOCAB, 130)
        dense[ids] = row_grads
        slots = torch.full((VOCAB,), -1, dtype=torch.int32)
        slots[ids] = torch.arange(ids.numel(), dtype=torch.int32)
        row_grads, dense, slots = row_grads.to(DEVICE), dense.to(DEVICE), slots.to(DEVICE)
        plain_w, spec_w = weight.clone(), weight.clone()
        plain_s, spec_s = ParamState(weight, rule, "int8", hp), EmbeddingState(weight, rule, "int8", hp)
        for other in (plain_s, spec_s):
            other.load_state_dict({k: v.clone() for k, v in kept_s.state_dict().items()})
        row_update(weight, kept_s, hp, step, slots=slots, row_grads=row_grads, keep_signed_codes=True)
        row_update(plain_w, plain_s, hp, step, slots=slots, row_grads=row_grads)
        reference_wgrad_update(weight.new_zeros(0, 130), weight.new_zeros(0, VOCAB), spec_w, spec_s, hp, step,
                               grad_accum=dense)
        assert torch.equal(weight, plain_w)
        for name in ("square_avg", "grad_avg"):
            assert torch.equal(kept_s.values[name], plain_s.values[name]), name
        kept, plain, spec = (state.values["momentum_buffer"].int() for state in (kept_s, plain_s, spec_s))
        raised = (plain == 0) & (kept != 0)
        assert torch.equal(kept[~raised], plain[~raised]) and torch.all(kept[raised].abs() == 1)
        assert torch.equal(kept != 0, spec != 0) and (kept - spec).abs().max() <= 1
        raised_codes += int(raised.sum())
    assert raised_codes > 0


# ---- checkpoints ------------------------------------------------------------------------------------

RESUME_CASES = [("rmsprop_momentum_centered", "bf16"), ("rmsprop_momentum", "fp8"), ("rmsprop_centered", "fp32"),
                ("adagrad", "int8"),
                ("adamax", "bf16"), ("nadam_decoupled", "fp8"), ("radam", "int8"), ("sgd", "fp32"),
                ("lamb", "fp8"), ("lamb_clipped", "fp32")]


@pytest.mark.parametrize("case, state_dtype", RESUME_CASES)
def test_state_dict_resumes_bit_identically(case: str, state_dtype: str) -> None:
    rule_name, hp = _rule_name(case), CASES[case]
    batches = _batches(4, seed=11)
    torch.manual_seed(0)
    start = Tiny()
    straight = copy.deepcopy(start)
    straight_opt = forge_core.fuse(straight, rule_name, state_dtype=state_dtype, probe_inputs=False, **hp)
    for batch in batches:
        _step(straight, straight_opt, batch)
    first = copy.deepcopy(start)
    first_opt = forge_core.fuse(first, rule_name, state_dtype=state_dtype, probe_inputs=False, **hp)
    for batch in batches[:2]:
        _step(first, first_opt, batch)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = Tiny()
    resumed_opt = forge_core.fuse(resumed, rule_name, state_dtype=state_dtype, probe_inputs=False, **hp)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    for batch in batches[2:]:
        _step(resumed, resumed_opt, batch)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    for left, right in zip(straight_opt.state_dict()["state"].values(), resumed_opt.state_dict()["state"].values()):
        for key, value in left.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.reshape(-1).view(torch.uint8), right[key].reshape(-1).view(torch.uint8)), key


# ---- LAMB ---------------------------------------------------------------------------------------------

def test_lamb_reference_is_the_textbook_algorithm_in_float64() -> None:
    """You et al. 2019 Algorithm 2 with Adam's bias correction, per tensor, in float64."""
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.99, 1e-6, 0.05
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(DOUT, DIN, generator=generator)
    grads = [torch.randn(DOUT, DIN, generator=generator) for _ in range(4)]
    ours = weight.clone()
    states = {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight)}
    w, m, v = weight.double(), torch.zeros_like(weight).double(), torch.zeros_like(weight).double()
    for step, grad in enumerate(grads, start=1):
        get_rule("lamb").reference(ours, grad.clone(), states, dict(lr=lr, betas=(beta1, beta2), eps=eps,
                                                                     weight_decay=wd), step)
        g = grad.double()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps) + wd * w
        w = w - lr * (w.norm() / r.norm()) * r
    torch.testing.assert_close(ours.double(), w, rtol=1e-6, atol=1e-6)


def test_lamb_trust_ratio_is_one_where_a_norm_is_zero_and_clipped_at_one() -> None:
    hp = dict(lr=0.1, weight_decay=0.0)
    for backend_update in (fused_wgrad_update, reference_wgrad_update):
        weight = torch.zeros(DOUT, DIN, device=DEVICE)      # ||w|| = 0: the ratio is 1, the step is Adam's
        state = ParamState(weight, get_rule("lamb"), "fp32")
        x, dy = torch.randn(TOKENS, DIN).to(DEVICE), torch.randn(TOKENS, DOUT).to(DEVICE)
        backend_update(x, dy, weight, state, hp, 1)
        grad = dy.t() @ x
        adam_direction = grad / (grad.abs() + 1e-6)          # m_hat / (sqrt(v_hat) + eps) at step 1
        assert _relative(weight, -0.1 * adam_direction) <= 1e-5
    big = torch.full((DOUT, DIN), 4.0, device=DEVICE)       # ||w|| / ||r|| is about 4: clipped to 1
    state = ParamState(big, get_rule("lamb"), "fp32")
    clipped = big.clone()
    fused_wgrad_update(x, dy, clipped, state, dict(hp, trust_clip=True), 1)
    assert _relative(clipped - big, -0.1 * adam_direction) <= 1e-5


def test_lamb_row_update_equals_its_dense_step_within_rounding() -> None:
    """The embedding's row step (sums in the row kernel's order) against the dense step's."""
    from forge_core.kernels.row_update import row_update

    hp = CASES["lamb"]
    generator = torch.Generator().manual_seed(6)
    (start,) = _drawn(generator, (VOCAB, DIN))
    dense_w, rows_w = start.clone(), start.clone()
    rule = get_rule("lamb")
    dense_s, rows_s = ParamState(start, rule, "int8"), ParamState(start, rule, "int8")
    for step in (1, 2):
        ids = torch.sort(torch.randint(0, VOCAB, (7,), generator=generator)).values.unique()
        row_grads = torch.randn(ids.numel(), DIN, generator=generator)
        dense = torch.zeros(VOCAB, DIN)
        dense[ids] = row_grads
        slots = torch.full((VOCAB,), -1, dtype=torch.int32)
        slots[ids] = torch.arange(ids.numel(), dtype=torch.int32)
        row_grads, dense, slots = row_grads.to(DEVICE), dense.to(DEVICE), slots.to(DEVICE)
        fused_wgrad_update(start.new_zeros(0, DIN), start.new_zeros(0, VOCAB), dense_w, dense_s, hp, step,
                           grad_accum=dense)
        row_update(rows_w, rows_s, hp, step, slots=slots, row_grads=row_grads)
    assert _relative(rows_w, dense_w) <= 1e-6
    for name in rule.state_names:
        assert torch.equal(rows_s.values[name], dense_s.values[name]), name


def test_lamb_micro_batches_equal_one_batch_of_their_sum() -> None:
    torch.manual_seed(0)
    model = Tiny()
    twin = copy.deepcopy(model)
    opt = forge_core.fuse(model, "lamb", accumulate_steps=2, probe_inputs=False, **CASES["lamb"])
    reference = Lamb(twin.parameters(), **CASES["lamb"])
    for first, second in zip(_batches(4)[::2], _batches(4)[1::2]):
        for batch in (first, second):
            (model(batch[0]) * batch[1]).sum().backward()
            (twin(batch[0]) * batch[1]).sum().backward()
        opt.step()
        opt.zero_grad()
        reference.step()
        reference.zero_grad()
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters()):
        assert _relative(ours, theirs) <= 1e-5, name


def test_lamb_refuses_row_block_updates_of_a_fused_head() -> None:
    head = nn.Linear(DIN, DOUT, bias=False)
    model = nn.Sequential(head)
    forge_core.fuse(model, "lamb", probe_inputs=False)
    hidden = torch.randn(2, 5, DIN)
    labels = torch.randint(0, DOUT, (2, 5))
    with pytest.raises(ValueError, match=r"rule 'lamb' reads norms of the whole weight"):
        forge_core.chunked_lm_head_cross_entropy(hidden.requires_grad_(), model[0], labels).backward()


def test_lamb_leaves_moe_experts_to_its_fallback_with_a_reason() -> None:
    """The fused experts update expert by expert, never the whole 3-D weight LAMB takes the norms of."""
    transformers = pytest.importorskip("transformers")
    from forge_core.experts import is_forge_experts

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=1, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                         max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    with pytest.warns(UserWarning, match="rule 'lamb' reads norms of each whole 3-D weight"):
        opt = forge_core.fuse(model, "lamb", backend="reference")
    assert "model.layers.0.mlp.experts" in opt.excluded_modules
    assert not is_forge_experts(model.model.layers[0].mlp.experts)
    ids = torch.randint(0, 64, (1, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


# ---- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule_name, options, message", [
    ("adagrad", dict(capturable=True), r"rule 'adagrad' does not support capturable: torch.optim.Adagrad"),
    ("lamb", dict(capturable=True), r"rule 'lamb' does not support capturable: its fallback Lamb"),
])
def test_options_a_rule_cannot_take_are_refused_at_fuse(rule_name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        forge_core.fuse(Tiny(), rule_name, backend="triton", probe_inputs=False, **options)
    assert "\n" not in str(error.value)


def test_a_rule_names_the_state_formats_it_stores() -> None:
    narrow = dataclasses.replace(get_rule("adamax"), state_dtypes=frozenset({"fp32", "bf16"}))
    assert narrow.option_problem(state_dtype="fp8") == \
        "rule 'adamax' cannot store state_dtype='fp8'; it takes ['bf16', 'fp32']"
    assert narrow.option_problem(state_dtype="bf16") is None
    accumulating = dataclasses.replace(get_rule("adamax"), refusals={"accumulate_steps": "why not"})
    assert accumulating.option_problem(accumulate_steps=2) == \
        "rule 'adamax' does not support accumulate_steps: why not"


@pytest.mark.skipif(hopper_ws.GLUON_IMPORT_ERROR is not None, reason="Gluon not importable")
def test_the_gluon_kernel_refuses_what_it_cannot_run() -> None:
    """No state, three states, fp8 states (uint8 codes) and a regime-2 rule go to the Triton tile."""
    x2, dy2 = torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    weight = torch.zeros(128, 256, dtype=torch.bfloat16)
    bf16 = [torch.zeros_like(weight) for _ in range(3)]
    codes = [torch.zeros(128, 256, dtype=torch.uint8)] * 2
    count = "it takes one or two bf16 states, or one or two int8 states"
    assert hopper_ws.unsupported_reason(x2, dy2, weight, []) == count
    assert hopper_ws.unsupported_reason(x2, dy2, weight, bf16) == count
    assert "fp8 states" in hopper_ws.unsupported_reason(x2, dy2, weight, codes)
    assert "regime-2" in hopper_ws.unsupported_reason(x2, dy2, weight, bf16[:2], layer_sums=2)


# ---- GPU: Llama-3.1-8B shapes -----------------------------------------------------------------------

GPU_CASES = ["rmsprop_momentum_centered", "rmsprop", "adagrad", "adamax", "nadam", "radam", "sgd", "lamb"]
GPU_HP = {"rmsprop_momentum_centered": dict(alpha=0.9)}
"""(The centered variance at alpha 0.99 is 1% of square_avg at the first step: its rounding, amplified
100 times, would be all the test measures.)"""
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _kernel_gradient(x: torch.Tensor, dy: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """dY^T X as the fused kernel's untuned default tile sums it: one SGD step (lr 1, no state) on a zero
    fp32 weight leaves -G, bit for bit (the tile and its MMA order are the same for every rule)."""
    weight = torch.zeros(shape, device="cuda")
    fused_wgrad_update(x, dy, weight, ParamState(weight, get_rule("sgd"), "fp32", {"momentum": 0.0}),
                       {"lr": 1.0}, 1)
    return -weight


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096)], ids=["q", "gate"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_llama_shapes_equal_the_torch_class(case: str, shape: tuple[int, int], monkeypatch) -> None:
    """5 fused steps of an fp32 weight with fp32 states at 512 bf16 tokens, against the torch class fed
    the kernel's own G (so an element whose G is near zero, where an adaptive rule's first step is
    sign(G), compares the same sign); the untuned default tile (no tuning time)."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    rule_name, hp = _rule_name(case), dict(CASES[case], **GPU_HP.get(case, {}))
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(shape, device="cuda", generator=generator) * 0.02
    state = ParamState(weight, get_rule(rule_name), "fp32", hp)
    param = nn.Parameter(weight.clone())
    opt = TORCH_CLASS[rule_name]([param], **hp)
    for step in range(1, 6):
        x = torch.randn(512, shape[1], device="cuda", generator=generator).bfloat16()
        dy = (torch.randn(512, shape[0], device="cuda", generator=generator) * 1e-2).bfloat16()
        fused_wgrad_update(x, dy, weight, state, hp, step)
        param.grad = _kernel_gradient(x, dy, shape)
        opt.step()
    assert _relative(weight, param.detach()) <= 1e-5
    for name in state.state_names:
        assert _relative(state.values[name], opt.state[param][name]) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernel runs on a Hopper (sm_90) GPU only")
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("case", ["rmsprop", "rmsprop_momentum", "rmsprop_centered", "adagrad", "adamax", "nadam",
                                  "radam"])
def test_gpu_gluon_kernel_runs_the_new_one_and_two_state_rules(case: str, state_dtype: str, monkeypatch) -> None:
    """The warp-specialized kernel runs every regime-1 rule of one or two states with the rule's epilogue:
    one step equals the Triton tile's (fp32 summation order may flip a rounding; int8 codes within one)."""
    from forge_core.kernels import ws_choice

    monkeypatch.setenv("FORGE_AUTOTUNE", "0")
    rule_name, hp = _rule_name(case), CASES[case]
    rule = get_rule(rule_name)
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(1024, 4096, device="cuda", generator=generator) * 0.02).bfloat16()
    state = ParamState(weight, rule, state_dtype, hp)
    for name in state.state_names:
        value = torch.randn(weight.shape, device="cuda", generator=generator) * 1e-3
        state.store(name, value * 0.1 if name in rule.signed_states else value.square() + 1e-6)
    x = torch.randn(520, 4096, device="cuda", generator=generator).bfloat16()
    dy = (torch.randn(520, 1024, device="cuda", generator=generator) * 1e-2).bfloat16()
    twins = []
    for _ in range(2):
        twin = ParamState(weight, rule, state_dtype, hp)
        twin.load_state_dict({k: v.clone() for k, v in state.state_dict().items()})
        twins.append((weight.clone(), twin))
    (w_ws, s_ws), (w_tr, s_tr) = twins
    config = ws_choice.CANDIDATES[0]
    names = s_ws.state_names
    assert hopper_ws.unsupported_reason(x, dy, w_ws, [s_ws.values[n] for n in names], config,
                                        [s_ws.scales[n] for n in names]) is None
    hopper_ws.launch(x, dy, w_ws, [s_ws.values[n] for n in names], s_ws.epilogue, kernel_scalars(rule, hp, 7), config,
                     scales=[s_ws.scales[n] for n in names],
                     sqrt_domain=tuple(s_ws.is_sqrt_domain(n) for n in names) + (False,) * (2 - len(names)))
    fused_wgrad_update(x, dy, w_tr, s_tr, hp, 7)
    assert (w_ws != w_tr).float().mean().item() <= 1e-4
    for name in names:
        if state_dtype == "int8":
            assert (s_ws.values[name].int() - s_tr.values[name].int()).abs().max().item() <= 1, name
        assert (s_ws.values[name] != s_tr.values[name]).float().mean().item() <= 1e-3, name
