"""FORGE under data parallelism: each fused weight's gradient is reduced across ranks before its update.

Each rank holds a replica and a slice of the global batch, so a fused layer's local
``G = dY^T X`` is a partial sum. A nonlinear rule (AdamW) must see the average over the ranks
(the paper's Proposition 3), so the gradient travels, but only through a bucket:

* **Bucket-transient** (any rule): the layer's backward writes ``G / N`` (cuBLAS, scaled in the
  same GEMM) into a slot of a bucket of ``bucket_cap_mb`` (DDP's bucket size) in the weight's dtype
  (what DDP reduces: the same bytes on the wire); a weight larger than the bucket is a bucket of its
  own. A full bucket is all-reduced asynchronously (``async_op=True``). When more than
  ``buckets_in_flight`` reductions are outstanding, the oldest is waited for, each of its slots
  updates its weight with the fused kernel's zero-token path (the slot as its accumulator input),
  and the bucket is dropped, its memory going back to the caching allocator for the next one. At
  the end of the backward (an autograd engine callback) the open bucket is sent and every reduction
  finished, so the weights are updated when ``backward()`` returns. The gradient memory is
  ``buckets_in_flight`` buckets (or the largest weight), whatever the model's size.
* **Momentum in place** (SGD with momentum, ``affine.py``): no bucket; the kernel writes each rank's
  share of the new momentum and the momentum buffer itself is all-reduced.

The updates run on the backward's stream after their reduction (the reduction itself overlaps the
backward), so every rank applies the same reduced gradient with the same deterministic kernel and
the replicas stay bit-identical. The fallback parameters (norms, biases, a dense ``.grad``) are
all-reduced in ``step()`` as DDP would (small ones coalesced up to a bucket); a row-gradient
embedding's rows (``forge_core.embedding``) are all-gathered instead, so its vocabulary-sized
gradient never exists on any rank.

Every rank must run every fused layer in every backward, in the same order (as DDP without
``find_unused_parameters``); the first backward checks that the order agrees across ranks.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..dense import DenseWeight, no_tokens
from ..fused_weight import FusedWeight
from ..optimizer import ForgeOptimizer
from .affine import MomentumReduction

SLOT_ALIGN_ELEMENTS = 64
"""Slots start at multiples of 64 elements (128 B in bf16): aligned loads for the kernel."""
_ORDER_HASH_MODULUS = (1 << 61) - 1


@dataclasses.dataclass
class Reduction:
    """One all-reduce in flight and what to do once it is done."""
    work: Any
    finish: Callable[[], None]


@dataclasses.dataclass
class OpenBucket:
    """The bucket being filled: its buffer, how much of it is used, and the (weight, slot) pairs."""
    buffer: torch.Tensor
    used: int = 0
    slots: list[tuple[FusedWeight, torch.Tensor]] = dataclasses.field(default_factory=list)


def _aligned(count: int) -> int:
    return -(-count // SLOT_ALIGN_ELEMENTS) * SLOT_ALIGN_ELEMENTS


def write_scaled_gradient(out: torch.Tensor, x: torch.Tensor, grad_output: torch.Tensor, scale: float) -> None:
    """``out = scale * dY^T X`` (``out`` weight-shaped), in one GEMM where the dtypes allow it."""
    dout, din = out.shape
    x2 = x.reshape(-1, din)
    dy2 = grad_output.reshape(-1, dout)
    if x2.dtype == out.dtype and dy2.dtype == out.dtype:
        out.addmm_(dy2.t(), x2, beta=0.0, alpha=scale)      # beta=0: the slot's old bytes are ignored
    else:                                                    # autocast inputs for fp32 weights
        out.copy_(torch.mm(dy2.t(), x2)).mul_(scale)


class RowGradient:
    """One weight's last micro-batch arriving in row blocks (``DataParallelUpdates.row_updates``),
    called as ``fused_weight.RowSliceUpdate`` is: ``(r0, r1, dy_rows, block_index, x=None)``."""

    mode = "update"       # what an expert weight reads to count its experts as updated

    def __init__(self, owner: "DataParallelUpdates", binding: FusedWeight, x: Optional[torch.Tensor]) -> None:
        self.owner, self.binding, self.x = owner, binding, x
        matrix = binding.matrix
        self.at_end_of_backward = hasattr(binding, "rows_left_out")       # an expert weight
        self.accumulator = binding.grad_accum
        if self.accumulator is not None:
            self.gradient = self.accumulator
        else:
            self.gradient = torch.zeros_like(matrix) if self.at_end_of_backward else torch.empty_like(matrix)
        self.covered = 0
        self.sent = False

    def __call__(self, r0: int, r1: int, dy_rows: torch.Tensor, block_index: int = 0,
                 x: Optional[torch.Tensor] = None) -> None:
        inputs = self.x if x is None else x
        target = self.gradient[int(r0):int(r1)]
        with torch.no_grad():
            if self.accumulator is not None:       # scaled by 1/N as a whole when sent
                target.addmm_(dy_rows.reshape(-1, target.shape[0]).t().float(),
                              inputs.reshape(-1, target.shape[1]).float())
            else:
                write_scaled_gradient(target, inputs, dy_rows, 1.0 / self.owner.world_size)
        self.covered += int(r1) - int(r0)
        if not self.at_end_of_backward and self.covered == self.gradient.shape[0]:
            self.send()

    def send(self) -> None:
        """All-reduce the gradient, then update the whole matrix from it (once)."""
        if self.sent:
            return
        self.sent = True
        binding, gradient = self.binding, self.gradient
        if self.accumulator is not None:
            gradient.mul_(1.0 / self.owner.world_size)
        self.owner.all_reduce(gradient, lambda: self.owner.update_from(binding, gradient,
                                                                       zero_after=self.accumulator is not None))
        experts = getattr(binding, "num_experts", None)
        if experts is not None:                # every row is updated from the reduced gradient
            binding.updated_experts.update(range(experts))


class DataParallelUpdates:
    """``ForgeOptimizer.distributed`` for data parallelism (see the module docstring).

    ``fused``: the optimizer's fused weights (in its order); ``state_reduction``: reduce SGD's momentum
    in place (``affine.py``) instead of the gradient."""

    def __init__(self, optimizer: ForgeOptimizer, fused: list[FusedWeight], process_group: Any,
                 bucket_cap_bytes: int, buckets_in_flight: int, state_reduction: bool) -> None:
        self.optimizer = optimizer
        self.fused = fused
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.buckets_in_flight = int(buckets_in_flight)
        self.momentum = MomentumReduction(optimizer, self.rank, self.world_size) if state_reduction else None
        self.pending: collections.deque[Reduction] = collections.deque()
        self.open: dict[tuple[torch.dtype, torch.device], OpenBucket] = {}
        self.open_rows: list[RowGradient] = []      # expert weights' gradients, sent at the end of the backward
        self._callbacks_queued: set[int] = set()
        self._order: Optional[list[int]] = []     # fused weights in reduction order, first backward only
        self.reductions_started = 0
        """All-reduces launched for fused weights (tests and the harness read it)."""

    # -- the backward side -------------------------------------------------------------------

    def fused_backward(self, binding: FusedWeight, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """The last micro-batch of ``binding`` (``DistributedUpdates``): into a bucket, or the
        momentum share, and on its way to the all-reduce."""
        self._at_end_of_backward()
        self._record_order(binding)
        if self.momentum is not None:
            buffer = self.momentum.write_share(binding, x, grad_output)
            self.all_reduce(buffer, lambda: self.momentum.step_weight(binding))
            return
        weight = binding.matrix
        if binding.grad_accum is not None:
            # Accumulation: the fp32 accumulator holds micro-batches 1..k-1; add the last and reduce it
            # in place (it exists anyway: no bucket needed), then update from it.
            accumulator = binding.grad_accum
            dout, din = weight.shape
            accumulator.addmm_(grad_output.reshape(-1, dout).t().float(), x.reshape(-1, din).float())
            accumulator.mul_(1.0 / self.world_size)
            self.all_reduce(accumulator, lambda: self.update_from(binding, accumulator, zero_after=True))
            return
        slot, bucket_key = self._slot(binding)
        write_scaled_gradient(slot, x, grad_output, 1.0 / self.world_size)
        if bucket_key is None:                                       # a bucket of its own: send it now
            self.all_reduce(slot, lambda: self.update_from(binding, slot))
        elif self.open[bucket_key].used >= self.open[bucket_key].buffer.numel():
            self._send(bucket_key)

    def row_updates(self, binding: FusedWeight, x: Optional[torch.Tensor]) -> "RowGradient":
        """The last micro-batch of ``binding`` in row blocks: an LM head's vocab chunks (the chunked
        loss), or the experts of a 3-D expert weight, each block with its own tokens. The rows go into
        one gradient of the weight's matrix (the accumulator when there is one); it is reduced once
        every row has arrived (an LM head: every rank sends it at the same point) or, for expert
        weights, whose experts some ranks' tokens may not reach, at the end of the backward; then the
        whole matrix is updated from it (a row no rank reached gets the zero-gradient step, as torch's
        AdamW steps the whole 3-D Parameter). SGD's momentum takes this path too (no share kernel per
        block)."""
        self._at_end_of_backward()
        self._record_order(binding)
        rows = RowGradient(self, binding, x)
        if rows.at_end_of_backward:
            self.open_rows.append(rows)
        return rows

    def _slot(self, binding: FusedWeight) -> tuple[torch.Tensor, Optional[tuple[torch.dtype, torch.device]]]:
        """Where ``binding``'s gradient goes, and the key of its open bucket: a slot of the open bucket
        of its dtype (sending the bucket first when the slot does not fit), or a tensor of its own
        (key None) when it is larger than a bucket."""
        weight = binding.matrix
        numel = weight.numel()
        capacity = self.bucket_cap_bytes // weight.element_size()
        if numel > capacity:
            return torch.empty_like(weight), None
        key = (weight.dtype, weight.device)
        bucket = self.open.get(key)
        if bucket is not None and bucket.used + numel > bucket.buffer.numel():
            self._send(key)
            bucket = None
        if bucket is None:
            bucket = self.open[key] = OpenBucket(torch.empty(capacity, dtype=weight.dtype, device=weight.device))
        slot = bucket.buffer[bucket.used:bucket.used + numel].view(weight.shape)
        bucket.slots.append((binding, slot))
        bucket.used = min(_aligned(bucket.used + numel), bucket.buffer.numel())
        return slot, key

    def _send(self, key: tuple[torch.dtype, torch.device]) -> None:
        """All-reduce the open bucket of ``key`` (only its used part)."""
        bucket = self.open.pop(key, None)
        if bucket is None or not bucket.slots:
            return
        slots = bucket.slots

        def finish() -> None:
            for binding, slot in slots:
                self.update_from(binding, slot)
        self.all_reduce(bucket.buffer[:bucket.used], finish)

    def all_reduce(self, tensor: torch.Tensor, finish: Callable[[], None]) -> None:
        """Sum ``tensor`` over the ranks asynchronously; ``finish`` once it is done, when more than
        ``buckets_in_flight`` reductions are outstanding or at the end of the backward."""
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.reductions_started += 1
        self.pending.append(Reduction(work, finish))
        while len(self.pending) > self.buckets_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        reduction = self.pending.popleft()
        reduction.work.wait()
        reduction.finish()

    def update_from(self, binding: FusedWeight, gradient: torch.Tensor, zero_after: bool = False) -> None:
        self.optimizer.apply_gradient(binding, gradient)
        if zero_after:
            gradient.zero_()

    def finish_all(self) -> None:
        """Send the open buckets and row gradients, finish every reduction (the end of a backward, or
        ``step()``)."""
        for key in list(self.open):
            self._send(key)
        for rows in self.open_rows:
            rows.send()
        self.open_rows = []
        while self.pending:
            self._finish_oldest()
        if self._order:
            self._check_order()

    def _at_end_of_backward(self) -> None:
        """Queue ``finish_all`` once per backward (autograd engine callback, as DDP finalizes)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._callbacks_queued:
            return
        self._callbacks_queued.add(task)

        def at_end() -> None:
            self._callbacks_queued.discard(task)
            self.finish_all()
        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    def _record_order(self, binding: FusedWeight) -> None:
        if self._order is not None:
            self._order.append(binding.index)

    def _check_order(self) -> None:
        """After the first backward: every rank reduced the same fused weights in the same order
        (else buckets would sum different layers); a one-line error on every rank otherwise."""
        order, self._order = self._order, None
        digest = 17
        for index in order:
            digest = (digest * 1_000_003 + index + 1) % _ORDER_HASH_MODULUS
        device = self._collective_device()
        spread = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.group)
        if int(spread[0]) != -int(spread[1]):
            raise RuntimeError("data parallel: the ranks ran their fused layers in different orders or numbers in "
                               "one backward; every rank must run every fused layer once per micro-batch")

    def _collective_device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- the step side ----------------------------------------------------------------------

    def before_step(self) -> None:
        """``step()`` first: finish what the backward left (an accumulation flushed early included),
        then average the fallback gradients and gather the embedding rows."""
        self.finish_all()
        self._reduce_partial_accumulations()
        self._reduce_fallback_gradients()
        for dense in self.optimizer.dense_weights():
            if dense.records_rows and dense.recorded_rows:
                self._gather_rows(dense)

    def _reduce_partial_accumulations(self) -> None:
        """``step()`` after fewer than ``accumulate_steps`` backwards: reduce what was accumulated
        and update from it, as the local path would update from the accumulator alone."""
        steps = self.optimizer.accumulate_steps
        for binding in self.fused:
            if 0 < binding.micro_batches < steps:
                accumulator = binding.grad_accum
                if self.momentum is not None:
                    buffer = self.momentum.write_share(binding, *no_tokens(binding.matrix, binding.matrix.shape[0]))
                    dist.all_reduce(buffer, group=self.group)
                    self.momentum.step_weight(binding)
                else:
                    accumulator.mul_(1.0 / self.world_size)
                    dist.all_reduce(accumulator, group=self.group)
                    self.update_from(binding, accumulator, zero_after=True)
                binding.micro_batches = steps

    def _reduce_fallback_gradients(self) -> None:
        """All-reduce (average) every fallback parameter's ``.grad``: small ones coalesced into one
        flat tensor up to a bucket, larger ones in place; all in flight at once."""
        grads = [p.grad for p in self.optimizer.fallback_parameters() if p.grad is not None]
        scale = 1.0 / self.world_size
        works: list[tuple[Any, Optional[list[torch.Tensor]], torch.Tensor]] = []
        batch: list[torch.Tensor] = []
        batch_bytes = 0

        def send_batch() -> None:
            nonlocal batch, batch_bytes
            if batch:
                flat = torch.cat([g.reshape(-1) for g in batch]).mul_(scale)
                works.append((dist.all_reduce(flat, group=self.group, async_op=True), batch, flat))
            batch, batch_bytes = [], 0

        for grad in grads:
            size = grad.numel() * grad.element_size()
            if grad.is_sparse:
                raise RuntimeError("data parallel: a sparse gradient (nn.Embedding(sparse=True)) is not supported")
            if size > self.bucket_cap_bytes or not grad.is_contiguous():
                if not grad.is_contiguous():
                    raise RuntimeError("data parallel: a fallback gradient is not contiguous")
                grad.mul_(scale)
                works.append((dist.all_reduce(grad, group=self.group, async_op=True), None, grad))
                continue
            if batch and (batch[0].dtype != grad.dtype or batch_bytes + size > self.bucket_cap_bytes):
                send_batch()
            batch.append(grad)
            batch_bytes += size
        send_batch()
        for work, members, flat in works:
            work.wait()
            if members is not None:
                offset = 0
                for grad in members:
                    grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()

    def _gather_rows(self, dense: DenseWeight) -> None:
        """Replace a row-gradient embedding's recorded (ids, dY) by every rank's, rank after rank
        (dY scaled by 1/N): ``step()`` then sums each id's rows in that order on every rank, the
        global batch's order, so the replicas stay equal and no vocabulary-sized gradient exists."""
        ids = torch.cat([r[0] for r in dense.recorded_rows])
        grad_output = torch.cat([r[1] for r in dense.recorded_rows])
        sizes = torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)
        every_size = [torch.zeros_like(sizes) for _ in range(self.world_size)]
        dist.all_gather(every_size, sizes, group=self.group)
        counts = [int(s) for s in every_size]
        longest = max(counts)
        if longest != ids.numel():
            ids = torch.cat([ids, ids.new_zeros(longest - ids.numel())])
            grad_output = torch.cat([grad_output, grad_output.new_zeros(longest - grad_output.shape[0],
                                                                        grad_output.shape[1])])
        id_parts = [torch.empty_like(ids) for _ in range(self.world_size)]
        row_parts = [torch.empty_like(grad_output) for _ in range(self.world_size)]
        dist.all_gather(id_parts, ids.contiguous(), group=self.group)
        dist.all_gather(row_parts, grad_output.contiguous(), group=self.group)
        all_ids, all_rows = torch.cat(id_parts), torch.cat(row_parts)
        if any(count != longest for count in counts):
            keep = torch.cat([torch.arange(r * longest, r * longest + count, device=ids.device)
                              for r, count in enumerate(counts)])
            all_ids, all_rows = all_ids[keep], all_rows[keep]
        dense.recorded_rows = [(all_ids, all_rows.mul_(1.0 / self.world_size))]


__all__ = ["DataParallelUpdates", "RowGradient", "write_scaled_gradient", "SLOT_ALIGN_ELEMENTS"]
