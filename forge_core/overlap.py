"""Fused updates on a side CUDA stream, overlapping the rest of the backward (``fuse(..., overlap=True)``;
by default every update runs in line on the backward's stream, D102: the fork, join and ``record_stream``
cost an eager step more host time than the overlap buys it, and a replayed graph gains nothing from it).

Why one would: a fused update is memory-bound (it streams W and the moments once) and needs nothing from the
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

from .traced import in_traced_update

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_JOINS_QUEUED: set[tuple[int, int]] = set()        # (graph task id, backward stream id)
_STREAMS_BY_ID: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_FORK_EVENTS: dict[tuple[int, int, int], torch.cuda.Event] = {}
_MAX_CACHED_STREAMS = 256
_get_current_stream_ids = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_current_stream = getattr(torch._C, "_cuda_setStream", None)


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
    tensor and a running autograd backward (to join at its end), not a compiled model's update
    (``forge_core.traced``: no stream or event while a CUDA graph may be recorded)."""
    return (bool(getattr(updater, "overlap_updates", False)) and tensor.is_cuda
            and torch._C._current_graph_task_id() != -1 and not in_traced_update())


def run_beside(update: Callable[[], None], device: torch.device, used: Iterable[torch.Tensor]) -> None:
    """Run ``update`` (which launches GPU work) on the side stream of ``device`` after what the
    current stream has queued; keep ``used`` alive for it; join at the end of this backward.

    An eager Llama-8B backward is bound by the host, and this runs once per fused layer (226 times a
    step), so the eager path avoids the public stream API's per-call work (resolving the device,
    building Stream and Event objects: about 20 us a layer on the H100 hosts):
    the current stream comes from its ids through a cache, and the fork re-records one event per
    backward stream (a stream's wait orders after the event's record at the time of the wait, so a
    later record does not disturb an earlier wait). A graph capture runs the public API (it runs once)."""
    if _get_current_stream_ids is None or _set_current_stream is None or torch.cuda.is_current_stream_capturing():
        _run_beside_public(update, device, used)
        return
    ids = _get_current_stream_ids(device.index if device.index is not None else torch.cuda.current_device())
    main = _STREAMS_BY_ID.get(ids)
    if main is None:
        main = _cache_stream(ids)
    side = _SIDE_STREAMS.get(device) or side_stream(device)
    event = _FORK_EVENTS.get(ids)
    if event is None:
        event = _FORK_EVENTS[ids] = torch.cuda.Event()
    event.record(main)
    side.wait_event(event)
    _set_current_stream(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)
    try:
        update()
    finally:
        _set_current_stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
    _hold_until_join(main, side, used)


def run_update(updater: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor,
               grad_output: torch.Tensor) -> None:
    """``updater(x, grad_output)``, on the side stream where the updater asks for it (``wants_overlap``)."""
    if wants_overlap(updater, grad_output):
        # The update streams W and the moments once; the rest of the backward need not wait.
        run_beside(lambda: updater(x, grad_output), grad_output.device, (x, grad_output))
    else:
        updater(x, grad_output)


def run_update_outside_autograd(updater: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor,
                                grad_output: torch.Tensor) -> None:
    """``run_update`` outside autograd: a backward with ``create_graph=True`` runs with grad mode on, and the
    update is not differentiable; a plain backward has it off already (no context to enter)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            run_update(updater, x, grad_output)
    else:
        run_update(updater, x, grad_output)


def _cache_stream(ids: tuple[int, int, int]) -> torch.cuda.Stream:
    """The Stream object of ``ids`` (what ``torch.cuda.current_stream`` would build), kept: a process
    uses a bounded set of streams (the pools' and the default one)."""
    if len(_STREAMS_BY_ID) >= _MAX_CACHED_STREAMS:
        _STREAMS_BY_ID.clear()
        _FORK_EVENTS.clear()
    stream = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
    _STREAMS_BY_ID[ids] = stream
    return stream


def _run_beside_public(update: Callable[[], None], device: torch.device, used: Iterable[torch.Tensor]) -> None:
    """``run_beside`` through the public stream API: inside a graph capture (where the fork and the
    join become graph edges, once), or on a torch without the private stream calls."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    torch.cuda.set_stream(side)
    try:
        update()
    finally:
        torch.cuda.set_stream(main)
    _hold_until_join(main, side, used)


def _hold_until_join(main: torch.cuda.Stream, side: torch.cuda.Stream, used: Iterable[torch.Tensor]) -> None:
    """Mark ``used`` as read by ``side`` (the allocator then does not hand their blocks to ``main``
    before the side stream is past this point) and join the two at the end of this backward."""
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
