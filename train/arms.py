"""The correction arms of the study (docs/study.md) as data: `Arm` says which token weight, score
centering and top-p replay an arm's loss uses, `ARMS` names them (`mismatch train --correction`).
No torch: the run config and the command line read the registry without loading it. The loss
itself is train/loss.py's, which re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch.ratios import MIS_HIGH, MIS_LOW
from mismatch.registry import table_of

__all__ = ["Arm", "ARMS", "arm_named"]

_TIS_CAP = 2.0  # truncated IS's cap C: a token weighs at most twice its sampled share


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One correction arm of the study, with every parameter its loss uses."""

    name: str
    """the arm's name (the key of ARMS; `--correction`)"""
    weight: str
    """token weight w: "one", "mis" (x inside [mis_low, mis_high], else 0) or "tis"
    (min(x, tis_cap))"""
    centered: bool
    """score centering over the candidate set"""
    top_p: bool
    """renormalize π and μ over the replayed top-p support"""
    mis_low: float
    """MIS band's lower end: a "mis" weight zeroes ratios below it; every arm reports the
    fraction of tokens outside [mis_low, mis_high] (`mis_masked_fraction`)"""
    mis_high: float
    """MIS band's upper end"""
    tis_cap: float
    """truncated IS's cap C (the "tis" weight)"""

    def __post_init__(self):
        if self.weight not in ("one", "mis", "tis"):
            raise ValueError(f"weight must be one, mis or tis, got {self.weight!r}")
        if not 0 <= self.mis_low < self.mis_high:
            raise ValueError(f"the MIS band needs 0 <= low < high, got [{self.mis_low}, "
                             f"{self.mis_high}]")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


def _registry(*arms: Arm) -> dict[str, Arm]:
    return table_of(arms, lambda arm: arm.name, "arm")


# every arm states its band and cap; today all share MIS_LOW, MIS_HIGH and _TIS_CAP (IcePop is
# MIS under another name: the same token mask over the same band)
ARMS: dict[str, Arm] = _registry(
    Arm(name="grpo", weight="one", centered=False, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="mis", weight="mis", centered=False, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="icepop", weight="mis", centered=False, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="tis", weight="tis", centered=False, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="sc", weight="one", centered=True, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="sc+mis", weight="mis", centered=True, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="sc+tis", weight="tis", centered=True, top_p=False,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="topp", weight="one", centered=False, top_p=True,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
    Arm(name="sc+mis+topp", weight="mis", centered=True, top_p=True,
        mis_low=MIS_LOW, mis_high=MIS_HIGH, tis_cap=_TIS_CAP),
)
"""The correction arms by name (`--correction`)."""


def arm_named(name: str) -> Arm:
    """ARMS[name], or a ValueError listing the arms."""
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r}; arms: {', '.join(ARMS)}")
    return ARMS[name]
