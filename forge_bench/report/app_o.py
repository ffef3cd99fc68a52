"""Capability (paper App. O): the largest model each arm trains per GPU, predicted by the analytic
memory model (``forge_bench.capability``) and measured in the rows (``coverage.largest_fit_tables``).

* ``predicted_table``: every GPU of ``capability.GPUS`` x arm of ``capability.CAPABILITY_ARMS`` for the
  default families at batch 1 x seq 512, written when any row comes from a GPU the arithmetic knows;
* ``comparison_tables``: per family measured at two or more sizes on such a GPU, each measured arm's
  largest model that ran ok and smallest that did not fit, beside the predicted ones at the same
  shape, dtype and activations. The memory model is a low estimate, so where the two differ the
  prediction is the larger.

``forge_bench.capability`` builds models on the meta device for their parameter counts, which
imports torch and transformers; the report imports it in these functions only, so a report with no
GPU rows never loads torch.
"""
from __future__ import annotations

import pandas as pd

from .coverage import largest_fit_tables
from .data import slug
from .render import Table

PREDICTED_BATCH, PREDICTED_SEQ = 1, 512


def known_gpus(frame: pd.DataFrame) -> dict[str, str]:
    """device_name -> ``capability.GPUS`` key, for the rows' devices the arithmetic knows."""
    from forge_bench.capability import gpu_of_device

    return {name: gpu for name in frame["device_name"].dropna().unique() if (gpu := gpu_of_device(name))}


def _boundary_text(model: str | None, gib: float | None) -> str:
    from forge_bench.capability import fmt_gib

    return "none" if model is None else f"{model} ({fmt_gib(gib)})"


def predicted_table() -> Table:
    """The predicted boundaries at batch 1 x seq 512, bf16, hf activations, every GPU and arm."""
    from forge_bench import capability

    found = capability.boundaries(batch=PREDICTED_BATCH, seq=PREDICTED_SEQ)
    body, recs = [], []
    for b in found:
        body.append([b.family, f"{b.gpu} ({b.hbm_gib:g} GB)", f"`{b.method}`", _boundary_text(b.largest_fit, b.largest_fit_gib),
                     "—" if b.first_miss is None else _boundary_text(b.first_miss, b.first_miss_gib),
                     f"{b.params_bound_b:.1f}"])
        recs.append(b.as_record())
    return Table(slug("capability-predicted", PREDICTED_BATCH, PREDICTED_SEQ),
                 f"Predicted: the largest model each arm trains, batch {PREDICTED_BATCH} × seq {PREDICTED_SEQ}, bf16",
                 f"From the analytic memory model (weights, optimizer states, gradients at the optimizer boundary, "
                 f"activations; `forge-bench capability`), against {capability.USABLE_FRACTION:.0%} of each GPU's "
                 f"nominal HBM (capability.USABLE_FRACTION). In brackets: the predicted GiB. B params: the "
                 f"parameters whose weights, states and gradients alone fill the usable memory.",
                 ["Family", "GPU", "Method", "Largest that fits", "Smallest that does not", "B params"],
                 body, "lllllr", [], recs)


def agreement(members: list[str], measured_largest: str | None, measured_miss: str | None,
              predicted_largest: str | None) -> bool | None:
    """Whether the measured and predicted boundaries agree: True (the same largest model), False, or
    None when the rows cannot tell: the prediction is the larger and no model above the measured
    largest was run to a miss (nothing larger was tried, or only arms that cannot run it)."""
    if measured_largest == predicted_largest:
        return True
    rank = {name: i for i, name in enumerate(members)}
    measured_rank = rank.get(measured_largest, -1) if measured_largest is not None else -1
    predicted_rank = rank.get(predicted_largest, -1) if predicted_largest is not None else -1
    if measured_miss is None and predicted_rank > measured_rank:
        return None
    return False


AGREEMENT_TEXT = {True: "yes", False: "no", None: "not tested above the measured largest"}


def comparison_tables(frame: pd.DataFrame) -> list[Table]:
    """Per measured family group on a known GPU: measured and predicted boundaries per arm."""
    from forge_bench import capability

    gpus = known_gpus(frame)
    tables = []
    for measured in largest_fit_tables(frame):
        if not measured.records:
            continue
        keys = {k: v for k, v in measured.records[0].items()
                if k not in ("method", "largest_ok", "first_not_fitting")}
        gpu = gpus.get(keys["device_name"])
        if gpu is None:
            continue
        try:
            members = capability.family_models(keys["family"])
        except capability.CapabilityError:
            continue                      # a family the zoo has no sized models of
        body, recs = [], []
        for rec in measured.records:
            try:
                [predicted] = capability.boundaries(
                    gpus=[gpu], arms=[rec["method"]], models=members, batch=int(keys["batch"]), seq=int(keys["seq"]),
                    dtype=str(keys["dtype"]), activations=str(keys.get("activations") or "hf"))
            except capability.CapabilityError:
                continue                  # an arm without a memory model (a plugin's)
            agree = agreement(members, rec["largest_ok"], rec["first_not_fitting"], predicted.largest_fit)
            body.append([f"`{rec['method']}`", rec["largest_ok"] or "none",
                         _boundary_text(predicted.largest_fit, predicted.largest_fit_gib),
                         rec["first_not_fitting"] or "—",
                         "—" if predicted.first_miss is None else _boundary_text(predicted.first_miss,
                                                                                 predicted.first_miss_gib),
                         AGREEMENT_TEXT[agree]])
            recs.append({**keys, "gpu": gpu, "method": rec["method"], "measured_largest": rec["largest_ok"],
                         "predicted_largest": predicted.largest_fit, "measured_first_miss": rec["first_not_fitting"],
                         "predicted_first_miss": predicted.first_miss, "predicted_largest_gib": predicted.largest_fit_gib,
                         "usable_gib": predicted.usable_gib, "agree": agree})
        if body:
            tables.append(Table(slug("capability", keys["family"], keys["device_name"], keys["batch"], keys["seq"]),
                                measured.title.replace("Largest", "Capability: largest", 1),
                                f"Measured: the largest model of the family that ran ok, and the smallest larger one "
                                f"that did not fit. Predicted: the analytic memory model against "
                                f"{capability.USABLE_FRACTION:.0%} of the {gpu}'s nominal HBM (predicted GiB in "
                                f"brackets). Agree: the same largest model; not tested: the prediction is the larger and "
                                f"no larger model was run to a miss. The model is a low estimate: where the two "
                                f"differ, the prediction is the larger.",
                                ["Method", "Measured largest", "Predicted largest", "Measured first miss",
                                 "Predicted first miss", "Agree"], body, "llllll", [], recs))
    return tables


def app_o_tables(frame: pd.DataFrame) -> list[Table]:
    """The section's tables: the measured-against-predicted ones, then the predicted grid; none when
    no row comes from a GPU the arithmetic knows."""
    if not known_gpus(frame):
        return []
    return comparison_tables(frame) + [predicted_table()]


__all__ = ["AGREEMENT_TEXT", "agreement", "app_o_tables", "comparison_tables", "known_gpus", "predicted_table"]
