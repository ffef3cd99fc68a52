"""The LM head and the causal-LM cross-entropy in one vocab-chunked autograd Function.

``chunked_lm_head_cross_entropy(hidden, lm_head, labels)`` returns what Hugging Face's
``LlamaForCausalLM`` returns as ``.loss`` (``ForCausalLMLoss``: logits in the model dtype, upcast to
fp32, labels shifted left by one with ``ignore_index`` padding, mean over the non-ignored tokens;
all tokens ignored gives NaN, as there) without ever holding the ``(tokens, vocab)`` logits.

Why: at 512 tokens and a 128256-token vocabulary the logits and their fp32 loss temporaries are
about 0.9 GiB, at 8192 tokens several GiB, and they are alive at the peak (the start of backward).
Here the forward loops over vocab chunks (``logits_c = hidden @ W_c^T`` in the model dtype, then
fp32) keeping only a running max, a running sum of exponentials and the target logit per token;
it saves ``hidden``, the labels and the fp32 log-sum-exp (4 bytes per token). The backward
recomputes each chunk's logits, forms ``dlogits_c = (softmax_c - onehot_c) * grad / n_valid`` in
the dtype HF's backward gives dlogits (the model dtype), adds ``dlogits_c @ W_c`` (the PRE-update
rows, products in fp32) into an fp32 ``dH`` that is rounded once at the end, and then:

* a FORGE-fused LM head (a ``ForgeLinear`` from ``forge_core.fuse``): rows ``[c0, c1)`` of the
  weight are updated at once by the fused kernel with ``G_c = dlogits_c^T hidden`` (never formed),
  so neither the logits nor the 1 GiB (Llama-3.1-8B, bf16) weight gradient ever exists;
* a plain ``nn.Linear`` (any optimizer; also a tied head such as GPT-2's): rows ``[c0, c1)`` of
  an ordinary weight gradient are written, returned through autograd as ``lm_head.weight.grad``.

With ``fuse(..., overlap=True)`` (the default) each chunk's row update runs on the side CUDA stream of
``forge_core.overlap``, overlapping the next chunk's GEMMs, as a ForgeLinear's update does.

Cost: the backward recomputes the logits once (four vocab-sized GEMMs per step instead of three).
The chunk loop has a fixed trip count and no host sync, so a step with this loss can be captured
in a CUDA graph (with ``forge_core.fuse(..., capturable=True)`` or a capturable torch optimizer).
Labels are range-checked only for CPU tensors (a check on the GPU would be a host sync); a label
outside ``[0, vocab)`` that is not ``ignore_index`` is an error there, and undefined here.

Chunk size: ``default_chunk_size`` keeps one chunk's fp32 logits at most ``DEFAULT_CHUNK_BYTES``
(64 MiB; with the model-dtype logits and dlogits of the chunk, about twice that is transient), widths
a multiple of ``CHUNK_ALIGN`` (256, so the fused kernel's row tiles divide a chunk) and as equal as
possible: equal chunks plus at most one narrower last chunk, so the kernel tunes two shapes at most.
Llama-3.1-8B: 512 tokens -> 4 chunks (3 x 32256 + 31488 rows); 8192 tokens -> 63 (62 x 2048 + 1280).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ForgeLinear, _autocast_dtype
from .overlap import run_beside, wants_overlap

DEFAULT_CHUNK_BYTES = 64 * 2 ** 20
"""Upper bound on one chunk's fp32 logits (tokens x chunk x 4 bytes) when no chunk_size is given."""
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


def _chunk_bounds(vocab_size: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(c0, min(vocab_size, c0 + chunk_size)) for c0 in range(0, vocab_size, chunk_size)]


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], c0: int, c1: int,
                  compute_dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of vocab rows ``[c0, c1)``, computed in ``compute_dtype`` first (as HF does)."""
    w = weight[c0:c1]
    b = bias[c0:c1] if bias is not None else None
    if w.dtype != compute_dtype:
        w = w.to(compute_dtype)
        b = b.to(compute_dtype) if b is not None else None
    return F.linear(hidden, w, b).float()


_FP32_OUT_MM_FAILED: set[str] = set()
"""Device types on which ``torch.mm(..., out_dtype=torch.float32)`` raised (tried once per process)."""


def _accumulate_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``accumulator (fp32) += a @ b`` with fp32 accumulation across chunks, as HF's one matmul of the
    full dlogits accumulates in fp32 and rounds once. Half-precision inputs: on CUDA the product
    comes out in fp32 (``out_dtype``, the tensor-core speed); elsewhere (CPU tests) the inputs are
    upcast, which gives the same exact products."""
    if a.dtype == torch.float32:
        accumulator.addmm_(a, b)
        return
    device_type = a.device.type
    if device_type == "cuda" and device_type not in _FP32_OUT_MM_FAILED:
        try:
            accumulator.add_(torch.mm(a, b, out_dtype=torch.float32))
            return
        except (RuntimeError, TypeError) as error:   # a torch without out_dtype for this case
            _FP32_OUT_MM_FAILED.add(device_type)
            warnings.warn(f"chunked_lm_head_cross_entropy: torch.mm(out_dtype=float32) failed ({error}); each "
                          f"chunk's d hidden is rounded to {a.dtype} before the fp32 sum", RuntimeWarning,
                          stacklevel=3)
    if device_type == "cuda":
        accumulator.add_(a @ b)
    else:
        accumulator.addmm_(a.float(), b.float())


class _ChunkedLMHeadCrossEntropy(torch.autograd.Function):
    """loss = sum over valid tokens of (logsumexp(logits) - logits[target]) / denominator, by chunks."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, denominator: torch.Tensor, chunk_size: int, ignore_index: int,
                updater: Any, compute_dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            hidden_c = hidden if hidden.dtype == compute_dtype else hidden.to(compute_dtype)
            tokens = hidden_c.shape[0]
            valid = targets != ignore_index
            safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
            running_max = torch.full((tokens,), -math.inf, dtype=torch.float32, device=hidden.device)
            running_sum = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
            target_logit = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
            for c0, c1 in _chunk_bounds(weight.shape[0], chunk_size):
                logits = _chunk_logits(hidden_c, weight, bias, c0, c1, compute_dtype)
                in_chunk = (safe_targets >= c0) & (safe_targets < c1)
                index = (safe_targets - c0).clamp(0, c1 - c0 - 1).unsqueeze(1)
                target_logit = torch.where(in_chunk, logits.gather(1, index).squeeze(1), target_logit)
                new_max = torch.maximum(running_max, logits.amax(dim=1))
                running_sum = running_sum * torch.exp(running_max - new_max) \
                    + logits.sub_(new_max.unsqueeze(1)).exp_().sum(dim=1)
                running_max = new_max
                del logits
            lse = running_max + torch.log(running_sum)
            per_token = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
            loss = per_token.sum() / denominator
        ctx.save_for_backward(hidden_c, weight, bias, targets, lse, denominator)
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        ctx.updater = updater
        ctx.compute_dtype = compute_dtype
        ctx.hidden_dtype = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, targets, lse, denominator = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        compute_dtype = ctx.compute_dtype
        updater = ctx.updater
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            valid = targets != ctx.ignore_index
            safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
            scale = grad_loss.to(torch.float32) / denominator
            # where, not a product: with no valid token the scale is inf and the rows must stay 0 (as HF).
            row_scale = torch.where(valid, scale.expand(tokens), torch.zeros((), dtype=torch.float32,
                                                                              device=hidden.device)).unsqueeze(1)
            grad_hidden32 = torch.zeros((tokens, width), dtype=torch.float32, device=hidden.device) \
                if needs_hidden else None
            grad_weight = torch.empty_like(weight) if (needs_weight and updater is None) else None
            grad_bias = torch.empty_like(bias) if (bias is not None and needs_bias) else None
            rows = updater.begin_row_updates(hidden) if (updater is not None and needs_weight) else None
            overlap = rows is not None and wants_overlap(updater, hidden)
            for block, (c0, c1) in enumerate(_chunk_bounds(vocab, ctx.chunk_size)):
                probs = _chunk_logits(hidden, weight, bias, c0, c1, compute_dtype)
                probs.sub_(lse.unsqueeze(1)).exp_()
                in_chunk = valid & (safe_targets >= c0) & (safe_targets < c1)
                index = (safe_targets - c0).clamp(0, c1 - c0 - 1).unsqueeze(1)
                probs.scatter_add_(1, index, -in_chunk.to(torch.float32).unsqueeze(1))
                probs.mul_(row_scale)
                dlogits = probs.to(compute_dtype)
                del probs
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
            grad_hidden = grad_hidden32.to(ctx.hidden_dtype) if grad_hidden32 is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


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
                                  num_items_in_batch: Optional[Union[int, torch.Tensor]] = None) -> torch.Tensor:
    """Causal-LM cross-entropy of ``lm_head(hidden)`` against ``labels``, vocab chunk by chunk.

    ``hidden``: (B, T, D) or (N, D) in the model dtype; ``lm_head``: an ``nn.Linear`` (bias
    allowed), plain or fused by ``forge_core.fuse``; ``labels``: (B, T) or (N,) integers, with
    ``ignore_index`` for tokens without a target. ``shift=True`` shifts labels left by one along
    the last axis (HF's causal-LM convention: position t predicts label t+1, the last position
    predicts nothing); ``shift=False`` takes labels as per-position targets. ``chunk_size``: vocab
    columns per chunk (default ``default_chunk_size``). ``num_items_in_batch``: divide the summed
    loss by this instead of the count of valid tokens (HF's gradient-accumulation convention).

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
    labels = labels.to(device=hidden.device, dtype=torch.long)
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = labels.reshape(-1)
    hidden2 = hidden.reshape(-1, width)
    tokens = hidden2.shape[0]
    if targets.device.type == "cpu":
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise ValueError(f"labels hold {int(bad.sum())} ids outside [0, {vocab}) that are not "
                             f"ignore_index={ignore_index}")

    autocast_dtype = _autocast_dtype(hidden.device.type)
    compute_dtype = autocast_dtype or weight.dtype
    if autocast_dtype is None and hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but the LM head's weight is {weight.dtype} (outside autocast)")
    if num_items_in_batch is None:
        denominator = (targets != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    chunk = int(chunk_size) if chunk_size is not None else default_chunk_size(tokens, vocab)
    chunk = min(chunk, vocab)
    updater = _fused_updater(lm_head) if weight.requires_grad else None
    return _ChunkedLMHeadCrossEntropy.apply(hidden2, weight, bias, targets, denominator, chunk, ignore_index,
                                            updater, compute_dtype)


__all__ = ["chunked_lm_head_cross_entropy", "default_chunk_size", "DEFAULT_CHUNK_BYTES", "CHUNK_ALIGN"]
