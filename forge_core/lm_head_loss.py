"""The LM head and the causal-LM cross-entropy in one vocab-chunked autograd Function.

``chunked_lm_head_cross_entropy(hidden, lm_head, labels)`` returns what Hugging Face's
``LlamaForCausalLM`` returns as ``.loss`` (``ForCausalLMLoss``: logits in the model dtype, upcast to
fp32, labels shifted left by one with ``ignore_index`` padding, mean over the non-ignored tokens;
all tokens ignored gives NaN, as there) without ever holding the ``(tokens, vocab)`` logits.

Why: at 512 tokens and a 128256-token vocabulary the logits and their fp32 loss temporaries are
about 0.9 GiB, at 8192 tokens several GiB, and they are alive at the peak (the start of backward).
Here the forward loops over vocab chunks (``logits_c = hidden @ W_c^T`` in the model dtype)
keeping only a running max, a running sum of exponentials (fp32, as HF's fp32 upcast) and the
target logit per token; it saves ``hidden``, the targets and the fp32 log-sum-exp (4 bytes per
token). The backward recomputes each chunk's logits, forms ``dlogits_c = (softmax_c - onehot_c) *
grad / n_valid`` in the dtype HF's backward gives dlogits (the model dtype), adds ``dlogits_c @ W_c``
(the PRE-update rows, products in fp32) into an fp32 ``dH`` that is rounded once at the end, and then:

* a FORGE-fused LM head (a ``ForgeLinear`` from ``forge_core.fuse``): rows ``[c0, c1)`` of the
  weight are updated at once by the fused kernel with ``G_c = dlogits_c^T hidden`` (never formed),
  so neither the logits nor the 1 GiB (Llama-3.1-8B, bf16) weight gradient ever exists;
* a plain ``nn.Linear`` (any optimizer; also a tied head such as GPT-2's): rows ``[c0, c1)`` of
  an ordinary weight gradient are written, returned through autograd as ``lm_head.weight.grad``.

With ``fuse(..., overlap=True)`` each chunk's row update runs on the side CUDA stream of
``forge_core.overlap``, overlapping the next chunk's GEMMs, as a ForgeLinear's update does.

Cost: where all the logits of a step would take more than ``keep_logits_bytes`` (default
``DEFAULT_KEEP_LOGITS_BYTES``) in the model dtype, the backward recomputes each chunk's logits (four
vocab-sized GEMMs per step instead of three). Below it the forward keeps its chunks' logits (they are
what the recomputation would give: the same GEMM of the same, not yet updated rows) and the backward
turns each into its dlogits in place and drops it: Llama-3.1-8B at 512 tokens keeps 125 MiB and
saves a 0.54 TFLOP GEMM a step. A second backward through the same graph (``retain_graph``)
recomputes, since the first consumed the kept logits.
The per-chunk softmax work is one Triton kernel per direction (``kernels.cross_entropy``: the
forward's statistics, the backward's dlogits written over the chunk's logits) on CUDA and under the
interpreter; ``chunk_stats_reference`` and ``chunk_dlogits_reference`` below are their spec and the
path elsewhere. On CUDA ``dH += dlogits_c @ W_c`` is one GEMM into the fp32 accumulator.
The chunk loop has a fixed trip count and no host sync, so a step with this loss can be captured
in a CUDA graph (with ``forge_core.fuse(..., capturable=True)`` or a capturable torch optimizer).
Labels are range-checked only for CPU tensors (a check on the GPU would be a host sync); a label
outside ``[0, vocab)`` that is not ``ignore_index`` is an error there, and undefined here.

Chunk size: ``default_chunk_size`` keeps one chunk's fp32 logits at most ``DEFAULT_CHUNK_BYTES``
(64 MiB: what the plain-torch path holds; the kernels hold only the model-dtype logits, half that), widths
a multiple of ``CHUNK_ALIGN`` (256, so the fused kernel's row tiles divide a chunk) and as equal as
possible: equal chunks plus at most one narrower last chunk, so the kernel tunes two shapes at most.
Llama-3.1-8B: 512 tokens -> 4 chunks (3 x 32256 + 31488 rows); 8192 tokens -> 63 (62 x 2048 + 1280).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import cross_entropy as chunk_kernels
from .linear import ForgeLinear, autocast_dtype
from .overlap import run_beside, wants_overlap
from .traced import MUTATED, arguments_of, owner_of, traced, traced_update_scope

DEFAULT_CHUNK_BYTES = 64 * 2 ** 20
"""Upper bound on one chunk's fp32 logits (tokens x chunk x 4 bytes) when no chunk_size is given."""
DEFAULT_KEEP_LOGITS_BYTES = 256 * 2 ** 20
"""The forward keeps the logits for the backward when all of them (tokens x vocab in the model dtype)
fit in this; above it the backward recomputes them. 256 MiB: Llama-3.1-8B up to 1024 tokens, a
fraction of the ~1 GiB per 512 tokens that HF's unchunked loss holds."""
CHUNK_ALIGN = 256
"""Default chunk widths are multiples of this (whole row tiles of the fused kernel)."""


def default_chunk_size(num_tokens: int, vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Vocab columns per chunk: fp32 logits of a chunk within ``budget_bytes``, chunks as equal as
    possible, widths a multiple of ``CHUNK_ALIGN`` (the whole vocabulary when it fits at once)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    widest = budget_bytes // (4 * max(1, int(num_tokens))) // CHUNK_ALIGN * CHUNK_ALIGN
    widest = max(CHUNK_ALIGN, widest)
    if widest >= vocab_size:
        return int(vocab_size)
    count = math.ceil(vocab_size / widest)
    per_chunk = math.ceil(vocab_size / count)
    return int(min(vocab_size, math.ceil(per_chunk / CHUNK_ALIGN) * CHUNK_ALIGN))


def chunk_bounds(vocab_size: int, chunk_size: int) -> list[tuple[int, int]]:
    """The vocab chunks ``[c0, c1)`` of ``chunk_size`` columns (the last one shorter)."""
    return [(c0, min(vocab_size, c0 + chunk_size)) for c0 in range(0, vocab_size, chunk_size)]


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], c0: int, c1: int,
                  compute_dtype: torch.dtype) -> torch.Tensor:
    """Logits of vocab rows ``[c0, c1)`` in ``compute_dtype`` (as HF computes them, before its fp32 upcast)."""
    w = weight[c0:c1]
    b = bias[c0:c1] if bias is not None else None
    if w.dtype != compute_dtype:
        w = w.to(compute_dtype)
        b = b.to(compute_dtype) if b is not None else None
    return F.linear(hidden, w, b)


def _target_columns(hit_targets: torch.Tensor, first_col: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each token's target is in the chunk, its column there clamped into the chunk)."""
    local = hit_targets - first_col
    return (local >= 0) & (local < n_cols), local.clamp(0, n_cols - 1).unsqueeze(1)


def chunk_stats_reference(logits: torch.Tensor, hit_targets: torch.Tensor, first_col: int,
                          running_max: torch.Tensor, running_sum: torch.Tensor, target_logit: torch.Tensor) -> None:
    """The spec of ``kernels.cross_entropy.chunk_stats``: fold a chunk of logits (model dtype, upcast
    to fp32 as HF does) into the per-token running max and sum of exponentials, in place, and take
    the target logit of tokens whose target (``hit_targets``, -1 for none) is in the chunk."""
    logits32 = logits.to(torch.float32, copy=True)      # fp32 logits too: the backward may read them (kept)
    in_chunk, index = _target_columns(hit_targets, first_col, logits32.shape[1])
    target_logit.copy_(torch.where(in_chunk, logits32.gather(1, index).squeeze(1), target_logit))
    new_max = torch.maximum(running_max, logits32.amax(dim=1))
    running_sum.mul_(torch.exp(running_max - new_max))
    running_sum.add_(logits32.sub_(new_max.unsqueeze(1)).exp_().sum(dim=1))
    running_max.copy_(new_max)


def chunk_dlogits_reference(logits: torch.Tensor, hit_targets: torch.Tensor, first_col: int, lse: torch.Tensor,
                            row_scale: torch.Tensor) -> torch.Tensor:
    """The spec of ``kernels.cross_entropy.chunk_dlogits_``: ``(softmax - onehot(target)) * row_scale``
    of a chunk, computed in fp32 and rounded to the logits' dtype (the dtype HF's backward gives
    dlogits in)."""
    probs = logits.float()
    probs.sub_(lse.unsqueeze(1)).exp_()
    in_chunk, index = _target_columns(hit_targets, first_col, probs.shape[1])
    probs.scatter_add_(1, index, -in_chunk.to(torch.float32).unsqueeze(1))
    probs.mul_(row_scale.unsqueeze(1))
    return probs.to(logits.dtype)


_FP32_OUT_FAILED: set[str] = set()
"""The CUDA ops (``"addmm"``, ``"mm"``) that raised with ``out_dtype=torch.float32`` (tried once per process)."""


def _accumulate_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``accumulator (fp32) += a @ b`` with fp32 accumulation across chunks, as HF's one matmul of the
    full dlogits accumulates in fp32 and rounds once. Half-precision inputs: on CUDA one GEMM reads
    and writes the fp32 accumulator (``addmm`` with ``out_dtype``, the tensor-core speed), else the
    product comes out in fp32 and is added; elsewhere (CPU tests) the inputs are upcast, which gives
    the same exact products."""
    if a.dtype == torch.float32:
        accumulator.addmm_(a, b)
        return
    if a.device.type == "cuda":
        if "addmm" not in _FP32_OUT_FAILED:
            try:
                torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
                return
            except (RuntimeError, TypeError):   # a torch without addmm(out_dtype) here: the mm below
                _FP32_OUT_FAILED.add("addmm")
        if "mm" not in _FP32_OUT_FAILED:
            try:
                accumulator.add_(torch.mm(a, b, out_dtype=torch.float32))
                return
            except (RuntimeError, TypeError) as error:   # a torch without out_dtype for this case
                _FP32_OUT_FAILED.add("mm")
                warnings.warn(f"chunked_lm_head_cross_entropy: torch.mm(out_dtype=float32) failed ({error}); each "
                              f"chunk's d hidden is rounded to {a.dtype} before the fp32 sum", RuntimeWarning,
                              stacklevel=3)
        accumulator.add_(a @ b)
    else:
        accumulator.addmm_(a.float(), b.float())


def chunked_loss_forward(hidden_c: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         hit_targets: torch.Tensor, denominator: torch.Tensor, chunk_size: int,
                         compute_dtype: torch.dtype, kept: Optional[list[Optional[torch.Tensor]]] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) over vocab chunks of ``hidden_c @ weight^T`` (``hidden_c`` already in ``compute_dtype``;
    ``hit_targets``: -1 where ignored); appends each chunk's logits to ``kept`` when given."""
    with torch.autocast(hidden_c.device.type, enabled=False):
        tokens = hidden_c.shape[0]
        stats = chunk_kernels.chunk_stats if chunk_kernels.usable_for(hidden_c) else chunk_stats_reference
        running_max = torch.full((tokens,), -math.inf, dtype=torch.float32, device=hidden_c.device)
        running_sum = torch.zeros(tokens, dtype=torch.float32, device=hidden_c.device)
        target_logit = torch.zeros(tokens, dtype=torch.float32, device=hidden_c.device)
        for c0, c1 in chunk_bounds(weight.shape[0], chunk_size):
            logits = _chunk_logits(hidden_c, weight, bias, c0, c1, compute_dtype)
            stats(logits, hit_targets, c0, running_max, running_sum, target_logit)
            if kept is not None:
                kept.append(logits)
            del logits
        lse = running_max + torch.log(running_sum)
        per_token = torch.where(hit_targets >= 0, lse - target_logit, torch.zeros_like(lse))
        return per_token.sum() / denominator, lse


def chunked_loss_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], hit_targets: torch.Tensor, lse: torch.Tensor,
                          denominator: torch.Tensor, chunk_size: int, compute_dtype: torch.dtype,
                          hidden_dtype: torch.dtype, needs: tuple[bool, bool, bool], updater: Any,
                          kept: Optional[list[Optional[torch.Tensor]]] = None
                          ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(d hidden, d weight, d bias) of the chunked loss, those ``needs`` asks for; a fused head
    (``updater``) gets its rows updated chunk by chunk instead of a d weight. ``kept``: the forward's
    chunk logits (each freed once its dlogits are done), else each chunk is recomputed."""
    needs_hidden, needs_weight, needs_bias = needs
    tokens, width = hidden.shape
    vocab = weight.shape[0]
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        valid = hit_targets >= 0
        scale = grad_loss.to(torch.float32) / denominator
        # where, not a product: with no valid token the scale is inf and the rows must stay 0 (as HF).
        row_scale = torch.where(valid, scale.expand(tokens), torch.zeros((), dtype=torch.float32,
                                                                          device=hidden.device)).contiguous()
        dlogits_of = chunk_kernels.chunk_dlogits_ if chunk_kernels.usable_for(hidden) else chunk_dlogits_reference
        grad_hidden32 = torch.zeros((tokens, width), dtype=torch.float32, device=hidden.device) \
            if needs_hidden else None
        grad_weight = torch.empty_like(weight) if (needs_weight and updater is None) else None
        grad_bias = torch.empty_like(bias) if (bias is not None and needs_bias) else None
        rows = updater.begin_row_updates(hidden) if (updater is not None and needs_weight) else None
        overlap = rows is not None and wants_overlap(updater, hidden)
        for block, (c0, c1) in enumerate(chunk_bounds(vocab, chunk_size)):
            if kept is not None:
                logits, kept[block] = kept[block], None          # freed once its dlogits are done
            else:
                logits = _chunk_logits(hidden, weight, bias, c0, c1, compute_dtype)
            dlogits = dlogits_of(logits, hit_targets, c0, lse, row_scale)
            del logits
            w = weight[c0:c1]
            if grad_hidden32 is not None:
                # The PRE-update rows: the fused update of this chunk comes after.
                _accumulate_product(grad_hidden32, dlogits, w if w.dtype == compute_dtype else w.to(compute_dtype))
            if grad_bias is not None:
                grad_bias[c0:c1] = dlogits.sum(dim=0).to(grad_bias.dtype)
            if rows is not None:
                if overlap:
                    # As a ForgeLinear's update (forge_core.overlap): on the side stream, after this
                    # chunk's dH product read rows [c0, c1); later chunks read only other rows.
                    run_beside(lambda c0=c0, c1=c1, dy=dlogits, b=block: rows(c0, c1, dy, b),
                               hidden.device, (hidden, dlogits))
                else:
                    rows(c0, c1, dlogits, block)
            elif grad_weight is not None:
                if grad_weight.dtype == compute_dtype:
                    torch.mm(dlogits.t(), hidden, out=grad_weight[c0:c1])
                else:
                    grad_weight[c0:c1] = (dlogits.t() @ hidden).to(grad_weight.dtype)
            del dlogits
        grad_hidden = grad_hidden32.to(hidden_dtype) if grad_hidden32 is not None else None
    return grad_hidden, grad_weight, grad_bias


class _ChunkedLMHeadCrossEntropy(torch.autograd.Function):
    """loss = sum over valid tokens of (logsumexp(logits) - logits[target]) / denominator, by chunks."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, denominator: torch.Tensor, chunk_size: int, ignore_index: int,
                updater: Any, compute_dtype: torch.dtype, keep_logits: bool) -> torch.Tensor:
        hidden_c = hidden if hidden.dtype == compute_dtype else hidden.to(compute_dtype)
        # targets of ignored tokens become -1, which no chunk column matches
        hit_targets = torch.where(targets != ignore_index, targets, torch.full_like(targets, -1))
        # kept only where a backward will read them (not under no_grad, nor for constants)
        kept: Optional[list[Optional[torch.Tensor]]] = [] if keep_logits and any(ctx.needs_input_grad[:3]) \
            else None
        loss, lse = chunked_loss_forward(hidden_c, weight, bias, hit_targets, denominator, chunk_size,
                                         compute_dtype, kept)
        ctx.save_for_backward(hidden_c, weight, bias, hit_targets, lse, denominator)
        ctx.chunk_size = chunk_size
        ctx.kept_logits = kept
        ctx.updater = updater
        ctx.compute_dtype = compute_dtype
        ctx.hidden_dtype = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, hit_targets, lse, denominator = ctx.saved_tensors
        kept, ctx.kept_logits = ctx.kept_logits, None        # consumed: a second backward recomputes
        grads = chunked_loss_backward(grad_loss, hidden, weight, bias, hit_targets, lse, denominator, ctx.chunk_size,
                                      ctx.compute_dtype, ctx.hidden_dtype, tuple(ctx.needs_input_grad[:3]),
                                      ctx.updater, kept)
        return (*grads, None, None, None, None, None, None, None)


@torch.library.custom_op("forge::chunked_lm_head_loss", mutates_args=())
def _traced_loss(hidden_c: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], hit_targets: torch.Tensor,
                 denominator: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked loss's forward as the compiler sees it: (loss, lse)."""
    return chunked_loss_forward(hidden_c, weight, bias, hit_targets, denominator, chunk_size, hidden_c.dtype)


@_traced_loss.register_fake
def _traced_loss_fake(hidden_c: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      hit_targets: torch.Tensor, denominator: torch.Tensor, chunk_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return (hidden_c.new_empty((), dtype=torch.float32), hidden_c.new_empty((hidden_c.shape[0],), dtype=torch.float32))


@torch.library.custom_op("forge::chunked_lm_head_loss_backward_", mutates_args=MUTATED)
def _traced_loss_backward(grad_loss: torch.Tensor, hidden_c: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], hit_targets: torch.Tensor, lse: torch.Tensor,
                          denominator: torch.Tensor, written: list[torch.Tensor], scalars: Optional[torch.Tensor],
                          chunk_size: int, key: int, hidden_dtype: torch.dtype, needs_hidden: bool,
                          needs_weight: bool, needs_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked loss's backward as the compiler sees it: (d hidden, d weight, d bias), each empty where
    not asked for; with ``key`` >= 0 the fused head ``key`` names is updated row block by row block (no d
    weight), on the tensors given (its own, or copies: ``ForgeOptimizer.updating_on``)."""
    updater = owner_of(key) if key >= 0 and needs_weight else None
    with contextlib.ExitStack() as scope:
        if updater is not None:
            updater.optimizer.prepare_traced_update(updater)
            scope.enter_context(updater.optimizer.updating_on(updater, weight, written, scalars))
        scope.enter_context(traced_update_scope())
        grads = chunked_loss_backward(grad_loss, hidden_c, weight, bias, hit_targets, lse, denominator, chunk_size,
                                      hidden_c.dtype, hidden_dtype, (needs_hidden, needs_weight, needs_bias), updater)
    return tuple(g if g is not None else hidden_c.new_empty((0,)) for g in grads)  # type: ignore[return-value]


@_traced_loss_backward.register_fake
def _traced_loss_backward_fake(grad_loss: torch.Tensor, hidden_c: torch.Tensor, weight: torch.Tensor,
                               bias: Optional[torch.Tensor], hit_targets: torch.Tensor, lse: torch.Tensor,
                               denominator: torch.Tensor, written: list[torch.Tensor], scalars: Optional[torch.Tensor],
                               chunk_size: int, key: int, hidden_dtype: torch.dtype, needs_hidden: bool,
                               needs_weight: bool, needs_bias: bool
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    empty = hidden_c.new_empty((0,))
    return (hidden_c.new_empty(hidden_c.shape, dtype=hidden_dtype) if needs_hidden else empty,
            torch.empty_like(weight) if needs_weight and key < 0 else empty,
            torch.empty_like(bias) if bias is not None and needs_bias else empty)


class _TracedChunkedLMHeadCrossEntropy(torch.autograd.Function):
    """``_ChunkedLMHeadCrossEntropy`` as ``torch.compile`` traces it: the forward and the backward are the
    registered operators ``forge::chunked_lm_head_loss`` and ``forge::chunked_lm_head_loss_backward_``
    (the logits are recomputed in the backward, never kept); ``key``: the fused head's (-1: a plain head,
    which gets its d weight)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, denominator: torch.Tensor, chunk_size: int, ignore_index: int,
                compute_dtype: torch.dtype, scalars: Optional[torch.Tensor], key: int,
                *written: torch.Tensor) -> torch.Tensor:
        hidden_c = hidden if hidden.dtype == compute_dtype else hidden.to(compute_dtype)
        hit_targets = torch.where(targets != ignore_index, targets, torch.full_like(targets, -1))
        loss, lse = _traced_loss(hidden_c, weight, bias, hit_targets, denominator, chunk_size)
        ctx.save_for_backward(hidden_c, weight, bias, hit_targets, lse, denominator, scalars, *written)
        ctx.chunk_size, ctx.key, ctx.hidden_dtype = chunk_size, key, hidden.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):  # type: ignore[override]
        hidden_c, weight, bias, hit_targets, lse, denominator, scalars, *written = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden, grad_weight, grad_bias = _traced_loss_backward(
            grad_loss, hidden_c, weight, bias, hit_targets, lse, denominator, list(written), scalars, ctx.chunk_size,
            ctx.key, ctx.hidden_dtype, needs_hidden, needs_weight, bias is not None and needs_bias)
        return (grad_hidden if needs_hidden else None,
                grad_weight if needs_weight and ctx.key < 0 else None,
                grad_bias if bias is not None and needs_bias else None,
                None, None, None, None, None, None, None, *(None for _ in written))


def _fused_updater(lm_head: nn.Linear) -> Any:
    """The FORGE binding of a fused LM head (None for a plain or unbound one)."""
    if not isinstance(lm_head, ForgeLinear):
        return None
    updater = getattr(lm_head, "forge_updater", None)
    if updater is None:
        return None
    if not callable(getattr(updater, "begin_row_updates", None)):
        raise TypeError(f"the LM head's updater {type(updater).__name__} cannot update row blocks "
                        "(needs begin_row_updates, as forge_core's FusedWeight has)")
    return updater


def chunked_lm_head_cross_entropy(hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, *,
                                  ignore_index: int = -100, shift: bool = True, chunk_size: Optional[int] = None,
                                  num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
                                  keep_logits_bytes: Optional[int] = None) -> torch.Tensor:
    """Causal-LM cross-entropy of ``lm_head(hidden)`` against ``labels``, vocab chunk by chunk.

    ``hidden``: (B, T, D) or (N, D) in the model dtype; ``lm_head``: an ``nn.Linear`` (bias
    allowed), plain or fused by ``forge_core.fuse``; ``labels``: (B, T) or (N,) integers, with
    ``ignore_index`` for tokens without a target. ``shift=True`` shifts labels left by one along
    the last axis (HF's causal-LM convention: position t predicts label t+1, the last position
    predicts nothing); ``shift=False`` takes labels as per-position targets. ``chunk_size``: vocab
    columns per chunk (default ``default_chunk_size``). ``num_items_in_batch``: divide the summed
    loss by this instead of the count of valid tokens (HF's gradient-accumulation convention).
    ``keep_logits_bytes``: keep the forward's logits for the backward when all of them fit in this
    many bytes (default ``DEFAULT_KEEP_LOGITS_BYTES``; 0 always recomputes them in the backward).

    Equal to HF ``ForCausalLMLoss(lm_head(hidden), labels, ...)``; a fused head is updated inside
    this loss's backward, a plain head gets its ``.grad`` (and its bias's) from autograd."""
    if not isinstance(lm_head, nn.Linear):
        raise TypeError(f"lm_head must be an nn.Linear, got {type(lm_head).__name__}")
    weight, bias = lm_head.weight, lm_head.bias
    vocab, width = weight.shape
    if hidden.dim() < 2 or hidden.shape[-1] != width:
        raise ValueError(f"hidden must have shape (..., {width}) for an LM head of shape {tuple(weight.shape)}, "
                         f"got {tuple(hidden.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden's token shape "
                         f"{tuple(hidden.shape[:-1])}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if keep_logits_bytes is not None and (isinstance(keep_logits_bytes, bool) or not isinstance(keep_logits_bytes, int)
                                          or keep_logits_bytes < 0):
        raise ValueError(f"keep_logits_bytes must be a non-negative integer, got {keep_logits_bytes!r}")
    labels = labels.to(device=hidden.device, dtype=torch.long)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = labels.reshape(-1)
    hidden2 = hidden.reshape(-1, width)
    tokens = hidden2.shape[0]
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise ValueError(f"labels hold {int(bad.sum())} ids outside [0, {vocab}) that are not "
                             f"ignore_index={ignore_index}")

    compute_dtype = logits_dtype(hidden, lm_head)
    if autocast_dtype(hidden.device.type) is None and hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but the LM head's weight is {weight.dtype} (outside autocast)")
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    chunk = int(chunk_size) if chunk_size is not None else default_chunk_size(tokens, vocab)
    chunk = min(chunk, vocab)
    updater = _fused_updater(lm_head) if weight.requires_grad else None
    if torch.compiler.is_compiling() and (updater is None or traced(updater)):
        arguments = arguments_of(updater) if updater is not None else (None, -1)
        return _TracedChunkedLMHeadCrossEntropy.apply(hidden2, weight, bias, targets, denominator, chunk, ignore_index,
                                                      compute_dtype, *arguments)
    return _ChunkedLMHeadCrossEntropy.apply(hidden2, weight, bias, targets, denominator, chunk, ignore_index,
                                            updater, compute_dtype,
                                            keeps_logits(tokens, vocab, compute_dtype, keep_logits_bytes))


def logits_dtype(hidden: torch.Tensor, lm_head: nn.Linear) -> torch.dtype:
    """The dtype the loss computes (and may keep) the logits in: autocast's where it is on for
    ``hidden``'s device, else the head's weight dtype (as HF's ``lm_head(hidden)``)."""
    return autocast_dtype(hidden.device.type) or lm_head.weight.dtype


def keeps_logits(tokens: int, vocab_size: int, dtype: torch.dtype, keep_logits_bytes: Optional[int] = None) -> bool:
    """Whether the loss keeps the forward's logits for the backward (instead of recomputing them)."""
    budget = DEFAULT_KEEP_LOGITS_BYTES if keep_logits_bytes is None else keep_logits_bytes
    return int(tokens) * int(vocab_size) * dtype.itemsize <= budget


__all__ = ["chunked_lm_head_cross_entropy", "default_chunk_size", "keeps_logits", "logits_dtype",
           "DEFAULT_CHUNK_BYTES", "DEFAULT_KEEP_LOGITS_BYTES", "CHUNK_ALIGN"]
