"""The optimizer families of the paper's App. I: names, regimes, their unfused optimizers and the
paper's figures. No torch here: the report reads it (``forge_bench.report.app_i``); the arms are
built in ``forge_bench.families``.
"""
from __future__ import annotations

from dataclasses import dataclass

STATE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Family:
    """One optimizer family: how its unfused arm runs and what the paper's App. I says about it."""
    name: str                          # the forge_core rule
    label: str                         # how the paper names it
    regime: int                        # docs/design.md section 1
    unfused: str                       # what the unfused arm runs
    torch_class: str | None            # torch.optim's class of the same name, if any
    states: float                      # parameter-sized state tensors (0 for factored statistics)
    unfused_graphable: bool            # whether the unfused step can be captured in a CUDA graph
    paper_speedup: float | None = None  # App. I's fused-over-unfused step-time ratio, where it names one
    takes_momentum: bool = False       # the sweep's ``momentum`` applies (SGD-like)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("rmsprop", "RMSprop", 1, "torch.optim.RMSprop", "RMSprop", 1.0, True),
    Family("adagrad", "Adagrad", 1, "torch.optim.Adagrad", "Adagrad", 1.0, False),
    Family("adamax", "Adamax", 1, "torch.optim.Adamax", "Adamax", 2.0, True),
    Family("nadam", "NAdam", 1, "torch.optim.NAdam", "NAdam", 2.0, True),
    Family("radam", "RAdam", 1, "torch.optim.RAdam", "RAdam", 2.0, True),
    Family("lamb", "LAMB", 2, "forge_core's LAMB reference optimizer", None, 2.0, False),
    Family("muon", "Muon", 2, "torch.optim.Muon (hidden weights) + torch.optim.AdamW (the rest)", "Muon", 1.0, True),
    Family("adafactor", "Adafactor", 3, "torch.optim.Adafactor", "Adafactor", 0.0, False, paper_speedup=3.4),
    Family("adalomo", "AdaLomo", 3, "forge_core's AdaLomo reference optimizer", None, 0.0, True),
    Family("sm3", "SM3", 3, "forge_core's SM3 reference optimizer", None, 0.0, True, paper_speedup=3.5),
    Family("adam_mini", "Adam-mini", 3, "forge_core's Adam-mini reference optimizer", None, 1.0, True,
           paper_speedup=2.5),
    Family("lars", "LARS", 3, "forge_core's LARS reference optimizer", None, 1.0, True, takes_momentum=True),
)}

PAPER_PEAK_FALL = (0.27, 0.54)
"""App. I (fp32 states, a 96 GB card): FORGE's peak falls by 27-54% against the unfused arm in every family."""
PAPER_TIME_FALL = (0.32, 0.71)
"""App. I: the step time falls by 32-71% in every family."""


def family_of(name: str) -> Family:
    """The family called ``name``; KeyError (one line, listing the known names) otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown optimizer family {name!r}; known: {', '.join(FAMILIES)}") from None


__all__ = ["FAMILIES", "Family", "PAPER_PEAK_FALL", "PAPER_TIME_FALL", "STATE_DTYPES", "family_of"]
