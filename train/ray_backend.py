"""`mismatch train --backend ray`: the sampler fleet and the trainer as Ray actors.

The run loop (train.loop.run: the monitor, the metrics log, checkpoints, resume) stays in the
driver; what moves into actors is the work:

- **Sampler actors**: one per replica of each sampler group (`replicas` per group), holding the
  group's numerics (its NumericsSpec, emulated on CPU) and its resource request: a share of the
  CPUs locally (`placement="cpu"`), or `{"GPU": 1}` plus Ray's accelerator-type label of the
  group's GPU (`placement="gpu"`, resource `accelerator_type:H100` and so on), so each group lands
  on its GPU type in a heterogeneous cluster (placement only: the actor's sampling is the
  emulated numerics on its CPU either way). An actor samples a batch of units (one GRPO group
  per unit) per call, with the weight version it is told to use.
- **The trainer actor** holds the FP32 master and AdamW, takes the steps and writes the
  checkpoints (to `out`, which must be a path the trainer's node can write: a shared filesystem
  on a cluster). With `trainer_ranks` N > 1 the trainer is N actors forming one torch.distributed
  process group (gloo on CPU, NCCL on GPUs; rank 0's node holds the rendezvous) around
  train.distributed.ShardedTrainer (FSDP2): each rank steps on its rows of the batch with the
  global token count as the loss's denominator, the ranks gather each other's log-probs for the
  step's metrics, and rank 0 returns them, publishes the gathered BF16 weights and writes the
  checkpoints (full state).
- **Weights** go through Ray's object store: each published version is the return value of one
  trainer call (stored once, by reference); the driver passes the reference on without reading
  it, and a sampler fetches a version only when its cached one differs. With `weights_dir` (a
  path every node sees, for models too large for the object store) the trainer writes each
  version there as safetensors (temporary name, then renamed; the newest few kept) and the
  object store carries only its path.
- **Trajectories** come back as the return values of the sampling calls into the driver's queue.
  Units are claimed only while fewer than `queue_steps` steps' worth are claimed and not yet
  consumed (or as the staleness gate allows), so the queue — in flight plus finished — is
  bounded and a full queue stops the claims (back-pressure). Every record carries the queue's
  depth when the trainer took its batch.

Faults: actors are created with unlimited restarts and no task retries, so a sampler that dies
(OOM, a lost node, `kill -9`) is restarted by Ray while the driver sees the failed call, counts
the restart once, and sends the call's units again (to a live replica of the group, the restarted
one included); the units keep their numbers and seeds, so nothing is lost or duplicated and a
unit sampled again is the same trajectory. The counts (`sampler_restarts`, `requeued_units`) are
in every metrics record and each event is logged. A trainer actor that dies ends the run with a
one-line error; its newest checkpoint resumes it (`--resume`). So does one that dies while it
publishes a version: the samplers' calls fail fetching it (`weights_lost`), not restarted.

The actors and the driver's handle on the trainer are in ray_actors.py; starting or joining Ray
in ray_session.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .batch import Unit
from .config import TrainConfig
from .fleet import SamplerGroup, fleet
from .pipeline import Pipeline, Publisher, by_group
from .ray_actors import (PLACEMENTS, BackendError, RemoteTrainer, SamplerActor,
                         ShardedTrainerActor, TrainerActor, sampler_resources, write_version)
from .ray_session import ray_module, start_ray

__all__ = ["RayBackend", "RayPipeline", "weights_lost"]

log = logging.getLogger("mismatch.train")

_MAX_ATTEMPTS = 5  # sampling calls of one batch before its group is declared lost


def weights_lost(exc: BaseException) -> bool:
    """Whether a failed sampling call failed inside a live sampler actor: its task raised
    (Ray's RayTaskError) an actor's death — that of the trainer actor whose call was to return
    the weights the sampler fetches — rather than the sampler's own actor dying (a plain
    ActorDiedError, which Ray restarts). The first ends the run; retrying would fetch the same
    lost weights."""
    return isinstance(exc, ray_module().exceptions.RayTaskError)


class RayPipeline(Pipeline):
    """Pipeline whose units are sampled by sampler actors (the claiming, gating and queue are
    the local pipeline's; see the module docstring for faults)."""

    def __init__(self, cfg: TrainConfig, groups: list[SamplerGroup], model, tokenizer,
                 publisher: Publisher, start_unit: int, actors: dict[str, list]) -> None:
        super().__init__(cfg, groups, model, tokenizer, publisher, start_unit)
        self.actors = actors
        self.inflight: dict[tuple[str, int], int] = defaultdict(int)
        self._generation: dict[tuple[str, int], int] = defaultdict(int)
        self._faults = {"sampler_restarts": 0, "requeued_units": 0}
        self._down: set[tuple[str, int]] = set()
        self.pids: dict[tuple[str, int], int] = {}
        """Process id of each sampler actor (group, replica) when the run started."""

    def start(self) -> None:
        replicas = sum(len(a) for a in self.actors.values())
        n = 1 if self.cfg.pipeline.lockstep else max(self.cfg.pipeline.workers, replicas)
        for w in range(n):
            th = threading.Thread(target=self._work, name=f"dispatch-{w}", daemon=True)
            th.start()
            self._threads.append(th)

    @property
    def faults(self) -> dict[str, int]:
        with self._cond:
            return dict(self._faults)

    def _pick(self, group: str) -> int:
        with self._cond:
            n = len(self.actors[group])
            # a replica seen dying is avoided until one of its calls succeeds again
            return min(range(n), key=lambda i: ((group, i) in self._down,
                                                self.inflight[(group, i)], i))

    def _submit(self, group: str, units: list[int], version: int, weights):
        i = self._pick(group)
        with self._cond:
            self.inflight[(group, i)] += 1
            gen = self._generation[(group, i)]
        ref = self.actors[group][i].generate.remote(units, version, [weights])
        return i, gen, ref

    def _batches(self, claims):
        """One batch per sampler group: each group's calls go to its own actors."""
        return by_group(claims)

    def _generate(self, batches, version: int, weights, models: dict,
                  scales: dict | None = None) -> list[Unit]:
        ray = ray_module()
        pending = []
        for batch in batches:  # every group's batch in flight at once
            name, units = batch[0][1].name, [u for u, _ in batch]
            pending.append((name, units, *self._submit(name, units, version, weights)))
        done: list[Unit] = []
        for name, units, i, gen, ref in pending:
            for attempt in range(1, _MAX_ATTEMPTS + 1):
                try:
                    got, dt = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    if weights_lost(exc):
                        raise BackendError(
                            f"sampler group {name} cannot fetch weight version {version}: the "
                            "trainer actor that was publishing it died; resume the run with "
                            "--resume from its newest checkpoint") from None
                    self._lost(name, i, gen, units, exc)
                    if attempt == _MAX_ATTEMPTS:
                        raise BackendError(f"sampler group {name}: {_MAX_ATTEMPTS} sampling "
                                           "calls in a row failed; its actors keep dying (see "
                                           "the Ray logs)") from None
                    i, gen, ref = self._submit(name, units, version, weights)
                else:
                    with self._cond:
                        self.inflight[(name, i)] -= 1
                        self._down.discard((name, i))
                    break
            with self._cond:
                self.busy_seconds += dt
            done += got
        return done

    def _lost(self, group: str, i: int, gen: int, units: list[int], exc: BaseException) -> None:
        with self._cond:
            self.inflight[(group, i)] -= 1
            self._down.add((group, i))
            first = self._generation[(group, i)] == gen  # other calls may have seen this death
            if first:
                self._generation[(group, i)] += 1
                self._faults["sampler_restarts"] += 1
            self._faults["requeued_units"] += len(units)
        if first:
            log.warning("sampler actor %s[%d] died (%s); Ray restarts it", group, i,
                        type(exc).__name__)
        log.warning("re-queued %d unit(s) (%d episodes) of %s[%d]: units %s", len(units),
                    len(units) * self.cfg.samples_per_prompt, group, i, units)

    def actor_pid(self, group: str, i: int) -> int:
        return ray_module().get(self.actors[group][i].pid.remote())


# ---------------------------------------------------------------------------------------------
# the backend


class RayBackend:
    """Samplers and trainer as Ray actors (`--backend ray`); see the module docstring."""

    name = "ray"

    def __init__(self, address: str | None = None, *, replicas: int = 1,
                 trainer_ranks: int = 1, placement: str = "cpu", num_cpus: int | None = None,
                 dashboard: bool = True, weights_dir: str | Path | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if trainer_ranks < 1:
            raise ValueError(f"trainer-ranks must be >= 1, got {trainer_ranks}")
        self.trainer_ranks = trainer_ranks
        self.weights_dir = str(weights_dir) if weights_dir else None
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}; placements: "
                             f"{', '.join(PLACEMENTS)}")
        self.replicas, self.placement = replicas, placement
        self.session = start_ray(address, num_cpus, dashboard)
        self.pipe: RayPipeline | None = None
        self._actors: list = []

    def _cpu_share(self, n_actors: int) -> float:
        cpus = ray_module().cluster_resources().get("CPU", 1.0)
        return max(0.0001, math.floor(min(1.0, cpus / n_actors) * 1e4) / 1e4)

    def trainer(self, model: torch.nn.Module, cfg: TrainConfig) -> RemoteTrainer:
        ray = ray_module()
        n = self.trainer_ranks + self.replicas * len(fleet(cfg.fleet))
        opts: dict[str, Any] = ({"num_cpus": self._cpu_share(n)} if self.placement == "cpu"
                                else {"num_cpus": 1, "num_gpus": 1})
        # versions a sampler may still be about to read: the lag, the claims ahead, margin
        keep = cfg.pipeline.lag + cfg.pipeline.queue_steps + (cfg.pipeline.max_staleness or 0) + 3
        if self.trainer_ranks == 1:
            actors = [ray.remote(TrainerActor).options(max_restarts=0, **opts)
                      .remote(cfg, self.weights_dir, keep)]
        else:
            world = self.trainer_ranks
            remote = ray.remote(ShardedTrainerActor).options(max_restarts=0, **opts)
            actors = [remote.remote(cfg, r, world, self.weights_dir, keep)
                      for r in range(world)]
            addr, port = ray.get(actors[0].address.remote())
            ray.get([a.join.remote(addr, port) for a in actors])
            log.info("ray: FSDP2 trainer over %d rank actors (store %s:%d)", world, addr, port)
        self._actors += actors
        return RemoteTrainer(actors, model)

    def pipeline(self, cfg: TrainConfig, groups: list[SamplerGroup], model, tokenizer,
                 publisher: Publisher, start_unit: int) -> RayPipeline:
        ray = ray_module()
        share = self._cpu_share(self.trainer_ranks + self.replicas * len(groups))
        remote = ray.remote(SamplerActor)
        actors: dict[str, list] = {}
        for g in groups:
            opts = sampler_resources(g, self.placement, share)
            actors[g.name] = [remote.options(max_restarts=-1, max_task_retries=0, **opts)
                              .remote(cfg, g.name) for _ in range(self.replicas)]
            self._actors += actors[g.name]
        log.info("ray: %d sampler actor(s) (%d group(s) × %d) and a trainer actor; dashboard: %s",
                 sum(len(a) for a in actors.values()), len(groups), self.replicas,
                 f"http://{self.session.dashboard_url}" if self.session.dashboard_url
                 else "none")
        keys = [(g, i) for g, reps in actors.items() for i in range(len(reps))]
        t0 = time.perf_counter()
        pids = ray.get([actors[g][i].pid.remote() for g, i in keys])  # all up (model loaded)
        log.info("ray: sampler actors ready in %.1f s", time.perf_counter() - t0)
        self.pipe = RayPipeline(cfg, groups, model, tokenizer, publisher, start_unit, actors)
        self.pipe.pids = dict(zip(keys, pids))
        return self.pipe

    def put(self, weights: dict[str, torch.Tensor]):
        """A weight version held by the driver (a resume's older versions) as the pipeline
        holds published ones."""
        if self.weights_dir:
            return ray_module().put(write_version(self.weights_dir, weights, keep=1 << 30))
        return ray_module().put(weights)

    def close(self) -> None:
        ray = ray_module()
        if ray.is_initialized():
            for actor in self._actors:
                try:
                    ray.kill(actor)
                except Exception:  # already gone
                    pass
        self._actors = []
        self.session.close()
