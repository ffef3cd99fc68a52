"""forge_bench: FORGE's benchmark harness (``forge-bench``).

Importing the package drops one warning that is not the harness's: torchao (a peer arm's package,
which transformers imports whenever it is installed, so in every process that builds a model) logs
"Failed to load .../torchao/_C_mxfp8...so" and "..._C_cutlass_90a...so" at import where its CUDA
extensions cannot load (a CPU torch, another CPython's build). Nothing here uses those extensions;
torchao's other warnings and every other logger are left as they are.
"""
from __future__ import annotations

import logging
import re

TORCHAO_EXTENSION_FAILURE = re.compile(r"Failed to load \S*torchao[/\\]_C[^/\\\s]*\.so: ")
"""What torchao logs when one of its compiled extensions does not load (``torchao/__init__.py``)."""


class TorchaoExtensionFilter(logging.Filter):
    """Drops torchao's "Failed to load <its extension>.so" records, and only those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not TORCHAO_EXTENSION_FAILURE.match(record.getMessage())


_torchao_logger = logging.getLogger("torchao")
if not any(isinstance(f, TorchaoExtensionFilter) for f in _torchao_logger.filters):
    _torchao_logger.addFilter(TorchaoExtensionFilter())
