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


SELECTED_ONLY = {
    "sweep": "the larger differential sweep runs only when selected: pytest -m sweep",
    "slow": "a slow end-to-end test runs only when selected: make test-slow (CI runs it after make test)",
}
"""Markers whose tests run only when the marker expression names them: ``make test`` leaves them out (it stays
under 10 minutes on two cores); ``.ci/run`` runs ``make test-slow`` after it, never ``sweep``."""


def pytest_collection_modifyitems(config, items):
    """Skip the tests of each ``SELECTED_ONLY`` marker the marker expression (``-m``) does not name."""
    expression = config.getoption("markexpr") or ""
    for marker, reason in SELECTED_ONLY.items():
        if marker in expression:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
