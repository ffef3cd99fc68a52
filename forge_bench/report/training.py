"""The report's training-quality sections: convergence runs and fidelity measurements.

Their rows are not sweep rows (``forge_bench.run_rows``): ``forge-bench convergence`` writes one
row per (arm, seed) with the loss curves, ``forge-bench fidelity`` one row per arm and shape.

* Convergence, per device, model, settings (``spec_hash``) and corpus: a loss-curve figure
  (validation loss per arm, mean over seeds with the seeds' range; the smoothed training loss; and
  each arm's validation loss minus the baseline's on the same seed) and a table of end-of-run
  deltas against fused AdamW (``adamw_fused``; ``adamw_foreach`` where it has no completed run),
  paired by seed: the runs of one seed share initial weights and batches, so the pairing removes
  the seed-to-seed spread. Target: |delta| <= ``TARGET_DELTA`` nats. Folders that ran the same
  settings again (a repeat: same arm, seed, initial weights and batches) are pooled: each seed's
  runs are averaged, and how far apart the repeats ended is the run-to-run floor of a delta (GPU
  kernels are not bitwise deterministic, and training amplifies a last-bit difference). The
  floor (``floor_curve``) is, at each evaluation, the largest |validation loss gap| between two runs
  of one arm and seed, over every arm and seed of the study; an arm is within the floor when its
  |delta| at the end is at most the floor's last value, and the figure shades the floor around 0
  beside each arm's mean delta curve.
* Fidelity, per device, shape, steps and learning rate: rms-rel and max |dW| of each arm against
  fp32, and each arm's rms-rel over the standard bf16 path's (below 1: closer to fp32).
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .data import slug
from .figures import FORMATS, method_colors, save
from .render import Table
from .data import params_text

CONVERGENCE_BASELINES = ("adamw_fused", "adamw_foreach")
CONVERGENCE_KEYS = ["device_name", "model", "spec_hash", "corpus_digest"]
TARGET_DELTA = 0.01
FLAT_FRACTION = 0.2           # "flat": how much the validation loss still fell over the last 20% of the steps
FIDELITY_KEYS = ["device_name", "vocab", "hidden", "tokens", "steps", "lr"]
STANDARD_BF16 = "adamw_bf16"


def _completed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["status"] == "ok") & frame["completed"].fillna(False).astype(bool)]


def convergence_groups(frame: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """(keys, completed ok runs) per device, model, settings and corpus."""
    done = _completed(frame)
    return [(dict(zip(CONVERGENCE_KEYS, keys)), group)
            for keys, group in done.groupby(CONVERGENCE_KEYS, sort=True, dropna=False)]


def _baseline(group: pd.DataFrame) -> str | None:
    return next((b for b in CONVERGENCE_BASELINES if b in set(group["arm"])), None)


def _arms(group: pd.DataFrame, baseline: str | None) -> list[str]:
    arms = sorted(set(group["arm"]), key=lambda a: (a != baseline, not a.startswith("adamw"), a.startswith("forge"), a))
    return arms


def _title(keys: dict[str, Any], group: pd.DataFrame) -> str:
    first = group.iloc[0]
    return (f"{keys['model']} ({params_text(first['n_params'])}), {int(first['steps'])} steps of "
            f"{int(first['batch'])}×{int(first['seq'])} bytes, lr {first['lr']:g}, {keys['device_name']}")


def _tail_drop(val_step: Sequence[int], val_loss: Sequence[float], steps: int) -> float | None:
    """How much the validation loss fell over the last ``FLAT_FRACTION`` of the run (nats)."""
    points = [(s, v) for s, v in zip(val_step, val_loss)]
    if len(points) < 2:
        return None
    start = steps * (1 - FLAT_FRACTION)
    before = [v for s, v in points if s <= start]
    return (before[-1] - points[-1][1]) if before else None


def _by_seed(rows: list[dict[str, Any]], column: str) -> dict[int, list[Any]]:
    """``column``'s values per seed: one run's, or a run's and its repeats'."""
    by_seed: dict[int, list[Any]] = {}
    for row in rows:
        by_seed.setdefault(int(row["seed"]), []).append(row[column])
    return by_seed


def _seed_means(rows: list[dict[str, Any]], column: str) -> dict[int, Any]:
    """Per seed, the mean of ``column`` over that seed's runs; list columns (curves) are averaged
    point by point over the runs of the longest length."""
    by_seed = _by_seed(rows, column)
    if not rows or np.ndim(rows[0][column]) == 0:
        return {seed: float(np.mean(values)) for seed, values in by_seed.items()}
    means = {}
    for seed, curves in by_seed.items():
        longest = max(len(c) for c in curves)
        means[seed] = np.mean([np.asarray(c, dtype=float) for c in curves if len(c) == longest], axis=0)
    return means


def repeat_gaps(rows: list[dict[str, Any]]) -> list[float]:
    """|final validation loss difference| of every two runs of one arm and seed (a repeat)."""
    return [abs(float(a) - float(b)) for values in _by_seed(rows, "final_val_loss").values()
            for a, b in itertools.combinations(values, 2)]


def floor_curve(group: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """The run-to-run floor of a study: (validation steps, the largest |validation loss gap| at each
    between two runs of one arm and seed, over every arm and seed of ``group``); None when no run
    was repeated. Its last value is the floor of an end-of-run delta."""
    steps, gaps = None, []
    for _, runs in group.groupby(["arm", "seed"], sort=True):
        for a, b in itertools.combinations(runs.to_dict("records"), 2):
            if len(a["val_loss"]) == len(b["val_loss"]) and list(a["val_step"]) == list(b["val_step"]):
                steps = np.asarray(a["val_step"], dtype=float)
                gaps.append(np.abs(np.asarray(a["val_loss"], dtype=float) - np.asarray(b["val_loss"], dtype=float)))
    same = [g for g in gaps if steps is not None and g.size == steps.size]
    return (steps, np.max(same, axis=0)) if same else None


def convergence_tables(frame: pd.DataFrame) -> list[Table]:
    tables = []
    for keys, group in convergence_groups(frame):
        baseline = _baseline(group)
        base_rows = group[group["arm"] == baseline].to_dict("records") if baseline else []
        base_val, base_train = _seed_means(base_rows, "final_val_loss"), _seed_means(base_rows, "final_train_loss_smoothed")
        study_gaps = [g for arm in _arms(group, baseline) for g in repeat_gaps(group[group["arm"] == arm].to_dict("records"))]
        floor = max(study_gaps) if study_gaps else None      # the run-to-run floor of this study
        body, recs, gaps_all = [], [], {}
        for arm in _arms(group, baseline):
            rows = group[group["arm"] == arm].to_dict("records")
            val_by_seed = _seed_means(rows, "final_val_loss")
            train_by_seed = _seed_means(rows, "final_train_loss_smoothed")
            val, train = np.array(list(val_by_seed.values())), np.array(list(train_by_seed.values()))
            paired = sorted(seed for seed in val_by_seed if seed in base_val)
            dval = np.array([val_by_seed[s] - base_val[s] for s in paired])
            dtrain = np.array([train_by_seed[s] - base_train[s] for s in paired])
            drops = [d for d in (_tail_drop(r["val_step"], r["val_loss"], int(r["steps"])) for r in rows) if d is not None]
            rates = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None]
            gaps = repeat_gaps(rows)
            if gaps:
                gaps_all[arm] = gaps

            def spread(values: np.ndarray, digits: int = 4) -> str:
                if values.size == 0:
                    return "—"
                text = f"{values.mean():+.{digits}f}" if digits else f"{values.mean():.0f}"
                return text + (f" ± {values.std(ddof=1):.{digits}f}" if values.size > 1 else "")

            within = None if arm == baseline or dval.size == 0 else bool(abs(dval.mean()) <= TARGET_DELTA)
            in_floor = None if within is None or floor is None else bool(abs(dval.mean()) <= floor)
            body.append([f"`{arm}`", f"{len(val_by_seed)}" + (f" ({len(rows)} runs)" if len(rows) > len(val_by_seed) else ""),
                         f"{val.mean():.4f}" + (f" ± {val.std(ddof=1):.4f}" if val.size > 1 else ""),
                         "baseline" if arm == baseline else spread(dval), f"{train.mean():.4f}",
                         "baseline" if arm == baseline else spread(dtrain),
                         "—" if within is None else ("yes" if within else "no"),
                         "—" if in_floor is None else ("yes" if in_floor else "no"),
                         "—" if not drops else f"{np.mean(drops):.4f}",
                         "—" if not gaps else f"{max(gaps):.4f}",
                         "—" if not rates else f"{np.mean(rates):,.0f}"])
            recs.append({**keys, "arm": arm, "seeds": len(val_by_seed), "runs": len(rows),
                         "final_val_loss_mean": float(val.mean()),
                         "delta_val_mean": float(dval.mean()) if dval.size and arm != baseline else None,
                         "delta_train_smoothed_mean": float(dtrain.mean()) if dtrain.size and arm != baseline else None,
                         "within_target": within, "run_to_run_floor": floor, "within_floor": in_floor,
                         "val_drop_last_20pct": float(np.mean(drops)) if drops else None,
                         "repeat_gap_max": max(gaps) if gaps else None,
                         "tokens_per_s": float(np.mean(rates)) if rates else None})
        caption = (f"End of run, mean over seeds (± their standard deviation); a seed run more than once counts "
                   f"as the mean of its runs. Δ: the arm's value minus `{baseline}`'s on the same seed (same "
                   f"initial weights and batches), in nats per byte; target |Δ val| ≤ {TARGET_DELTA}. Smoothed "
                   f"train: mean training loss over the last 10% of the steps. Last-20% drop: how much the "
                   f"validation loss still fell over the last 20% of the steps (near 0: the curve has "
                   f"flattened). Repeat |Δ|: the largest end-of-run gap between two runs of one seed of the "
                   f"arm. Floor: the largest end-of-run gap between two runs of one arm and seed over every arm "
                   f"of this study (its run-to-run spread); within the floor: |Δ val| at most that, so this "
                   f"study cannot tell the arm from `{baseline}` (— where no run was repeated).") if baseline \
            else "No fused or foreach AdamW run completed here: no deltas."
        notes = []
        if gaps_all:
            every = [g for gaps in gaps_all.values() for g in gaps]
            notes.append(f"Run to run: the same arm and seed run again (same settings, initial weights and batches) "
                         f"ended {min(every):.4f}-{max(every):.4f} nats apart ({len(every)} pair{'s' if len(every) > 1 else ''}, "
                         f"{', '.join(f'`{a}`' for a in gaps_all)}): GPU kernels are not bitwise deterministic and "
                         f"training amplifies the difference, so a Δ of that size is noise. The largest gap, "
                         f"{max(every):.4f}, is this study's floor.")
        tables.append(Table(slug("convergence", keys["device_name"], keys["model"], keys["spec_hash"]),
                            f"Convergence, {_title(keys, group)}", caption,
                            ["Arm", "Seeds", "Final val loss", "Δ val", "Smoothed train", "Δ train",
                             f"|Δ val| ≤ {TARGET_DELTA}", "|Δ val| ≤ floor" + (f" ({floor:.4f})" if floor is not None else ""),
                             "Last-20% drop", "Repeat |Δ|", "Tokens/s"],
                            body, "lrrrrrllrrr", notes, recs))
    return tables


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    if window <= 1 or values.size < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def convergence_figures(frame: pd.DataFrame, folder: Path, formats: Sequence[str] = FORMATS
                        ) -> tuple[list[Path], str | None]:
    groups = convergence_groups(frame)
    if not groups:
        return [], "no convergence run completed"
    paths = []
    for keys, group in groups:
        baseline = _baseline(group)
        arms = _arms(group, baseline)
        colors = method_colors(arms)
        fig = Figure(figsize=(13.0, 3.9))
        ax_val, ax_train, ax_delta = fig.subplots(1, 3)
        base = _seed_means(group[group["arm"] == baseline].to_dict("records"), "val_loss") if baseline else {}
        measured = floor_curve(group)
        for arm in arms:
            rows = group[group["arm"] == arm].to_dict("records")
            steps = np.asarray(rows[0]["val_step"], dtype=float)
            vals = np.array([r["val_loss"] for r in rows if len(r["val_loss"]) == steps.size], dtype=float)
            ax_val.plot(steps, vals.mean(0), color=colors[arm], label=arm)
            if len(vals) > 1:
                ax_val.fill_between(steps, vals.min(0), vals.max(0), color=colors[arm], alpha=0.15)
            window = max(1, len(rows[0]["train_loss"]) // 50)
            smoothed = np.mean([_smooth(r["train_loss"], window) for r in rows], axis=0)
            ax_train.plot(np.arange(smoothed.size) + window, smoothed, color=colors[arm], label=arm)
            curves = _seed_means(rows, "val_loss")
            diffs = [curve - base[seed] for seed, curve in curves.items() if seed in base and base[seed].size == curve.size]
            if diffs and arm != baseline:
                ax_delta.plot(steps, np.mean(diffs, axis=0), color=colors[arm], marker=".", label=arm)
        marks = [ax_delta.fill_between(measured[0], -measured[1], measured[1], color="#7f7f7f", alpha=0.3,
                                       label="run-to-run floor")] if measured is not None else []
        marks.append(ax_delta.axhline(TARGET_DELTA, color="#2ca02c", linestyle="--", linewidth=0.9,
                                      label=f"±{TARGET_DELTA} nats"))
        ax_delta.axhline(-TARGET_DELTA, color="#2ca02c", linestyle="--", linewidth=0.9)
        ax_delta.axhline(0.0, color="black", linewidth=0.8)
        ax_delta.legend(handles=marks, loc="upper right", fontsize=7)
        for ax, title, ylabel in ((ax_val, "Validation loss (seed range shaded)", "nats per byte"),
                                  (ax_train, "Training loss (moving average)", "nats per byte"),
                                  (ax_delta, f"Validation loss − {baseline or 'baseline'}, same seed\n(mean over "
                                             f"seeds; run-to-run floor shaded)", "Δ nats per byte")):
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        low = min(float(np.min(r["val_loss"])) for r in group.to_dict("records"))
        ax_val.set_ylim(low - 0.05, low + 1.5)
        handles, labels = ax_val.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), title="arm", fontsize=8)
        fig.suptitle(f"Convergence: {_title(keys, group)}")
        fig.tight_layout()
        paths += save(fig, folder, slug("convergence", keys["device_name"], keys["model"], keys["spec_hash"]), formats)
    return paths, None


def fidelity_run_tables(frame: pd.DataFrame) -> list[Table]:
    tables = []
    for keys, group in frame.groupby(FIDELITY_KEYS, sort=True, dropna=False):
        keys = dict(zip(FIDELITY_KEYS, keys))
        newest = group.sort_values("finished_at").groupby("arm", sort=False).tail(1)
        standard = newest[newest["arm"] == STANDARD_BF16]
        reference = float(standard["rms_rel"].iloc[0]) if not standard.empty else math.nan
        order = [STANDARD_BF16, "forge_fp32", "forge_bf16", "forge_bf16_sr", "forge_int8", "forge_fp8"]
        rows = sorted(newest.to_dict("records"), key=lambda r: (order.index(r["arm"]) if r["arm"] in order else 99, r["arm"]))
        body, recs = [], []
        for row in rows:
            ratio = row["rms_rel"] / reference if reference and not math.isnan(reference) else None
            body.append([f"`{row['arm']}`", row["gradient"], row["state_dtype"], f"{row['rms_rel']:.4e}",
                         f"{row['max_abs_dw']:.3e}", f"{row['rms_rel_update']:.4e}",
                         "—" if ratio is None else f"{ratio:.4f}"])
            recs.append({**keys, "arm": row["arm"], "rms_rel": row["rms_rel"], "max_abs_dw": row["max_abs_dw"],
                         "rms_rel_update": row["rms_rel_update"], "rms_rel_over_standard_bf16": ratio})
        forge = newest[newest["arm"] == "forge_bf16"]
        claim = []
        if not forge.empty and not standard.empty:
            holds = float(forge["rms_rel"].iloc[0]) <= reference
            claim = [f"FORGE bf16 is {'no further from' if holds else 'further from'} fp32 than the standard bf16 "
                     f"path here ({float(forge['rms_rel'].iloc[0]):.4e} against {reference:.4e})."]
        tables.append(Table(slug("fidelity-app-e", keys["device_name"], keys["vocab"], keys["hidden"], keys["tokens"],
                                 f"lr{keys['lr']:g}"),
                            f"Fidelity against fp32, {int(keys['vocab'])}×{int(keys['hidden'])} head, "
                            f"{int(keys['tokens'])} tokens, {int(keys['steps'])} steps, lr {keys['lr']:g}, "
                            f"{keys['device_name']}",
                            "Every arm: bf16 weights and inputs, the same W₀ and batches as the fp32 run (fp32 "
                            "weights, gradient and moments). rms-rel = rms(W − W_fp32) / rms(W_fp32); of the update: "
                            "over rms(W_fp32 − W₀); last column: rms-rel over the standard bf16 path's.",
                            ["Arm", "Gradient", "Moments", "rms-rel", "max |dW|", "rms-rel of the update",
                             "vs standard bf16"], body, "lllrrrr", claim, recs))
    return tables


__all__ = ["TARGET_DELTA", "convergence_figures", "convergence_groups", "convergence_tables", "fidelity_run_tables",
           "floor_curve", "repeat_gaps"]
