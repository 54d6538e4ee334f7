"""The event model of the fleet simulation (mismatch.plan.simulate, whose docstring states the
model): GPUs that cold-start, serve and go; slots that decode episodes; the trainer that takes U
useful tokens per update and publishes versions; the bills."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import numpy as np
import simpy

from . import PlanInputError
from .simresult import UpdateRecord

__all__: list[str] = []


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
