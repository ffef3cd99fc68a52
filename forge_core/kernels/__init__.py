"""Kernels: the fused weight-gradient + optimizer step, and its plain-torch reference.

``fused_wgrad_update(x, dy, weight, state, hp, step, *, grad_accum=None,
stochastic_rounding=False, seed=0)`` updates ``weight`` and ``state`` in place with one optimizer
step on G = dY^T X without ever writing G to memory; ``reference_wgrad_update`` has the same
signature and materializes G (see docs/CONTRACTS.md). ``grouped_wgrad_update`` steps every expert
of a 3-D expert weight in one launch (``forge_core.experts``). The modules ``row_gradient`` and
``row_update`` step an embedding from the rows its batch touched (``forge_core.embedding``).

The modules, from the device up: ``device`` (where kernels run), ``codec`` (how tiles and states
are read and written), ``tile_kernel`` / ``tile_config`` (the Triton kernel and its tiles),
``hopper_ws_kernel`` / ``hopper_ws`` (the warp-specialized Gluon kernel), ``direct_launch`` and
``launch`` (plans and launches), ``layer_apply`` (a regime-2 rule's second pass: LAMB's W),
``tune_cache`` / ``ws_choice`` / ``tuning`` (which kernel and tile run a weight), ``dispatch``
(``fused_wgrad_update``), ``grouped_update`` (``grouped_wgrad_update``). Without Triton only the reference runs
and nothing of the Triton stack is imported.
"""
from __future__ import annotations

from typing import Any, Mapping

from .reference import reference_wgrad_update
from .tile_config import TileConfig

try:
    from .device import triton_available
    from .dispatch import fused_wgrad_update
    from .grouped_update import grouped_wgrad_update
    from .launch import NUM_SCALARS, launch_path_counts, launch_paths, reset_launch_paths
    from .tuning import (count_current_tune_cache_entries, describe_tuned_configs, rekey_tune_cache_entries,
                         tuned_configs)
except ImportError:  # pragma: no cover - a torch-only install without Triton
    from ..rules.base import KERNEL_SCALARS as NUM_SCALARS

    fused_wgrad_update = reference_wgrad_update
    grouped_wgrad_update = None         # each expert is stepped by the reference alone

    def triton_available() -> bool:
        """No Triton: the fused kernel cannot run here."""
        return False

    _NO_LAUNCHES = {"direct": 0, "jit": 0, "graph": 0, "recorded": 0}

    def launch_paths() -> dict[str, int]:
        """No Triton: no fused-kernel launch."""
        return {**_NO_LAUNCHES, "native": 0}

    def launch_path_counts() -> dict[str, int]:
        """No Triton: counts nothing reads."""
        return _NO_LAUNCHES

    def reset_launch_paths() -> None:
        """No Triton: nothing to reset."""

    def tuned_configs() -> dict[tuple, Any]:
        """No Triton: nothing is tuned."""
        return {}

    def describe_tuned_configs() -> dict[str, str]:
        """No Triton: nothing is tuned."""
        return {}

    def rekey_tune_cache_entries(entries: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """No Triton: the kernels' fingerprints cannot be computed."""
        raise RuntimeError("re-keying a tune cache needs Triton (the fingerprints hash the kernels' sources)")

    def count_current_tune_cache_entries(entries: Mapping[str, Any]) -> tuple[int, int]:
        """No Triton: the kernels' fingerprints cannot be computed."""
        raise RuntimeError("checking a tune cache needs Triton (the fingerprints hash the kernels' sources)")

__all__ = ["NUM_SCALARS", "TileConfig", "count_current_tune_cache_entries", "describe_tuned_configs",
           "fused_wgrad_update", "grouped_wgrad_update", "launch_path_counts", "launch_paths", "reference_wgrad_update", "rekey_tune_cache_entries",
           "reset_launch_paths", "triton_available", "tuned_configs"]
