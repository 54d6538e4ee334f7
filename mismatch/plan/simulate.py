"""An asynchronous RL run on a sampler fleet over time: a discrete-event simulation.

`mismatch plan` solves for a steady fleet; a run is not steady. Spot GPUs are reclaimed, scale-ups
take minutes to load weights, and the trainer's pace and the fleet's meet in a buffer whose depth
sets how stale the sampled tokens are. `simulate` plays a run on a fleet of `PlanGroup`s under a
capacity trace and reports, per update, its time, staleness and cost, and per group what its GPUs
did. The events are scheduled with SimPy (https://simpy.readthedocs.io, a process-based
discrete-event library); the model is deliberately small:

**Samplers.** Group g has n_g(t) GPUs, each decoding `batch` sequences at once (continuous
batching, Yu et al., "Orca", OSDI 2022) at an aggregate r_g = `tokens_per_s` sampled tokens/s, so
one episode of L tokens lasts L · batch / r_g seconds whatever the other sequences do (a fuller
batch does not slow a sequence down, nor an emptier one speed it up). Each slot starts a new
episode the moment it frees, with the newest published weight version; episode lengths are drawn
(seeded, with replacement) from a list, e.g. `episode_lengths_from_metrics` of a `mismatch train`
run. An episode's useful tokens are its tokens × (1 − q_g), the group's MIS masked share applied
as an expectation.

**Router.** Because every slot pulls its next episode when it frees, the next episode starts on
group g with probability proportional to the rate at which g's slots free, n_g · batch /
(L · batch / r_g) = n_g r_g / L: capacity-proportional routing, the long-run shares of
mismatch.train.fleet's Router with shares n_g r_g / Σ n r, with no group left idle while another
queues. A user's `replan(capacity) -> shares` callback (the planner, say) is called at the start
and whenever a group's productive GPU count changes, with {group: productive GPUs}; its shares
(weights, normalised over the groups that have productive GPUs) are enforced as a cap on each
group's concurrent episodes: with c_g = n_g r_g, the fleet's pace is S = min over s_g > 0 of
c_g / s_g (the group that runs out first), and group g may run round(n_g · batch · s_g S / c_g)
episodes at once (at least 1 where s_g > 0), so its token share is s_g up to that rounding. A
share the capacity cannot carry leaves the other groups' GPUs partly idle — which serverless
billing does not charge and reserved billing does.

**Capacity.** A trace (`load_trace`: CSV `time_s,group,gpus`, one row per change) sets each
group's GPU count over time; a group it does not name keeps the count the caller gives (`gpus`,
else the group's `max_gpus`). The GPUs present at time 0 are productive at once, their slots
already in a steady state when `warm_start` (slot j of K starts with (j + ½)/K of its first
episode left, sampled with version 0: the run begins on a fleet that has been sampling, not with
every slot starting together). GPUs added later decode only after `cold_start_s` (weights loading,
CUDA graphs); they are held, and billed under reserved billing, from the moment they are added.
A removal is immediate: cold-starting GPUs go first, then productive ones, newest first; an
episode in flight on a removed GPU is lost (its tokens discarded, its GPU-seconds still billed)
and resampled — the same length is started afresh by the next free slot, so removals do not bias
the length distribution towards short episodes — as when a spot instance is reclaimed without
notice.

**Trainer.** Finished episodes wait in a FIFO buffer. The trainer takes exactly U =
`tokens_per_update` useful tokens (an episode that straddles two updates is split between them:
the token-weighted figures stay exact, and a real trainer packing whole episodes differs by less
than one episode per update), trains for `trainer_step_s`, and publishes version v + 1 after step
v. A consumed token's staleness is the trainer's version at consumption minus the version its
episode was sampled with (≥ 0). Without `max_staleness` the samplers never wait: when they
outpace the trainer the buffer, and the staleness, grow without bound. With `max_staleness` η a
slot starts a new episode only while the useful tokens started so far are below (v + η + 1) · U,
v the published version (the bounded staleness of AReaL, Fu et al., arXiv:2505.24298, in tokens
rather than trajectories): staleness then stays ≤ η whenever episodes finish in the order they
start.

**Billing**, both at once from the same run: *serverless* pays the GPU-seconds a group's GPUs
decode — busy slot-seconds / batch, i.e. a GPU decoding k of its `batch` sequences is k/batch
busy, as a platform packing requests on the fewest GPUs bills, which makes a sampled token cost
p_g / (3600 r_g), the planner's serverless price — and *reserved* pays every GPU held, cold ones
included. An update's cost is what was spent between the previous update's publication and its
own.

Bad input (a trace naming an unknown group, a negative or fractional GPU count, unsorted or
garbled rows, a group without a price or throughput) raises `PlanInputError` with one line.
"""

from __future__ import annotations

import csv
import json
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simpy

from . import PlanInputError
from .spec import PlanGroup

__all__ = ["CapacityTrace", "UpdateRecord", "GroupUsage", "SimResult", "load_trace",
           "episode_lengths_from_metrics", "simulate", "plot"]

TRACE_HEADER = ("time_s", "group", "gpus")
Replan = Callable[[dict[str, int]], Mapping[str, float]]


# ---- inputs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CapacityTrace:
    """Each group's GPU count over time: {group: ((time_s, gpus), ...)} sorted by time, a step
    function (the count holds until the next change)."""

    changes: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    path: str = "<trace>"

    def at(self, group: str, t: float, default: int) -> int:
        """GPUs of `group` at time t (the last change at or before t; `default` before the
        first)."""
        n = default
        for when, gpus in self.changes.get(group, ()):
            if when > t:
                break
            n = gpus
        return n

    def to_json(self) -> dict:
        return {g: [[t, n] for t, n in rows] for g, rows in self.changes.items()}


def _trace_error(path: str, line: int, msg: str) -> PlanInputError:
    return PlanInputError(f"{path}, line {line}: {msg}")


def load_trace(path: Path | str, groups: Iterable[PlanGroup | str]) -> CapacityTrace:
    """Read a capacity trace: CSV with the header `time_s,group,gpus` and one row per change
    (seconds from the run's start, a group's name, its GPU count from then on), rows in
    non-decreasing time; blank lines and lines starting with `#` are skipped. Raises
    PlanInputError naming the file, the line and what to fix."""
    path = Path(path)
    names = {g if isinstance(g, str) else g.name for g in groups}
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanInputError(f"cannot read capacity trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlanInputError(f"{path}: not a text file; a capacity trace is CSV with the header "
                             f"time_s,group,gpus") from None
    lines = text.splitlines()
    rows = [[] if ln.lstrip().startswith("#") else next(csv.reader([ln]), [])
            for ln in lines]  # one line at a time: a stray quote cannot swallow the next rows
    header_at = next((i for i, r in enumerate(rows) if any(c.strip() for c in r)), None)
    if header_at is None:
        raise PlanInputError(f"{path}: empty; a capacity trace is CSV with the header "
                             f"time_s,group,gpus and one row per change")
    header = tuple(c.strip() for c in rows[header_at])
    if header != TRACE_HEADER:
        raise _trace_error(str(path), header_at + 1, f"the header is {','.join(header)!r}; "
                           f"write time_s,group,gpus")
    changes: dict[str, list[tuple[float, int]]] = {}
    last_t = -math.inf
    for i in range(header_at + 1, len(rows)):
        row, line = rows[i], i + 1
        if not any(c.strip() for c in row):
            continue
        if len(row) != 3:
            raise _trace_error(str(path), line, f"{len(row)} fields; write time_s,group,gpus "
                               f"(3 fields)")
        t_raw, group, n_raw = (c.strip() for c in row)
        try:
            t = float(t_raw)
        except ValueError:
            raise _trace_error(str(path), line, f"time_s {t_raw!r} is not a number; write "
                               f"seconds from the run's start") from None
        if not math.isfinite(t) or t < 0:
            raise _trace_error(str(path), line, f"time_s {t_raw!r} must be finite and ≥ 0")
        if t < last_t:
            raise _trace_error(str(path), line, f"time_s {t_raw} comes before the previous "
                               f"row's {last_t:g}; sort the rows by time")
        if group not in names:
            known = ", ".join(sorted(names)) or "none"
            raise _trace_error(str(path), line, f"unknown group {group!r}; the fleet's groups: "
                               f"{known}")
        try:
            gpus = float(n_raw)
        except ValueError:
            raise _trace_error(str(path), line, f"gpus {n_raw!r} is not a number; write a whole "
                               f"number of GPUs ≥ 0") from None
        if not math.isfinite(gpus) or gpus < 0 or gpus != int(gpus):
            raise _trace_error(str(path), line, f"gpus {n_raw!r} must be a whole number ≥ 0")
        rows_g = changes.setdefault(group, [])
        if rows_g and rows_g[-1][0] == t:
            raise _trace_error(str(path), line, f"a second row for {group} at time_s {t_raw}; "
                               f"keep one row per group and time")
        rows_g.append((t, int(gpus)))
        last_t = t
    return CapacityTrace({g: tuple(r) for g, r in changes.items()}, str(path))


def episode_lengths_from_metrics(path: Path | str,
                                 fallback: Sequence[float] | None = None) -> list[float]:
    """Episode lengths (sampled tokens) from a `mismatch train` metrics.jsonl, else `fallback`.

    A step's record holds its `sampled_tokens` and `n_episodes`, not each episode's length, so
    the list holds each step's mean episode length (sampled_tokens / n_episodes), one per step:
    the run's drift in length is kept, but the spread of means is narrower than the spread of
    episodes — give per-episode lengths as `fallback` (or directly to `simulate`) where you have
    them. With no usable record the fallback is returned; with none given, PlanInputError."""
    path = Path(path)
    out: list[float] = []
    problem = None
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        lines, problem = [], f"cannot read {path}: {exc.strerror or exc}"
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        tokens, eps = rec.get("sampled_tokens"), rec.get("n_episodes")
        if (isinstance(tokens, (int, float)) and isinstance(eps, (int, float))
                and not isinstance(tokens, bool) and eps > 0 and tokens > 0):
            out.append(float(tokens) / float(eps))
    if out:
        return out
    if fallback is not None:
        return [float(x) for x in fallback]
    raise PlanInputError(problem or f"{path}: no step with sampled_tokens and n_episodes; give "
                         f"the `mismatch train` metrics.jsonl of a run, or a list of lengths")


def _check_groups(groups: Sequence[PlanGroup]) -> None:
    if not groups:
        raise PlanInputError("simulate: no groups")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise PlanInputError(f"simulate: two groups share a name in {', '.join(names)}")
    for g in groups:
        for figure, positive in (("tokens_per_s", True), ("price_per_hour", False)):
            v = getattr(g, figure)
            if v is None or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise PlanInputError(f"group {g.name!r}: {figure} must be a number "
                                     f"{'>' if positive else '≥'} 0, got {v!r}; give it (or let "
                                     f"`mismatch plan` fill it)")
        if g.masked is not None and not (0 <= g.masked < 1):
            raise PlanInputError(f"group {g.name!r}: masked must be in [0, 1), got {g.masked!r}")


# ---- outputs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class UpdateRecord:
    """One trainer update."""

    version: int
    """The version it published (1 for the first update)."""
    consumed_s: float
    """When the trainer took its tokens."""
    time_s: float
    """When it published (consumed_s + trainer_step_s)."""
    trainer_wait_s: float
    """How long the trainer waited for tokens before taking them."""
    staleness_mean: float
    """Useful-token-weighted mean staleness of its tokens, in versions."""
    staleness_max: int
    staleness_tokens: dict[int, float]
    """Useful tokens per staleness."""
    group_tokens: dict[str, float]
    """Useful tokens per group that supplied any."""
    cost_serverless_usd: float
    """Spent since the previous publication, serverless billing."""
    cost_reserved_usd: float
    """Spent since the previous publication, reserved billing."""
    buffered_tokens: float
    """Useful tokens left waiting in the buffer once it took its own."""

    def to_json(self) -> dict:
        return {"version": self.version, "consumed_s": self.consumed_s, "time_s": self.time_s,
                "trainer_wait_s": self.trainer_wait_s, "staleness_mean": self.staleness_mean,
                "staleness_max": self.staleness_max,
                "staleness_tokens": {str(k): v for k, v in sorted(self.staleness_tokens.items())},
                "group_tokens": dict(self.group_tokens),
                "cost_serverless_usd": self.cost_serverless_usd,
                "cost_reserved_usd": self.cost_reserved_usd,
                "buffered_tokens": self.buffered_tokens}


@dataclass(frozen=True)
class GroupUsage:
    """What one group's GPUs did over the run."""

    name: str
    held_gpu_s: float
    """GPU-seconds held (cold-starting included): what reserved billing charges."""
    productive_gpu_s: float
    """GPU-seconds past their cold start."""
    busy_gpu_s: float
    """GPU-seconds decoding (busy slot-seconds / batch): what serverless billing charges."""
    sampled_tokens: float
    """Tokens of the episodes it finished."""
    consumed_tokens: float
    """Useful tokens of its episodes the trainer consumed."""
    lost_tokens: float
    """Tokens decoded on removed GPUs, discarded."""
    lost_episodes: int
    cost_serverless_usd: float
    cost_reserved_usd: float

    @property
    def utilisation(self) -> float:
        """Busy GPU-seconds over available (held) GPU-seconds; 0 when it held none."""
        return self.busy_gpu_s / self.held_gpu_s if self.held_gpu_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"name": self.name, "held_gpu_s": self.held_gpu_s,
                "productive_gpu_s": self.productive_gpu_s, "busy_gpu_s": self.busy_gpu_s,
                "utilisation": self.utilisation, "sampled_tokens": self.sampled_tokens,
                "consumed_tokens": self.consumed_tokens, "lost_tokens": self.lost_tokens,
                "lost_episodes": self.lost_episodes,
                "cost_serverless_usd": self.cost_serverless_usd,
                "cost_reserved_usd": self.cost_reserved_usd}


@dataclass(frozen=True)
class SimResult:
    """A simulated run: its updates in order, each group's usage and the capacity it had."""

    updates: tuple[UpdateRecord, ...]
    groups: tuple[GroupUsage, ...]
    duration_s: float
    capacity: tuple[tuple[float, str, int, int], ...]
    """(time_s, group, GPUs held, GPUs productive) at the start and after every change."""
    params: dict = field(default_factory=dict)
    """The inputs, for the record."""

    @property
    def updates_per_hour(self) -> float:
        """The pace between the first and the last publication (3600 (N − 1) / (t_N − t_1));
        with fewer than two updates, N per hour of the run."""
        u = self.updates
        if len(u) >= 2 and u[-1].time_s > u[0].time_s:
            return 3600.0 * (len(u) - 1) / (u[-1].time_s - u[0].time_s)
        return 3600.0 * len(u) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def staleness_tokens(self) -> dict[int, float]:
        """Useful tokens per staleness over every update."""
        out: dict[int, float] = {}
        for u in self.updates:
            for k, v in u.staleness_tokens.items():
                out[k] = out.get(k, 0.0) + v
        return dict(sorted(out.items()))

    @property
    def staleness_mean(self) -> float:
        hist = self.staleness_tokens
        total = sum(hist.values())
        return sum(k * v for k, v in hist.items()) / total if total > 0 else 0.0

    @property
    def staleness_max(self) -> int:
        return max((u.staleness_max for u in self.updates), default=0)

    def cost_usd(self, billing: str) -> float:
        """The whole run's spend under `billing` ("serverless" or "reserved")."""
        attr = _billing_attr(billing)
        return sum(getattr(g, attr) for g in self.groups)

    def cost_per_update(self, billing: str) -> list[tuple[float, float]]:
        """[(publication time_s, $ spent since the previous one)] under `billing`: cost per
        update over time."""
        attr = _billing_attr(billing)
        return [(u.time_s, getattr(u, attr)) for u in self.updates]

    def token_shares(self) -> dict[str, float]:
        """Each group's share of the sampled tokens."""
        total = sum(g.sampled_tokens for g in self.groups)
        return {g.name: (g.sampled_tokens / total if total > 0 else 0.0) for g in self.groups}

    def to_json(self) -> dict:
        n = len(self.updates)
        return {"duration_s": self.duration_s, "updates": n,
                "updates_per_hour": self.updates_per_hour,
                "staleness_mean": self.staleness_mean, "staleness_max": self.staleness_max,
                "staleness_tokens": {str(k): v for k, v in self.staleness_tokens.items()},
                "cost_usd": {b: self.cost_usd(b) for b in ("serverless", "reserved")},
                "cost_per_update_usd": {b: (self.cost_usd(b) / n if n else None)
                                        for b in ("serverless", "reserved")},
                "token_shares": self.token_shares(),
                "groups": [g.to_json() for g in self.groups],
                "capacity": [{"time_s": t, "group": g, "held": h, "productive": p}
                             for t, g, h, p in self.capacity],
                "per_update": [u.to_json() for u in self.updates],
                "params": dict(self.params)}


def _billing_attr(billing: str) -> str:
    if billing not in ("serverless", "reserved"):
        raise ValueError(f"billing is {billing!r}; choose serverless or reserved")
    return f"cost_{billing}_usd"


# ---- the simulation --------------------------------------------------------------------------

class _Gpu:
    __slots__ = ("g", "state", "procs")

    def __init__(self, g: int) -> None:
        self.g = g
        self.state = "cold"          # cold → up → gone
        self.procs: list = []        # its cold-start process, then its slot processes


class _Run:
    def __init__(self, groups, lengths, U, tau, batch, cold, replan, eta, seed):
        self.env = simpy.Environment()
        self.groups = list(groups)
        G = len(self.groups)
        self.r = [float(g.tokens_per_s) for g in self.groups]
        self.p = [float(g.price_per_hour) / 3600.0 for g in self.groups]  # $ per GPU-second
        self.q = [float(g.masked or 0.0) for g in self.groups]
        self.batch = batch
        self.lengths = np.asarray(lengths, dtype=np.float64)
        self.rng = np.random.default_rng(seed)
        self.U, self.tau, self.cold, self.replan, self.eta = U, tau, cold, replan, eta
        self.gpus: list[list[_Gpu]] = [[] for _ in range(G)]
        self.active = [0] * G
        self.n_up = [0] * G
        self.cap = [0] * G
        # running integrals
        self.last_t = 0.0
        self.held_s = [0.0] * G
        self.up_s = [0.0] * G
        self.busy_s = [0.0] * G
        self.sampled = [0.0] * G
        self.consumed = [0.0] * G
        self.lost_tokens = [0.0] * G
        self.lost_eps = [0] * G
        self.retry: deque[float] = deque()
        self.started_useful = 0.0
        # buffer and trainer
        self.buffer: deque[list] = deque()  # [useful tokens left, version, group]
        self.buffered = 0.0
        self.version = 0
        self.updates: list[UpdateRecord] = []
        self.capacity: list[tuple[float, str, int, int]] = []
        self._wake = self.env.event()
        self._arrival = self.env.event()
        self._billed = (0.0, 0.0)  # cumulative (serverless, reserved) at the last publication

    # accounting
    def advance(self) -> None:
        now = self.env.now
        dt = now - self.last_t
        if dt > 0:
            for g, gpus in enumerate(self.gpus):
                self.held_s[g] += len(gpus) * dt
                self.up_s[g] += self.n_up[g] * dt
                self.busy_s[g] += self.active[g] / self.batch[g] * dt
        self.last_t = now

    def spent(self) -> tuple[float, float]:
        return (sum(b * p for b, p in zip(self.busy_s, self.p)),
                sum(h * p for h, p in zip(self.held_s, self.p)))

    def notify(self) -> None:
        wake, self._wake = self._wake, self.env.event()
        wake.succeed()

    def record_capacity(self, g: int) -> None:
        gpus = self.gpus[g]
        self.capacity.append((self.env.now, self.groups[g].name, len(gpus), self.n_up[g]))

    # capacity
    def capacity_changed(self) -> None:
        """Recompute the groups' caps on concurrent episodes (module docstring) and wake the
        slots waiting on them."""
        up = list(self.n_up)
        slots = [n * b for n, b in zip(up, self.batch)]
        self.cap = slots if self.replan is None else self._replanned_caps(up, slots)
        self.notify()

    def _replanned_caps(self, up: list[int], slots: list[int]) -> list[int]:
        names = [g.name for g in self.groups]
        shares = self.replan({n: k for n, k in zip(names, up)})
        if not isinstance(shares, Mapping):
            raise PlanInputError(f"replan returned {type(shares).__name__}; return "
                                 f"{{group: share}}")
        unknown = sorted(set(shares) - set(names))
        if unknown:
            raise PlanInputError(f"replan returned a share for unknown group {unknown[0]!r}; "
                                 f"the groups: {', '.join(names)}")
        s = []
        for n in names:
            v = shares.get(n, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v >= 0):
                raise PlanInputError(f"replan returned share {v!r} for {n!r}; shares are "
                                     f"numbers ≥ 0")
            s.append(float(v))
        live = [g for g in range(len(names)) if s[g] > 0 and up[g] > 0]
        if not live:
            return [0] * len(names)  # nothing samples until the next change
        total = sum(s[g] for g in live)
        c = [up[g] * self.r[g] for g in range(len(names))]
        pace = min(c[g] / (s[g] / total) for g in live)
        caps = [0] * len(names)
        for g in live:
            caps[g] = min(slots[g], max(1, round(slots[g] * (s[g] / total) * pace / c[g])))
        return caps

    def set_gpus(self, g: int, n: int) -> None:
        self.advance()
        gpus = self.gpus[g]
        changed = False
        while len(gpus) < n:
            gpu = _Gpu(g)
            gpus.append(gpu)
            if self.cold > 0:
                gpu.procs.append(self.env.process(self._cold_start(gpu)))
            else:
                self._bring_up(gpu, residuals=None)
                changed = True
        while len(gpus) > n:
            cold = [x for x in gpus if x.state == "cold"]
            gpu = cold[-1] if cold else gpus[-1]
            gpus.remove(gpu)
            if gpu.state == "up":
                self.n_up[g] -= 1
                changed = True
            gpu.state = "gone"
            for proc in gpu.procs:
                if proc.is_alive:
                    proc.interrupt("removed")
        self.record_capacity(g)
        if changed:
            self.capacity_changed()

    def _cold_start(self, gpu: _Gpu):
        try:
            yield self.env.timeout(self.cold)
        except simpy.Interrupt:
            return
        self.advance()
        self._bring_up(gpu, residuals=None)
        self.record_capacity(gpu.g)
        self.capacity_changed()

    def _bring_up(self, gpu: _Gpu, residuals: list[float] | None) -> None:
        gpu.state = "up"
        self.n_up[gpu.g] += 1
        for k in range(self.batch[gpu.g]):
            res = None if residuals is None else residuals[k]
            gpu.procs.append(self.env.process(self._slot(gpu, k, res)))

    # sampling
    def _may_start(self, g: int) -> bool:
        if self.active[g] >= self.cap[g]:
            return False
        if self.eta is not None:
            return self.started_useful < (self.version + self.eta + 1) * self.U * (1 - 1e-12)
        return True

    def _next_length(self) -> float:
        if self.retry:
            return self.retry.popleft()
        return float(self.lengths[self.rng.integers(len(self.lengths))])

    def _slot(self, gpu: _Gpu, k: int, residual: float | None):
        g, env = gpu.g, self.env
        per_token = self.batch[g] / self.r[g]
        running = None  # (length, useful, start, duration)
        try:
            while True:
                while not self._may_start(g):
                    yield self._wake
                length = self._next_length()
                useful = length * (1.0 - self.q[g])
                frac = residual if (residual is not None and env.now == 0) else 1.0
                residual = None
                duration = frac * length * per_token
                self.advance()
                self.active[g] += 1
                self.started_useful += useful
                version = self.version
                running = (length, useful, env.now, duration)
                yield env.timeout(duration)
                running = None
                self.advance()
                self.active[g] -= 1
                self.sampled[g] += length
                self.buffer.append([useful, version, g])
                self.buffered += useful
                if not self._arrival.triggered:
                    self._arrival.succeed()
                # no wake-up needed: this slot, looping, is the first to use the room it made
        except simpy.Interrupt:
            if running is None:
                return
            length, useful, start, duration = running
            self.advance()
            self.active[g] -= 1
            self.started_useful -= useful
            self.lost_eps[g] += 1
            self.lost_tokens[g] += (env.now - start) / per_token
            self.retry.append(length)
            self.notify()

    # training
    def trainer(self, target: int | None, done: simpy.Event):
        env, U = self.env, self.U
        while True:
            idle_from = env.now
            while self.buffered < U * (1 - 1e-12):
                self._arrival = env.event()
                yield self._arrival
            consumed_at = env.now
            need = U
            hist: dict[int, float] = {}
            by_group: dict[str, float] = {}
            while need > U * 1e-12 and self.buffer:
                item = self.buffer[0]
                take = min(item[0], need)
                st = self.version - item[1]
                hist[st] = hist.get(st, 0.0) + take
                name = self.groups[item[2]].name
                by_group[name] = by_group.get(name, 0.0) + take
                self.consumed[item[2]] += take
                item[0] -= take
                need -= take
                if item[0] <= U * 1e-12:
                    self.buffer.popleft()
            self.buffered = max(0.0, self.buffered - U)
            buffered = self.buffered
            yield env.timeout(self.tau)
            self.advance()
            self.version += 1
            spent = self.spent()
            total = sum(hist.values())
            self.updates.append(UpdateRecord(
                version=self.version, consumed_s=consumed_at, time_s=env.now,
                trainer_wait_s=consumed_at - idle_from,
                staleness_mean=sum(k * v for k, v in hist.items()) / total if total else 0.0,
                staleness_max=max(hist, default=0), staleness_tokens=dict(sorted(hist.items())),
                group_tokens=by_group, cost_serverless_usd=spent[0] - self._billed[0],
                cost_reserved_usd=spent[1] - self._billed[1], buffered_tokens=buffered))
            self._billed = spent
            if self.eta is not None:
                self.notify()
            if target is not None and self.version >= target:
                done.succeed()
                return

    def trace_process(self, g: int, rows):
        for t, n in rows:
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            self.set_gpus(g, n)


def simulate(groups: Sequence[PlanGroup], lengths: Sequence[float], *,
             tokens_per_update: float, trainer_step_s: float,
             duration_s: float | None = None, updates: int | None = None,
             trace: CapacityTrace | Path | str | None = None,
             gpus: Mapping[str, int] | None = None, cold_start_s: float = 0.0,
             batch: int | Mapping[str, int] = 1, replan: Replan | None = None,
             max_staleness: int | None = None, seed: int = 0,
             warm_start: bool = True) -> SimResult:
    """Simulate an asynchronous RL run on `groups` (module docstring for the model).

    groups: PlanGroups with tokens_per_s (per GPU) and price_per_hour; masked (q_g) 0 when None.
    lengths: episode lengths in sampled tokens, drawn with replacement (seeded).
    tokens_per_update: U, useful tokens per update. trainer_step_s: one update's training time.
    duration_s / updates: stop at that simulated time, or after that many updates (whichever
    comes first; one of them is needed).
    trace: a CapacityTrace or the path of a trace CSV (`load_trace`). gpus: {group: GPUs} for
    the groups the trace leaves out or before their first row (default: the group's max_gpus).
    cold_start_s: seconds a GPU added after the start takes to become productive.
    batch: sequences each GPU decodes at once (one for all groups, or {group: batch}).
    replan: called with {group: productive GPUs} at the start and whenever that changes; returns
    {group: token share}. None: shares follow capacity.
    max_staleness: η, the admission bound (module docstring); None: samplers never wait.
    warm_start: the fleet at time 0 is mid-stream (module docstring); False: every slot starts a
    whole episode at time 0.
    """
    groups = list(groups)
    _check_groups(groups)
    names = [g.name for g in groups]
    lengths = [float(x) for x in lengths]
    if not lengths or any(not (math.isfinite(x) and x > 0) for x in lengths):
        raise PlanInputError("simulate: episode lengths must be a non-empty list of positive "
                             "token counts")
    for label, v in (("tokens_per_update", tokens_per_update),
                     ("trainer_step_s", trainer_step_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise PlanInputError(f"simulate: {label} must be a positive number, got {v!r}")
    if not (isinstance(cold_start_s, (int, float)) and math.isfinite(cold_start_s)
            and cold_start_s >= 0):
        raise PlanInputError(f"simulate: cold_start_s must be ≥ 0, got {cold_start_s!r}")
    if duration_s is None and updates is None:
        raise PlanInputError("simulate: give duration_s or updates (when to stop)")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise PlanInputError(f"simulate: duration_s must be > 0, got {duration_s!r}")
    if updates is not None and (int(updates) != updates or updates < 1):
        raise PlanInputError(f"simulate: updates must be a whole number ≥ 1, got {updates!r}")
    if max_staleness is not None and (int(max_staleness) != max_staleness or max_staleness < 0):
        raise PlanInputError(f"simulate: max_staleness must be a whole number ≥ 0, got "
                             f"{max_staleness!r}")
    if isinstance(batch, Mapping):
        unknown = sorted(set(batch) - set(names))
        if unknown:
            raise PlanInputError(f"simulate: batch names unknown group {unknown[0]!r}")
        b = [batch.get(n, 1) for n in names]
    else:
        b = [batch] * len(names)
    if any(isinstance(x, bool) or int(x) != x or x < 1 for x in b):
        raise PlanInputError(f"simulate: batch must be a whole number ≥ 1, got {batch!r}")
    b = [int(x) for x in b]
    gpus = dict(gpus or {})
    unknown = sorted(set(gpus) - set(names))
    if unknown:
        raise PlanInputError(f"simulate: gpus names unknown group {unknown[0]!r}")
    default = {g.name: gpus.get(g.name, g.max_gpus) for g in groups}
    for n, k in default.items():
        if isinstance(k, bool) or int(k) != k or k < 0:
            raise PlanInputError(f"simulate: gpus of {n!r} must be a whole number ≥ 0, got {k!r}")
    if trace is None:
        trace = CapacityTrace()
    elif not isinstance(trace, CapacityTrace):
        trace = load_trace(trace, groups)
    unknown = sorted(set(trace.changes) - set(names))
    if unknown:
        raise PlanInputError(f"{trace.path}: unknown group {unknown[0]!r}; the fleet's groups: "
                             f"{', '.join(names)}")
    for name, rows in trace.changes.items():
        times = [t for t, _ in rows]
        if any(not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0) for t in times) \
                or any(b <= a for a, b in zip(times, times[1:])):
            raise PlanInputError(f"{trace.path}: the changes of {name!r} need increasing times "
                                 f"≥ 0, got {times}")
        if any(isinstance(n, bool) or int(n) != n or n < 0 for _, n in rows):
            raise PlanInputError(f"{trace.path}: the GPU counts of {name!r} must be whole "
                                 f"numbers ≥ 0, got {[n for _, n in rows]}")

    run = _Run(groups, lengths, float(tokens_per_update), float(trainer_step_s), b,
               float(cold_start_s), replan, None if max_staleness is None else int(max_staleness),
               seed)
    env = run.env
    # the fleet at time 0: productive at once, mid-stream when warm
    for g, grp in enumerate(groups):
        n0 = int(trace.at(grp.name, 0.0, int(default[grp.name])))
        total_slots = n0 * b[g]
        for i in range(n0):
            gpu = _Gpu(g)
            run.gpus[g].append(gpu)
            res = ([(i * b[g] + k + 0.5) / total_slots for k in range(b[g])]
                   if warm_start else None)
            run._bring_up(gpu, res)
        run.record_capacity(g)
    run.capacity_changed()
    for g, grp in enumerate(groups):
        later = [(t, n) for t, n in trace.changes.get(grp.name, ()) if t > 0]
        if later:
            env.process(run.trace_process(g, later))
    done = env.event()
    env.process(run.trainer(updates, done))
    until = done if updates is not None else duration_s
    if updates is not None and duration_s is not None:
        stop = env.timeout(duration_s)
        until = env.any_of([done, stop])
    try:
        env.run(until=until)
    except RuntimeError as exc:  # the event queue ran dry: nothing samples any more
        if "No scheduled events left" not in str(exc):
            raise
        raise PlanInputError(f"simulate: the run stops at t = {env.now:g} s after "
                             f"{len(run.updates)} of {updates} updates: no GPU can sample "
                             f"(check the capacity trace and replan's shares)") from None
    run.advance()
    usage = tuple(GroupUsage(
        name=grp.name, held_gpu_s=run.held_s[g], productive_gpu_s=run.up_s[g],
        busy_gpu_s=run.busy_s[g], sampled_tokens=run.sampled[g],
        consumed_tokens=run.consumed[g], lost_tokens=run.lost_tokens[g],
        lost_episodes=run.lost_eps[g], cost_serverless_usd=run.busy_s[g] * run.p[g],
        cost_reserved_usd=run.held_s[g] * run.p[g]) for g, grp in enumerate(groups))
    params = {"groups": [grp.to_json() for grp in groups], "tokens_per_update": tokens_per_update,
              "trainer_step_s": trainer_step_s, "duration_s": duration_s, "updates": updates,
              "gpus": default, "trace": trace.to_json(), "cold_start_s": cold_start_s,
              "batch": dict(zip(names, b)), "replan": replan is not None,
              "max_staleness": max_staleness, "seed": seed, "warm_start": warm_start,
              "lengths": {"n": len(lengths), "mean": float(np.mean(lengths)),
                          "min": min(lengths), "max": max(lengths)}}
    return SimResult(updates=tuple(run.updates), groups=usage, duration_s=float(env.now),
                     capacity=tuple(run.capacity), params=params)


# ---- the figure ------------------------------------------------------------------------------

def plot(result: SimResult, path: Path | str) -> str:
    """Cost per update (both billings) and staleness (mean and max) over the run, capacity
    changes marked; written atomically (`mismatch.io.save_figure`). Returns the file's name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mismatch.io import save_figure

    fig, (ax_cost, ax_st) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [u.time_s / 3600.0 for u in result.updates]
    for billing, style in (("serverless", "-"), ("reserved", "--")):
        ax_cost.plot(t, [c for _, c in result.cost_per_update(billing)], style, lw=1.2,
                     label=billing)
    ax_cost.set_ylabel("$ per update")
    ax_cost.legend(loc="best", fontsize=8)
    ax_st.plot(t, [u.staleness_mean for u in result.updates], "-", lw=1.2, label="mean")
    ax_st.plot(t, [u.staleness_max for u in result.updates], ":", lw=1.0, label="max")
    ax_st.set_ylabel("staleness (versions)")
    ax_st.set_xlabel("time (hours)")
    ax_st.legend(loc="best", fontsize=8)
    changes = sorted({c[0] for c in result.capacity if c[0] > 0})
    for ax in (ax_cost, ax_st):
        for c in changes:
            ax.axvline(c / 3600.0, color="0.7", lw=0.8, zorder=0)
        ax.grid(alpha=0.3)
    ax_cost.set_title(f"{len(result.updates)} updates, {result.updates_per_hour:.3g}/hour; "
                      f"grey: capacity changes")
    return save_figure(fig, Path(path))
