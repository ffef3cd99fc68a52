"""The chunked loss's Triton kernels (forge_core.kernels.cross_entropy) against their plain-torch spec
in forge_core.lm_head_loss. Without a GPU they run in the interpreter (TRITON_INTERPRET=1 from
conftest); on CUDA the same tests run on the device."""
from __future__ import annotations

import math

import pytest
import torch

from forge_core import lm_head_loss
from forge_core.kernels import cross_entropy
from forge_core.lm_head_loss import chunk_dlogits_reference, chunk_stats_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not cross_entropy.usable_for(torch.empty(0, device=DEVICE)),
                                reason="the Triton kernels cannot run here (no CUDA, TRITON_INTERPRET unset at import)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EXP_RTOL = 1e-5


def _chunk(tokens: int, cols: int, dtype: torch.dtype, padded: int = 0, seed: int = 0) -> torch.Tensor:
    """Logits of O(3) with some large ones; ``padded`` extra columns make the row stride wider than the chunk."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(tokens, cols + padded, generator=generator) * 3.0
    full[::5, min(1, cols - 1)] = 40.0
    return full.to(dtype).to(DEVICE)[:, :cols]


def _targets(tokens: int, first_col: int, cols: int) -> torch.Tensor:
    """-1 (no target), before, inside (first and last column too) and after the chunk."""
    generator = torch.Generator().manual_seed(3)
    targets = torch.randint(0, first_col + cols + 50, (tokens,), generator=generator)
    targets[0], targets[1], targets[2] = -1, first_col, first_col + cols - 1
    if tokens > 3:
        targets[3] = first_col + cols
    return targets.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, cols, padded", [(7, 203, 0), (33, 1500, 9), (5, 2051, 0), (4, 1, 3)])
@pytest.mark.parametrize("first", [True, False], ids=["first_chunk", "later_chunk"])
def test_chunk_stats_equal_the_reference(dtype: torch.dtype, tokens: int, cols: int, padded: int, first: bool) -> None:
    logits = _chunk(tokens, cols, dtype, padded)
    first_col = 0 if first else 517
    targets = _targets(tokens, first_col, cols)
    generator = torch.Generator().manual_seed(5)
    if first:   # what the loss starts from
        start = [torch.full((tokens,), -math.inf), torch.zeros(tokens), torch.zeros(tokens)]
    else:       # after earlier chunks: maxima below and above this chunk's
        start = [torch.randn(tokens, generator=generator) * 20, torch.rand(tokens, generator=generator) + 0.5,
                 torch.randn(tokens, generator=generator)]
    want = [t.to(DEVICE) for t in start]
    got = [t.clone() for t in want]
    chunk_stats_reference(logits.clone(), targets, first_col, *want)
    cross_entropy.chunk_stats(logits, targets, first_col, *got)
    running_max, running_sum, target_logit = got
    assert torch.equal(running_max, want[0]), "the max is exact"
    assert torch.equal(target_logit, want[2]), "the target logit is a copy"
    # the sum of exponentials differs only by the order of fp32 summation and the exp: the GPU's is
    # ex2.approx of x * log2(e), good to ~1e-7 relative plus the product's rounding (|x| <= ~50 here)
    torch.testing.assert_close(running_sum, want[1], rtol=EXP_RTOL, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, cols, padded", [(7, 203, 0), (33, 4100, 9), (3, 1, 0)])
def test_chunk_dlogits_equal_the_reference_and_overwrite_the_logits(dtype: torch.dtype, tokens: int, cols: int,
                                                                    padded: int) -> None:
    logits = _chunk(tokens, cols, dtype, padded)
    before = logits.clone()
    first_col = 1000
    targets = _targets(tokens, first_col, cols)
    generator = torch.Generator().manual_seed(9)
    # the log-sum-exp of the whole vocabulary: at least this chunk's
    lse = torch.logsumexp(before.float(), dim=1) + torch.rand(tokens, generator=generator).to(DEVICE) * 3.0
    row_scale = torch.rand(tokens, generator=generator).to(DEVICE)
    row_scale[0] = 0.0     # a token without a target
    want = chunk_dlogits_reference(before, targets, first_col, lse, row_scale)
    got = cross_entropy.chunk_dlogits_(logits, targets, first_col, lse, row_scale)
    assert got.data_ptr() == logits.data_ptr() and got.dtype == dtype
    assert not got[0].any(), "a zero row scale gives a zero row"
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=EXP_RTOL, atol=1e-30)
    else:
        # one rounding of the same fp32 value: equal, except where the exp's last ulp crosses a rounding
        # boundary (one step of the half-precision type)
        differ = got != want
        assert differ.float().mean() < 0.01
        step = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((got.float() - want.float()).abs() <= step)[differ].all()


def test_dlogits_subtract_one_at_the_target_only() -> None:
    logits = torch.zeros(3, 8, device=DEVICE)                 # softmax over 8 equal logits: 1/8 each
    targets = torch.tensor([13, -1, 9], device=DEVICE)        # first_col 10: columns 3, none, out of chunk
    out = cross_entropy.chunk_dlogits_(logits, targets, 10, torch.full((3,), math.log(8.0), device=DEVICE),
                                       torch.ones(3, device=DEVICE))
    want = torch.full((3, 8), 0.125)
    want[0, 3] = 0.125 - 1.0
    torch.testing.assert_close(out.cpu(), want)


@pytest.mark.parametrize("call, message", [
    (lambda z, t: cross_entropy.chunk_stats(z.t(), t, 0, t.float(), t.float(), t.float()), "unit column stride"),
    (lambda z, t: cross_entropy.chunk_stats(z, t[:3], 0, t.float(), t.float(), t.float()), "shape (4,)"),
    (lambda z, t: cross_entropy.chunk_dlogits_(z[0], t, 0, t.float(), t.float()), "2-D tensor"),
])
def test_bad_chunks_are_clear_errors(call, message) -> None:
    logits, targets = torch.zeros(4, 6, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(logits, targets)


def test_the_loss_gives_the_same_values_on_the_kernel_and_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels are what the loss runs here; the plain-torch path (CPU without the interpreter)
    must give the same loss and gradients."""
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 301, bias=True).to(DEVICE)
    hidden = torch.randn(2, 9, 24, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 301, (2, 9), device=DEVICE)
    labels[0, :3] = -100

    def run() -> tuple[torch.Tensor, ...]:
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        loss = lm_head_loss.chunked_lm_head_cross_entropy(hidden, head, labels, chunk_size=64)
        loss.backward()
        return loss.detach(), hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()

    with_kernels = run()
    monkeypatch.setattr(cross_entropy, "usable_for", lambda tensor: False)
    reference = run()
    for got, want in zip(with_kernels, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
