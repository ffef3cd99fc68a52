"""The one rule for ratios, shared by every table and figure of the report.

A speed-up or a memory saving is a number only when both rows come from the same sweep run on
the same machine state: same ``run_id``, same ``device_name``, same torch / triton /
CUDA versions. A time ratio (not a memory one) also needs SM clocks (``sm_clock_mhz_after``)
within ``CLOCK_TOLERANCE`` of each other and one machine boot where both rows recorded one
(``extra.boot_id``): a sweep resumed on another machine (a rented GPU comes as a fresh virtual
machine) keeps its run id, but an eager step is bound by the host's launch speed, which changes
from one machine to the next; likewise the same CPUs where both recorded them (``extra.cpus``, D114).
Anything else is printed as ``DIFFERENT_RUN`` instead of a number, because a ratio of two times
taken under different software, silicon or clocks measures those differences, not the method.

One exception for clocks: when the faster of the two cells ran at the LOWER clock, the difference
could only have slowed the winner, so the measured speed-up is a bound on the equal-clock one and is
printed as such (``≥1.22×`` for a faster candidate, ``≤0.95×`` for a slower one; ``Ratio.bound``).
Why: a memory-bound optimizer step draws less power than a GEMM-heavy one, so the GPU boosts it
higher (fused AdamW at 1950 MHz, FORGE at 1740-1830 on an H100 in every run): refusing those pairs
hid a property of the workload, not noise.

A time ratio whose difference lies inside the measured noise of the two cells is still printed,
but flagged (``within_noise``, rendered with a leading ``~``) so that it is not read as a clean
win. The noise of one cell is ``noise_halfwidth_ms``: half of its widest per-run interquartile
range, or half of the range of its per-run medians, whichever is larger.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

# SM clocks of two rows may differ by at most this fraction of the larger clock (5 %): a GPU
# that boosted in one cell and throttled in another does not give a comparable pair of times.
CLOCK_TOLERANCE = 0.05

# Columns that must be identical for two rows to share one measurement context.
IDENTITY_COLUMNS = ("run_id", "device_name", "torch_version", "triton_version", "cuda_version")

DIFFERENT_RUN = "n/a (different run)"
NOISE_MARK = "~"
NOISE_FOOTNOTE = (
    f"{NOISE_MARK} the difference lies inside the measured step-time spread of the two cells "
    "(half the widest per-run IQR, or half the range of the per-run medians, of each): "
    "not a clean win or loss."
)
BOUND_FOOTNOTE = (
    f"≥ / ≤ the two cells ran at SM clocks more than {CLOCK_TOLERANCE:.0%} apart and the faster one at the "
    "lower clock, so the clock difference can only have narrowed the gap: the ratio at equal clocks is at "
    "least (≥) / at most (≤) the number shown."
)


def as_number(value: Any) -> float | None:
    """A finite float, or None for null / NaN / inf (pandas gives NaN for missing numbers)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def as_text(value: Any) -> str | None:
    """A string, or None for null / NaN."""
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def incomparable_reason(row_a: Mapping[str, Any], row_b: Mapping[str, Any]) -> str | None:
    """None when a ratio between the two rows is allowed; otherwise why not, in one line."""
    for column in IDENTITY_COLUMNS:
        value_a, value_b = as_text(row_a.get(column)), as_text(row_b.get(column))
        if value_a != value_b:
            return f"{column} differs ({value_a} vs {value_b})"
    return None


def clock_bound(candidate: Mapping[str, Any], baseline: Mapping[str, Any], speed_up: float) -> str | None:
    """"≥" when the candidate is faster at a lower SM clock than the baseline, "≤" when it is slower
    at a higher one (the clock difference then narrowed the gap), else None."""
    clock_c = as_number(candidate.get("sm_clock_mhz_after"))
    clock_b = as_number(baseline.get("sm_clock_mhz_after"))
    if clock_c is None or clock_b is None:
        return None
    if speed_up >= 1.0 and clock_c < clock_b:
        return "≥"
    if speed_up <= 1.0 and clock_c > clock_b:
        return "≤"
    return None


def _clock_reason(row_a: Mapping[str, Any], row_b: Mapping[str, Any]) -> str | None:
    clock_a = as_number(row_a.get("sm_clock_mhz_after"))
    clock_b = as_number(row_b.get("sm_clock_mhz_after"))
    if (clock_a is None) != (clock_b is None):
        return "SM clock recorded on one row only"
    if clock_a is not None and clock_b is not None:
        larger = max(clock_a, clock_b)
        if larger > 0 and abs(clock_a - clock_b) / larger > CLOCK_TOLERANCE:
            return (f"SM clocks differ by more than {CLOCK_TOLERANCE:.0%} "
                    f"({clock_a:.0f} vs {clock_b:.0f} MHz)")
    return None


def time_incomparable_reason(row_a: Mapping[str, Any], row_b: Mapping[str, Any]) -> str | None:
    """Why two step times may not be divided although the rows share a run, or None.

    Clocks and the host only move time: a memory ratio stays valid across them."""
    return _clock_reason(row_a, row_b) or different_host_reason(row_a, row_b)


def json_field(value: Any) -> dict[str, Any]:
    """A JSON-object column (``extra``, ``method_settings``) as a dict; {} when absent or bad."""
    text = as_text(value)
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def different_host_reason(row_a: Mapping[str, Any], row_b: Mapping[str, Any]) -> str | None:
    """Why two step times come from different machine boots or CPUs, or None (the same, or unrecorded).
    CPUs: a sweep lane's timed windows run on CPUs of its own (``extra.cpus``), and a virtual machine's
    CPUs do not run alike (D114), so cells of two lanes are two hosts for an eager step."""
    extra_a, extra_b = json_field(row_a.get("extra")), json_field(row_b.get("extra"))
    boot_a, boot_b = extra_a.get("boot_id"), extra_b.get("boot_id")
    if boot_a and boot_b and boot_a != boot_b:
        return f"measured on different machine boots ({str(boot_a)[:8]} vs {str(boot_b)[:8]}): host speed differs"
    cpus_a, cpus_b = extra_a.get("cpus"), extra_b.get("cpus")
    if cpus_a and cpus_b and sorted(cpus_a) != sorted(cpus_b):
        return (f"timed on different CPUs ({','.join(map(str, cpus_a))} vs {','.join(map(str, cpus_b))}): "
                f"a virtual machine's CPUs do not run alike")
    return None


def took_turns(row_a: Mapping[str, Any], row_b: Mapping[str, Any]) -> bool:
    """Whether the two rows' cells were resident together and their timed repeats alternated on one GPU
    (``forge-bench sweep --interleave``: each row names the other's cell in ``extra.turns.peers``), so
    that the host's drift fell on both alike."""
    def peers(row: Mapping[str, Any]) -> list:
        turns = json_field(row.get("extra")).get("turns")
        return turns.get("peers", []) if isinstance(turns, dict) else []
    return row_b.get("cell_id") in peers(row_a) and row_a.get("cell_id") in peers(row_b)


def comparable(row_a: Mapping[str, Any], row_b: Mapping[str, Any]) -> bool:
    """Whether both a time and a memory ratio between the two rows are allowed."""
    return incomparable_reason(row_a, row_b) is None and time_incomparable_reason(row_a, row_b) is None


def noise_halfwidth_ms(row: Mapping[str, Any]) -> float:
    """Half-width of the step-time band a single cell cannot resolve, ms (0 when unknown)."""
    median = as_number(row.get("step_ms_median"))
    if median is None:
        return 0.0
    widths = [0.0]
    spread = as_number(row.get("step_ms_spread_max"))
    if spread is not None:
        widths.append(spread * median / 2.0)
    run_medians = row.get("step_ms_run_medians")
    if run_medians is not None:
        values = [v for v in (as_number(x) for x in list(run_medians)) if v is not None]
        if len(values) >= 2:
            widths.append((max(values) - min(values)) / 2.0)
    return max(widths)


@dataclass(frozen=True)
class Ratio:
    """A guarded ratio: ``value`` is None whenever ``text`` explains why there is no number."""
    value: float | None
    text: str
    within_noise: bool = False
    refusal: str | None = None  # the one-line reason behind a non-number (for footnotes)
    bound: str | None = None    # "≥" / "≤": clocks apart, the value bounds the equal-clock ratio

    @property
    def is_number(self) -> bool:
        return self.value is not None


def _refuse_or_none(candidate: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> Ratio | None:
    """The shared refusals of every ratio kind, or None when the pair may be divided."""
    if baseline is None:
        return Ratio(None, "n/a (no baseline)", refusal="no baseline row for this cell")
    # A row that did not measure has nothing to divide (its clocks are unrecorded too, which
    # would otherwise read as "different run").
    for row, who in ((candidate, "this row"), (baseline, "baseline")):
        if as_text(row.get("status")) != "ok":
            return Ratio(None, f"n/a ({who} {as_text(row.get('status'))})",
                         refusal=f"{who} status {as_text(row.get('status'))}")
    reason = incomparable_reason(candidate, baseline)
    if reason is not None:
        return Ratio(None, DIFFERENT_RUN, refusal=reason)
    return None


def speedup(candidate: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> Ratio:
    """Baseline step time over candidate step time (>1: the candidate is faster)."""
    refused = _refuse_or_none(candidate, baseline)
    if refused is not None:
        return refused
    host_reason = different_host_reason(candidate, baseline)
    if host_reason is not None:
        return Ratio(None, DIFFERENT_RUN, refusal=host_reason)
    clock_reason = _clock_reason(candidate, baseline)
    cand_ms = as_number(candidate.get("step_ms_median"))
    base_ms = as_number(baseline.get("step_ms_median"))
    if cand_ms is None or base_ms is None or cand_ms <= 0:
        return Ratio(None, DIFFERENT_RUN if clock_reason else "n/a (no time)",
                     refusal=clock_reason or "step time missing")
    value = base_ms / cand_ms
    bound = clock_bound(candidate, baseline, value) if clock_reason is not None else None
    if clock_reason is not None and bound is None:
        return Ratio(None, DIFFERENT_RUN, refusal=clock_reason)
    noisy = abs(base_ms - cand_ms) <= noise_halfwidth_ms(candidate) + noise_halfwidth_ms(baseline)
    text = f"{NOISE_MARK if noisy else ''}{bound or ''}{value:.2f}×"
    return Ratio(value, text, within_noise=noisy, bound=bound)


def peak_change(candidate: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> Ratio:
    """Relative change of peak allocated memory vs the baseline (negative: less memory)."""
    refused = _refuse_or_none(candidate, baseline)
    if refused is not None:
        return refused
    cand = as_number(candidate.get("peak_allocated_gib"))
    base = as_number(baseline.get("peak_allocated_gib"))
    if cand is None or base is None or base <= 0:
        why = as_text(candidate.get("peak_reason")) or as_text(baseline.get("peak_reason")) or "peak missing"
        return Ratio(None, "n/a (no peak)", refusal=f"peak not measured: {why}")
    value = (cand - base) / base
    return Ratio(value, f"{value * 100:+.1f}%")


def memory_saving(candidate: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> Ratio:
    """Fraction of the baseline's peak that the candidate does not need (positive: saves)."""
    change = peak_change(candidate, baseline)
    if change.value is None:
        return change
    saving = -change.value
    return Ratio(saving, f"{saving * 100:.1f}%")
