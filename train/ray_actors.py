"""The Ray backend's actors and the driver's handle on the trainer actor(s).

- `SamplerActor`: one replica of a sampler group (its numerics, emulated on CPU), placed by
  `sampler_resources`: a share of the CPUs (`placement="cpu"`), or one GPU of the group's type by
  Ray's accelerator-type label (`placement="gpu"`; placement only, the sampling is the emulated
  numerics either way). It samples a batch of units per call with the version it is told to use.
- `TrainerActor`: the trainer (FP32 master, AdamW), its steps and checkpoints. With N > 1
  `ShardedTrainerActor`s the trainer is one torch.distributed process group around
  distributed.ShardedTrainer (FSDP2); rank 0 publishes and writes the checkpoints.
- Weights: a published version is the return value of one trainer call (stored once in Ray's
  object store, passed on by reference); with `weights_dir` (a path every node sees) it is a
  safetensors file there (`write_version`, written whole and renamed) and the store carries its
  path (`read_version` reads either).
- `RemoteTrainer`: the driver's handle, with the local Trainer's interface; a dead trainer actor
  is a `BackendError` (the newest checkpoint resumes the run).

These are plain classes: ray.remote is applied when a backend starts, so importing this module
does not need Ray.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch

from mismatch.io import atomic_path
from mismatch.probes.base import TORCH_DTYPES
from mismatch.runtime import torch_threads

from .batch import Unit
from .config import TrainConfig
from .fleet import SamplerGroup, run_fleet
from .ray_session import ray_module
from .rundir import check_ranks, save_checkpoint
from .unit_sampling import model_at, sample_units, split_units
from .trainer import Trainer

__all__ = ["PLACEMENTS", "ACCELERATOR_LABELS", "sampler_resources", "write_version",
           "read_version", "SamplerActor", "TrainerActor", "ShardedTrainerActor", "BackendError",
           "RemoteTrainer"]

PLACEMENTS = ("cpu", "gpu")

ACCELERATOR_LABELS = {"a100": "A100", "h100": "H100", "h200": "H200", "b200": "B200",
                      "b300": "B300", "rtx-pro-6000": "RTX-PRO-6000"}
"""Ray's accelerator-type label of each GPU profile (Ray labels a node `accelerator_type:<X>`
from the GPU's product name; A100 and H100 are ray.util.accelerators constants)."""



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
    with atomic_path(path) as tmp:
        save_file({n: w.contiguous() for n, w in weights.items()}, str(tmp))
    for old in done[:max(0, len(done) + 1 - keep)]:
        old.unlink(missing_ok=True)
    return str(path)


def read_version(published) -> dict[str, torch.Tensor]:
    """The weights of a published version: the state dict itself, or the file it names."""
    if isinstance(published, str):
        from safetensors.torch import load_file

        return load_file(published)
    return published


def _load(cfg: TrainConfig):
    from mismatch.zoo import load_model, load_tokenizer

    return load_model(cfg.model, dtype="bfloat16"), load_tokenizer(cfg.model)


class _Process:
    def pid(self) -> int:
        """The actor's process id (tests kill actors with it)."""
        return os.getpid()


class SamplerActor(_Process):
    """One replica of a sampler group: samples batches of units with a given weight version."""

    def __init__(self, cfg: TrainConfig, group_name: str) -> None:
        self.cfg = cfg
        self.group = next(g for g in run_fleet(cfg) if g.name == group_name)
        self.base, self.tokenizer = _load(cfg)
        self.models: dict = {}
        self.scales: dict = {}  # calibrated activation scales per weight version

    def generate(self, units: list[int], version: int, weights: list) -> tuple[list[Unit], float]:
        """The units' episodes (weights: [the version's object reference], fetched only when the
        cached version differs) and the seconds spent sampling them."""
        ray = ray_module()
        model = model_at(self.models, self.base, TORCH_DTYPES[self.group.spec.compute_dtype],
                         version, lambda: read_version(ray.get(weights[0])))
        # the run's threads (Ray's for the actor otherwise)
        with torch_threads(self.cfg.pipeline.threads):
            t0 = time.perf_counter()
            eps = sample_units(model, self.tokenizer, self.cfg, self.group, units, version,
                               scales=self.scales)
            dt = time.perf_counter() - t0
        return split_units(eps, [(u, self.group) for u in units], version, dt,
                           self.cfg.samples_per_prompt), dt


class _Publisher(_Process):
    """What the trainer actors share: publishing a version and writing a checkpoint."""

    weights_dir: str | None = None
    keep: int = 0

    def _publish(self, weights: dict[str, torch.Tensor]):
        return write_version(self.weights_dir, weights, self.keep) if self.weights_dir \
            else weights

    def _checkpoint(self, out: str, step: int, state: dict, next_unit: int, cfg: TrainConfig,
                    older: dict[int, list]) -> str:
        ray = ray_module()
        held = {v: read_version(ray.get(box[0])) for v, box in older.items()}
        return str(save_checkpoint(Path(out), step, state, next_unit, cfg, held))


class TrainerActor(_Publisher):
    """The trainer: FP32 master and AdamW, corrected GRPO steps, checkpoints."""

    def __init__(self, cfg: TrainConfig, weights_dir: str | None = None, keep: int = 0) -> None:
        model, _ = _load(cfg)
        self.trainer = Trainer(model, cfg)
        self.weights_dir, self.keep = weights_dir, keep

    def step(self, batch):
        # the run's (Trainer.step may raise them)
        with torch_threads(self.trainer.cfg.pipeline.threads):
            return self.trainer.step(batch)

    def published(self):
        return self._publish(self.trainer.published())

    def load(self, state: dict[str, Any]) -> None:
        self.trainer.load(state)

    def save(self, out: str, step: int, next_unit: int, older: dict[int, list]) -> str:
        return self._checkpoint(out, step, self.trainer.state(), next_unit, self.trainer.cfg,
                                older)


class ShardedTrainerActor(_Publisher):
    """One rank of the FSDP2 trainer (train.distributed.ShardedTrainer) over `world` actors:
    each steps on its rows of the batch (the ranks gather each other's log-probs for the step's
    metrics); rank 0 returns the metrics, publishes the gathered BF16 weights and writes the
    checkpoints."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, weights_dir: str | None = None,
                 keep: int = 0) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.weights_dir, self.keep = weights_dir, keep
        self.base, _ = _load(cfg)
        self.trainer = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0: the process group's store)."""
        import socket

        ip = ray_module().util.get_node_ip_address()
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
        with torch_threads(self.cfg.pipeline.threads):
            res = self.trainer.step(batch)  # the whole batch's metrics, on every rank
        return res if self.rank == 0 else None

    def published(self):
        weights = self.trainer.published()  # a collective: every rank
        return self._publish(weights) if self.rank == 0 else None

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
        ray = ray_module()
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

    def step(self, batch):
        return self._all("step", ray_module().put(batch), what="a step")

    def published(self):
        refs = [a.published.remote() for a in self.actors]
        return refs[0]

    def load(self, state: dict[str, Any]) -> None:
        check_ranks(state, len(self.actors))
        self._all("load", ray_module().put(state), what="the resume")

    def policy(self) -> torch.nn.Module:
        model = copy.deepcopy(self.base)
        model.load_state_dict(read_version(self._all("published", what="an export")))
        return model

    def save(self, out: Path, step: int, next_unit: int, older: dict | None = None) -> Path:
        boxed = {v: [ref] for v, ref in (older or {}).items()}
        return Path(self._all("save", str(out), step, next_unit, boxed, what="a checkpoint"))

