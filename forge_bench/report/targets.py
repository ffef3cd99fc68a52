"""The memory-and-speed target that FORGE's arms are held to against their unfused twins: save at
least ``POOL_SHARE_TARGET`` of the gradient pool the twin holds, at no loss of speed. One verdict
for the distributed table (FORGE-DP against DDP) and the App. I table (each family against its
unfused optimizer), through the report's one ratio rule (``ratios.speedup``: noise, clock bounds,
refusals)."""
from __future__ import annotations

from dataclasses import dataclass

from ..units import GIB
from .ratios import Ratio

POOL_SHARE_TARGET = 0.90
POWER_FLOOR_TARGET = 1.05
"""A FORGE step's allowed distance from its power-limited floor (``forge_bench.floor``): step / floor."""


def gradient_pool_gib(n_params: object, bytes_per_parameter: int) -> float:
    """The gradient pool a model of ``n_params`` parameters holds: one gradient per parameter, GiB."""
    return bytes_per_parameter * float(n_params or 0) / GIB


@dataclass(frozen=True)
class PoolVerdict:
    """``met``: None when the times could not be divided (the saving alone cannot decide it);
    ``text``: met / not met / n/a (time); ``why``: what missed, for a table with room for it."""
    share: float | None
    met: bool | None
    text: str
    why: str = ""

    @property
    def long_text(self) -> str:
        return f"{self.text} ({self.why})" if self.why else self.text


def no_slower(speed: Ratio) -> bool:
    """Whether a speed-up (the other arm's step over this one's) says "no slower": at least 1, or a
    difference inside the two cells' step-time noise (not measurably slower)."""
    return speed.is_number and (speed.value >= 1.0 or speed.within_noise)


INT8_AGAINST_BF16 = (("forge_int8", "forge_bf16"), ("forge_int8_cce", "forge_bf16_cce"))
"""(int8, bf16) arm pairs held to "an eager forge_int8 step no slower than forge_bf16's" (the margin
issue's last target: the int8 codec must not cost the step what the moments' bytes save)."""


def pool_and_speed(saved_gib: float, pool_gib: float, speed: Ratio, strictly_faster: bool = False) -> PoolVerdict:
    """Whether ``saved_gib`` is at least the target share of ``pool_gib`` and ``speed`` (the twin's step
    over FORGE's) is no slower: a ratio of at least 1, or one inside the two cells' step-time noise
    (not measurably slower). ``strictly_faster``: the speed part asks a ratio above 1 outside the noise."""
    share = saved_gib / pool_gib if pool_gib else None
    if share is None or share < POOL_SHARE_TARGET:
        return PoolVerdict(share, False, "not met", f"{share:.0%} of the pool" if share is not None else "no pool")
    if not speed.is_number:
        return PoolVerdict(share, None, "n/a (time)")
    fast = speed.value > 1.0 and not speed.within_noise if strictly_faster else no_slower(speed)
    return PoolVerdict(share, fast, "met" if fast else "not met", "" if fast else
                       ("not faster" if strictly_faster else "slower"))


__all__ = ["INT8_AGAINST_BF16", "POOL_SHARE_TARGET", "PoolVerdict", "gradient_pool_gib", "no_slower", "pool_and_speed"]
