"""The fused kernel's tile choices kept on disk between processes (``FORGE_TUNE_CACHE=path.json``).

Why: tuning times every candidate tile of each weight shape, with its TMA, prefetching and
register-capped variants, and most of that time is compiling them: 40-120 s for the five shapes
of Llama-3.2-1B on an H100 host, paid again by every process. A benchmark sweep runs one process
per cell over the same shapes, and a training job restarts with the same model; both can reuse
the first process's choices. Entries are keyed by the tuning key and a fingerprint of what made
the choice valid (the source of the kernel and of what it calls, not its line numbers; the Triton
version, the GPU's name and the candidate list), so a changed kernel, another GPU or another
candidate list tunes again, with a warning naming the entry it could not use.

The file is JSON, rewritten whole (a temporary file, then an atomic rename) after each new entry.
A file that cannot be read or written costs a warning and the tuning, never the training step.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import re
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

ENV = "FORGE_TUNE_CACHE"
FORMAT_VERSION = 1
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tune_caches"
"""Tile choices that ship with the package, one file per GPU model (``shipped_file_name``): a first
step on a shape tuned here starts without tuning. Read-only; after ``FORGE_TUNE_CACHE``."""
SHIPPED_ENV = "FORGE_TUNE_SHIPPED"
"""``FORGE_TUNE_SHIPPED=0`` ignores the shipped choices (tune every shape in this process)."""
_DEVICE_INDEX = re.compile(r"'cuda:\d+'")


def cache_path() -> Path | None:
    """The file named by ``FORGE_TUNE_CACHE``, or None when tuning results stay in the process."""
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def shipped_file_name(device_name: str) -> str:
    """The shipped cache's file name for a GPU model: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3.json``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


def shipped_path(device_name: str) -> Path | None:
    """The shipped cache of this GPU model, or None (none ships, or ``FORGE_TUNE_SHIPPED=0``)."""
    if os.environ.get(SHIPPED_ENV, "1").strip() == "0":
        return None
    path = SHIPPED_DIR / shipped_file_name(device_name)
    return path if path.is_file() else None


def portable_key(key: str) -> str:
    """An entry key with its CUDA device index made 0: every rank of a job on one GPU model (``cuda:3``
    too) finds the choice shipped for that model."""
    return _DEVICE_INDEX.sub("'cuda:0'", key)


def lookup_shipped(path: Path, key: str, make_config: Callable[..., Any]) -> Any | None:
    """The configuration for ``key`` in the shipped cache ``path`` (``shipped_path``), or None. The file
    is read once per process: it does not change under a running job, unlike a ``FORGE_TUNE_CACHE``
    that other processes write."""
    return _config(_read_shipped(path).get(portable_key(key)), key, path, make_config)


@functools.lru_cache(maxsize=None)
def _read_shipped(path: Path) -> dict[str, Any]:
    return _read(path)


def fingerprint(kernel_identity: str, triton_version: str, device_name: str, candidates: list[Any]) -> str:
    """What a cached choice depends on besides its tuning key, as a short hash."""
    text = "\n".join([kernel_identity, triton_version, device_name, repr(candidates)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source_identity(fn: Any) -> str:
    """A hash of a Triton function's code and of everything it calls or reads by global name
    (other Triton functions, recursively, and plain constants), without where it sits in its file
    and without its docstrings and comments.

    Why not Triton's own ``cache_key``: that adds the function's starting line number, so an edit
    anywhere above the kernel (an import) would throw away every tile choice on disk although the
    kernel is the same, and each FORGE cell of the GPU smoke suite would tune again for ~70 s.
    Kept per function for the process (a kernel's source does not change under it): every new weight
    shape looks its choice up under this hash."""
    known = _IDENTITIES.get(id(fn))
    if known is not None and known[0] is fn:
        return known[1]
    visited: set[int] = set()
    parts: list[str] = []

    def visit(f: Any) -> None:
        if id(f) in visited:
            return
        visited.add(id(f))
        raw = getattr(f, "fn", f)
        name = getattr(raw, "__qualname__", type(raw).__name__)       # not the module: files move
        code, scope = getattr(raw, "__code__", None), getattr(raw, "__globals__", {})
        try:
            src = code_only(inspect.getsource(raw))      # not Triton's copy: the interpreter keeps none
        except (OSError, TypeError):              # no file (exec'd, or no function): still no address
            src = code.co_code.hex() if code is not None else type(raw).__name__
        parts.append(f"{name}\n{src}")
        for ref in (code.co_names if code is not None else ()):
            value = scope.get(ref)
            if type(value).__module__.startswith("triton.") and callable(getattr(value, "fn", None)):
                visit(value)                                          # a Triton function it calls
            elif isinstance(value, (bool, int, float, str)) or type(value).__name__ == "constexpr":
                parts.append(f"{name}:{ref}={value!r}")

    visit(fn)
    identity = hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()
    _IDENTITIES[id(fn)] = (fn, identity)
    return identity


_IDENTITIES: dict[int, tuple[Any, str]] = {}


def code_only(source: str) -> str:
    """The function's syntax tree without docstrings, comments, layout or positions.

    Why: with the raw source, a reworded docstring of a Triton helper the kernel calls would change
    the hash, and every committed tile choice would be tuned again although the compiled kernel is
    the same."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return _dump(tree)


def _dump(node: Any) -> str:
    """A syntax tree as text, the same on every Python from 3.9: node names and their non-empty fields.

    Why not ``ast.dump``: Python 3.12 gave every function a ``type_params`` field, so its dump of the
    same source differs from 3.11's, and a cache written on one would miss on the other (the CPU
    machines run 3.11, the H100 host 3.12)."""
    if isinstance(node, ast.AST):
        fields = ((name, getattr(node, name, None)) for name in node._fields)
        return f"{type(node).__name__}(" + ",".join(f"{name}={_dump(value)}" for name, value in fields
                                                     if value is not None and value != []) + ")"
    if isinstance(node, list):
        return "[" + ",".join(_dump(item) for item in node) + "]"
    return repr(node)


def entry_key(tuning_key: tuple, fingerprint_hex: str) -> str:
    """The file's key of a choice: its fingerprint, then the tuning key's repr."""
    return f"{fingerprint_hex}|{tuning_key!r}"


def split_entry_key(key: str) -> tuple[str, str]:
    """(fingerprint, the tuning key's repr) of an ``entry_key``."""
    fingerprint_hex, _, tuning_key_text = key.partition("|")
    return fingerprint_hex, tuning_key_text


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
    return _config(_read(path).get(key), key, path, make_config)


def _config(fields: Any, key: str, path: Path, make_config: Callable[..., Any]) -> Any | None:
    if not isinstance(fields, dict) or not isinstance(fields.get("config"), dict):
        return None
    try:
        return make_config(**fields["config"])
    except (TypeError, ValueError) as exc:
        warnings.warn(f"{ENV}: entry {key} of {path} is not a tile configuration ({exc}); tuning instead",
                      RuntimeWarning, stacklevel=3)
        return None


def other_fingerprints(path: Path, tuning_key: tuple) -> list[str]:
    """Fingerprints under which ``path`` holds a choice for ``tuning_key``: when the lookup missed,
    these are choices made for another kernel source, Triton, GPU or candidate list (why a
    committed cache tunes again, said in a warning rather than found from the timings)."""
    wanted = repr(tuning_key)
    return sorted(fp for fp, text in map(split_entry_key, _read(path)) if text == wanted)


def store(path: Path, key: str, config: Any, note: dict[str, Any]) -> None:
    """Add ``config`` (a dataclass) under ``key``, keeping the file's other entries."""
    entries = _read(path)
    entries[key] = {"config": dataclasses.asdict(config), **note}
    try:
        write(path, entries)
    except OSError as exc:
        warnings.warn(f"{ENV}: cannot write {path} ({exc}); the choice stays in this process",
                      RuntimeWarning, stacklevel=2)


def write(path: Path, entries: dict[str, Any], header: Mapping[str, Any] | None = None) -> None:
    """The whole file, atomically (a temporary file, then a rename); OSError when it cannot be written.
    ``header``: other top-level fields to keep (a re-keyed file keeps its source's, version included)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": FORMAT_VERSION, **(header or {}), "entries": entries}
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
