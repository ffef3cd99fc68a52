"""An eager fused update replayed from a CUDA graph of itself (``FORGE_UPDATE_GRAPHS=0`` turns it off).

Why: an eager step at batch 1 is bound by the host, and each fused layer's update costs it the Python
from the backward hook down to Triton's launcher (``ForgeOptimizer.fused_backward``, the plan lookup, the
arguments, the launch): ~80 us a layer inside real ViT-L/16 steps on the H200, where torch's own dW
GEMM costs its C++ node a few. Once a layer's update has been seen twice with its inputs at the same
addresses (the caching allocator hands a steady training loop the same blocks every step), the
update is recorded into a one-layer CUDA graph and every later update with the same inputs replays
it: one graph launch, nothing else.

What makes a replay the same update: the graph holds the inputs' addresses, shapes and strides (the
key), the weight's address (also in the key) and its states', the launch plan (its tile, its kernel)
and the address of the group's device scalars, which the kernel reads at every replay: the optimizer
runs in device mode once it records (``TracedUpdates.enter_device_mode``: the step count and the rule's
scalars in device tensors, rewritten by ``step()`` and when a hyper-parameter changes), so an lr
schedule reaches a replayed update as it reaches a launched one. Everything else (gradient
accumulation, data parallel, the side stream, stochastic rounding, a whole-step graph being captured
around it) keeps the launched path; ``ForgeOptimizer.fused_backward`` decides. On CUDA weights the C++
backward hook (``forge_core.native_hooks``), and under ``torch.compile`` the update operator's C++ kernel, replay
the recordings themselves, without Python; ``list_natively`` hands each one to them.

Small inputs are staged: one of at most ``STAGED_BYTES`` (the caching allocator's small-pool limit) is
copied into a staging buffer the recording reads, and its address leaves the key. The small pool's blocks
move whenever a loop keeps a tensor per step (each step's loss, for logging without a sync), so such an
input's address rarely repeats: without staging, 19 of Llama-3.2-1B's 32 k and v projection updates
(512 KiB gradients) were launched at every step under ``torch.compile`` (D121). A copy costs a few
microseconds where a launch costs ~80; larger inputs come from the large pool, whose blocks a steady loop
gets back every step.
"""
from __future__ import annotations

import collections
import os
from typing import Any, Callable, Optional, Protocol

import torch

UPDATE_GRAPHS = os.environ.get("FORGE_UPDATE_GRAPHS", "1") != "0"
"""Whether eager fused updates may replay recorded graphs; read once at import (a test may set it)."""
GRAPHS_PER_WEIGHT = 2
"""Recorded graphs kept per weight (two input placements that alternate, e.g. two sequence lengths);
a third placement that repeats replaces the oldest."""
RECENT_PLACEMENTS = 4
"""Launched placements of one weight remembered: one that comes back among them is recorded."""
RECORDINGS_WITHOUT_REPLAY = 8
"""Recordings of one weight that found no replay before it stops recording: inputs whose addresses
repeat once and then move (a loop whose allocations drift) would otherwise pay a recording per step.
A replay by the C++ side counts as one: a loop that keeps each step's loss moves a small gradient's
block now and then (Llama-3.2-1B's k and v projections, 512 KiB), and each move costs one recording."""


def staged_bytes(setting: Optional[str]) -> int:
    """The staging limit ``FORGE_STAGED_BYTES`` sets (1 MiB where unset); a one-line error for anything but a
    byte count."""
    if setting is None or setting == "":
        return 1 << 20
    if not setting.strip().isdigit():
        raise ValueError(f"FORGE_STAGED_BYTES={setting!r} is not a byte count (an integer >= 0; 0 stages nothing)")
    return int(setting)


STAGED_BYTES = staged_bytes(os.environ.get("FORGE_STAGED_BYTES"))
"""Inputs of at most this many bytes (contiguous ones) are copied into a staging buffer that their recordings
read, so their address is not part of the key (the module docstring says why); 0 (``FORGE_STAGED_BYTES=0``)
stages nothing."""
_STAGING: dict[tuple, torch.Tensor] = {}
"""The staging buffers, by (device, stream, operand): the updates on one stream run one after the other, so
every weight's recordings share them."""


def staged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` reaches a recording through a staging buffer (``STAGED_BYTES``)."""
    return tensor.is_contiguous() and tensor.numel() * tensor.element_size() <= STAGED_BYTES


def _stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _staging_view(tensor: torch.Tensor, stream: int, operand: int) -> torch.Tensor:
    """The part of the staging buffer of ``(tensor.device, stream, operand)`` laid out as ``tensor``."""
    buffer = _STAGING.get((tensor.device, stream, operand))
    if buffer is None:
        buffer = _STAGING[(tensor.device, stream, operand)] = torch.empty(STAGED_BYTES, dtype=torch.uint8,
                                                                          device=tensor.device)
    return buffer[:tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)


class Replay(Protocol):
    """A recorded update: ``replay()`` enqueues it on the current stream."""

    def replay(self) -> None: ...


Recorder = Callable[[Callable[[], None], torch.device], Optional[Replay]]
"""Records ``update()`` (GPU work only) on ``device``; None where it cannot be recorded."""

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def record_cuda_graph(update: Callable[[], None], device: torch.device) -> Optional[Replay]:
    """``update`` recorded as a CUDA graph (not run), or None when its work cannot be captured (it then
    runs launched, as it would have). Captured on a stream of its own, in thread-local mode: the
    autograd engine's thread records while the main thread waits in ``backward()``."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            update()
        except BaseException as error:
            _end_capture_quietly(graph)
            if isinstance(error, RuntimeError):     # work a graph cannot hold (a sync, a host read)
                return None
            raise
        try:
            graph.capture_end()
        except RuntimeError:
            return None
    return graph


def _end_capture_quietly(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture whose work failed, so the stream records nothing more (its own error is the update's)."""
    try:
        graph.capture_end()
    except RuntimeError:
        pass


class UpdateGraphs:
    """One fused weight's recorded updates, by where their inputs lie (see the module docstring)."""

    def __init__(self, counts: dict[str, int], recorder: Recorder = record_cuda_graph) -> None:
        self.counts = counts
        """Launch counts by path, shared (``kernels.launch_path_counts``): a replay counts as ``graph``, a
        recording (replayed once) as ``graph`` and ``recorded``."""
        self.recorder = recorder
        self.native: Optional[Any] = None
        """The weight's C++ hook side (``forge_core.native_hooks``, set by ``use_native``), which replays the
        recordings listed here without Python; None where the Python hook runs."""
        self.graphs: dict[tuple, Replay] = {}
        self.staging: dict[tuple, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = {}
        """Per recording: the staging views it reads in place of (x, grad_output) (None: the input itself), in
        the buffers of the stream its key ends with."""
        self._native_ids: dict[tuple, int] = {}
        self._next_native_id = 1
        self.recent_keys: collections.deque[tuple] = collections.deque(maxlen=RECENT_PLACEMENTS)
        self.recordings_unreplayed = 0
        self._native_replays_seen = 0
        self.stopped = False

    @staticmethod
    def key(x: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor) -> tuple:
        """Where an update's inputs and weight lie and how they are laid out: what a graph holds fixed. A staged
        input's place is its stream's staging buffer: the key holds the stream instead of its address."""
        x_staged, grad_staged = staged(x), staged(grad_output)
        stream = _stream_handle(x.device) if x_staged or grad_staged else None
        return (None if x_staged else x.data_ptr(), None if grad_staged else grad_output.data_ptr(),
                weight.data_ptr(), x.shape, x.stride(), grad_output.shape, grad_output.stride(), x.dtype,
                grad_output.dtype, stream)

    def replay(self, key: tuple, x: torch.Tensor, grad_output: torch.Tensor) -> bool:
        """Replay the graph recorded for ``key`` on ``(x, grad_output)`` (their key); False when there is none."""
        graph = self.graphs.get(key)
        if graph is None:
            return False
        self._stage(key, x, grad_output)
        graph.replay()
        self.counts["graph"] += 1
        self.recordings_unreplayed = 0
        return True

    def wants_recording(self, key: tuple) -> bool:
        """Whether to record this update: its key is one of the weight's last ``RECENT_PLACEMENTS`` launched
        updates' (else it is remembered, and the update runs launched). Not only the previous update's: inputs
        that alternate between two places (a loop that keeps each step's loss moves a small gradient's block
        back and forth) would never be recorded."""
        if self.stopped:
            return False
        if key in self.recent_keys:
            return True
        self.recent_keys.append(key)
        return False

    def record_and_replay(self, key: tuple, update: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor,
                          grad_output: torch.Tensor) -> bool:
        """Record ``update`` of ``(x, grad_output)`` (their key; staged ones read from their staging buffer) and
        replay it once (the update of this call); False, with nothing run, when it cannot be recorded
        (recording then stops for this weight)."""
        stream = key[-1]
        x_view = _staging_view(x, stream, 0) if key[0] is None else None
        grad_view = _staging_view(grad_output, stream, 1) if key[1] is None else None
        read = (x if x_view is None else x_view, grad_output if grad_view is None else grad_view)
        graph = self.recorder(lambda: update(*read), x.device)
        if graph is None:
            self.stopped = True
            return False
        if self.native is not None and self.native.replays != self._native_replays_seen:
            self._native_replays_seen = self.native.replays     # replayed without Python since the last recording
            self.recordings_unreplayed = 0
        self.recordings_unreplayed += 1
        if self.recordings_unreplayed > RECORDINGS_WITHOUT_REPLAY:
            self.stopped = True
        if len(self.graphs) >= GRAPHS_PER_WEIGHT:
            self._forget(next(iter(self.graphs)))
        self.graphs[key] = graph
        self.staging[key] = (x_view, grad_view)
        self._stage(key, x, grad_output)
        graph.replay()
        self.counts["graph"] += 1
        self.counts["recorded"] += 1
        return True

    def _stage(self, key: tuple, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """Copy the staged ones of ``(x, grad_output)`` where the recording of ``key`` reads them."""
        x_view, grad_view = self.staging[key]
        with torch.no_grad():
            if x_view is not None:
                x_view.copy_(x)
            if grad_view is not None:
                grad_view.copy_(grad_output)

    def use_native(self, slot: Any) -> None:
        """Hand this weight's recordings to ``slot`` (a C++ hook's side) from now on: each is listed there at its
        next Python replay (``list_natively``), those listed on an earlier slot too."""
        if self.native is not None and self.native is not slot:
            self.native.clear()             # a hook still holding the old slot launches nothing this may free
        self.native = slot
        self._native_ids.clear()
        self._native_replays_seen = slot.replays

    def _forget(self, key: tuple) -> None:
        native_id = self._native_ids.pop(key, None)
        if native_id is not None:           # before the graph (and its exec handle) can be freed
            self.native.remove(native_id)
        del self.graphs[key]
        del self.staging[key]

    def list_natively(self, key: tuple, x: torch.Tensor, grad_output: torch.Tensor, written: list[torch.Tensor],
                      scalars: Optional[torch.Tensor]) -> None:
        """Hand the recording of ``key`` (the update of ``x``, ``grad_output``, writing ``written`` and reading
        ``scalars``) to the C++ hook, where there is one: a CUDA graph by its exec handle, anything else (a
        test's stand-in) as its Python ``replay``."""
        graph = self.graphs.get(key)
        if self.native is None or graph is None or key in self._native_ids:
            return
        native_id = self._next_native_id
        self._next_native_id += 1
        x_view, grad_view = self.staging[key]
        staging = {"staged_first": x_view, "staged_second": grad_view, "stream": key[-1] or 0}
        if isinstance(graph, torch.cuda.CUDAGraph):
            self.native.add(native_id, x, grad_output, graph.raw_cuda_graph_exec(), None, written, scalars, **staging)
        else:
            self.native.add(native_id, x, grad_output, 0, graph.replay, written, scalars, **staging)
        self._native_ids[key] = native_id

    def clear(self) -> None:
        """Forget every recording (the states were replaced, or the weight's plan may change)."""
        if self.native is not None:         # before the graphs (and their exec handles) can be freed
            self.native.clear()
        self._native_ids.clear()
        self.graphs.clear()
        self.staging.clear()
        self.recent_keys.clear()
        self.recordings_unreplayed = 0
        self.stopped = False


def replay_problem(enabled: bool, backend: str, device_scalars_problem: Optional[str],
                   devices: set[Any]) -> Optional[str]:
    """Why an optimizer's eager updates cannot replay recorded graphs, in one line; None when they can."""
    if not enabled:
        return "FORGE_UPDATE_GRAPHS=0"
    if device_scalars_problem is not None:
        return device_scalars_problem
    if backend != "triton":
        return f"backend {backend!r} launches no kernel to record"
    if any(getattr(device, "type", None) != "cuda" for device in devices):
        return "CUDA graphs need the fused weights on a CUDA device"
    return None


__all__ = ["UPDATE_GRAPHS", "GRAPHS_PER_WEIGHT", "RECORDINGS_WITHOUT_REPLAY", "STAGED_BYTES", "UpdateGraphs",
           "record_cuda_graph", "replay_problem", "staged", "staged_bytes", "Replay", "Recorder"]
