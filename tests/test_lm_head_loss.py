"""The vocab-chunked LM head + causal-LM cross-entropy (forge_core.chunked_lm_head_cross_entropy) and
the row-block update of a fused LM head inside its backward.

Values are checked against Hugging Face's ``ForCausalLMLoss`` on full logits (the loss every
transformers causal LM returns), gradients against autograd through those logits, and FORGE
training with the chunked loss against torch AdamW training with HF's loss. Without a GPU the
Triton kernel runs in the interpreter (``TRITON_INTERPRET=1`` from conftest)."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import forge_core
from forge_core import chunked_lm_head_cross_entropy, default_chunk_size
from forge_core.kernels import triton_available
from forge_core.lm_head_loss import CHUNK_ALIGN, chunk_bounds
from forge_core.state import ParamState

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

HP = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
VOCAB = 203          # not a multiple of any chunk below
WIDTH = 40
CHUNK = 64           # 4 chunks of the tiny models' 200-token vocabulary: 3 x 64 + 8
BACKENDS = ["reference", "triton"]
needs_triton = pytest.mark.skipif(not triton_available(), reason="the Triton kernel cannot run here "
                                  "(no CUDA, TRITON_INTERPRET unset at import)")


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# Values against HF's loss on full logits
# ----------------------------------------------------------------------------------------------

def _labels(pattern: str, shape: tuple[int, int], vocab: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, shape, generator=generator)
    if pattern == "some_ignored":
        labels[0, 2:5] = -100
        labels[-1, -3:] = -100
    elif pattern == "all_but_one_ignored":
        keep = labels[1, 4].item()
        labels.fill_(-100)
        labels[1, 4] = keep           # shifted: position (1, 3) is the one token with a target
    elif pattern == "edges":          # targets in the first and the ragged last chunk
        labels[:, ::2] = vocab - 1
        labels[:, 1::2] = 0
    return labels


def _head(dtype: torch.dtype, bias: bool, seed: int = 0, vocab: int = VOCAB, width: int = WIDTH) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(width, vocab, bias=bias)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.3)       # logits of O(1): a non-trivial softmax
        if bias:
            head.bias.normal_(0.0, 0.5)
    return head.to(dtype)


def _both(dtype: torch.dtype, bias: bool, labels: torch.Tensor, chunk_size, shift: bool = True,
          hidden_shape: tuple[int, ...] = (3, 11), **kwargs):
    """(chunked loss, hidden grad, head) and (HF loss, hidden grad, head) from the same start."""
    head = _head(dtype, bias)
    reference_head = copy.deepcopy(head)
    torch.manual_seed(7)
    hidden = torch.randn(*hidden_shape, WIDTH).to(dtype).requires_grad_()
    reference_hidden = hidden.detach().clone().requires_grad_()
    loss = chunked_lm_head_cross_entropy(hidden, head, labels, chunk_size=chunk_size, shift=shift, **kwargs)
    loss.backward()
    logits = reference_head(reference_hidden)
    if shift:
        reference = ForCausalLMLoss(logits, labels, VOCAB, **kwargs)
    else:
        reference = ForCausalLMLoss(logits, None, VOCAB, shift_labels=labels, **kwargs)
    reference.backward()
    return (loss, hidden.grad, head), (reference, reference_hidden.grad, reference_head)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=2e-2, atol=2e-4)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == want.dtype, what
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype], msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pattern", ["random", "some_ignored", "all_but_one_ignored", "edges"])
@pytest.mark.parametrize("chunk_size", [7, CHUNK, VOCAB, None])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_loss_and_gradients_equal_hf_on_full_logits(dtype, pattern, chunk_size, bias) -> None:
    labels = _labels(pattern, (3, 11), VOCAB)
    (loss, grad_hidden, head), (reference, reference_grad, reference_head) = _both(dtype, bias, labels, chunk_size)
    assert loss.dtype == reference.dtype == torch.float32
    rel = 1e-6 if dtype == torch.float32 else 1e-3
    assert abs(loss.item() - reference.item()) <= rel * abs(reference.item()), (loss.item(), reference.item())
    _close(grad_hidden, reference_grad, dtype, "d hidden")
    _close(head.weight.grad, reference_head.weight.grad, dtype, "d weight")
    if bias:
        _close(head.bias.grad, reference_head.bias.grad, dtype, "d bias")


def test_flat_hidden_without_shift_and_num_items_in_batch_equal_hf() -> None:
    labels = _labels("some_ignored", (3, 11), VOCAB).reshape(-1)
    (loss, grad_hidden, head), (reference, reference_grad, reference_head) = _both(
        torch.float32, True, labels, 50, shift=False, hidden_shape=(33,), num_items_in_batch=57)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    _close(grad_hidden, reference_grad, torch.float32, "d hidden")
    _close(head.weight.grad, reference_head.weight.grad, torch.float32, "d weight")


def test_all_tokens_ignored_is_nan_with_zero_gradients_as_hf() -> None:
    labels = torch.full((3, 11), -100)
    (loss, grad_hidden, head), (reference, reference_grad, reference_head) = _both(torch.float32, True, labels, CHUNK)
    assert torch.isnan(loss) and torch.isnan(reference)
    for got, want in ((grad_hidden, reference_grad), (head.weight.grad, reference_head.weight.grad),
                      (head.bias.grad, reference_head.bias.grad)):
        assert torch.equal(got, want) and not got.any()


def test_custom_ignore_index() -> None:
    labels = _labels("random", (3, 11), VOCAB)
    labels[1, :6] = 7
    (loss, grad_hidden, _), (reference, reference_grad, _) = _both(torch.float32, False, labels, CHUNK,
                                                                    ignore_index=7)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    _close(grad_hidden, reference_grad, torch.float32, "d hidden")


def test_autocast_computes_logits_in_the_autocast_dtype_as_hf() -> None:
    labels = _labels("some_ignored", (3, 11), VOCAB)
    head = _head(torch.float32, True)
    reference_head = copy.deepcopy(head)
    torch.manual_seed(7)
    hidden = torch.randn(3, 11, WIDTH, requires_grad=True)
    reference_hidden = hidden.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_lm_head_cross_entropy(hidden, head, labels, chunk_size=CHUNK)
        reference = ForCausalLMLoss(reference_head(reference_hidden), labels, VOCAB)
    loss.backward()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-3)
    assert hidden.grad.dtype == torch.float32 and head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(head.weight.grad, reference_head.weight.grad, **TOLERANCE[torch.bfloat16])


def test_a_tied_head_gets_ordinary_gradients_from_both_uses() -> None:
    """GPT-2: lm_head.weight IS the token embedding; FORGE never fuses it, the loss gives its .grad
    through autograd, summed with the embedding's own gradient."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    hidden = model.transformer(input_ids=ids).last_hidden_state
    loss = chunked_lm_head_cross_entropy(hidden, model.lm_head, ids, chunk_size=CHUNK)
    loss.backward()
    reference_loss = reference(input_ids=ids, labels=ids).loss
    reference_loss.backward()
    assert loss.item() == pytest.approx(reference_loss.item(), rel=1e-6)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _loss_and_grads(dtype: torch.dtype, bias: bool, chunk_size, keep_logits_bytes, backwards: int = 1):
    """(loss, d hidden, d weight, d bias) of the chunked loss from one fixed start."""
    head = _head(dtype, bias)
    torch.manual_seed(7)
    hidden = torch.randn(3, 11, WIDTH).to(dtype).requires_grad_()
    loss = chunked_lm_head_cross_entropy(hidden, head, _labels("some_ignored", (3, 11), VOCAB),
                                         chunk_size=chunk_size, keep_logits_bytes=keep_logits_bytes)
    for index in range(backwards):
        loss.backward(retain_graph=index + 1 < backwards)
    return loss, hidden.grad, head.weight.grad, head.bias.grad if bias else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [7, None])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_kept_logits_give_the_recomputed_backward_bit_for_bit(dtype, chunk_size, bias, path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward's logits kept for the backward are what its recomputation gives: the same GEMM of
    the same rows, so loss and every gradient are identical (keep_logits_bytes=0 recomputes). On the
    plain-torch path too, whose statistics must leave fp32 logits as they were."""
    if path == "torch":
        from forge_core.kernels import cross_entropy
        monkeypatch.setattr(cross_entropy, "usable_for", lambda tensor: False)
    kept = _loss_and_grads(dtype, bias, chunk_size, None)
    recomputed = _loss_and_grads(dtype, bias, chunk_size, 0)
    for name, got, want in zip(("loss", "d hidden", "d weight", "d bias"), kept, recomputed):
        if want is not None:
            assert torch.equal(got, want), name


def test_the_backward_consumes_the_kept_logits_and_a_second_backward_recomputes() -> None:
    head = _head(torch.float32, False)
    hidden = torch.randn(3, 11, WIDTH, requires_grad=True)
    labels = _labels("random", (3, 11), VOCAB)
    loss = chunked_lm_head_cross_entropy(hidden, head, labels, chunk_size=CHUNK)
    kept = loss.grad_fn.kept_logits
    assert [tuple(t.shape) for t in kept] == [(33, c1 - c0) for c0, c1 in chunk_bounds(VOCAB, CHUNK)]
    loss.backward(retain_graph=True)
    assert loss.grad_fn.kept_logits is None and all(t is None for t in kept)     # freed chunk by chunk
    once = hidden.grad.clone()
    loss.backward()                                      # recomputes: the same gradient again
    torch.testing.assert_close(hidden.grad, 2 * once, rtol=0, atol=0)
    twice = _loss_and_grads(torch.float32, True, CHUNK, None, backwards=2)
    twice_recomputed = _loss_and_grads(torch.float32, True, CHUNK, 0, backwards=2)
    for got, want in zip(twice[1:], twice_recomputed[1:]):
        assert torch.equal(got, want)


def test_nothing_is_kept_without_a_backward_to_read_it() -> None:
    head = _head(torch.float32, False).requires_grad_(False)
    labels = _labels("random", (3, 11), VOCAB)
    loss = chunked_lm_head_cross_entropy(torch.randn(3, 11, WIDTH, requires_grad=True), head, labels)
    assert loss.grad_fn.kept_logits is not None                  # hidden still needs its gradient
    constant = chunked_lm_head_cross_entropy(torch.randn(3, 11, WIDTH), head, labels)
    assert constant.grad_fn is None
    over_budget = chunked_lm_head_cross_entropy(torch.randn(3, 11, WIDTH, requires_grad=True), head, labels,
                                                keep_logits_bytes=33 * VOCAB * 4 - 1)
    assert over_budget.grad_fn.kept_logits is None


def test_keeps_logits_up_to_its_budget() -> None:
    llama_vocab = 128256
    assert forge_core.keeps_logits(512, llama_vocab, torch.bfloat16)           # 125 MiB
    assert forge_core.keeps_logits(1024, llama_vocab, torch.bfloat16)          # 250.5 MiB
    assert not forge_core.keeps_logits(2048, llama_vocab, torch.bfloat16)
    assert not forge_core.keeps_logits(1024, llama_vocab, torch.float32)
    assert not forge_core.keeps_logits(1, 10, torch.bfloat16, keep_logits_bytes=0)
    assert forge_core.keeps_logits(512, llama_vocab, torch.bfloat16, keep_logits_bytes=512 * llama_vocab * 2)


def test_default_chunk_size_bounds_the_fp32_chunk_and_keeps_two_shapes_at_most() -> None:
    llama_vocab = 128256
    assert default_chunk_size(512, llama_vocab) == 32256         # 3 x 32256 + 31488
    assert default_chunk_size(8192, llama_vocab) == 2048         # 62 x 2048 + 1280
    assert default_chunk_size(512, 512) == 512                   # a small vocabulary: one chunk
    assert default_chunk_size(10 ** 9, llama_vocab) == CHUNK_ALIGN
    for tokens in (1, 100, 512, 1000, 2048, 4096, 8192, 65536):
        for vocab in (1000, 32000, 50257, 128256, 151936):
            chunk = default_chunk_size(tokens, vocab)
            assert chunk == vocab or (chunk % CHUNK_ALIGN == 0 and tokens * chunk * 4 <= max(
                forge_core.lm_head_loss.DEFAULT_CHUNK_BYTES, tokens * CHUNK_ALIGN * 4))
            widths = {c1 - c0 for c0, c1 in chunk_bounds(vocab, chunk)}
            assert len(widths) <= 2 and max(widths) == chunk


@pytest.mark.parametrize("call, error, message", [
    (lambda h, head, y: chunked_lm_head_cross_entropy(h, head, y[:, :-1]), ValueError, "labels shape"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h[..., :-1], head, y), ValueError, "hidden must have shape"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h, head, y.float()), TypeError, "integer token ids"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h, head, y + VOCAB), ValueError, "outside"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h, head, y, chunk_size=0), ValueError, "chunk_size"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h, head, y, keep_logits_bytes=-1), ValueError,
     "keep_logits_bytes"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h.double(), head, y), TypeError, "outside autocast"),
    (lambda h, head, y: chunked_lm_head_cross_entropy(h, nn.Identity(), y), TypeError, "nn.Linear"),
])
def test_bad_arguments_are_clear_errors(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call(torch.randn(2, 5, WIDTH), _head(torch.float32, False), torch.randint(0, VOCAB, (2, 5)))


# ----------------------------------------------------------------------------------------------
# Row views of the optimizer state
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_param_state_rows_are_views_holding_whole_int8_blocks(state_dtype: str) -> None:
    weight = torch.zeros(10, 130)
    state = ParamState(weight, forge_core.get_rule("adamw"), state_dtype)
    view = state.rows(3, 7)
    assert view.shape == (4, 130) and view.rule is state.rule
    value = torch.randn(4, 130)
    view.store("exp_avg", value)
    assert torch.equal(state.dequantize("exp_avg")[3:7], view.dequantize("exp_avg"))
    assert not state.dequantize("exp_avg")[:3].any() and not state.dequantize("exp_avg")[7:].any()
    if state_dtype == "int8":
        assert view.scales["exp_avg"].shape == (4, 3) and view.scales["exp_avg"].data_ptr() == \
            state.scales["exp_avg"][3].data_ptr()
    for bad in ((5, 5), (-1, 3), (0, 11)):
        with pytest.raises(ValueError, match="rows"):
            state.rows(*bad)


# ----------------------------------------------------------------------------------------------
# FORGE training with the chunked loss
# ----------------------------------------------------------------------------------------------

def _tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", layers: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
                                      max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _batches(steps: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 200, (2, 12), generator=generator)
        labels = ids.clone()
        labels[0, :3] = -100
        out.append((ids.to(device), labels.to(device)))
    return out


def _chunked_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    hidden = model.model(input_ids=ids).last_hidden_state
    return chunked_lm_head_cross_entropy(hidden, model.lm_head, labels, chunk_size=chunk)


def _train_chunked(model: nn.Module, opt: torch.optim.Optimizer, batches, chunk: int = CHUNK) -> None:
    for ids, labels in batches:
        _chunked_loss(model, ids, labels, chunk).backward()
        assert model.lm_head.weight.grad is None or not isinstance(opt, forge_core.ForgeOptimizer)
        opt.step()
        opt.zero_grad()


def _train_hf(model: nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for ids, labels in batches:
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()


def _rms_rel(got: nn.Module, want: nn.Module) -> float:
    pairs = [(a.detach().double(), b.detach().double()) for a, b in zip(got.parameters(), want.parameters())]
    return float((sum(((a - b) ** 2).sum() for a, b in pairs) / sum((b ** 2).sum() for _, b in pairs)).sqrt())


def _fuse(model: nn.Module, backend: str, **kwargs) -> forge_core.ForgeOptimizer:
    opt = forge_core.fuse(model, "adamw", backend=backend, **{**HP, **kwargs})
    assert "lm_head" in opt.fused_module_names()
    return opt


def _steps(backend: str) -> int:
    return 2 if backend == "triton" and not torch.cuda.is_available() else 5


@pytest.mark.parametrize("backend", [pytest.param(b, marks=needs_triton) if b == "triton" else b for b in BACKENDS])
def test_fused_head_with_chunked_loss_trains_like_torch_adamw_with_hf_loss(backend: str) -> None:
    device = _device(backend)
    model = _tiny_llama(device=device)
    reference = copy.deepcopy(model)
    start = copy.deepcopy(model)
    opt = _fuse(model, backend)
    batches = _batches(_steps(backend), device)
    _train_chunked(model, opt, batches)
    _train_hf(reference, torch.optim.AdamW(reference.parameters(), **HP), batches)
    assert _rms_rel(reference, start) > 1e-3, "the run did not train: parity would be vacuous"
    assert _rms_rel(model, reference) < 1e-5
    with torch.no_grad():
        head_rms = float((model.lm_head.weight - reference.lm_head.weight).norm() / reference.lm_head.weight.norm())
    assert head_rms < 1e-5


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("backend", [pytest.param(b, marks=needs_triton) if b == "triton" else b for b in BACKENDS])
def test_lossy_states_row_blocks_equal_the_whole_head_update(backend: str, state_dtype: str) -> None:
    """bf16 / int8 moments: updating the head in row blocks gives the same weights and states as the
    whole-head fused update (HF loss through the ForgeLinear), and stays near fp32 torch AdamW."""
    device = _device(backend)
    model = _tiny_llama(device=device)
    whole = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    opt = _fuse(model, backend, state_dtype=state_dtype)
    whole_opt = _fuse(whole, backend, state_dtype=state_dtype)
    batches = _batches(_steps(backend), device)
    _train_chunked(model, opt, batches)
    _train_hf(whole, whole_opt, batches)
    _train_hf(reference, torch.optim.AdamW(reference.parameters(), **HP), batches)
    assert _rms_rel(model, whole) < 1e-5
    head, whole_head = opt._bindings[-1], whole_opt._bindings[-1]
    assert head.name == whole_head.name == "lm_head"
    for name in head.state.values:
        got, want = head.state.dequantize(name), whole_head.state.dequantize(name)
        assert float((got - want).norm() / want.norm()) < 1e-3, name
    assert _rms_rel(model, reference) < 0.02            # the smoke suite's parity tolerance


def test_step_count_advances_once_per_step_with_several_chunks() -> None:
    model = _tiny_llama()
    opt = _fuse(model, "reference")
    head = opt._bindings[-1]
    seen_steps = []
    update = opt._update_function

    def recording(x, dy, weight, state, hp, step, **kwargs):
        if any(state is part.state for part in head._row_parts.values()):
            seen_steps.append(step)
        return update(x, dy, weight, state, hp, step, **kwargs)

    opt._update_function = recording
    for index, (ids, labels) in enumerate(_batches(3)):
        _chunked_loss(model, ids, labels).backward()
        assert head.micro_batches == 1 and head.steps_done == index
        opt.step()
        opt.zero_grad()
    assert seen_steps == [1] * 4 + [2] * 4 + [3] * 4          # 4 chunks per backward, one step count
    assert head.steps_done == 3 and opt.steps_taken == 3
    state = opt.state_dict()
    assert all(float(state["state"][i]["step"]) == 3.0 for i in state["forge"]["fused"])
    assert sorted(head._row_parts) == [(0, 64), (64, 128), (128, 192), (192, 200)]


@pytest.mark.parametrize("state_dtype, backend", [
    ("fp32", "reference"), ("int8", "reference"), pytest.param("int8", "triton", marks=needs_triton)])
def test_resume_from_checkpoint_into_a_used_optimizer_is_bit_identical(state_dtype: str, backend: str) -> None:
    """load_state_dict copies into the state tensors in place: the row views (and the kernel's launch
    plans cached on them) built before the load keep working after it."""
    device = _device(backend)
    batches = _batches(4, device)
    straight = _tiny_llama(device=device)
    first = copy.deepcopy(straight)
    straight_opt = _fuse(straight, backend, state_dtype=state_dtype)
    _train_chunked(straight, straight_opt, batches)

    first_opt = _fuse(first, backend, state_dtype=state_dtype)
    _train_chunked(first, first_opt, batches[:2])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed = _tiny_llama(seed=5, device=device)
    resumed_opt = _fuse(resumed, backend, state_dtype=state_dtype)
    _train_chunked(resumed, resumed_opt, batches[2:3])          # builds the row views before the load
    head = resumed_opt._bindings[-1]
    parts = dict(head._row_parts)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train_chunked(resumed, resumed_opt, batches[2:])
    assert all(head._row_parts[key] is part for key, part in parts.items()), "views were rebuilt"
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@needs_triton
def test_row_views_and_launch_plans_are_built_once() -> None:
    from forge_core.kernels import dispatch

    device = _device("triton")
    model = _tiny_llama(device=device)
    opt = _fuse(model, "triton", state_dtype="int8")
    batches = _batches(2, device)
    _train_chunked(model, opt, batches[:1])
    head = opt._bindings[-1]
    parts = dict(head._row_parts)
    plans = {key: dict(dispatch.PLANS[part.state]) for key, part in parts.items()}
    assert len(plans) == 4 and all(len(p) == 1 for p in plans.values())
    _train_chunked(model, opt, batches[1:])
    for key, part in parts.items():
        assert head._row_parts[key] is part
        assert dispatch.PLANS[part.state] == plans[key], "a chunk's launch plan was rebuilt"


@needs_triton
def test_capturable_mode_equals_the_default_path_with_the_chunked_loss() -> None:
    """Device step counts and kernel scalars read from a buffer (the CUDA-graph path) give the same
    bits as launch arguments, chunk by chunk."""
    device = _device("triton")
    plain = _tiny_llama(device=device)
    captured = copy.deepcopy(plain)
    plain_opt = _fuse(plain, "triton")
    captured_opt = _fuse(captured, "triton", capturable=True)
    batches = _batches(_steps("triton"), device)
    _train_chunked(plain, plain_opt, batches)
    _train_chunked(captured, captured_opt, batches)
    for (name, a), b in zip(plain.named_parameters(), captured.parameters()):
        assert torch.equal(a, b), name
    assert captured_opt.steps_taken == len(batches)


def test_micro_batch_accumulation_equals_torch_accumulation() -> None:
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    opt = _fuse(model, "reference", accumulate_steps=2)
    reference_opt = torch.optim.AdamW(reference.parameters(), **HP)
    batches = _batches(6)
    for pair in (batches[0:2], batches[2:4], batches[4:6]):
        for ids, labels in pair:
            (_chunked_loss(model, ids, labels) / 2).backward()
            (reference(input_ids=ids, labels=labels).loss / 2).backward()
        opt.step()
        opt.zero_grad()
        reference_opt.step()
        reference_opt.zero_grad()
    assert _rms_rel(model, reference) < 1e-5
    assert opt._bindings[-1].steps_done == 3 and not opt._bindings[-1].grad_accum.any()


def test_stochastic_rounding_draws_a_different_seed_per_chunk() -> None:
    model = _tiny_llama(dtype=torch.bfloat16)
    opt = _fuse(model, "reference", state_dtype="bf16", stochastic_rounding=True)
    seeds: list[int] = []
    update = opt._update_function
    head = opt._bindings[-1]

    def recording(x, dy, weight, state, hp, step, **kwargs):
        if any(state is part.state for part in head._row_parts.values()):
            seeds.append(kwargs["seed"])
        return update(x, dy, weight, state, hp, step, **kwargs)

    opt._update_function = recording
    before = model.lm_head.weight.detach().clone()
    _train_chunked(model, opt, _batches(2))
    assert len(seeds) == 8 and len(set(seeds)) == 8
    assert torch.isfinite(model.lm_head.weight).all() and not torch.equal(before, model.lm_head.weight)


def test_using_a_fused_head_twice_in_one_step_is_refused() -> None:
    """The fused head's forward and the chunked loss in one step would update it twice."""
    model = _tiny_llama()
    opt = _fuse(model, "reference")
    ids, labels = _batches(1)[0]
    hidden = model.model(input_ids=ids).last_hidden_state
    loss = chunked_lm_head_cross_entropy(hidden, model.lm_head, labels) + model.lm_head(hidden).float().mean()
    # Whichever backward runs second refuses: the binding's use count, or autograd's check that the
    # head's weight (saved by the loss) was modified in place by the other use's update.
    with pytest.raises(RuntimeError, match="received backward number 2|modified by an inplace operation"):
        loss.backward()
    del opt


def test_an_updater_without_row_blocks_is_refused() -> None:
    head = _head(torch.float32, False)
    head.__class__ = forge_core.ForgeLinear
    head.forge_updater = lambda x, dy: None
    with pytest.raises(TypeError, match="begin_row_updates"):
        chunked_lm_head_cross_entropy(torch.randn(2, 5, WIDTH), head, torch.randint(0, VOCAB, (2, 5)))


def test_probe_counts_one_backward_and_updates_nothing() -> None:
    model = _tiny_llama()
    opt = _fuse(model, "reference")
    head = opt._bindings[-1]
    before = model.lm_head.weight.detach().clone()
    head.begin_probe()
    try:
        ids, labels = _batches(1)[0]
        _chunked_loss(model, ids, labels).backward()
    finally:
        head.end_probe()
    assert head.probe_backward_calls == 1 and head.micro_batches == 0
    assert torch.equal(before, model.lm_head.weight)


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------

def _graph_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = _chunked_loss(model, ids, labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graph capture)")
@pytest.mark.parametrize("arm", ["forge", "torch_adamw"])
def test_cuda_graph_capture_of_a_chunked_loss_step_equals_eager(arm: str) -> None:
    """The chunk loop has no host sync: capture one whole step (forward, chunked loss, backward with
    the head updated chunk by chunk, optimizer) and replay it; weights equal an eager run."""
    eager = _tiny_llama(device="cuda")
    graphed = copy.deepcopy(eager)

    def build(model: nn.Module) -> torch.optim.Optimizer:
        if arm == "forge":
            return _fuse(model, "triton", capturable=True)
        return torch.optim.AdamW(model.parameters(), capturable=True, **HP)

    eager_opt, graphed_opt = build(eager), build(graphed)
    batches = _batches(8, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ids, labels in batches[:3]:
            _graph_step(graphed, graphed_opt, ids, labels)
    torch.cuda.current_stream().wait_stream(side)
    static_ids, static_labels = batches[3][0].clone(), batches[3][1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _graph_step(graphed, graphed_opt, static_ids, static_labels)
    # the capture itself ran nothing: replay every remaining batch, the captured one first
    graph_losses = []
    for ids, labels in batches[3:]:
        static_ids.copy_(ids)
        static_labels.copy_(labels)
        graph.replay()
        graph_losses.append(static_loss.clone())
    eager_losses = [_graph_step(eager, eager_opt, ids, labels) for ids, labels in batches]
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.stack(graph_losses), torch.stack(eager_losses[3:]), rtol=1e-5, atol=1e-6)
    assert _rms_rel(graphed, eager) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the side stream exists on CUDA only)")
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_chunk_updates_on_the_side_stream_equal_in_line_updates(state_dtype: str) -> None:
    """fuse(overlap=True): each chunk's row update runs on forge_core.overlap's side stream while the
    next chunk's logits are computed; the weights must be the same bits as with updates in line."""
    overlapped = _tiny_llama(device="cuda", layers=2)
    inline = copy.deepcopy(overlapped)
    overlapped_opt = _fuse(overlapped, "triton", state_dtype=state_dtype, overlap=True)
    inline_opt = _fuse(inline, "triton", state_dtype=state_dtype, overlap=False)
    assert overlapped_opt._bindings[-1].overlap_updates and not inline_opt._bindings[-1].overlap_updates
    batches = _batches(4, "cuda")
    _train_chunked(overlapped, overlapped_opt, batches)
    _train_chunked(inline, inline_opt, batches)
    torch.cuda.synchronize()
    for (name, a), b in zip(overlapped.named_parameters(), inline.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Llama-3.1-8B head shape in bf16)")
def test_llama8b_head_shape_bf16_on_cuda_values_memory_and_fused_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """512 tokens x 4096 hidden x 128256 vocab in bf16: loss and d hidden as HF's (bf16 tolerance),
    no logits-sized temporaries, and the fused head's row-block update as the whole-head update."""
    monkeypatch.setenv("FORGE_AUTOTUNE", "0")     # the tuner's scratch copy of a chunk's rows is not the step's
    torch.manual_seed(0)
    tokens, width, vocab = 512, 4096, 128256
    head = nn.Linear(width, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")
    labels[0, :17] = -100

    reference_hidden = hidden.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    reference = ForCausalLMLoss(head(reference_hidden), labels, vocab)
    hf_saved = torch.cuda.memory_allocated() - start               # kept from forward to backward
    reference.backward()
    head.weight.grad = None

    logits_bytes = tokens * vocab * 2
    for keep_logits_bytes in (0, None):         # recomputed in the backward; kept (125 MiB: under the default)
        hidden.grad = None
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = chunked_lm_head_cross_entropy(hidden, head, labels, keep_logits_bytes=keep_logits_bytes)
        chunked_saved = torch.cuda.memory_allocated() - start
        chunked_forward_peak = torch.cuda.max_memory_allocated() - start
        loss.backward()
        print(f"\n[8B head bf16] kept for backward: HF loss {hf_saved / 2**20:.0f} MiB, chunked "
              f"(keep_logits_bytes={keep_logits_bytes}) {chunked_saved / 2**20:.1f} MiB; chunked forward peak "
              f"{chunked_forward_peak / 2**20:.0f} MiB")
        assert loss.item() == pytest.approx(reference.item(), rel=2e-3)
        grad_error = float((hidden.grad.float() - reference_hidden.grad.float()).norm()
                           / reference_hidden.grad.float().norm())
        assert grad_error < 1e-2
        kept = logits_bytes if keep_logits_bytes is None else 0
        assert kept <= chunked_saved < kept + 16 * 2 ** 20 and hf_saved > 200 * 2 ** 20
        assert chunked_forward_peak < kept + 256 * 2 ** 20
    head.weight.grad = None

    # FORGE: the head fused (bf16 states), updated in 4 row blocks vs the whole-head update via HF's loss.
    chunked_model, whole_model = nn.Sequential(head), copy.deepcopy(nn.Sequential(head))
    initial = head.weight.detach().clone()
    opts = [forge_core.fuse(m, "adamw", state_dtype="bf16", probe_inputs=False, **HP)
            for m in (chunked_model, whole_model)]
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    chunked_lm_head_cross_entropy(hidden.detach(), chunked_model[0], labels).backward()
    fused_peak = torch.cuda.max_memory_allocated() - start
    ForCausalLMLoss(whole_model[0](hidden.detach()), labels, vocab).backward()
    for opt in opts:
        opt.step()
    chunked_delta = chunked_model[0].weight.float() - initial.float()
    whole_delta = whole_model[0].weight.float() - initial.float()
    print(f"[8B head bf16] fused head + chunked loss backward peak {fused_peak / 2**20:.0f} MiB")
    assert fused_peak < 512 * 2 ** 20, "no weight gradient (1 GiB) and no logits may be alive"
    # First AdamW step: about lr * sign(G) per element. Recomputed bf16 logits may round differently from
    # the full matmul's, which can flip the sign of a G element near zero; such flips must be rare.
    flipped = float(((chunked_delta - whole_delta).abs() > 0.5 * HP["lr"]).float().mean())
    rms = float((chunked_delta - whole_delta).norm() / whole_delta.norm())
    print(f"[8B head bf16] row-block vs whole-head update: {flipped:.2e} of elements differ by > lr/2, rms-rel {rms:.2e}")
    assert flipped < 1e-3 and rms < 0.1
