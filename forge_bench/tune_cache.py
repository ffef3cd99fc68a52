"""``forge-bench tune-cache``: check a ``FORGE_TUNE_CACHE`` file against this tree's kernel, re-key
its tile choices to it, or ship them with the package.

Why: every entry of a tune cache is keyed by a fingerprint of the kernel's source, so any change to
the kernel makes the new tree tune again, and the tuner's pick among candidates a few percent apart
moves between runs: an old-vs-new step A/B (``scripts/step_ab.sh``) would then measure the tuner as
well as the code. ``rekey`` writes the same choices under the fingerprints this tree computes (each
entry keeps its own Triton version and GPU name); ``check`` counts the entries this tree accepts
(a GPU CI baseline's cache must match the tree it checks). A re-keyed file is for A/Bs, not a
tuning result: its tiles are the other kernel's choices.

``ship`` adds caches' entries, re-keyed and with their CUDA device index made 0, to the package's
per-GPU-model files (``forge_core/tune_caches/<gpu>.json``): a first step on a shipped shape then
starts without tuning (40-80 s for an 8B model otherwise). ``tests/test_tune_cache.py`` keeps every
shipped entry current: a kernel change re-ships them (``ship`` on the shipped files themselves).

The fingerprints are forge_core's (``forge_core.kernels.rekey_tune_cache_entries`` and
``count_current_tune_cache_entries``); this module reads and writes the file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forge_core import kernels
from forge_core.kernels import tune_cache
from forge_core.kernels.tune_cache import SHIPPED_DIR, portable_key, shipped_file_name


class TuneCacheError(ValueError):
    """A file that is not a tune cache, or one that cannot be written; the message is one line."""


def read_cache(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the whole file, its entries); TuneCacheError naming the file when it is not a tune cache."""
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TuneCacheError(f"{path} is not a tune cache ({type(exc).__name__}: {exc})") from None
    if not isinstance(entries, dict):
        raise TuneCacheError(f"{path} is not a tune cache ('entries' is a {type(entries).__name__}, not a mapping)")
    return data, entries


def check(path: Path) -> tuple[int, int]:
    """(entries this tree's kernel accepts, all entries) of the tune cache at ``path``."""
    _, entries = read_cache(path)
    current, total = kernels.count_current_tune_cache_entries(entries)
    return int(current), int(total)


def _rekeyed(source: Path, entries: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``kernels.rekey_tune_cache_entries``, its error as one line naming the file."""
    try:
        return kernels.rekey_tune_cache_entries(entries)
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TuneCacheError(f"{source}: {first}") from None


def rekey(source: Path, target: Path) -> tuple[int, int]:
    """Write ``source``'s entries under this tree's fingerprints to ``target`` (atomically, in the
    source's format version); returns (entries written, keys that changed)."""
    data, entries = read_cache(source)
    rekeyed, changed = _rekeyed(source, entries)
    _write(target, rekeyed, {key: value for key, value in data.items() if key != "entries"})
    return len(rekeyed), int(changed)


def _write(target: Path, entries: dict[str, Any], header: dict[str, Any] | None = None) -> None:
    """forge_core's atomic tune-cache write, its OSError as one line naming the file."""
    try:
        tune_cache.write(target, entries, header)
    except OSError as exc:
        raise TuneCacheError(f"cannot write {target}: {exc}") from None


def ship(sources: list[Path], folder: Path = SHIPPED_DIR) -> dict[Path, tuple[int, int]]:
    """Add the sources' entries, re-keyed to this tree with portable keys, to ``folder``'s file of
    each entry's GPU model (an entry of a later source replaces the same key's earlier one).
    Returns per file written: (entries added or replaced, entries in the file now)."""
    by_file: dict[Path, dict[str, Any]] = {}
    for source in sources:
        rekeyed, _ = _rekeyed(source, read_cache(source)[1])
        for key, entry in rekeyed.items():
            device = entry.get("device") if isinstance(entry, dict) else None
            if not isinstance(device, str) or not device:
                raise TuneCacheError(f"{source}: entry {key!r} names no device")
            by_file.setdefault(folder / shipped_file_name(device), {})[portable_key(key)] = entry
    written = {}
    for target, added in by_file.items():
        current = read_cache(target)[1] if target.exists() else {}
        merged = {**current, **added}
        _write(target, merged)
        written[target] = (len(added), len(merged))
    return written
