"""The sampler pipeline: workers claim units, sample them with the newest published weights they
may use, and queue the finished units for the trainer.

- A worker thread claims units, picks up the newest published weights if it holds an older
  version (only between units, never mid-episode), and drives the episodes (unit_sampling.py). Each
  sampled token carries the version that generated it. The router (fleet.Router,
  capacity-proportional) assigns each unit to a sampler group; all its episodes are sampled by
  that group's numerics (a GRPO group is one request to one server).
- `Publisher` holds the newest weights and their monotonic version; the trainer publishes the
  BF16 cast of its master as version step+1 after each step. Staleness of a token = the
  optimizer step that consumes it − the version that generated it.
- The gate (`Pipeline._may_claim`). Unbounded staleness (default): a unit is claimed while fewer
  than `queue_steps` steps' worth are claimed and not yet consumed (back-pressure, not a
  staleness bound). `max_staleness` = s: while claimed < (version + 1 + s)·prompts_per_step (an
  AReaL-style bounded-staleness gate). Lockstep (`sync`, forced `staleness` K): one step of units
  per version, claimed together and generated as one batch (as a server batches the requests
  it holds), with the weights of K versions before (the publisher holds them).
- A batch holds the claimed units of every sampler group, each unit computed with its own group's
  numerics (lanes: mismatch.engines.lanes), where the groups can share one batch; otherwise one
  batch per group.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

import torch

from mismatch.engines.lanes import attention_of, lanes_possible
from mismatch.probes.base import TORCH_DTYPES

from .batch import Unit
from .components import PipelineConfig
from .config import TrainConfig
from .fleet import Router, SamplerGroup
from .unit_sampling import model_at, sample_in_worker, sample_units, split_units

__all__ = ["Publisher", "Pipeline", "PipelineConfig", "by_group", "spread_width"]


class Publisher:
    """The newest published weights and their monotonic version; with `keep` > 0 it also holds
    the `keep` versions before it (what samplers K versions behind load)."""

    def __init__(self, version: int, weights: dict[str, torch.Tensor], keep: int = 0,
                 history: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        self._lock = threading.Lock()
        self.keep = keep
        self.version, self.weights = version, weights
        self.history: dict[int, dict[str, torch.Tensor]] = dict(history or {})
        self.history[version] = weights

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if version <= self.version:
                raise RuntimeError(f"publication must be monotonic: {version} after "
                                   f"{self.version}")
            self.version, self.weights = version, weights
            self.history[version] = weights
            for v in [v for v in self.history if v < version - self.keep]:
                del self.history[v]

    def latest(self, lag: int = 0) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version, or the one `lag` versions before it (the oldest held if the run
        is younger than `lag`)."""
        with self._lock:
            if lag == 0:
                return self.version, self.weights
            v = max(self.version - lag, min(self.history))
            return v, self.history[v]

    def older(self) -> dict[int, dict[str, torch.Tensor]]:
        """The held versions before the newest (saved in checkpoints to resume a lag)."""
        with self._lock:
            return {v: w for v, w in self.history.items() if v != self.version}


def _spread(batches: list[list], n: int) -> list[list]:
    """Split the largest batches in halves (by units) until there are `n` batches or none has two
    units: every sampler process gets a share of a step (each episode's draws are its own)."""
    out = [list(b) for b in batches]
    while len(out) < n:
        big = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[big]) < 2:
            break
        out[big:big + 1] = _halves(out[big])
    return out


def _attends_alike(group) -> tuple:
    """Groups whose rows share one attention call in a lane batch (lanes.attention_of)."""
    spec = getattr(group, "spec", None)
    return attention_of(spec) if spec is not None else (group,)


def _halves(batch: list) -> list[list]:
    """Two halves of a batch of claims, as many units each (±1). A lane batch (several groups)
    is cut along its groups' attention: whole sets of groups that attend alike go to one half,
    the largest first into the half with more room (a set that does not fit is cut there), so
    each process runs fewer kinds of attention and GEMM per layer; a decode step is made of small
    operations, and each kind is another call per layer and step. The study's mixed fleet, 16
    units in two processes: the FA3 groups (H100/H200, FP8 and BF16) in one, the NVFP4, A100 and
    RTX groups in the other — 2.14 and 2.09 s of sampling CPU against 2.51 s each for halves of
    every group (reports/benchmarks.md). Each half keeps the claims' order."""
    half = len(batch) // 2
    sets: dict[tuple, list[int]] = {}
    for i, (_, group) in enumerate(batch):
        sets.setdefault(_attends_alike(group), []).append(i)
    if len(sets) == 1:
        return [batch[:half], batch[half:]]
    room, parts = [half, len(batch) - half], [[], []]
    for members in sorted(sets.values(), key=len, reverse=True):  # ties: the first claimed first
        side = 0 if room[0] >= room[1] else 1
        take = min(room[side], len(members))
        parts[side] += members[:take]
        parts[1 - side] += members[take:]
        room[side] -= take
        room[1 - side] -= len(members) - take
    return [[batch[i] for i in sorted(part)] for part in parts]


def spread_width(pipeline: PipelineConfig, processes: int) -> int:
    """Over how many sampler processes one claim's batch is split. Lockstep: one thread claims
    the whole step, so over all of them. Asynchronous: each sampler thread claims its own share
    (`Pipeline._chunk`) and has `processes` / threads of them to itself; splitting its share
    again would sample in batches half as large, and slower (an asynchronous step measured
    0.79–0.86× of `--sync`'s before, ~1.0× after: reports/benchmarks.md)."""
    if pipeline.lockstep:
        return processes
    return max(1, processes // max(pipeline.workers, processes))


def by_group(claims: list[tuple[int, SamplerGroup]]) -> list[list[tuple[int, SamplerGroup]]]:
    """The claimed units, one batch per sampler group (in order of first claim)."""
    out: dict[str, list[tuple[int, SamplerGroup]]] = defaultdict(list)
    for u, group in claims:
        out[group.name].append((u, group))
    return list(out.values())


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Pipeline:
    """Sampler worker threads feeding finished units into a queue, gated as the run's
    `PipelineConfig` (`cfg.pipeline`, this module's) says."""

    def __init__(self, cfg: TrainConfig, groups: list[SamplerGroup], model, tokenizer,
                 publisher: Publisher, start_unit: int, pool=None) -> None:
        self.cfg, self.groups, self.tokenizer, self.publisher = cfg, groups, tokenizer, publisher
        self._base = model
        self.pool = pool  # sampler processes (mismatch.engines.workers.WorkerPool), or None
        self.router = Router(groups, seed=cfg.seed)
        for u in range(start_unit):  # replay: unit u's group is the router's u-th assignment
            self.router.assign(u)
            self.router.release(u)
        self.cursor = start_unit
        self.consumed = start_unit
        self.results: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.busy_seconds = 0.0

    def start(self) -> None:
        threads = max(self.cfg.pipeline.workers, self.pool.size if self.pool is not None else 0)
        for w in range(threads):
            th = threading.Thread(target=self._work, name=f"sampler-{w}", daemon=True)
            th.start()
            self._threads.append(th)

    def _may_claim(self) -> bool:
        p, bound = self.cfg.prompts_per_step, self.cfg.pipeline.staleness_bound
        if self.cfg.pipeline.lockstep:
            return self.cursor < (self.publisher.version + 1) * p
        if bound is not None:
            return self.cursor < (self.publisher.version + 1 + bound) * p
        return self.cursor < self.consumed + self.cfg.pipeline.queue_steps * p

    def _claim(self) -> tuple[int, SamplerGroup] | None:
        with self._cond:
            while not self._stop.is_set() and not self._may_claim():
                self._cond.wait(0.5)
            if self._stop.is_set():
                return None
            u = self.cursor
            self.cursor += 1
            group = self.router.assign(u)
            self.router.release(u)
            return u, group

    def notify(self, consumed: int | None = None) -> None:
        with self._cond:
            if consumed is not None:
                self.consumed = consumed
            self._cond.notify_all()

    @property
    def _chunk(self) -> int:
        """Asynchronous claims: a step's units shared among the sampler threads, in batches."""
        pool = getattr(self, "pool", None)
        threads = max(self.cfg.pipeline.workers, pool.size if pool is not None else 0)
        return max(1, self.cfg.prompts_per_step // threads)

    def _claim_some(self, limit: int) -> list[tuple[int, SamplerGroup]]:
        """Asynchronous modes: the next unit (waiting for the gate), then up to `limit` − 1 more
        that the gate allows now — sampled together, as a server batches what it holds."""
        first = self._claim()
        if first is None:
            return []
        claims = [first]
        with self._cond:
            while len(claims) < limit and not self._stop.is_set() and self._may_claim():
                u = self.cursor
                self.cursor += 1
                claims.append((u, self.router.assign(u)))
                self.router.release(u)
        return claims

    def _claim_step(self) -> list[tuple[int, SamplerGroup]]:
        """Lockstep modes: the claimable units of the current step, all at once (one batched
        generation, as a server batches the requests it holds)."""
        first = self._claim()
        if first is None:
            return []
        claims = [first]
        with self._cond:
            while not self._stop.is_set() and self._may_claim():
                u = self.cursor
                self.cursor += 1
                claims.append((u, self.router.assign(u)))
                self.router.release(u)
        return claims

    def _work(self) -> None:
        models: dict[torch.dtype, tuple[int, torch.nn.Module]] = {}
        scales: dict = {}  # calibrated activation scales per numerics and version
        cfg = self.cfg
        try:
            while True:
                if cfg.pipeline.lockstep:
                    claims = self._claim_step()
                else:
                    claims = self._claim_some(self._chunk)
                if not claims:
                    return
                version, weights = self.publisher.latest(cfg.pipeline.lag)
                done = self._generate(self._batches(claims), version, weights, models,
                                      scales)
                for unit in sorted(done, key=lambda x: x.index):
                    self.results.put(unit)
        except BaseException as exc:  # handed to the trainer thread, which raises it
            self.results.put(_Failure(exc))

    def _batches(self, claims: list[tuple[int, SamplerGroup]]
                 ) -> list[list[tuple[int, SamplerGroup]]]:
        """The claimed units as batched generations: all in one, each unit with its own group's
        numerics (lanes), where their groups can share a batch; else one batch per group."""
        if lanes_possible([g.spec for g in dict.fromkeys(g for _, g in claims)]):
            return [list(claims)]
        return by_group(claims)

    def _generate(self, batches: list[list[tuple[int, SamplerGroup]]], version: int, weights,
                  models: dict, scales: dict) -> list[Unit]:
        """Sample the claimed units, one batched generation per batch, with weight `version` (in
        the sampler processes, spread over them, when the pipeline has a pool)."""
        done: list[Unit] = []
        n = self.cfg.samples_per_prompt
        if self.pool is not None:
            batches = _spread(batches, spread_width(self.cfg.pipeline, self.pool.size))
            calls = [(self.cfg, [g for _, g in batch], [u for u, _ in batch], version, weights)
                     for batch in batches]
            for batch, (eps, dt) in zip(batches, self.pool.map(sample_in_worker, calls)):
                with self._cond:
                    self.busy_seconds += dt
                done += split_units(eps, batch, version, dt, n)
            return done
        for batch in batches:
            model = model_at(models, self._base, TORCH_DTYPES[batch[0][1].spec.compute_dtype],
                             version, weights)
            t0 = time.perf_counter()
            eps = sample_units(model, self.tokenizer, self.cfg, [g for _, g in batch],
                               [u for u, _ in batch], version, scales=scales)
            dt = time.perf_counter() - t0
            with self._cond:
                self.busy_seconds += dt
            done += split_units(eps, batch, version, dt, n)
        return done

    @property
    def faults(self) -> dict[str, int]:
        """Sampler failures survived: restarts and the units (episodes) sampled again."""
        return {"sampler_restarts": self.pool.restarts if self.pool is not None else 0,
                "requeued_units": 0}

    def take(self) -> Unit:
        item = self.results.get()
        if isinstance(item, _Failure):
            raise item.exc
        return item

    def stop(self) -> None:
        self._stop.set()
        self.notify()
        for th in self._threads:
            th.join(timeout=60)

