"""``forge-bench tune-cache``: check a ``FORGE_TUNE_CACHE`` file against this tree's kernel, or re-key
its tile choices to it.

Why: every entry of a tune cache is keyed by a fingerprint of the kernel's source, so any change to
the kernel makes the new tree tune again, and the tuner's pick among candidates a few percent apart
moves between runs: an old-vs-new step A/B (``scripts/step_ab.sh``) would then measure the tuner as
well as the code. ``rekey`` writes the same choices under the fingerprints this tree computes (each
entry keeps its own Triton version and GPU name); ``check`` counts the entries this tree accepts
(a GPU CI baseline's cache must match the tree it checks). A re-keyed file is for A/Bs, not a
tuning result: its tiles are the other kernel's choices.

The fingerprints are forge_core's (``forge_core.kernels.rekey_tune_cache_entries`` and
``count_current_tune_cache_entries``); this module reads and writes the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from forge_core import kernels


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


def rekey(source: Path, target: Path) -> tuple[int, int]:
    """Write ``source``'s entries under this tree's fingerprints to ``target`` (atomically, in the
    source's format version); returns (entries written, keys that changed)."""
    data, entries = read_cache(source)
    try:
        rekeyed, changed = kernels.rekey_tune_cache_entries(entries)
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TuneCacheError(f"{source}: {first}") from None
    body = json.dumps({**data, "entries": rekeyed}, indent=1, sort_keys=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(body)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TuneCacheError(f"cannot write {target}: {exc}") from None
    return len(rekeyed), int(changed)
