"""The report's distributed section: per-rank peak, step time and tokens/s per arm and world size.

Rows of a distributed arm (a ``strategy``: dp, fsdp2, tp) are grouped by run, device, model, dtype,
per-rank batch x seq, timing and activations; each arm (with its bucket size, for data parallel)
is a row of the table and each world size a block of columns. A second table reads the targets:

* FORGE-DP (``forge_dp_bf16``) against DDP + fused AdamW (``ddp_adamw_fused``) at the same world size
  and bucket: the per-rank peak saved, as a share of the bf16 gradient pool (2 bytes per
  parameter; target >= 90%), the step-time ratio (target: no loss of speed: >= 1.00x, or a
  difference inside the two cells' step-time noise, marked ~ as everywhere in the report), and the
  spread of FORGE-DP's peak over the world sizes (target: flat);
* FORGE-FSDP2 (``forge_fsdp2_bf16``) against FSDP2 + AdamW (``fsdp2_adamw``): the per-rank peak
  difference (target: parity or better, <= ``FSDP_PARITY_GIB``: the allocator's peaks of two
  processes differ by a few MiB of small buffers when the sharded states are the same).

Ratios are taken only within one run (``run_id``), as everywhere in the report.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd
from matplotlib.figure import Figure

from .data import fmt_memory, fmt_ms, fmt_number, group_title, memory_unit, one_per_key, records, run_label, slug
from .figures import FORMATS, save
from .ratios import as_number, as_text, speedup
from .render import Table
from .targets import POOL_SHARE_TARGET, gradient_pool_gib, pool_and_speed

DIST_KEYS = ["run_id", "device_name", "model", "dtype", "batch", "seq", "timing", "activations"]
FORGE_DP, DDP = "forge_dp_bf16", "ddp_adamw_fused"
FORGE_FSDP, FSDP = "forge_fsdp2_bf16", "fsdp2_adamw"
FSDP_PARITY_GIB = 0.01
"""FORGE-FSDP2's per-rank peak counts as at parity with FSDP2 + AdamW's within this many GiB."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per parameter of the gradient pool (one gradient in the weight dtype)."""
ARM_ORDER = ("ddp_adamw_fused", "forge_dp_bf16", "forge_dp_int8", "fsdp2_adamw", "forge_fsdp2_bf16",
             "forge_fsdp2_int8", "tp_adamw", "forge_tp_bf16", "forge_tp_int8")


def is_distributed(frame: pd.DataFrame) -> pd.Series:
    """Which rows belong to this section: a strategy recorded (older rows have none: not distributed)."""
    if "strategy" not in frame:
        return pd.Series(False, index=frame.index)
    return frame["strategy"].notna() & (frame["strategy"].astype(str) != "")


def arm_label(row: Mapping[str, Any]) -> str:
    """The arm's name, with its bucket size where one was set (data parallel)."""
    bucket = as_number(row.get("bucket_cap_mb"))
    return f"`{row['method']}`" + (f" ({bucket:g} MB buckets)" if bucket else "")


def _arm_key(row: Mapping[str, Any]) -> tuple:
    method = str(row["method"])
    order = ARM_ORDER.index(method) if method in ARM_ORDER else len(ARM_ORDER)
    return (order, method, as_number(row.get("bucket_cap_mb")) or 0.0)


def dist_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, ok rows) of every distributed group with at least one ok row."""
    rows = frame[is_distributed(frame)]
    out = []
    for keys, group in rows.groupby(DIST_KEYS, sort=True, dropna=False):
        ok = group[group["status"] == "ok"]
        if not ok.empty:
            out.append((dict(zip(DIST_KEYS, keys)), ok))
    return out


def _world_sizes(group: pd.DataFrame) -> list[int]:
    return sorted({int(w) for w in group["world_size"].dropna()})


def _cell(group_rows: list[dict[str, Any]], method: str, world: int, bucket: float | None) -> dict[str, Any] | None:
    for row in group_rows:
        if row["method"] == method and int(row["world_size"]) == world and \
                (bucket is None or as_number(row.get("bucket_cap_mb")) == bucket):
            return row
    return None


def dist_tables(frame: pd.DataFrame) -> list[Table]:
    """Per group: the measurements table, then the targets table where its arms ran."""
    tables = []
    for keys, group in dist_groups(frame):
        rows = records(group)
        worlds = _world_sizes(group)
        unit = memory_unit(r.get("peak_allocated_gib") for r in rows)
        arms: dict[tuple, dict[str, Any]] = {}
        for row in sorted(rows, key=_arm_key):
            arms.setdefault(_arm_key(row), row)
        header = ["Arm"] + [f"N={n} {part}" for n in worlds for part in (f"peak/rank {unit}", "step ms", "tok/s")]
        body, recs = [], []
        for key, first in arms.items():
            line = [arm_label(first)]
            for n in worlds:
                row = _cell(rows, first["method"], n, as_number(first.get("bucket_cap_mb")))
                line += ([fmt_memory(row.get("peak_allocated_gib"), unit), fmt_ms(row.get("step_ms_median")),
                          fmt_number(row.get("tokens_per_s"), 0)] if row else ["—", "—", "—"])
                if row:
                    recs.append({**keys, "method": first["method"], "bucket_cap_mb": as_number(first.get("bucket_cap_mb")),
                                 "world_size": n, "strategy": as_text(row.get("strategy")),
                                 "peak_per_rank_gib": as_number(row.get("peak_allocated_gib")),
                                 "step_ms": as_number(row.get("step_ms_median")),
                                 "tokens_per_s": as_number(row.get("tokens_per_s"))})
            body.append(line)
        name = slug("distributed", keys["device_name"], keys["model"], keys["dtype"], keys["batch"], keys["seq"],
                    run_label(keys["run_id"]))
        tables.append(Table(name, f"Across GPUs, {group_title(keys)}",
                            f"Per-rank peak ({unit}: the largest rank's), step time (the slowest rank's, median) and "
                            "tokens per second of the global batch (N x batch sequences for dp and fsdp2, batch for tp), "
                            "per world size N; batch x seq is per rank.",
                            header, body, "l" + "rrr" * len(worlds), [], recs))
        targets = target_table(keys, rows, worlds)
        if targets is not None:
            tables.append(targets)
    return tables


def target_table(keys: Mapping[str, Any], rows: list[dict[str, Any]], worlds: list[int]) -> Table | None:
    """The targets at each world size (and DP bucket): FORGE-DP's saving against the bf16 gradient
    pool and its speed against DDP, FORGE-FSDP2's peak against FSDP2's."""
    body, recs, notes = [], [], []
    buckets = sorted({as_number(r.get("bucket_cap_mb")) for r in rows if r["method"] in (FORGE_DP, DDP)} - {None})
    for n in worlds:
        for bucket in buckets or [None]:
            forge, ddp = _cell(rows, FORGE_DP, n, bucket), _cell(rows, DDP, n, bucket)
            fsdp_forge, fsdp = _cell(rows, FORGE_FSDP, n, None), _cell(rows, FSDP, n, None)
            measured = [r for r in (forge, ddp, fsdp_forge, fsdp) if r and as_number(r.get("peak_allocated_gib")) is not None]
            if (not (forge and ddp) and not (fsdp_forge and fsdp)) or not measured:
                continue                # nothing to compare (a CPU run has no peak)
            line = [str(n), f"{bucket:g}" if bucket else "—"]
            record: dict[str, Any] = {**keys, "world_size": n, "bucket_cap_mb": bucket}
            if forge and ddp and None not in (as_number(forge.get("peak_allocated_gib")),
                                               as_number(ddp.get("peak_allocated_gib"))):
                pool = gradient_pool_gib(ddp.get("n_params"), DTYPE_BYTES.get(str(keys["dtype"]), 2))
                saved = float(ddp["peak_allocated_gib"]) - float(forge["peak_allocated_gib"])
                speed = speedup(forge, ddp)
                verdict = pool_and_speed(saved, pool, speed)
                share = verdict.share
                line += [fmt_number(saved), fmt_number(pool), f"{share:.0%}" if share is not None else "—",
                         speed.text, verdict.text]
                record.update(dp_saved_gib=saved, bf16_pool_gib=pool, dp_pool_share=share, dp_speed_ratio=speed.value,
                              dp_speed_within_noise=speed.within_noise, dp_target_met=verdict.met)
            else:
                line += ["—"] * 5
            if fsdp_forge and fsdp and None not in (as_number(fsdp_forge.get("peak_allocated_gib")),
                                                     as_number(fsdp.get("peak_allocated_gib"))):
                delta = float(fsdp_forge["peak_allocated_gib"]) - float(fsdp["peak_allocated_gib"])
                verdict = "met" if delta < -FSDP_PARITY_GIB else ("met (parity)" if delta <= FSDP_PARITY_GIB else "not met")
                line += [fmt_number(delta), verdict]
                record.update(fsdp_peak_delta_gib=delta, fsdp_target_met=delta <= FSDP_PARITY_GIB)
            else:
                line += ["—", "—"]
            body.append(line)
            recs.append(record)
    if not body:
        return None
    dp_peaks = [as_number(r.get("peak_allocated_gib")) for r in rows if r["method"] == FORGE_DP]
    dp_peaks = [p for p in dp_peaks if p is not None]
    if len(dp_peaks) >= 2:
        notes.append(f"FORGE-DP's per-rank peak over the world sizes and buckets: {min(dp_peaks):.2f} to "
                     f"{max(dp_peaks):.2f} GiB (target: flat in N).")
    notes.append(f"Targets: FORGE-DP saves at least {POOL_SHARE_TARGET:.0%} of the gradient pool (one gradient "
                 "per parameter in the weight dtype: 2 bytes in bf16) per rank against DDP + fused AdamW, at no "
                 "loss of speed (DDP ms / FORGE-DP ms >= 1.00, or ~: a difference inside the two cells' "
                 f"step-time noise); FORGE-FSDP2's per-rank peak at or below FSDP2 + AdamW's (parity: within "
                 f"{FSDP_PARITY_GIB:g} GiB).")
    header = ["N", "DP bucket MB", "DP saved GiB", "gradient pool GiB", "saved / pool", "DDP / FORGE-DP time",
              "DP target", "FSDP2 Δpeak GiB", "FSDP2 target"]
    return Table(slug("distributed-targets", keys["device_name"], keys["model"], keys["dtype"], keys["batch"],
                      keys["seq"], run_label(keys["run_id"])),
                 f"Targets across GPUs, {group_title(keys)}",
                 "Per world size N (and data-parallel bucket size): FORGE-DP against DDP + fused AdamW, "
                 "FORGE-FSDP2 against FSDP2 + AdamW, per-rank peaks, within one run.",
                 header, body, "lrrrrrlrl", notes, recs)


def dist_figures(frame: pd.DataFrame, folder: Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Per group (its newest run): per-rank peak against world size, one line per arm."""
    paths = []
    for keys, group in one_per_key(dist_groups(frame)):
        rows = records(group)
        worlds = _world_sizes(group)
        fig = Figure(figsize=(6.5, 4.0))
        ax = fig.subplots()
        arms: dict[tuple, dict[str, Any]] = {}
        for row in sorted(rows, key=_arm_key):
            arms.setdefault(_arm_key(row), row)
        for key, first in arms.items():
            points = [(n, as_number(row.get("peak_allocated_gib")))
                      for n in worlds if (row := _cell(rows, first["method"], n, as_number(first.get("bucket_cap_mb"))))]
            points = [(n, p) for n, p in points if p is not None]
            if points:
                ax.plot([n for n, _ in points], [p for _, p in points], marker="o",
                        label=arm_label(first).replace("`", ""))
        if not ax.lines:
            continue
        ax.set_xticks(worlds)
        ax.set_xlabel("world size N (GPUs)")
        ax.set_ylabel("peak memory per rank (GiB)")
        ax.set_title(f"Per-rank peak: {group_title(keys)}", fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        fig.tight_layout()
        paths += save(fig, folder, slug("distributed-peak", keys["device_name"], keys["model"], keys["dtype"],
                                        keys["batch"], keys["seq"], run_label(keys["run_id"])), formats)
    return paths


__all__ = ["dist_figures", "dist_tables", "is_distributed", "target_table"]
