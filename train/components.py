"""The component configs a training run composes (`TrainConfig`'s parts), each owned by the
component that takes it, and each validating its own fields:

- `OptimConfig` — the optimizer: the trainer (train.trainer, train.distributed);
- `RolloutConfig` — the samplers' per-episode limits: the unit sampler (train.unit_sampling)
  and the held-out evaluation (train.evaluation);
- `PipelineConfig` — when and where the samplers run against the trainer (staleness, workers,
  processes, threads): the pipeline (train.pipeline);
- `CheckpointConfig` — checkpoint cadence and retention: the run directory (train.rundir);
- `EvalConfig` — the held-out evaluation's size and cadence (train.evaluation).

Torch-free (the owning modules import torch and re-export their config), so that
mismatch.train.config imports without torch. The field names are the flat keys of
out/config.json (`TrainConfig.to_json`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OptimConfig", "RolloutConfig", "PipelineConfig", "CheckpointConfig", "EvalConfig"]


def _at_least_one(obj, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(obj, name)}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer (train.trainer's AdamW on the FP32 master)."""

    lr: float = 1e-4
    """AdamW learning rate on the FP32 master."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The samplers' per-episode limits (train.unit_sampling; the held-out evaluation too)."""

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

    def __post_init__(self) -> None:
        _at_least_one(self, "max_turns", "max_new_tokens", "candidates", "top_p_max_tokens")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")

    def episode_limits(self, top_p: bool) -> dict[str, int | float]:
        """train.rollout.run_episodes' limits: turns, tokens, and the top-p nucleus (capped by
        top-k) when `top_p`, else the full distribution."""
        return {"max_turns": self.max_turns, "max_new_tokens": self.max_new_tokens,
                "top_p": self.top_p if top_p else 1.0,
                "top_k": self.top_p_max_tokens if top_p else 0}


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """When and where the samplers run against the trainer (train.pipeline)."""

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
    threads: int = 1
    """torch intra-op threads (the process's; every worker and the trainer share them; in the
    lockstep modes the trainer's step also takes the idle workers' share: lockstep_threads)."""

    def __post_init__(self) -> None:
        if self.sampler_processes < 0:
            raise ValueError(f"sampler-processes must be >= 0, got {self.sampler_processes}")
        _at_least_one(self, "workers", "queue_steps", "threads")
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
    def lag(self) -> int:
        """Versions the samplers stay behind the newest (forced staleness; 0 otherwise)."""
        return self.staleness or 0

    @property
    def lockstep(self) -> bool:
        """One step of units per version (sync and forced staleness)."""
        return self.sync or self.staleness is not None


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoint cadence and retention (train.rundir.save_checkpoint; the loop's cadence)."""

    checkpoint_every: int = 10
    """Checkpoint every this many steps (and at the end or a stop)."""
    keep_checkpoints: int = 2
    """The newest checkpoints kept (older ones are deleted as new ones land); 0: every one, for
    measurements on a run's history (scripts/study_stale_ratios.py)."""

    def __post_init__(self) -> None:
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep-checkpoints must be >= 0 (0: keep every checkpoint), got "
                             f"{self.keep_checkpoints}")
        _at_least_one(self, "checkpoint_every")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The held-out evaluation's size and cadence (train.evaluation)."""

    eval_tasks: int = 0
    """Held-out tasks evaluated before the first and after the last step (0: no evaluation)."""
    eval_samples: int = 4
    """Episodes per held-out task in that evaluation (temperature 1, the trainer's numerics)."""
    eval_every: int = 0
    """Also evaluate after every this many steps (0: only before the first and after the last)."""

    def __post_init__(self) -> None:
        if self.eval_tasks < 0 or self.eval_samples < 1 or self.eval_every < 0:
            raise ValueError(f"eval-tasks and eval-every must be >= 0 and eval-samples >= 1, "
                             f"got {self.eval_tasks}, {self.eval_every}, {self.eval_samples}")
