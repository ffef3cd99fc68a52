"""Fused updates on a side CUDA stream, overlapping the rest of the backward.

Why: a fused update is memory-bound (it streams W and the moments once) and needs nothing from the
layers whose backward comes after it; the backward's own kernels (dX GEMMs, attention, norms) are
mostly compute- or latency-bound and at small batch leave much of the GPU idle. Launched on one
side stream, layer L's update runs while the main stream goes on with layer L-1's backward.

Ordering, and why it is safe:

* fork: the side stream waits for everything already queued on the backward's stream, so the
  update starts after ``dX = dY W`` read the pre-update weight, and after ``x`` and ``dY`` exist;
* the activations the update reads are marked as used by the side stream (``record_stream``), so
  the caching allocator does not hand their memory to the main stream before the update is done;
* join: at the end of the backward pass (an autograd engine final callback, registered once per
  backward) the backward's stream waits for the side stream, so ``opt.step()``, the next forward
  and anything the user does after ``backward()`` see updated weights. Inside a CUDA graph capture
  the fork and the join are captured as graph edges.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_JOINS_QUEUED: set[tuple[int, int]] = set()        # (graph task id, backward stream id)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one update stream of ``device`` (created on first use, outside any graph capture: the
    eager warm-up steps before a capture create it)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)
        _SIDE_STREAMS[device] = stream
    return stream


def wants_overlap(updater: object, tensor: torch.Tensor) -> bool:
    """Whether ``updater`` (a FusedWeight) asked for the side stream and can have it here: a CUDA
    tensor and a running autograd backward (to join at its end)."""
    return (bool(getattr(updater, "overlap_updates", False)) and tensor.is_cuda
            and torch._C._current_graph_task_id() != -1)


def run_beside(update: Callable[[], None], device: torch.device, used: Iterable[torch.Tensor]) -> None:
    """Run ``update`` (which launches GPU work) on the side stream of ``device`` after what the
    current stream has queued; keep ``used`` alive for it; join at the end of this backward."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    # set_stream and back rather than ``with torch.cuda.stream(side)``: the context manager looks the
    # current streams up again and handles a change of device, which cannot happen here (autograd
    # runs a CUDA backward on its device's thread), at a host cost paid once per fused layer.
    torch.cuda.set_stream(side)
    try:
        update()
    finally:
        torch.cuda.set_stream(main)
    for tensor in used:
        tensor.record_stream(side)
    _queue_join(main, side)


def _queue_join(main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    key = (torch._C._current_graph_task_id(), main.stream_id)
    if key in _JOINS_QUEUED:
        return
    _JOINS_QUEUED.add(key)

    def join() -> None:
        _JOINS_QUEUED.discard(key)
        main.wait_stream(side)

    torch.autograd.Variable._execution_engine.queue_callback(join)
