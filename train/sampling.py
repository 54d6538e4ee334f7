"""Sampling a batch of units: the sampler's model at a weight version, and the episodes of the
units it was given, as one batched generation.

Episode j of unit u draws from its own random stream, a function of (u, j, seed), so the same
units give the same episodes however they are batched, in a worker thread, a sampler process
(mismatch.engines.workers) or a Ray actor.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from mismatch.probes.base import TORCH_DTYPES

from .batch import Unit, task_of, unit_seed
from .config import TrainConfig
from .fleet import SamplerGroup
from .rollout import Trajectory, run_episodes

__all__ = ["model_at", "sample_units", "sample_in_worker", "split_units"]


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


def sample_units(model: torch.nn.Module, tokenizer, cfg: TrainConfig, group: SamplerGroup,
                 units: list[int], version: int) -> list[Trajectory]:
    """The episodes of `units` (samples_per_prompt each, in order) sampled by `group`'s numerics
    with `model` (weight `version`) as one batch. Episode j of unit u draws from its own stream,
    a function of (u, j, seed): the same draws however the units are batched."""
    top = cfg.samples_top_p
    n = cfg.samples_per_prompt
    tasks = [task_of(u, cfg.seed, cfg.task_kinds) for u in units for _ in range(n)]
    return run_episodes(
        model, tokenizer, tasks, group, version=version, max_turns=cfg.max_turns,
        max_new_tokens=cfg.max_new_tokens, top_p=cfg.top_p if top else 1.0,
        top_k=cfg.top_p_max_tokens if top else 0, top_k_candidates=cfg.candidates,
        episode_seeds=[unit_seed(u, cfg.seed) * 1_009 + j for u in units for j in range(n)])


def sample_in_worker(cfg: TrainConfig, group: SamplerGroup, units: list[int], version: int,
                     weights: dict[str, torch.Tensor]) -> tuple[list[Trajectory], float]:
    """`sample_units` inside a sampler process (mismatch.engines.workers): the process keeps its
    model per compute dtype and loads `weights` (mapped from shared memory) only when `version`
    changes. Returns the episodes and the seconds spent sampling them."""
    from mismatch.engines.workers import worker_state

    state = worker_state()
    base, tokenizer = state["setup"]
    model = model_at(state.setdefault("models", {}), base,
                     TORCH_DTYPES[group.spec.compute_dtype], version, weights)
    t0 = time.perf_counter()
    eps = sample_units(model, tokenizer, cfg, group, units, version)
    return eps, time.perf_counter() - t0


def split_units(eps: list[Trajectory], batch: list[tuple[int, Any]], group: str, version: int,
                seconds: float, n: int) -> list[Unit]:
    """The units of one batched generation (n episodes each, in claim order)."""
    return [Unit(index=u, group=group, version=version, episodes=eps[i * n:(i + 1) * n],
                 seconds=seconds / len(batch)) for i, (u, _) in enumerate(batch)]

