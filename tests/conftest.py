"""Shared test setup: without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` decorates any kernel, i.e. before anything
imports forge_core, which is why it happens here at conftest import time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Decorate every kernel now, while the variable is set: a test that unsets it for its own cell
# (test_cell's suite fixture) would otherwise be the first to import forge_core.lean's kernels,
# decorate them for the GPU, and a later test in the same process would run them in a half-set-up
# interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel"; seen running
# tests/test_cell.py alone).
import forge_core.kernels.dispatch  # noqa: E402,F401
import forge_core.kernels.rowwise  # noqa: E402,F401
import forge_core.lm_head_loss  # noqa: E402,F401


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_gpu_claims(tmp_path_factory, monkeypatch):
    """Each test claims ``--gpus`` lanes in a folder of its own (``forge_bench.lanes.GpuClaims``):
    tests running at once in other pytest workers must not wait on, or count, each other's cells."""
    monkeypatch.setenv("FORGE_BENCH_GPU_LOCK_DIR", str(tmp_path_factory.mktemp("gpu-claims")))


def pytest_collection_modifyitems(config, items):
    """``sweep`` tests run only when the marker expression names them (``pytest -m sweep``): ``make test``
    and CI leave them out."""
    if "sweep" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the larger differential sweep runs only when selected: pytest -m sweep")
    for item in items:
        if "sweep" in item.keywords:
            item.add_marker(skip)
