"""Units every row and report shares: memory is in GiB (2^30 bytes), as ``torch.cuda.max_memory_allocated()``
is read and as the paper's tables give it."""

GIB = float(2 ** 30)
"""Bytes in one GiB."""

__all__ = ["GIB"]
