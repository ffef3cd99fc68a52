"""What a row records about where it is measured: device, versions, source identity, NVML.

Nothing here may crash a cell: a missing NVML library, a CPU-only machine or a tree outside
git gives nulls plus a one-line reason.
"""
from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCE_PACKAGES = ("forge_core", "forge_bench")
SOURCE_SUFFIXES = (".py", ".json", ".yaml")
GIT_COMMIT_ENV = "FORGE_BENCH_GIT_COMMIT"   # set where the tree was copied without .git


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", None))


def versions() -> dict[str, Any]:
    import torch

    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "triton_version": _version("triton"),
        "transformers_version": _version("transformers"),
        "python_version": platform.python_version(),
    }


def _source_files() -> list[Path]:
    files: list[Path] = []
    for pkg in SOURCE_PACKAGES:
        root = REPO_ROOT / pkg
        if root.is_dir():
            files += [p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    return sorted(files)


@lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the relative paths and bytes of the forge_core/forge_bench sources (16 hex)."""
    h = hashlib.sha256()
    for path in _source_files():
        h.update(str(path.relative_to(REPO_ROOT)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


@lru_cache(maxsize=1)
def git_info() -> dict[str, Any]:
    """HEAD and whether the library/harness sources differ from it (nulls outside git).

    ``FORGE_BENCH_GIT_COMMIT``, when set, wins: a copied tree can carry a stale ``.git`` whose HEAD
    is not the commit of the sources beside it, and whoever sets the variable knows what they
    copied; ``source_hash`` on the row stays the check."""
    explicit = os.environ.get(GIT_COMMIT_ENV)
    if explicit:
        return {"git_commit": explicit, "source_dirty": None}
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "source_dirty": None}
    status = _git("status", "--porcelain", "--", *SOURCE_PACKAGES)
    return {"git_commit": commit.strip(), "source_dirty": bool(status.strip()) if status is not None else None}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID_FILE) -> str | None:
    """The kernel's id of this machine boot (Linux), or None.

    Rented GPUs come as fresh virtual machines whose host speed differs from one to the next (the
    eager Llama-8B step differs by up to 64% between two machines of one H100 model), while every
    other identity column (device, versions, hostname) stays the same. Rows with different boot
    ids therefore do not share a host; the report refuses eager time ratios between them.
    """
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def forge_switches(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``FORGE_*`` variables the cell's process ran with (a fixed tile, the Python hook, no replays, ...),
    the harness's own ``FORGE_BENCH_*`` left out: a row's speed depends on them, and nothing else records them."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ)
            if name.startswith("FORGE_") and not name.startswith("FORGE_BENCH_")}


def nvml_handle(pynvml: Any, cuda_index: int) -> Any:
    """The NVML handle of CUDA device ``cuda_index`` of this process. NVML numbers every GPU of the
    host and ignores CUDA_VISIBLE_DEVICES, so a cell given GPU 2 (``forge-bench sweep --gpus``, or
    any launcher that sets it) would otherwise read GPU 0's clocks, power and energy. An entry of
    CUDA_VISIBLE_DEVICES is a host index (in PCI bus order, which the sweep sets with
    CUDA_DEVICE_ORDER) or a GPU UUID."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    if not entries or cuda_index >= len(entries):
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = entries[cuda_index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def _nvml_device_name(index: int) -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(nvml_handle(pynvml, index))
        finally:
            pynvml.nvmlShutdown()
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None


def device_info(device: str) -> dict[str, Any]:
    """Name and count of the devices. The name comes from NVML first: the sweep process writes rows
    too (timeouts, crashes) and must not create a CUDA context, which would hold GPU memory that
    the cell processes then miss (``nvml_handle`` follows CUDA_VISIBLE_DEVICES)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        name = _nvml_device_name(index) or torch.cuda.get_device_name(index)
        return {"device_name": name, "device_count": torch.cuda.device_count()}
    return {"device_name": cpu_name(), "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def environment(device: str) -> dict[str, Any]:
    """The identity columns every row carries."""
    return {**device_info(device), **versions(), **git_info(), "source_hash": source_hash(),
            "hostname": socket.gethostname()}


# --- NVML ---------------------------------------------------------------------------------

NVML_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "sm_clock_max_mhz", "temperature_c", "power_w", "throttle_reasons")


def _throttle_names(pynvml: Any, mask: int) -> str:
    names = []
    for attr in dir(pynvml):
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            if attr.startswith(prefix):
                bit = getattr(pynvml, attr)
                name = attr[len(prefix):]
                if isinstance(bit, int) and bit and name not in ("All", "None", "Unknown") and mask & bit == bit \
                        and bin(bit).count("1") == 1 and name not in names:
                    names.append(name)
    return ",".join(sorted(names)) if names else ("none" if mask == 0 else hex(mask))


def _clock_event_reasons(pynvml: Any):
    """NVML renamed "throttle reasons" to "clocks event reasons"; use whichever this binding has."""
    return getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons


def nvml_snapshot(device_index: int = 0) -> dict[str, Any]:
    """SM/memory clocks, temperature, power and throttle reasons; ``reason`` says why any is null."""
    out: dict[str, Any] = {k: None for k in NVML_FIELDS}
    out["reason"] = None
    try:
        import pynvml
    except Exception as exc:
        out["reason"] = f"pynvml not importable: {type(exc).__name__}"
        return out
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        out["reason"] = f"NVML unavailable: {exc}"
        return out
    problems = []
    try:
        handle = nvml_handle(pynvml, device_index)
        probes = {
            "sm_clock_mhz": lambda: float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": lambda: float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
            "sm_clock_max_mhz": lambda: float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "temperature_c": lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            # the board's energy counter since the driver loaded (mJ; Volta and later): two
            # snapshots give the energy of what ran between them (``window_energy``)
            "energy_j": lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0,
            "throttle_reasons": lambda: _throttle_names(pynvml, int(_clock_event_reasons(pynvml)(handle))),
        }
        for key, probe in probes.items():
            try:
                out[key] = probe()
            except Exception as exc:
                problems.append(f"{key}: {exc}")
    except Exception as exc:
        problems.append(f"device {device_index}: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    if problems:
        out["reason"] = "; ".join(problems)[:500]
    return out


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None


def nvml_columns(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The row's NVML columns from two snapshots."""
    cols = {
        "sm_clock_mhz_before": before["sm_clock_mhz"], "sm_clock_mhz_after": after["sm_clock_mhz"],
        "mem_clock_mhz_before": before["mem_clock_mhz"], "mem_clock_mhz_after": after["mem_clock_mhz"],
        "sm_clock_max_mhz": before["sm_clock_max_mhz"] or after["sm_clock_max_mhz"],
        "temperature_c_before": before["temperature_c"], "temperature_c_after": after["temperature_c"],
        "power_w_before": before["power_w"], "power_w_after": after["power_w"],
        "throttle_reasons_before": before["throttle_reasons"], "throttle_reasons_after": after["throttle_reasons"],
    }
    reasons = {r for r in (before.get("reason"), after.get("reason")) if r}
    cols["nvml_reason"] = "; ".join(sorted(reasons)) or None
    return cols


def window_energy(before: dict[str, Any], after: dict[str, Any], seconds: float, steps: int) -> dict[str, float]:
    """Energy per step and mean board power over a timed window, from two ``nvml_snapshot``s taken
    around it; {} when the counter is missing. Why: on the H100 every Llama-8B arm but fused AdamW
    runs at the power cap (~690 W, SwPowerCap), so a kernel's energy sets the whole step's SM clock."""
    start, end = before.get("energy_j"), after.get("energy_j")
    if start is None or end is None or end < start or seconds <= 0 or steps <= 0:
        return {}
    return {"energy_j_per_step": (end - start) / steps, "power_w_mean": (end - start) / seconds}


class EnergyCounter:
    """The board's NVML energy counter, opened once, for windows read many times a second (a
    kernel's joules): ``nvml_snapshot`` opens and closes NVML and reads every field per call."""

    def __init__(self, device_index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = nvml_handle(pynvml, device_index)
        self.read_j()                # fails here, not inside a measurement, where the board has no counter

    def read_j(self) -> float:
        """Joules since the driver loaded."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0

    def sm_clock_mhz(self) -> float:
        return float(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def power_limit_w(self) -> float:
        """The limit the board enforces now (what SwPowerCap throttles to)."""
        return self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000.0

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def open_energy_counter(device_index: int = 0) -> tuple[EnergyCounter | None, str | None]:
    """(counter, None), or (None, why not): benchmarks keep their timings where NVML is missing."""
    try:
        return EnergyCounter(device_index), None
    except Exception as exc:
        return None, f"NVML energy counter unavailable: {type(exc).__name__}: {exc}"[:300]


def cpu_nvml_columns(reason: str = "CPU run: no GPU to query") -> dict[str, Any]:
    empty = {k: None for k in NVML_FIELDS}
    cols = nvml_columns(empty, empty)
    cols["nvml_reason"] = reason
    return cols
