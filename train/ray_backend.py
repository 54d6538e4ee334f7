"""`mismatch train --backend ray`: the sampler fleet and the trainer as Ray actors.

The run loop (train.trainer.run: the monitor, the metrics log, checkpoints, resume) stays in the
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
  global token count as the loss's denominator, and rank 0 gathers the ranks' log-probs for the
  step's metrics, publishes the gathered BF16 weights and writes the checkpoints (full state).
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
one-line error; its newest checkpoint resumes it (`--resume`).

Local Ray (no `address`): started with the machine's CPUs, every listener (GCS, raylet, workers,
dashboard and its agents) on 127.0.0.1, a temporary directory under the system's temp dir that is
removed at the end, and token authentication with a token held in the environment rather than
written to ~/.ray. With `address`, the run joins that cluster as a driver and leaves it running.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .fleet import SamplerGroup, fleet
from .trainer import (Pipeline, Publisher, TrainConfig, Trainer, Unit, model_at, sample_units,
                      save_checkpoint, split_units)
from .rollout import COMPUTE_DTYPES

__all__ = ["RayBackend", "BackendError", "start_ray", "ACCELERATOR_LABELS", "sampler_resources",
           "PLACEMENTS"]

log = logging.getLogger("mismatch.train")

PLACEMENTS = ("cpu", "gpu")

ACCELERATOR_LABELS = {"a100": "A100", "h100": "H100", "h200": "H200", "b200": "B200",
                      "b300": "B300", "rtx-pro-6000": "RTX-PRO-6000"}
"""Ray's accelerator-type label of each GPU profile (Ray labels a node `accelerator_type:<X>`
from the GPU's product name; A100 and H100 are ray.util.accelerators constants)."""

_MAX_ATTEMPTS = 5  # sampling calls of one batch before its group is declared lost


def _ray():
    try:
        import ray
    except ImportError as exc:  # the optional extra
        raise ValueError("--backend ray needs Ray: pip install 'mismatch[ray]'") from exc
    return ray


def _check_reachable(address: str) -> None:
    """A HOST:PORT cluster address must accept a connection (Ray itself retries forever)."""
    if address == "auto" or "://" in address:
        return
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except ValueError:
        raise ValueError(f"--address {address!r} is not HOST:PORT (or auto)") from None
    except OSError as exc:
        raise ValueError(f"cannot reach a Ray cluster at {address} "
                         f"({exc.strerror or type(exc).__name__}); start one with `ray start "
                         "--head` or check the address") from None


class RaySession:
    """A connection to Ray: a local instance this process started (and stops), or a cluster."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 dashboard: bool = True) -> None:
        self.address, self.started, self._tmp, self._reaper = address, False, None, None
        self.dashboard_url: str | None = None
        self._env: dict[str, str | None] = {}
        imported = "ray" in sys.modules
        if imported and sys.modules["ray"].is_initialized():
            return  # a caller's Ray (tests share one): use it, leave it up
        if address is None:
            # a single-node instance: loopback address (Linux otherwise advertises the host's
            # external IP and binds its gRPC servers to every interface) and a token held in the
            # environment (Ray would otherwise write one to ~/.ray/auth_token). Ray reads these
            # when it is imported: set them first, and refresh them if it already was.
            self._setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            self._setenv("RAY_AUTH_MODE", "token")
            self._setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
        ray = _ray()
        if address is None:
            if imported:
                from ray._private import ray_constants
                from ray._raylet import Config

                ray_constants.ENABLE_RAY_CLUSTER = False
                Config.initialize("")
            self._tmp = tempfile.mkdtemp(prefix="mm-ray-")
            self._reaper = self._start_reaper()  # before Ray starts anything
            try:
                ctx = ray.init(num_cpus=num_cpus or os.cpu_count() or 1,
                               include_dashboard=dashboard, dashboard_host="127.0.0.1",
                               _node_ip_address="127.0.0.1", _temp_dir=self._tmp,
                               log_to_driver=False, configure_logging=False)
            except BaseException:
                self.close()
                raise
            self.dashboard_url = ctx.dashboard_url
        else:
            _check_reachable(address)
            try:
                ctx = ray.init(address=address, log_to_driver=False, configure_logging=False)
                self.dashboard_url = ctx.dashboard_url
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ValueError(f"cannot join the Ray cluster at {address} "
                                 f"({str(exc).splitlines()[0]}); check the address and that "
                                 "`ray status` sees it") from None
        self.started = True

    def _start_reaper(self):
        """A process that outlives this one: it notes this process's descendants every second,
        and if this process dies without close() (kill -9), it kills those still running (Ray's
        agents would otherwise outlive it; process start times guard against reused ids) and
        removes the temporary directory."""
        import subprocess

        if not Path("/proc").is_dir():
            return None
        return subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), self._tmp],
                                start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def _setenv(self, key: str, value: str) -> None:
        self._env.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    def close(self) -> None:
        if self.started:
            _ray().shutdown()
            self.started = False
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env = {}
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._reaper is not None:  # it sees the directory gone and exits
            self._reaper.wait(timeout=10)
            self._reaper = None


_REAPER = """
import os, shutil, signal, sys, time
driver, tmp = int(sys.argv[1]), sys.argv[2]

def table():
    parents, starts = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(name))
            starts[int(name)] = fields[19]
    return parents, starts

def below(pid):
    parents, starts = table()
    out, todo = {}, list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        if child != os.getpid():
            out[child] = starts[child]
            todo += parents.get(child, [])
    return out

seen = {}
while os.path.exists(tmp):
    try:
        os.kill(driver, 0)
    except OSError:
        break
    seen.update(below(driver))
    time.sleep(1.0)
if os.path.exists(tmp):  # the driver died without closing its Ray: end what it started
    _, starts = table()
    for pid, start in seen.items():
        if starts.get(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.5)
    shutil.rmtree(tmp, ignore_errors=True)
"""


def start_ray(address: str | None = None, num_cpus: int | None = None,
              dashboard: bool = True) -> RaySession:
    """Start (no `address`) or join Ray; close() the session to stop what it started."""
    return RaySession(address, num_cpus, dashboard)


def sampler_resources(group: SamplerGroup, placement: str, cpu_share: float) -> dict[str, Any]:
    """Ray actor options of one replica of `group`: a CPU share, or one GPU of the group's type."""
    if placement == "cpu":
        return {"num_cpus": cpu_share}
    if placement == "gpu":
        label = ACCELERATOR_LABELS.get(group.spec.gpu)
        if label is None:
            raise ValueError(f"no Ray accelerator label for GPU {group.spec.gpu!r} (group "
                             f"{group.name}); labels: {', '.join(ACCELERATOR_LABELS)}")
        return {"num_cpus": 1, "num_gpus": 1, "accelerator_type": label}
    raise ValueError(f"unknown placement {placement!r}; placements: {', '.join(PLACEMENTS)}")


def write_version(weights_dir: str, weights: dict[str, torch.Tensor], keep: int) -> str:
    """Publish `weights` as the next file of `weights_dir` (a path every node sees): written to a
    temporary name and renamed; the newest `keep` files are kept. Returns its path."""
    from safetensors.torch import save_file

    root = Path(weights_dir)
    root.mkdir(parents=True, exist_ok=True)
    done = sorted(root.glob("v-*.safetensors"))
    seq = int(done[-1].stem.split("-")[1]) + 1 if done else 0
    path = root / f"v-{seq:08d}.safetensors"
    tmp = root / f".{path.name}.tmp-{os.getpid()}"
    save_file({n: w.contiguous() for n, w in weights.items()}, str(tmp))
    os.replace(tmp, path)
    for old in done[:max(0, len(done) + 1 - keep)]:
        old.unlink(missing_ok=True)
    return str(path)


def read_version(published) -> dict[str, torch.Tensor]:
    """The weights of a published version: the state dict itself, or the file it names."""
    if isinstance(published, str):
        from safetensors.torch import load_file

        return load_file(published)
    return published


# ---------------------------------------------------------------------------------------------
# the actors (plain classes; ray.remote is applied when a backend starts, so importing this
# module does not need Ray)


def _load(cfg: TrainConfig):
    from mismatch.zoo import load_model, load_tokenizer

    torch.set_num_threads(cfg.threads)
    return load_model(cfg.model, dtype="bfloat16"), load_tokenizer(cfg.model)


class _Process:
    def pid(self) -> int:
        """The actor's process id (tests kill actors with it)."""
        return os.getpid()


class SamplerActor(_Process):
    """One replica of a sampler group: samples batches of units with a given weight version."""

    def __init__(self, cfg: TrainConfig, group_name: str) -> None:
        self.cfg = cfg
        self.group = next(g for g in fleet(cfg.fleet) if g.name == group_name)
        self.base, self.tokenizer = _load(cfg)
        self.models: dict = {}

    def generate(self, units: list[int], version: int, weights: list) -> tuple[list[Unit], float]:
        """The units' episodes (weights: [the version's object reference], fetched only when the
        cached version differs) and the seconds spent sampling them."""
        ray = _ray()
        model = model_at(self.models, self.base, COMPUTE_DTYPES[self.group.spec.compute_dtype],
                         version, lambda: read_version(ray.get(weights[0])))
        t0 = time.perf_counter()
        eps = sample_units(model, self.tokenizer, self.cfg, self.group, units, version)
        dt = time.perf_counter() - t0
        return split_units(eps, [(u, None) for u in units], self.group.name, version, dt,
                           self.cfg.samples_per_prompt), dt


class _Publisher(_Process):
    """What the trainer actors share: publishing a version and writing a checkpoint."""

    weights_dir: str | None = None
    keep: int = 0

    def _publish(self, weights: dict[str, torch.Tensor]):
        return write_version(self.weights_dir, weights, self.keep) if self.weights_dir \
            else weights

    def _checkpoint(self, out: str, step: int, trainer, next_unit: int, cfg: TrainConfig,
                    older: dict[int, list]) -> str:
        ray = _ray()
        held = {v: read_version(ray.get(box[0])) for v, box in older.items()}
        return str(save_checkpoint(Path(out), step, trainer, next_unit, cfg, held))


class TrainerActor(_Publisher):
    """The trainer: FP32 master and AdamW, corrected GRPO steps, checkpoints."""

    def __init__(self, cfg: TrainConfig, weights_dir: str | None = None, keep: int = 0) -> None:
        model, _ = _load(cfg)
        self.trainer = Trainer(model, cfg)
        self.weights_dir, self.keep = weights_dir, keep

    def step(self, batch) -> dict[str, Any]:
        return self.trainer.step(batch)

    def published(self):
        return self._publish(self.trainer.published())

    def load(self, state: dict[str, Any]) -> None:
        self.trainer.load(state)

    def save(self, out: str, step: int, next_unit: int, older: dict[int, list]) -> str:
        return self._checkpoint(out, step, self.trainer, next_unit, self.trainer.cfg, older)


class ShardedTrainerActor(_Publisher):
    """One rank of the FSDP2 trainer (train.distributed.ShardedTrainer) over `world` actors:
    each steps on its rows of the batch; rank 0 gathers the ranks' log-probs for the step's
    metrics, publishes the gathered BF16 weights and writes the checkpoints."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, weights_dir: str | None = None,
                 keep: int = 0) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.weights_dir, self.keep = weights_dir, keep
        self.base, _ = _load(cfg)
        self.trainer = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0: the process group's store)."""
        import socket

        ip = _ray().util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            return ip, sock.getsockname()[1]

    def join(self, addr: str, port: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from .distributed import ShardedTrainer

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                    world_size=self.world, timeout=timedelta(minutes=5))
        self.trainer = ShardedTrainer(self.base, self.cfg)

    def step(self, batch):
        import torch.distributed as dist

        from .distributed import shard_rows
        from .trainer import arm_loss, step_metrics

        out, mine = self.trainer.step(shard_rows(batch, self.rank, self.world), details=True)
        parts = [None] * self.world
        dist.all_gather_object(parts, mine)
        if self.rank != 0:
            return None
        logp, cand, ent = (torch.cat([p[i] for p in parts]) for i in range(3))
        with torch.no_grad():
            _, m, mask = arm_loss(logp, cand, batch, self.cfg.correction)
        res = step_metrics(m, ent, logp, cand, batch, mask)
        res.update(loss=out["loss"], grad_norm=out["grad_norm"],
                   skipped_nonfinite=not math.isfinite(out["grad_norm"]))
        return res

    def published(self):
        state = self.trainer.full_state_dict()  # a collective: every rank
        if self.rank != 0:
            return None
        return self._publish({n: v.to(torch.bfloat16) for n, v in state.items()})

    def load(self, state: dict[str, Any]) -> None:
        self.trainer.load(state)

    def save(self, out: str, step: int, next_unit: int, older: dict[int, list]) -> str | None:
        state = self.trainer.state()  # a collective: every rank
        if self.rank != 0:
            return None
        return self._checkpoint(out, step, state, next_unit, self.cfg, older)


class BackendError(RuntimeError):
    """The run cannot go on: the trainer actor died (its newest checkpoint resumes the run), or
    a sampler group keeps failing."""


class RemoteTrainer:
    """The driver's handle on the trainer actor(s) — one, or the ranks of an FSDP2 trainer —
    with the local Trainer's interface (published weights are object references). Every call
    goes to every rank in the same order (their collectives pair up); rank 0 answers."""

    def __init__(self, actors: list, base: torch.nn.Module) -> None:
        self.actors, self.base = actors, base

    def _all(self, method: str, *args, what: str):
        ray = _ray()
        pending = [getattr(a, method).remote(*args) for a in self.actors]
        first, rest = pending[0], list(pending)
        try:
            while rest:  # a dead rank fails the call at once (the others would wait for it)
                ready, rest = ray.wait(rest, num_returns=1)
                ray.get(ready[0])
            return ray.get(first)
        except ray.exceptions.RayActorError as exc:
            raise BackendError(f"a trainer actor died during {what} ({type(exc).__name__}); "
                               "resume the run with --resume from its newest checkpoint") \
                from None

    def step(self, batch) -> dict[str, Any]:
        return self._all("step", _ray().put(batch), what="a step")

    def published(self):
        refs = [a.published.remote() for a in self.actors]
        return refs[0]

    def load(self, state: dict[str, Any]) -> None:
        from .trainer import check_ranks

        check_ranks(state, len(self.actors))
        self._all("load", _ray().put(state), what="the resume")

    def policy(self) -> torch.nn.Module:
        import copy

        model = copy.deepcopy(self.base)
        model.load_state_dict(read_version(self._all("published", what="an export")))
        return model

    def save(self, out: Path, step: int, next_unit: int, older: dict | None = None) -> Path:
        boxed = {v: [ref] for v, ref in (older or {}).items()}
        return Path(self._all("save", str(out), step, next_unit, boxed, what="a checkpoint"))


# ---------------------------------------------------------------------------------------------
# the pipeline


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
        n = 1 if self.cfg.lockstep else max(self.cfg.workers, replicas)
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

    def _generate(self, batches, version: int, weights, models: dict) -> list[Unit]:
        ray = _ray()
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
        return _ray().get(self.actors[group][i].pid.remote())


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
        cpus = _ray().cluster_resources().get("CPU", 1.0)
        return max(0.0001, math.floor(min(1.0, cpus / n_actors) * 1e4) / 1e4)

    def trainer(self, model: torch.nn.Module, cfg: TrainConfig) -> RemoteTrainer:
        ray = _ray()
        n = self.trainer_ranks + self.replicas * len(fleet(cfg.fleet))
        opts: dict[str, Any] = ({"num_cpus": self._cpu_share(n)} if self.placement == "cpu"
                                else {"num_cpus": 1, "num_gpus": 1})
        # versions a sampler may still be about to read: the lag, the claims ahead, margin
        keep = cfg.lag + cfg.queue_steps + (cfg.max_staleness or 0) + 3
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
        ray = _ray()
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
            return _ray().put(write_version(self.weights_dir, weights, keep=1 << 30))
        return _ray().put(weights)

    def close(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            for actor in self._actors:
                try:
                    ray.kill(actor)
                except Exception:  # already gone
                    pass
        self._actors = []
        self.session.close()
