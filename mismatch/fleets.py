"""Sampler fleets: which GPUs serve which precisions, with which KV cache, in what shares.

A fleet is a tuple of groups; a group is a pool of identical samplers: one GPU serving one
precision with one KV-cache format, hence one `NumericsSpec` (mismatch.profiles.resolve). The
study's three fleets, one row each of `FLEETS`:

    fleet        level  groups
    homogeneous  L0     B200 BF16, BF16 KV (the trainer's numerics up to the kernels: control)
    precision    L1     B200 W4A16-NVFP4 (NVFP4 weights, BF16 activations), FP8 KV
    mixed        L2     the study's mixed samplers (docs/study.md):
                        B200 and B300 NVFP4; H100 and H200 FP8 and BF16; A100 and RTX PRO 6000
                        BF16; every group with an FP8 KV cache

Shares. A one-group fleet holds all the capacity (naming its one group with a positive weight is
allowed, anything else is an error). The mixed fleet's shares are equal unless some are given,
and then the groups left out get 0 (the study does not publish its shares as numbers). Shares
are normalized to 1. The accelerator probe weighs its fleet KL by them; the trainer's router
(mismatch.train.fleet) sends each group its share of episodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mismatch.registry import add_once

from .profiles import NumericsSpec, ProfileError, resolve

__all__ = ["FleetGroup", "Fleet", "FLEETS", "register_fleet", "natural_pairs", "fleet_groups"]


@dataclass(frozen=True, kw_only=True)
class FleetGroup:
    """A pool of identical samplers."""

    gpu: str
    """GPU profile name (mismatch.profiles.GPUS)."""
    dtype: str
    """Serving precision (mismatch.quantize.precisions)."""
    kv_cache: str
    """KV-cache format."""

    @property
    def name(self) -> str:
        return f"{self.gpu}-{self.dtype}"

    def spec(self) -> NumericsSpec:
        return resolve(self.gpu, self.dtype, self.kv_cache)


@dataclass(frozen=True, kw_only=True)
class Fleet:
    """A fleet preset: its groups, in order."""

    name: str
    """Preset name (`--fleet`)."""
    level: str
    """The study's name for it (L0, L1, L2)."""
    groups: tuple[FleetGroup, ...]
    """Its groups; names are unique."""

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"fleet {self.name}: needs groups with distinct names, got {names}")

    def shares(self, given: tuple[tuple[str, float], ...] = ()) -> list[tuple[FleetGroup, float]]:
        """[(group, share)], shares normalized to 1 (module docstring)."""
        if len(self.groups) == 1:
            (group,) = self.groups
            for key, value in given:
                if key.lower() != group.name:
                    raise ValueError(f"fleet {self.name}: unknown group {key!r}; groups: "
                                     f"{group.name}")
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"fleet {self.name}: share of {group.name} must be finite "
                                     f"and > 0")
            return [(group, 1.0)]
        weights = {k.lower(): float(v) for k, v in given}
        names = {g.name for g in self.groups}
        unknown = sorted(set(weights) - names)
        if unknown:
            raise ProfileError(f"--fleet-shares: unknown group {unknown[0]!r}; groups: "
                               f"{', '.join(sorted(names))}")
        if any(v < 0 or not math.isfinite(v) for v in weights.values()):
            raise ProfileError("--fleet-shares: shares must be finite and >= 0")
        raw = [(g, weights.get(g.name, 0.0 if weights else 1.0)) for g in self.groups]
        total = sum(s for _, s in raw)
        if total <= 0:
            raise ProfileError("--fleet-shares: at least one share must be > 0")
        return [(g, s / total) for g, s in raw]


FLEETS: dict[str, Fleet] = {}


def register_fleet(fleet: Fleet) -> Fleet:
    """Add a fleet preset; a name may be registered once."""
    return add_once(FLEETS, fleet.name, fleet, "fleet")


_MIXED = (("b200", "nvfp4"), ("b300", "nvfp4"), ("h100", "fp8"), ("h100", "bf16"),
          ("h200", "fp8"), ("h200", "bf16"), ("a100", "bf16"), ("rtx-pro-6000", "bf16"))

for _fleet in (
    Fleet(name="homogeneous", level="L0",
          groups=(FleetGroup(gpu="b200", dtype="bf16", kv_cache="bf16"),)),
    Fleet(name="precision", level="L1",
          groups=(FleetGroup(gpu="b200", dtype="w4a16-nvfp4", kv_cache="fp8"),)),
    Fleet(name="mixed", level="L2",
          groups=tuple(FleetGroup(gpu=g, dtype=d, kv_cache="fp8") for g, d in _MIXED)),
):
    register_fleet(_fleet)


def natural_pairs() -> list[tuple[str, str]]:
    """The study's mixed fleet as (gpu, dtype): each GPU at the precisions it served (B200/B300
    NVFP4; H100/H200 FP8 and BF16; A100 and RTX PRO 6000 BF16)."""
    return [(g.gpu, g.dtype) for g in FLEETS["mixed"].groups]


def fleet_groups(shares: tuple[tuple[str, float], ...] = ()) -> list[tuple[str, str, float]]:
    """[(gpu, dtype, share)] of the study's mixed fleet, shares normalized to 1."""
    return [(g.gpu, g.dtype, s) for g, s in FLEETS["mixed"].shares(shares)]
