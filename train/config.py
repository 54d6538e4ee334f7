"""A training run's configuration (`TrainConfig`) and the run presets of `mismatch train
--preset`: Python functions that return configs, registered once in `RUN_PRESETS`.

Everything that defines what a run computes is a field here; the config is saved as
out/config.json and a resume must match it (fields in `RESUMABLE` excepted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from mismatch.fleets import FLEETS as FLEET_PRESETS
from mismatch.profiles import LM_HEADS
from mismatch.registry import table_of

from .arms import ARMS

__all__ = ["TrainConfig", "RUN_PRESETS", "RUN_TRAINER_DTYPES", "preset_config", "homogeneous",
           "precision", "mixed", "smoke"]

RUN_TRAINER_DTYPES = ("bf16", "fp32")
"""The trainer's compute dtypes a run takes (`--trainer-dtype`): the FP32 master's BF16 cast, or
the master itself (a reference); mismatch.profiles.TRAINER_DTYPES less FP16."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a run (saved as out/config.json; a resume must match it)."""

    fleet: str = "mixed"
    """Sampler fleet (mismatch.fleets.FLEETS): homogeneous, precision or mixed; or a fleet file
    (a path ending in .toml, as `mismatch plan` writes it: groups with their shares)."""
    correction: str = "sc+mis+topp"
    """Loss arm (train.arms.ARMS)."""
    trainer_dtype: str = "bf16"
    """The trainer's compute dtype: "bf16" (the FP32 master's BF16 cast) or "fp32" (a
    reference: the master itself computes). The samplers get BF16 weights either way."""
    lm_head: str = "compute"
    """The LM head's precision on the trainer and every sampler: "compute" (BF16, the logits
    rounded to it) or "fp32" (inputs, weights and logits in FP32: mismatch.engines.head)."""
    steps: int = 200
    """Optimizer steps to reach (a resume may raise it)."""
    prompts_per_step: int = 4
    """Prompts (GRPO groups, units) per optimizer step."""
    samples_per_prompt: int = 8
    """Episodes per prompt (the GRPO group size)."""
    lr: float = 1e-4
    """AdamW learning rate on the FP32 master."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    max_turns: int = 4
    """Assistant turns per episode at most."""
    max_new_tokens: int = 64
    """Tokens per assistant turn at most."""
    candidates: int = 128
    """Top-k candidates the samplers ship per token (score centering's set)."""
    top_p: float = 0.97
    """Nucleus mass of the top-p arms' samplers (other arms sample the full distribution)."""
    top_p_max_tokens: int = 64
    """Cap on the top-p nucleus (top-k applied first)."""
    max_staleness: int | None = None
    """Bound on a token's staleness in optimizer steps (None: unbounded)."""
    sync: bool = False
    """Synchronous mode: sample with version s, then train step s (staleness 0)."""
    staleness: int | None = None
    """Forced staleness K: step s trains on episodes sampled with version max(0, s − K), one
    step of units at a time (exact, reproducible; None: the pipeline's natural staleness)."""
    workers: int = 1
    """Sampler worker threads (with sampler processes: at least one per process)."""
    sampler_processes: int = 0
    """Sampler worker processes of one torch thread each (mismatch.engines.workers): the
    rollouts run beside the trainer on other cores. 0: in this process's worker threads."""
    queue_steps: int = 2
    """Back-pressure of the unbounded pipeline: steps' worth of units claimed ahead at most."""
    checkpoint_every: int = 10
    """Checkpoint every this many steps (and at the end or a stop)."""
    keep_checkpoints: int = 2
    """The newest checkpoints kept (older ones are deleted as new ones land); 0: every one, for
    measurements on a run's history (scripts/study_stale_ratios.py)."""
    threads: int = 1
    """torch intra-op threads (the process's; every worker and the trainer share them; in the
    lockstep modes the trainer's step also takes the idle workers' share: lockstep_threads)."""
    seed: int = 0
    """Seeds the router, the tasks' order and every unit's sampling."""
    tasks: str = "zoo"
    """Task mix: "zoo" (the embedded model's mix of kinds) or kinds joined by commas, taken in
    turn (e.g. "arith,table"; mismatch.zoo.tasks.TASK_KINDS)."""
    eval_tasks: int = 0
    """Held-out tasks evaluated before the first and after the last step (0: no evaluation)."""
    eval_samples: int = 4
    """Episodes per held-out task in that evaluation (temperature 1, the trainer's numerics)."""
    eval_every: int = 0
    """Also evaluate after every this many steps (0: only before the first and after the last)."""
    model: str | None = None
    """The policy to start from: a model directory of the zoo's format (`mismatch zoo build
    --out DIR`; None: the embedded model)."""

    def __post_init__(self) -> None:
        if self.fleet.lower().endswith(".toml"):
            from .fleet import fleet_file

            fleet_file(self.fleet)  # a fleet file that cannot be read fails here, in one line
        elif self.fleet not in FLEET_PRESETS:
            raise ValueError(f"unknown fleet preset {self.fleet!r}; presets: "
                             f"{', '.join(FLEET_PRESETS)} (or a fleet file, FILE.toml)")
        if self.correction not in ARMS:
            raise ValueError(f"unknown correction {self.correction!r}; arms: {', '.join(ARMS)}")
        if self.trainer_dtype not in RUN_TRAINER_DTYPES:
            raise ValueError(f"--trainer-dtype must be {' or '.join(RUN_TRAINER_DTYPES)}, got "
                             f"{self.trainer_dtype!r}")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"--lm-head must be {' or '.join(LM_HEADS)}, got {self.lm_head!r}")
        if self.tasks != "zoo":
            from mismatch.zoo.tasks import TASK_KINDS

            unknown = [k for k in self.tasks.split(",") if k not in TASK_KINDS]
            if unknown or not self.tasks:
                raise ValueError(f"unknown task kind {unknown[0] if unknown else ''!r} in "
                                 f"--tasks; use zoo or kinds among {', '.join(TASK_KINDS)}")
        if self.eval_tasks < 0 or self.eval_samples < 1 or self.eval_every < 0:
            raise ValueError(f"eval-tasks and eval-every must be >= 0 and eval-samples >= 1, "
                             f"got {self.eval_tasks}, {self.eval_every}, {self.eval_samples}")
        if self.sampler_processes < 0:
            raise ValueError(f"sampler-processes must be >= 0, got {self.sampler_processes}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep-checkpoints must be >= 0 (0: keep every checkpoint), got "
                             f"{self.keep_checkpoints}")
        for name in ("steps", "prompts_per_step", "max_turns", "max_new_tokens", "candidates",
                     "top_p_max_tokens", "workers", "queue_steps", "checkpoint_every",
                     "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples-per-prompt must be >= 2 (GRPO advantages are relative "
                             f"to the group), got {self.samples_per_prompt}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max-staleness must be >= 0, got {self.max_staleness}")
        if self.staleness is not None:
            if self.staleness < 0:
                raise ValueError(f"staleness must be >= 0, got {self.staleness}")
            if self.sync or self.max_staleness is not None:
                raise ValueError("--staleness forces the lag; it cannot be combined with --sync "
                                 "or --max-staleness")

    @property
    def staleness_bound(self) -> int | None:
        if self.staleness is not None:
            return self.staleness
        return 0 if self.sync else self.max_staleness

    @property
    def task_kinds(self) -> tuple[str, ...] | None:
        return None if self.tasks == "zoo" else tuple(self.tasks.split(","))

    @property
    def lag(self) -> int:
        """Versions the samplers stay behind the newest (forced staleness; 0 otherwise)."""
        return self.staleness or 0

    @property
    def lockstep(self) -> bool:
        """One step of units per version (sync and forced staleness)."""
        return self.sync or self.staleness is not None

    @property
    def samples_top_p(self) -> bool:
        return ARMS[self.correction].top_p

    @property
    def masks_tokens(self) -> bool:
        """Whether the loss masks tokens whose ratio leaves a band (MIS weights): the collapse
        monitor then reads the masked share as the drift the update feels
        (`MonitorConfig.masked_loss`)."""
        return ARMS[self.correction].weight == "mis"

    # fields a resume may change without changing what the run computes
    RESUMABLE = ("steps", "checkpoint_every", "keep_checkpoints", "threads", "workers",
                 "eval_tasks", "eval_samples", "eval_every", "sampler_processes")


# ---------------------------------------------------------------------------------------------
# presets: a fleet plus defaults sized for it

_EVAL_TASKS = 64  # held-out tasks of the fleet presets: before and after


def homogeneous() -> TrainConfig:
    """One B200 BF16 sampler group (kernels only)."""
    return TrainConfig(fleet="homogeneous", eval_tasks=_EVAL_TASKS)


def precision() -> TrainConfig:
    """B200 NVFP4 W4A16 samplers with an FP8 KV cache (+ precision)."""
    return TrainConfig(fleet="precision", eval_tasks=_EVAL_TASKS)


def mixed() -> TrainConfig:
    """The study's eight sampler groups (+ accelerator)."""
    return TrainConfig(fleet="mixed", eval_tasks=_EVAL_TASKS)


def smoke() -> TrainConfig:
    """A few small steps on the mixed fleet: every code path (quantized groups, calibration,
    checkpoints, the monitor) in under a minute on 2 cores. 4 prompts × 8 episodes: groups of
    8 whose rewards differ, so the policy moves (2 × 4 shared one reward per group: gradient 0),
    and each of the fleet's groups serves a few episodes a step, so the step's KL and reward are
    steady enough that a 20-step run raises no critical alert."""
    return TrainConfig(fleet="mixed", steps=3, prompts_per_step=4, samples_per_prompt=8,
                       max_turns=2, max_new_tokens=48, candidates=32, checkpoint_every=2)


def _registry(*presets: Callable[[], TrainConfig]) -> dict[str, Callable[[], TrainConfig]]:
    return table_of(presets, lambda fn: fn.__name__, "run preset")


RUN_PRESETS: dict[str, Callable[[], TrainConfig]] = _registry(homogeneous, precision, mixed,
                                                              smoke)
"""`mismatch train --preset` name → the function returning its config."""


def preset_config(preset: str, **overrides: Any) -> TrainConfig:
    """The config of a run preset with explicit overrides (None values are ignored)."""
    if preset not in RUN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(RUN_PRESETS)}")
    return replace(RUN_PRESETS[preset](), **{k: v for k, v in overrides.items() if v is not None})
