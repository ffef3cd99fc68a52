"""An embedding's gradient as rows: one summed gradient row per token position, never the dense
(vocab, width) gradient.

Why: ``nn.Embedding``'s backward writes a dense ``.grad`` of the whole vocabulary (1 GiB for
Llama-3.1-8B in bf16) although a batch of T tokens touches at most T rows of it, and the optimizer
then reads all of it back. ``row_gradient`` gives, for the T token ids sorted, the gradient row
each id would have in that dense ``.grad``: the sum of the ``dY`` rows of every position holding
the id, in fp32, rounded once to the gradient's dtype (as torch's CUDA backward rounds). A
repeated id's row appears once per position, each copy equal, so everything stays a fixed T rows
(capturable in a CUDA graph: no ``unique``, no host sync).

The sum runs over a segment of equal sorted ids in ascending position order (``torch.sort`` is
stable), in one program per segment start: the same order every run, so the result is
deterministic, unlike an ``index_add_`` of atomics. ``row_gradient_reference`` is the plain-torch
spec the Triton kernel is tested against; the padding id's rows are zero (torch's embedding
backward gives the padding row no gradient).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .codec import store_tile
from .device import interpreting, runs_on_device_of

_DECORATED_FOR_INTERPRETER = interpreting()
NO_PADDING = -1
"""``padding_idx`` when there is none (ids are never negative)."""


def usable_for(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel runs on ``tensor``'s device (CUDA, or the CPU under the interpreter)."""
    return runs_on_device_of(tensor, _DECORATED_FOR_INTERPRETER)


@triton.jit
def _segment_sum_kernel(sorted_ids, order, segment_end, dy, out, width, stride_dy, stride_out, padding_idx,
                        HW_MATH: tl.constexpr, BLOCK: tl.constexpr):
    position = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < width
    token = tl.load(sorted_ids + position)
    previous = tl.load(sorted_ids + tl.maximum(position - 1, 0))
    if (position == 0) | (previous != token):          # a segment starts here: sum it, then fill it
        end = tl.load(segment_end + position)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(position, end):
            source = tl.load(order + j).to(tl.int64)
            total += tl.load(dy + source * stride_dy + cols, mask=col_mask, other=0.0).to(tl.float32)
        total = tl.where(token == padding_idx, 0.0, total)
        destination = out + position.to(tl.int64) * stride_out + cols       # 64-bit pointer arithmetic
        for _ in range(position, end):
            store_tile(destination, total, col_mask, False, HW_MATH)     # bf16: nearest even, as torch
            destination += stride_out


def _sorted_segments(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids sorted, the positions they came from, one past the end of each position's segment)."""
    sorted_ids, order = torch.sort(ids, stable=True)
    count = sorted_ids.numel()
    ends_here = torch.ones(count, dtype=torch.bool, device=ids.device)
    ends_here[:-1] = sorted_ids[1:] != sorted_ids[:-1]
    candidates = torch.where(ends_here, torch.arange(1, count + 1, device=ids.device),
                             torch.full_like(sorted_ids, count))
    segment_end = torch.flip(torch.cummin(torch.flip(candidates, (0,)), 0).values, (0,))
    return sorted_ids, order, segment_end


def _check(ids: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.reshape(-1)
    dy = dy.reshape(ids.numel(), -1) if ids.numel() else dy.reshape(0, dy.shape[-1])
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_gradient: token ids must be int32 / int64, got {ids.dtype}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"row_gradient: gradient dtype must be fp32 / bf16 / fp16, got {dtype}")
    return ids.to(torch.int64), dy


def row_gradient(ids: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype,
                 padding_idx: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the T ids sorted, their gradient rows (T, width) in ``dtype``), with the Triton kernel.

    ``ids``: any shape, T elements; ``dy``: the embedding output's gradient, ``ids.shape + (width,)``."""
    ids, dy = _check(ids, dy, dtype)
    if not usable_for(dy):
        raise RuntimeError(f"row_gradient: tensors on {dy.device}; the Triton kernel needs CUDA or TRITON_INTERPRET=1 "
                           "(row_gradient_reference runs anywhere)")
    sorted_ids, order, segment_end = _sorted_segments(ids)
    count, width = dy.shape
    out = torch.empty((count, width), dtype=dtype, device=dy.device)
    if count == 0:
        return sorted_ids, out
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    block = min(1024 if not _DECORATED_FOR_INTERPRETER else 64, triton.next_power_of_2(width))
    grid = (count, triton.cdiv(width, block))
    _segment_sum_kernel[grid](sorted_ids, order, segment_end, dy, out, width, dy.stride(0), out.stride(0),
                              NO_PADDING if padding_idx is None else int(padding_idx),
                              HW_MATH=not _DECORATED_FOR_INTERPRETER, BLOCK=block,
                              num_warps=1 if _DECORATED_FOR_INTERPRETER else 4)
    return sorted_ids, out


def row_gradient_reference(ids: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype,
                           padding_idx: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of ``row_gradient`` in plain torch: each segment summed in fp32 in ascending position
    order (a sequential loop; the CPU ``index_add_`` does not promise an order)."""
    ids, dy = _check(ids, dy, dtype)
    sorted_ids, order, segment_end = _sorted_segments(ids)
    out = torch.empty((sorted_ids.numel(), dy.shape[1]), dtype=dtype, device=dy.device)
    ends = segment_end.tolist()
    start = 0
    while start < len(ends):
        end = ends[start]
        total = torch.zeros(dy.shape[1], dtype=torch.float32, device=dy.device)
        for j in range(start, end):
            total += dy[order[j]].float()
        if padding_idx is not None and int(sorted_ids[start]) == padding_idx:
            total.zero_()
        out[start:end] = total.to(dtype)
        start = end
    return sorted_ids, out


__all__ = ["row_gradient", "row_gradient_reference", "usable_for", "NO_PADDING"]
