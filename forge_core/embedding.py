"""The row-gradient embedding: an ``nn.Embedding`` whose backward hands its token ids and output
gradient to the optimizer instead of writing a dense ``.grad``.

Why: the dense gradient of a vocabulary embedding is a weight-sized tensor (Llama-3.1-8B: 128256 x
4096, 0.98 GiB in bf16) that is written in full (zeros, then the touched rows), read in full by the
optimizer and held from the backward's end to ``step()``, although a batch of T tokens touches at
most T of its rows. ``step()`` instead rebuilds the touched rows' gradient from what this backward
recorded (``forge_core.kernels.row_gradient``) and updates every row in one pass that reads the
touched rows' gradient through a slot table and equals the dense update
(``forge_core.kernels.row_update``, ``forge_core.dense.DenseWeight``). The rest of FORGE already never
forms G; with this, no weight-gradient tensor remains for a plain embedding either.

``ForgeEmbedding`` is installed the way ``ForgeLinear`` is: ``module.__class__`` changes in place
(``forge_core.fuse``), the module keeps its object, Parameter, hooks and name, and
``forge_core.unfuse`` turns it back. Only a plain ``nn.Embedding`` whose options leave the
gradient a plain sum of output-gradient rows qualifies: not ``sparse``, no ``max_norm`` (the forward
renormalises the weight in place), no ``scale_grad_by_freq``.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .module_copies import plain_module_reduction
from .traced import arguments_of, traced, update_embedding_rows_


class RowGradientSink(Protocol):
    """What the backward calls once per use: keep the ids and the output gradient for ``step()``."""

    def record_rows(self, ids: torch.Tensor, grad_output: torch.Tensor) -> None:
        ...


def row_gradient_unsupported(module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot record its gradient as rows, or None when it can."""
    if type(module) is not nn.Embedding:
        return f"not exactly nn.Embedding ({type(module).__name__})"
    if module.sparse:
        return "sparse=True (its gradient is already sparse)"
    if module.max_norm is not None:
        return "max_norm renormalises the weight inside the forward"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq scales rows by batch counts"
    return None


class RowGradientEmbeddingFunction(torch.autograd.Function):
    """``F.embedding(ids, W)`` whose backward records (ids, dY) and gives W no gradient."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int],
                sink: RowGradientSink) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.sink = sink
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        ctx.sink.record_rows(ids.detach(), grad_output.detach())
        return None, None, None, None


class TracedRowGradientEmbeddingFunction(torch.autograd.Function):
    """``RowGradientEmbeddingFunction`` as ``torch.compile`` traces it: the backward hands the ids and dY to
    the registered operator ``forge::update_embedding_rows_`` (``forge_core.traced``), which steps the
    embedding's rows there (one micro-batch per step) instead of in ``step()``."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int],
                scalars: Optional[torch.Tensor], key: int, *written: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids, weight, scalars, *written)
        ctx.key = key
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        ids, weight, scalars, *written = ctx.saved_tensors
        update_embedding_rows_(ids, grad_output.detach(), weight, list(written), scalars, ctx.key)
        return (None, None, None, None, None, *(None for _ in written))


class ForgeEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight gradient goes to ``forge_row_sink`` as rows. Without a sink,
    outside autograd or with a frozen weight it is exactly ``nn.Embedding``."""

    forge_row_sink: Optional[RowGradientSink]

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        sink = getattr(self, "forge_row_sink", None)
        weight = self.weight
        if sink is None or not torch.is_grad_enabled() or not weight.requires_grad:
            return super().forward(input)
        if traced(sink):
            return TracedRowGradientEmbeddingFunction.apply(input, weight, self.padding_idx, *arguments_of(sink))
        return RowGradientEmbeddingFunction.apply(input, weight, self.padding_idx, sink)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", forge_row_gradient=True"

    def __reduce_ex__(self, protocol: int) -> tuple:
        """A deep copy or pickle is a plain ``nn.Embedding`` with the same weight (``forge_core.module_copies``)."""
        return plain_module_reduction(self, nn.Embedding, protocol)


def install_forge_embedding(module: nn.Embedding, sink: RowGradientSink) -> None:
    """Turn ``module`` into a ForgeEmbedding in place (``row_gradient_unsupported`` must be None)."""
    reason = row_gradient_unsupported(module)
    if reason is not None:
        raise TypeError(f"this embedding cannot record row gradients: {reason}")
    module.__class__ = ForgeEmbedding
    module.forge_row_sink = sink


def remove_forge_embedding(module: nn.Module) -> None:
    """Turn a ForgeEmbedding back into a plain ``nn.Embedding`` (same object, same Parameter)."""
    if not isinstance(module, ForgeEmbedding):
        raise TypeError(f"not a ForgeEmbedding: {type(module).__name__}")
    module.__dict__.pop("forge_row_sink", None)
    module.__class__ = nn.Embedding


__all__ = ["ForgeEmbedding", "RowGradientEmbeddingFunction", "TracedRowGradientEmbeddingFunction", "install_forge_embedding", "remove_forge_embedding",
           "row_gradient_unsupported"]
