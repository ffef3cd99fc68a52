"""Whether a peer arm can run here: its package, version and device, checked without crashing.

Each probe answers ``None`` (runs here) or one line saying what is missing: the package, its
version, or the import error's first line. A registry entry's ``extra_check`` is
``availability_check(PROBE)``; nothing else imports a peer's package, so a process loads only the
packages of the arms it builds or checks.

A probe imports the peer's package. Importing some of them (bitsandbytes, torchao) queries the
GPU, and in a process that will not itself train (the sweep's parent) that could leave a CUDA
context behind and skew the memory of every cell. So where CUDA is present but not yet
initialised, the probe runs in a short child process (``python -m forge_bench.peer_probes probe
NAME``); elsewhere (CPU, a process that already uses the GPU, or a ``forge_bench.cell``
process, which is about to) it runs in-process.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

PROBE_TIMEOUT_S = 300


@dataclass(frozen=True)
class PeerPackage:
    """A peer's Python package: import name, pip name, oldest version accepted, entry symbol, and the
    other peer packages its own import loads (so a process that builds it must not hide them)."""
    module: str
    distribution: str
    min_version: str
    symbol: str          # dotted attribute of the module that the adapter calls
    imports: tuple[str, ...] = ()


PACKAGES: dict[str, PeerPackage] = {
    # bitsandbytes: 0.48 is the first release whose wheel ships a CUDA 13 library (torch cu130).
    "bitsandbytes": PeerPackage("bitsandbytes", "bitsandbytes", "0.48.0", "optim.PagedAdamW8bit"),
    # torchao: low-bit optimizers left the prototype namespace for torchao.optim in 0.11.
    "torchao": PeerPackage("torchao", "torchao", "0.11.0", "optim.AdamWFp8"),
    "optimi": PeerPackage("optimi", "torch-optimi", "0.3.0", "AdamW"),
    # GaLore and APOLLO import bitsandbytes in their package __init__ (their 8-bit AdamW variants).
    "galore_torch": PeerPackage("galore_torch", "galore-torch", "1.0", "GaLoreAdamW", imports=("bitsandbytes",)),
    "apollo_torch": PeerPackage("apollo_torch", "apollo-torch", "1.0.3", "APOLLOAdamW", imports=("bitsandbytes",)),
    "lomo_optim": PeerPackage("lomo_optim", "lomo-optim", "0.1.1", "AdaLomo"),
    "flashoptim": PeerPackage("flashoptim", "flashoptim", "0.1.0", "FlashAdamW"),
}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _version_problem(pkg: PeerPackage) -> str | None:
    try:
        found = importlib.metadata.version(pkg.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None  # importable without metadata (a source checkout): the import check decides
    try:
        from packaging.version import Version
        too_old = Version(found) < Version(pkg.min_version)
    except Exception:  # no 'packaging' or an odd version string: do not guess
        return None
    if too_old:
        return f"{pkg.distribution} {found} is too old (need >= {pkg.min_version})"
    return None


def import_problem(pkg: PeerPackage) -> str | None:
    """Import the package and resolve its entry symbol; None, or the failure in one line."""
    if importlib.util.find_spec(pkg.module) is None:
        return f"Python package '{pkg.module}' (pip: {pkg.distribution}) is not installed"
    problem = _version_problem(pkg)
    if problem:
        return problem
    try:
        obj: Any = importlib.import_module(pkg.module)
    except BaseException as exc:  # a broken wheel can raise anything, even SystemExit
        return f"{pkg.distribution} failed to import: {first_line(exc)}"
    for part in pkg.symbol.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:  # a submodule that the package does not import eagerly
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except BaseException as exc:
                return f"{pkg.distribution} has no {pkg.module}.{pkg.symbol}: {first_line(exc)}"
    return None


def _bitsandbytes_native_problem() -> str | None:
    """On a CUDA machine bitsandbytes must have loaded its CUDA library (else it defers the error)."""
    if not torch.cuda.is_available():
        return None
    from bitsandbytes import cextension
    lib = cextension.lib
    if not getattr(lib, "compiled_with_cuda", False):
        detail = getattr(lib, "error_msg", "") or "the CPU library was loaded"
        return f"bitsandbytes has no CUDA library for torch CUDA {torch.version.cuda}: {detail.strip().splitlines()[0]}"
    return None


def _fp8_device_problem() -> str | None:
    """torchao's FP8 states need float8 e4m3 support: compute capability 8.9 or newer on CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"torchao AdamWFp8 needs compute capability >= 8.9 (found {major}.{minor})"
    return None


# A probe is the package check plus, for some peers, a device check that needs the package.
PROBES: dict[str, tuple[str, Callable[[], str | None] | None]] = {
    "bitsandbytes": ("bitsandbytes", _bitsandbytes_native_problem),
    "torchao": ("torchao", None),
    "torchao_fp8": ("torchao", _fp8_device_problem),
    "optimi": ("optimi", None),
    "galore_torch": ("galore_torch", None),
    "apollo_torch": ("apollo_torch", None),
    "lomo_optim": ("lomo_optim", None),
    "flashoptim": ("flashoptim", None),
}


def run_probe(name: str) -> str | None:
    """The probe ``name`` in this process: None when the peer can be built here."""
    package_name, device_check = PROBES[name]
    problem = import_problem(PACKAGES[package_name])
    if problem is None and device_check is not None:
        try:
            problem = device_check()
        except BaseException as exc:
            problem = f"{package_name} device check failed: {first_line(exc)}"
    return problem


def probe_in_child(name: str) -> str | None:
    cmd = [sys.executable, "-m", "forge_bench.peer_probes", "probe", name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{name}: import check timed out after {PROBE_TIMEOUT_S} s"
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PROBE-OK", "PROBE-FAIL "))]
    if not lines:
        err = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{name}: import check process failed (exit {done.returncode}): {err}"
    return None if lines[-1] == "PROBE-OK" else lines[-1][len("PROBE-FAIL "):]


def in_cell_process() -> bool:
    """True in a ``python -m forge_bench.cell`` process: it trains on the GPU right after."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "forge_bench.cell"


@functools.lru_cache(maxsize=None)
def peer_problem(name: str) -> str | None:
    """Cached probe; runs in a child process when this one has CUDA but has not touched it yet
    (unless it is a cell process, which will use the GPU anyway)."""
    if name not in PROBES:
        raise KeyError(f"unknown peer probe {name!r}; known: {', '.join(sorted(PROBES))}")
    if torch.cuda.is_available() and not torch.cuda.is_initialized() and not in_cell_process():
        return probe_in_child(name)
    return run_probe(name)


def availability_check(name: str) -> Callable[[], str | None]:
    """The ``extra_check`` of a registry entry: the peer probe ``name``."""
    if name not in PROBES:
        raise KeyError(f"unknown peer probe {name!r}; known: {', '.join(sorted(PROBES))}")

    def check() -> str | None:
        return peer_problem(name)

    check.__name__ = f"check_{name}"
    return check


def installed_version(distribution: str) -> str:
    """The installed version of a distribution, or "unknown" (recorded in a peer row's settings)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def hide_peer_packages_except(needed: Iterable[str]) -> list[str]:
    """Make every peer package outside ``needed`` unimportable in this process; returns their names.

    Why: transformers imports torchao while it loads any model class whenever torchao is installed
    (its quantizer registry), so a cell of a baseline arm would load a peer's package, and torchao's
    import prints two "Failed to load ... _C_mxfp8 / _C_cutlass_90a" lines into every cell's log.
    ``sys.modules[name] = None`` makes ``import name`` fail and ``importlib.util.find_spec(name)``
    answer None, so transformers takes the package as absent. A needed package's own peer imports
    (``PeerPackage.imports``) stay importable. Only a process that builds one arm calls this (a cell,
    a profiler's per-arm child): a package already imported stays as it is.
    """
    keep = set(needed)
    keep |= {dep for package in PACKAGES.values() if package.module in keep for dep in package.imports}
    hidden = []
    for module in sorted({package.module for package in PACKAGES.values()}):
        if module not in keep and module not in sys.modules:
            sys.modules[module] = None   # type: ignore[assignment]
            hidden.append(module)
    return hidden


def _main(argv: list[str]) -> int:
    """``python -m forge_bench.peer_probes probe NAME`` prints PROBE-OK or PROBE-FAIL <reason>: the
    child process of ``probe_in_child`` (a fixed two-word command line, so no option parser)."""
    if len(argv) != 2 or argv[0] != "probe" or argv[1] not in PROBES:
        print(f"usage: python -m forge_bench.peer_probes probe {{{','.join(sorted(PROBES))}}}", file=sys.stderr)
        return 2
    problem = run_probe(argv[1])
    print("PROBE-OK" if problem is None else f"PROBE-FAIL {problem}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
