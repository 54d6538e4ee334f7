"""A training run's configuration (`TrainConfig`) and the run presets of `mismatch train
--preset`: Python functions that return configs, registered once in `RUN_PRESETS`.

Everything that defines what a run computes is a field here or in one of its components'
configs (train.components: the optimizer's, the rollouts', the pipeline's, checkpointing's and
the evaluation's, each owned by its component); the config is saved as the flat
out/config.json (`TrainConfig.to_json`) and a resume must match it (fields in `RESUMABLE`
excepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from mismatch.fleets import FLEETS as FLEET_PRESETS
from mismatch.profiles import LM_HEADS
from mismatch.registry import table_of

from .arms import ARMS
from .components import (CheckpointConfig, EvalConfig, OptimConfig, PipelineConfig,
                         RolloutConfig)

__all__ = ["TrainConfig", "FLAT_KEYS", "OptimConfig", "RolloutConfig", "PipelineConfig",
           "CheckpointConfig", "EvalConfig", "RUN_PRESETS", "RUN_TRAINER_DTYPES", "preset_config",
           "homogeneous", "precision", "mixed", "smoke"]

RUN_TRAINER_DTYPES = ("bf16", "fp32")
"""The trainer's compute dtypes a run takes (`--trainer-dtype`): the FP32 master's BF16 cast, or
the master itself (a reference); mismatch.profiles.TRAINER_DTYPES less FP16."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a run (saved as out/config.json; a resume must match it): the
    run's own fields and its components' configs (train.components), each owned and taken by
    its component. `flat` builds one from the flat field names, `updated` replaces by them, and
    `to_json`/`from_json` are the flat out/config.json form (`FLAT_KEYS`, in that order)."""

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
    seed: int = 0
    """Seeds the router, the tasks' order and every unit's sampling."""
    tasks: str = "zoo"
    """Task mix: "zoo" (the embedded model's mix of kinds) or kinds joined by commas, taken in
    turn (e.g. "arith,table"; mismatch.zoo.tasks.TASK_KINDS)."""
    model: str | None = None
    """The policy to start from: a model directory of the zoo's format (`mismatch zoo build
    --out DIR`; None: the embedded model)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer (lr, grad_clip): the trainer's."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The samplers' per-episode limits (turns, tokens, candidates, top-p)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Staleness, workers, sampler processes, queue and threads."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out evaluation's size and cadence."""

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
        for name in ("steps", "prompts_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples-per-prompt must be >= 2 (GRPO advantages are relative "
                             f"to the group), got {self.samples_per_prompt}")
        for part, kind in _PARTS.items():
            if not isinstance(getattr(self, part), kind):
                raise TypeError(f"TrainConfig.{part} must be a {kind.__name__}, got "
                                f"{type(getattr(self, part)).__name__}")

    # -- the flat form: out/config.json, the CLI's and the presets' field names ---------------

    @classmethod
    def flat(cls, **values: Any) -> TrainConfig:
        """The config of these flat field names (FLAT_KEYS; the others at their defaults)."""
        own, parts = _split(values)
        return cls(**own, **{part: _PARTS[part](**kw) for part, kw in parts.items() if kw})

    def updated(self, **values: Any) -> TrainConfig:
        """This config with these flat fields replaced (dataclasses.replace by flat names)."""
        own, parts = _split(values)
        return replace(self, **own, **{part: replace(getattr(self, part), **kw)
                                       for part, kw in parts.items() if kw})

    def get(self, name: str) -> Any:
        """The value of the flat field `name` (a FLAT_KEYS name)."""
        if name not in _OWNER:
            raise KeyError(name)
        part = _OWNER[name]
        return getattr(getattr(self, part) if part else self, name)

    def to_json(self) -> dict[str, Any]:
        """The flat dict of out/config.json (and a checkpoint's "config"), in FLAT_KEYS order."""
        return {name: self.get(name) for name in FLAT_KEYS}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainConfig:
        """The config of a flat dict as `to_json` writes it; keys it does not know (a field
        since removed) are ignored, and keys it lacks (a field since added) take defaults."""
        return cls.flat(**{k: v for k, v in data.items() if k in _OWNER})

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every flat field's default (what a saved config lacking the field had)."""
        return {name: _default(name) for name in FLAT_KEYS}

    # -- derived ------------------------------------------------------------------------------

    @property
    def task_kinds(self) -> tuple[str, ...] | None:
        return None if self.tasks == "zoo" else tuple(self.tasks.split(","))

    @property
    def samples_top_p(self) -> bool:
        return ARMS[self.correction].top_p

    @property
    def masks_tokens(self) -> bool:
        """Whether the loss masks tokens whose ratio leaves a band (MIS weights): the collapse
        monitor then reads the masked share as the drift the update feels
        (`MonitorConfig.masked_loss`)."""
        return ARMS[self.correction].weight == "mis"

    # fields a resume may change without changing what the run computes (flat names)
    RESUMABLE = ("steps", "checkpoint_every", "keep_checkpoints", "threads", "workers",
                 "eval_tasks", "eval_samples", "eval_every", "sampler_processes")


_PARTS: dict[str, type] = {"optim": OptimConfig, "rollout": RolloutConfig,
                           "pipeline": PipelineConfig, "checkpoint": CheckpointConfig,
                           "eval": EvalConfig}
"""TrainConfig's component fields → their config classes."""

FLAT_KEYS = ("fleet", "correction", "trainer_dtype", "lm_head", "steps", "prompts_per_step",
             "samples_per_prompt", "lr", "grad_clip", "max_turns", "max_new_tokens",
             "candidates", "top_p", "top_p_max_tokens", "max_staleness", "sync", "staleness",
             "workers", "sampler_processes", "queue_steps", "checkpoint_every",
             "keep_checkpoints", "threads", "seed", "tasks", "eval_tasks", "eval_samples",
             "eval_every", "model")
"""out/config.json's keys, in its order (the flat config of before the components)."""

_OWNER: dict[str, str | None] = {
    **{f.name: None for f in fields(TrainConfig) if f.name not in _PARTS},
    **{f.name: part for part, kind in _PARTS.items() for f in fields(kind)}}
"""Flat field name → the component field holding it (None: TrainConfig's own)."""
assert sorted(_OWNER) == sorted(FLAT_KEYS), "FLAT_KEYS must name every field once"


def _split(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Flat field values → (TrainConfig's own, {component: its fields})."""
    own: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
    for name, value in values.items():
        if name not in _OWNER:
            raise TypeError(f"TrainConfig has no field {name!r}")
        part = _OWNER[name]
        (own if part is None else parts[part])[name] = value
    return own, parts


def _default(name: str) -> Any:
    part = _OWNER[name]
    kind = TrainConfig if part is None else _PARTS[part]
    return next(f.default for f in fields(kind) if f.name == name)


# ---------------------------------------------------------------------------------------------
# presets: a fleet plus defaults sized for it

_EVAL_TASKS = 64  # held-out tasks of the fleet presets: before and after


def homogeneous() -> TrainConfig:
    """One B200 BF16 sampler group (kernels only)."""
    return TrainConfig.flat(fleet="homogeneous", eval_tasks=_EVAL_TASKS)


def precision() -> TrainConfig:
    """B200 NVFP4 W4A16 samplers with an FP8 KV cache (+ precision)."""
    return TrainConfig.flat(fleet="precision", eval_tasks=_EVAL_TASKS)


def mixed() -> TrainConfig:
    """The study's eight sampler groups (+ accelerator)."""
    return TrainConfig.flat(fleet="mixed", eval_tasks=_EVAL_TASKS)


def smoke() -> TrainConfig:
    """A few small steps on the mixed fleet: every code path (quantized groups, calibration,
    checkpoints, the monitor) in under a minute on 2 cores. 4 prompts × 8 episodes: groups of
    8 whose rewards differ, so the policy moves (2 × 4 shared one reward per group: gradient 0),
    and each of the fleet's groups serves a few episodes a step, so the step's KL and reward are
    steady enough that a 20-step run raises no critical alert."""
    return TrainConfig.flat(fleet="mixed", steps=3, prompts_per_step=4, samples_per_prompt=8,
                            max_turns=2, max_new_tokens=48, candidates=32, checkpoint_every=2)


def _registry(*presets: Callable[[], TrainConfig]) -> dict[str, Callable[[], TrainConfig]]:
    return table_of(presets, lambda fn: fn.__name__, "run preset")


RUN_PRESETS: dict[str, Callable[[], TrainConfig]] = _registry(homogeneous, precision, mixed,
                                                              smoke)
"""`mismatch train --preset` name → the function returning its config."""


def preset_config(preset: str, **overrides: Any) -> TrainConfig:
    """The config of a run preset with explicit overrides by flat field names (FLAT_KEYS; None
    values are ignored)."""
    if preset not in RUN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(RUN_PRESETS)}")
    return RUN_PRESETS[preset]().updated(**{k: v for k, v in overrides.items() if v is not None})
