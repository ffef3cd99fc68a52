"""The fused kernel's tile choices kept on disk between processes (``FORGE_TUNE_CACHE=path.json``).

Why: tuning times every candidate tile of each weight shape, with its TMA, prefetching and
register-capped variants, and most of that time is compiling them: 40-120 s for the five shapes
of Llama-3.2-1B on an H100 host, paid again by every process. A benchmark sweep runs one process
per cell over the same shapes, and a training job restarts with the same model; both can reuse
the first process's choices. Entries are keyed by the tuning key and a fingerprint of what made
the choice valid (the kernel's source as Triton hashes it, the Triton version, the GPU's name and
the candidate list), so a changed kernel, another GPU or another candidate list tunes again.

The file is JSON, rewritten whole (a temporary file, then an atomic rename) after each new entry.
A file that cannot be read or written costs a warning and the tuning, never the training step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

ENV = "FORGE_TUNE_CACHE"
FORMAT_VERSION = 1


def cache_path() -> Path | None:
    """The file named by ``FORGE_TUNE_CACHE``, or None when tuning results stay in the process."""
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def fingerprint(kernel_identity: str, triton_version: str, device_name: str, candidates: list[Any]) -> str:
    """What a cached choice depends on besides its tuning key, as a short hash."""
    text = "\n".join([kernel_identity, triton_version, device_name, repr(candidates)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_key(tuning_key: tuple, fingerprint_hex: str) -> str:
    return f"{fingerprint_hex}|{tuning_key!r}"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"{ENV}: cannot read {path} ({exc}); tuning instead", RuntimeWarning, stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or not isinstance(data.get("entries"), dict):
        warnings.warn(f"{ENV}: {path} is not a version-{FORMAT_VERSION} tuning cache; tuning instead",
                      RuntimeWarning, stacklevel=3)
        return {}
    return data["entries"]


def lookup(path: Path, key: str, make_config: Callable[..., Any]) -> Any | None:
    """The cached configuration for ``key`` built by ``make_config(**fields)``, or None."""
    fields = _read(path).get(key)
    if not isinstance(fields, dict) or not isinstance(fields.get("config"), dict):
        return None
    try:
        return make_config(**fields["config"])
    except (TypeError, ValueError) as exc:
        warnings.warn(f"{ENV}: entry {key} of {path} is not a tile configuration ({exc}); tuning instead",
                      RuntimeWarning, stacklevel=2)
        return None


def store(path: Path, key: str, config: Any, note: dict[str, Any]) -> None:
    """Add ``config`` (a dataclass) under ``key``, keeping the file's other entries."""
    entries = _read(path)
    entries[key] = {"config": dataclasses.asdict(config), **note}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": FORMAT_VERSION, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"{ENV}: cannot write {path} ({exc}); the choice stays in this process",
                      RuntimeWarning, stacklevel=2)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
