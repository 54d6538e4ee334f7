"""The sampler fleet of the asynchronous trainer: its groups, and which group serves each episode.

A *group* is a pool of identical samplers: one GPU serving one precision with one KV-cache format,
hence one `NumericsSpec`, and a capacity share. The presets are the study's fleets L0, L1, L2
(`homogeneous`, `precision`, `mixed`), defined beside the GPU profiles in mismatch.fleets with
their share rules; `fleet(preset, shares)` resolves one into `SamplerGroup`s.

`Router` assigns each new episode (session) to a group in proportion to capacity. It is sticky —
a session keeps its group on later calls, so a multi-turn episode is sampled by one numerics —
and deterministic given its seed. Its guarantee, after N new sessions (any N, not only at the
end of a cycle):

    |count_g − N·share_g| < 1        for every group g

It schedules sessions as a uniprocessor Pfair schedule (Baruah et al., "Proportionate progress",
1996): the j-th session of group g has the window [floor((j−1)/s_g), ceil(j/s_g)) in units of
sessions, and each new session goes to the eligible group (window opened) with the earliest
window end. Any schedule that places every subtask inside its window keeps the lag N·s_g −
count_g strictly within (−1, 1); on one processor with Σ s_g = 1 such a schedule exists and
earliest-deadline-first finds one (it is optimal for unit jobs with integer windows), and some
group is always eligible (if none were at step t, every group would hold ≥ ceil((t+1)·s_g)
sessions, ≥ t+1 in all, but only t were assigned). The arithmetic is exact (fractions), so the
bound holds for shares like 1/3 as well. The naive "largest deficit" rule (smooth weighted
round-robin) does not have this bound: for some unequal shares over eight or nine groups
(weights 65:1000:3:1:3:54:1000:1000, say) its lag exceeds 1.

The seed orders ties between groups whose windows end together (a seeded permutation), so two
routers with the same groups and seed produce the same sequence. `release(session)` ends an
episode: the session leaves the sticky table (a later call with that id is a new session), and
its group keeps the count, so fairness is over all sessions ever assigned. All methods take one
lock: sampler worker threads call the router concurrently.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from mismatch.fleets import FLEETS
from mismatch.profiles import NumericsSpec

__all__ = ["SamplerGroup", "fleet", "fleet_file", "is_fleet_file", "Router"]


@dataclass(frozen=True)
class SamplerGroup:
    """A pool of identical samplers: its name ("<gpu>-<dtype>"), numerics and capacity share."""

    name: str
    spec: NumericsSpec
    share: float
    price_per_hour: float | None = None
    """$ per GPU-hour (a fleet file's groups; None for the presets)."""
    tokens_per_s: float | None = None
    """Sampled tokens/s per GPU of the real deployment (a fleet file's groups): with the price,
    what a sampled token costs (`cost_per_token`)."""

    @property
    def cost_per_token(self) -> float | None:
        """$ per sampled token on serverless billing (GPU-seconds of sampling), or None."""
        if self.price_per_hour is None or not self.tokens_per_s:
            return None
        return self.price_per_hour / 3600.0 / self.tokens_per_s


def run_fleet(cfg) -> list[SamplerGroup]:
    """The sampler groups a run samples with: `cfg.fleet`'s, each with the run's LM head
    (`TrainConfig.lm_head`)."""
    return [replace(g, spec=replace(g.spec, lm_head=cfg.lm_head)) for g in fleet(cfg.fleet)]


def is_fleet_file(name: str) -> bool:
    """Whether a `--fleet` value names a fleet file (a path ending in .toml) rather than a
    preset."""
    return isinstance(name, str) and name.lower().endswith(".toml")


def fleet_file(path: str) -> list[SamplerGroup]:
    """The groups of a fleet file: `[[group]]` tables with gpu, dtype, kv_cache and share (what
    `mismatch plan` writes as fleet.toml; price_per_hour and tokens_per_s optional). Raises
    ValueError with one line."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from pathlib import Path

    from mismatch.profiles import resolve

    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read fleet file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"fleet file {path} is not valid TOML: {exc}") from None
    raw = data.get("group")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"fleet file {path} has no [[group]] (write one with `mismatch plan`)")
    groups = []
    for i, g in enumerate(raw):
        if not isinstance(g, dict) or not {"gpu", "dtype", "share"} <= set(g):
            raise ValueError(f"fleet file {path}: group {i + 1} needs gpu, dtype and share")
        spec = resolve(str(g["gpu"]), str(g["dtype"]), str(g.get("kv_cache", "bf16")))
        name = str(g.get("name") or f"{spec.gpu}-{spec.dtype}")
        try:
            share = float(g["share"])
            price = None if g.get("price_per_hour") is None else float(g["price_per_hour"])
            rate = None if g.get("tokens_per_s") is None else float(g["tokens_per_s"])
        except (TypeError, ValueError):
            raise ValueError(f"fleet file {path}: group {name!r} has a value that is not a "
                             f"number") from None
        if not (math.isfinite(share) and share >= 0) or any(
                v is not None and not (math.isfinite(v) and v > 0) for v in (price, rate)):
            raise ValueError(f"fleet file {path}: group {name!r} needs share ≥ 0 and a "
                             f"positive price_per_hour and tokens_per_s")
        groups.append(SamplerGroup(name=name, spec=spec, share=share, price_per_hour=price,
                                   tokens_per_s=rate))
    total = sum(g.share for g in groups)
    names = [g.name for g in groups]
    if total <= 0 or len(set(names)) != len(names):
        raise ValueError(f"fleet file {path}: needs distinct group names and a share > 0")
    return [SamplerGroup(name=g.name, spec=g.spec, share=g.share / total,
                         price_per_hour=g.price_per_hour, tokens_per_s=g.tokens_per_s)
            for g in groups]


def fleet(preset: str,
          shares: Mapping[str, float] | Iterable[tuple[str, float]] = ()) -> list[SamplerGroup]:
    """The groups of `preset` ("homogeneous", "precision" or "mixed"), shares normalized to 1,
    or of a fleet file (a path ending in .toml: `fleet_file`).

    `shares`: {group name: weight} or [(name, weight)]; for `mixed`, groups left out get 0."""
    if is_fleet_file(preset):
        return fleet_file(preset)
    preset_fleet = FLEETS.get(preset.lower() if isinstance(preset, str) else preset)
    if preset_fleet is None:
        raise ValueError(f"unknown fleet preset {preset!r}; presets: {', '.join(FLEETS)}")
    items = shares.items() if isinstance(shares, Mapping) else shares
    try:
        pairs = tuple((str(k), float(v)) for k, v in items)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"fleet shares: expected (group, number) pairs ({exc})") from None
    return [SamplerGroup(name=g.name, spec=g.spec(), share=share)
            for g, share in preset_fleet.shares(pairs)]


class Router:
    """Sticky, capacity-proportional, deterministic assignment of sessions to groups (see the
    module docstring for the bound |count_g − N·share_g| < 1 and why it holds)."""

    def __init__(self, groups: Iterable[SamplerGroup], seed: int = 0) -> None:
        self.groups = list(groups)
        if not self.groups:
            raise ValueError("Router: no sampler groups")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"Router: duplicate group names in {', '.join(names)}")
        for g in self.groups:
            if not (isinstance(g.share, (int, float)) and math.isfinite(g.share) and g.share >= 0):
                raise ValueError(f"Router: share of {g.name} must be finite and >= 0, "
                                 f"got {g.share!r}")
        raw = [Fraction(g.share) for g in self.groups]
        total = sum(raw)
        if total <= 0:
            raise ValueError("Router: at least one group needs a share > 0")
        # exact normalized shares; a tiny float-normalization error does not move the schedule
        self._share = [w / total for w in raw]
        order = list(range(len(self.groups)))
        random.Random(seed).shuffle(order)
        self._tie = {g: rank for rank, g in enumerate(order)}
        self._counts = [0] * len(self.groups)
        self._sessions: dict[Hashable, int] = {}
        self._assigned = 0
        self._lock = threading.Lock()

    def _next_group(self) -> int:
        t = self._assigned  # the slot this session fills (0-based)
        best: tuple[int, int, int] | None = None
        for g, s in enumerate(self._share):
            if s == 0:
                continue
            j = self._counts[g] + 1  # the group's next subtask
            release = math.floor((j - 1) / s)
            if release > t:
                continue
            deadline = math.ceil(j / s)
            key = (deadline, self._tie[g], g)
            if best is None or key < best:
                best = key
        if best is None:  # impossible when the shares sum to 1 (module docstring)
            raise RuntimeError("Router: no eligible group")
        return best[2]

    def assign(self, session_id: Hashable) -> SamplerGroup:
        """The group serving `session_id`: its existing group if it is live, else a new one."""
        with self._lock:
            g = self._sessions.get(session_id)
            if g is None:
                g = self._next_group()
                self._counts[g] += 1
                self._assigned += 1
                self._sessions[session_id] = g
            return self.groups[g]

    def release(self, session_id: Hashable) -> SamplerGroup | None:
        """End an episode: forget its stickiness (its count stays). Returns its group, or None if
        the session was not live."""
        with self._lock:
            g = self._sessions.pop(session_id, None)
            return None if g is None else self.groups[g]

    def counts(self) -> dict[str, int]:
        """Sessions ever assigned, per group name (released ones included)."""
        with self._lock:
            return {grp.name: c for grp, c in zip(self.groups, self._counts)}

    def live(self) -> dict[str, int]:
        """Sessions assigned and not yet released, per group name."""
        with self._lock:
            out = {grp.name: 0 for grp in self.groups}
            for g in self._sessions.values():
                out[self.groups[g].name] += 1
            return out

    @property
    def assigned(self) -> int:
        """New sessions assigned so far (N in the bound)."""
        with self._lock:
            return self._assigned
