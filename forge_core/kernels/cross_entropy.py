"""Triton kernels for the vocab-chunked LM-head loss (``forge_core.lm_head_loss``).

Per vocab chunk, the plain-torch path upcasts the chunk's logits to an fp32 copy and makes about
five elementwise passes over it forward (max, subtract, exp, sum, gather) and six backward (exp,
scatter, scale, round), each a separate kernel that reads and writes the whole chunk. At 4096
tokens that is tens of GB of traffic per step (about 20 ms on an H100). Here each direction is one
kernel that reads the chunk's logits in the model dtype once (the forward's second pass hits L2)
and, backward, writes ``dlogits`` over them in place.

The functions ``chunk_stats_reference`` and ``chunk_dlogits_reference`` in
``forge_core.lm_head_loss`` are the spec these kernels are tested against: same operations and
roundings, so the results differ only by the order of fp32 summation and the exp's last ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import to_bf16_nearest_even
from .device import interpreting, runs_on_device_of

_DECORATED_FOR_INTERPRETER = interpreting()
STATS_BLOCK = 1024
DLOGITS_BLOCK = 2048


def usable_for(tensor: torch.Tensor) -> bool:
    """Whether these kernels can run on ``tensor``'s device (CUDA, or the CPU when the kernels were
    decorated for the interpreter)."""
    return runs_on_device_of(tensor, _DECORATED_FOR_INTERPRETER)


@triton.jit
def _chunk_stats_kernel(logits_ptr, row_stride, n_cols, first_col, targets_ptr, max_ptr, sum_ptr, target_logit_ptr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    old_max = tl.load(max_ptr + row)
    new_max = tl.maximum(old_max, tl.max(lane_max, axis=0))
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):     # the row was just read: this pass hits L2
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        lane_sum += tl.exp(x - new_max)
    total = tl.load(sum_ptr + row) * tl.exp(old_max - new_max) + tl.sum(lane_sum, axis=0)
    tl.store(max_ptr + row, new_max)
    tl.store(sum_ptr + row, total)
    target = tl.load(targets_ptr + row) - first_col
    if (target >= 0) & (target < n_cols):
        tl.store(target_logit_ptr + row, tl.load(base + target).to(tl.float32))


@triton.jit
def _chunk_dlogits_kernel(logits_ptr, row_stride, n_cols, first_col, targets_ptr, lse_ptr, scale_ptr,
                          BLOCK: tl.constexpr, HW_MATH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_cols
    pointers = logits_ptr + row * row_stride + offsets
    x = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    probs = tl.exp(x - tl.load(lse_ptr + row))
    target = tl.load(targets_ptr + row) - first_col
    probs = tl.where(offsets == target, probs - 1.0, probs)
    dlogits = probs * tl.load(scale_ptr + row)
    if logits_ptr.dtype.element_ty == tl.bfloat16:     # round to nearest even, as torch's cast (also interpreted)
        tl.store(pointers, to_bf16_nearest_even(dlogits, HW_MATH), mask=mask)
    else:
        tl.store(pointers, dlogits.to(logits_ptr.dtype.element_ty), mask=mask)


def _check_chunk(logits: torch.Tensor, *per_token: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"chunk logits must be a 2-D tensor with unit column stride, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    for tensor in per_token:
        if tensor.shape != (logits.shape[0],) or not tensor.is_contiguous():
            raise ValueError(f"per-token tensors must be contiguous with shape ({logits.shape[0]},), got "
                             f"{tuple(tensor.shape)}")


def _warps(block: int) -> int:
    return 1 if _DECORATED_FOR_INTERPRETER else max(4, min(8, block // 256))


def chunk_stats(logits: torch.Tensor, hit_targets: torch.Tensor, first_col: int, running_max: torch.Tensor,
                running_sum: torch.Tensor, target_logit: torch.Tensor) -> None:
    """Folds vocab columns ``[first_col, first_col + logits.shape[1])`` into the per-token running max
    and sum of exponentials (fp32, in place), and writes the target logit of tokens whose target
    falls in the chunk. ``hit_targets``: int64 targets, -1 for tokens without one."""
    _check_chunk(logits, hit_targets, running_max, running_sum, target_logit)
    tokens, n_cols = logits.shape
    if tokens == 0:
        return
    block = min(STATS_BLOCK, triton.next_power_of_2(max(1, n_cols)))
    _chunk_stats_kernel[(tokens,)](logits, logits.stride(0), n_cols, first_col, hit_targets, running_max,
                                   running_sum, target_logit, BLOCK=block, num_warps=_warps(block))


def chunk_dlogits_(logits: torch.Tensor, hit_targets: torch.Tensor, first_col: int, lse: torch.Tensor,
                   row_scale: torch.Tensor) -> torch.Tensor:
    """Overwrites the chunk's logits with ``dlogits = (softmax - onehot(target)) * row_scale`` in their
    own dtype, and returns them. ``lse``, ``row_scale``: fp32 per token (the scale is 0 for tokens
    without a target)."""
    _check_chunk(logits, hit_targets, lse, row_scale)
    tokens, n_cols = logits.shape
    if tokens == 0 or n_cols == 0:
        return logits
    block = min(DLOGITS_BLOCK, triton.next_power_of_2(n_cols))
    _chunk_dlogits_kernel[(tokens, triton.cdiv(n_cols, block))](logits, logits.stride(0), n_cols, first_col,
                                                               hit_targets, lse, row_scale, BLOCK=block,
                                                               HW_MATH=not _DECORATED_FOR_INTERPRETER,
                                                               num_warps=_warps(block))
    return logits


__all__ = ["chunk_stats", "chunk_dlogits_", "usable_for"]
