"""Sampling a batch of units: the sampler's model at a weight version, and the episodes of the
units it was given, as one batched generation.

Episode j of unit u draws from its own random stream, a function of (u, j, seed), so the same
units give the same episodes however they are batched, in a worker thread, a sampler process
(mismatch.engines.workers) or a Ray actor.

A batch may hold units of several sampler groups (a mixed fleet's step): each unit's episodes
compute with their own group's numerics in one engine batch (mismatch.engines.lanes), which keeps
the batch as large as a homogeneous fleet's. Samplers that quantize activations with static
scales are calibrated once per weight version, as a checkpoint is calibrated once when it is
quantized, on a fixed calibration set (the tasks of units 0 to 7), so that the scales do not
depend on which units a batch happens to hold (`scales_at`).
"""

from __future__ import annotations

import copy
import time

import torch

from mismatch.probes.base import TORCH_DTYPES

from .batch import Unit, task_of, unit_seed
from .components import RolloutConfig
from .config import TrainConfig
from .fleet import SamplerGroup
from .rollout import Trajectory, calibration_scales, needs_scales, run_episodes

__all__ = ["RolloutConfig", "model_at", "scales_at", "sample_units", "sample_in_worker",
           "split_units", "CALIBRATION_UNITS"]

CALIBRATION_UNITS = 8  # the calibration set: the tasks of units 0 … 7


def model_at(models: dict, base: torch.nn.Module, dtype: torch.dtype, version: int,
             weights) -> torch.nn.Module:
    """The sampler's model in `dtype` holding weight `version`, from the cache `models`
    {dtype: (version, model)}; `weights` (a state dict, or a callable returning one) is read only
    when the cached version differs."""
    held = models.get(dtype)
    if held is None or held[0] != version:
        state = weights() if callable(weights) else weights
        model = held[1] if held else copy.deepcopy(base).to(dtype).eval()
        model.load_state_dict({n: w.to(dtype) for n, w in state.items()})
        models[dtype] = (version, model)
    return models[dtype][1]


def scales_at(cache: dict, model: torch.nn.Module, tokenizer, cfg: TrainConfig,
              group: SamplerGroup, version: int) -> dict:
    """The static activation scales of `group`'s numerics at weight `version` ({} when it needs
    none), from the cache {numerics: (version, scales)}: calibrated when the version changes, on
    the tasks of units 0 … CALIBRATION_UNITS − 1."""
    if not needs_scales(group.spec):
        return {}
    key = group.spec.numerics_key()
    held = cache.get(key)
    if held is None or held[0] != version:
        tasks = [task_of(u, cfg.seed, cfg.task_kinds) for u in range(CALIBRATION_UNITS)]
        cache[key] = (version, calibration_scales(model, tokenizer, group.spec, tasks))
    return cache[key][1]


def sample_units(model: torch.nn.Module, tokenizer, cfg: TrainConfig,
                 group: SamplerGroup | list[SamplerGroup], units: list[int], version: int,
                 scales: dict | None = None) -> list[Trajectory]:
    """The episodes of `units` (samples_per_prompt each, in order) sampled with `model` (weight
    `version`) as one batch: by `group`'s numerics, or, given one group per unit, each unit by
    its own (lanes). `scales`: the cache of `scales_at` (a new one for this call when None)."""
    top = cfg.samples_top_p
    n = cfg.samples_per_prompt
    groups = [group] * len(units) if isinstance(group, SamplerGroup) else list(group)
    if len(groups) != len(units):
        raise ValueError(f"{len(groups)} sampler groups for {len(units)} units")
    cache = {} if scales is None else scales
    given = {g.name: scales_at(cache, model, tokenizer, cfg, g, version)
             for g in dict.fromkeys(groups)}
    tasks = [task_of(u, cfg.seed, cfg.task_kinds) for u in units for _ in range(n)]
    return run_episodes(
        model, tokenizer, tasks, [g for g in groups for _ in range(n)], version=version,
        scales={name: s for name, s in given.items() if s}, **cfg.rollout.episode_limits(top),
        top_k_candidates=cfg.rollout.candidates,
        episode_seeds=[unit_seed(u, cfg.seed) * 1_009 + j for u in units for j in range(n)])


def sample_in_worker(cfg: TrainConfig, groups: list[SamplerGroup], units: list[int],
                     version: int, weights: dict[str, torch.Tensor]
                     ) -> tuple[list[Trajectory], float]:
    """`sample_units` inside a sampler process (mismatch.engines.workers), one group per unit:
    the process keeps its model per compute dtype, loading `weights` (mapped from shared memory)
    only when `version` changes, and its calibrated scales per version. Returns the episodes and
    the seconds spent sampling them."""
    from mismatch.engines.workers import worker_state

    state = worker_state()
    base, tokenizer = state["setup"]
    model = model_at(state.setdefault("models", {}), base,
                     TORCH_DTYPES[groups[0].spec.compute_dtype], version, weights)
    t0 = time.perf_counter()
    eps = sample_units(model, tokenizer, cfg, groups, units, version,
                       scales=state.setdefault("scales", {}))
    return eps, time.perf_counter() - t0


def split_units(eps: list[Trajectory], batch: list[tuple[int, SamplerGroup]], version: int,
                seconds: float, n: int) -> list[Unit]:
    """The units of one batched generation (n episodes each, in claim order), each under its
    claim's group."""
    return [Unit(index=u, group=g.name, version=version, episodes=eps[i * n:(i + 1) * n],
                 seconds=seconds / len(batch)) for i, (u, g) in enumerate(batch)]
