"""Units of work and the trainer's batch.

One *unit* is one prompt's group of `samples_per_prompt` episodes, sampled by one sampler group
with one weight version. Units are numbered in the order they are claimed; unit u's task and its
episodes' random streams are functions of (u, seed) alone, so a unit sampled again (a resume, a
restarted sampler) is the same trajectory.

`build_batch` pads a step's units into one right-padded batch. Dims: B episodes, T positions,
K candidates per position. GRPO advantages are group-relative within a unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .loss import group_advantages
from .rollout import Trajectory

__all__ = ["Unit", "task_of", "unit_seed", "Batch", "build_batch"]


@dataclass
class Unit:
    """One prompt's group of episodes, sampled by one group with one weight version."""

    index: int
    group: str
    version: int
    episodes: list[Trajectory]
    seconds: float


def task_of(index: int, seed: int, kinds: tuple[str, ...] | None = None):
    """The training task of unit `index` (a fixed, seeded order over the zoo's train split;
    `kinds` taken in turn, or the zoo's mix when None)."""
    from mismatch.zoo.tasks import HELDOUT_SEED_BASE, make_task

    kind = kinds[index % len(kinds)] if kinds else None
    return make_task((seed * 7919 + index) % HELDOUT_SEED_BASE, kind)


def unit_seed(index: int, seed: int) -> int:
    """The base seed of unit `index`'s episodes (episode j draws from stream
    unit_seed · 1009 + j)."""
    return (seed * 1_000_003 + index * 104_729) % (2**31 - 1)


@dataclass
class Batch:
    """A step's episodes, padded (see the module docstring for the dims)."""

    ids: torch.Tensor            # [B, T] int64, right-padded
    attention: torch.Tensor      # [B, T] int64
    mask: torch.Tensor           # [B, T] bool, sampled tokens
    sampler_logp: torch.Tensor   # [B, T] float32
    cand_ids: torch.Tensor       # [B, T, K] int64
    cand_sampler_logp: torch.Tensor  # [B, T, K] float32, −inf padding
    support: torch.Tensor        # [B, T, K] bool
    advantages: torch.Tensor     # [B] float32
    staleness: torch.Tensor      # [B, T] float32 (valid where mask)
    groups: list[str]


def build_batch(units: list[Unit], step: int, pad_id: int) -> Batch:
    """Pad the units' episodes into one batch; advantages are group-relative within a unit.

    The per-token lists are converted with numpy (a few times faster than torch.tensor on
    nested Python lists; the same float32 rounding) and the candidates of the whole batch
    placed with one indexed write per field."""
    eps = [ep for u in units for ep in u.episodes]
    b, t = len(eps), max(len(ep.token_ids) for ep in eps)
    k = max((len(c) for ep in eps for c in ep.candidate_ids[:1]), default=1)
    lengths = [len(ep.token_ids) for ep in eps]
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    slp = torch.zeros(b, t)
    cand_ids = torch.zeros(b, t, k, dtype=torch.long)
    cand_slp = torch.full((b, t, k), float("-inf"))
    support = torch.zeros(b, t, k, dtype=torch.bool)
    stale = torch.zeros(b, t)
    rows, cols = [], []  # the sampled positions of the batch, episode by episode
    for i, ep in enumerate(eps):
        n = lengths[i]
        ids[i, :n] = torch.from_numpy(np.asarray(ep.token_ids, dtype=np.int64))
        attention[i, :n] = 1
        mask[i, :n] = torch.from_numpy(np.asarray(ep.sampled_mask, dtype=np.bool_))
        slp[i, :n] = torch.from_numpy(np.asarray(ep.sampler_logprobs, dtype=np.float32))
        pos = torch.from_numpy(np.asarray(ep.sampled_positions, dtype=np.int64))
        if len(pos):
            version = torch.from_numpy(np.asarray(ep.policy_version, dtype=np.float32))
            stale[i, pos] = float(step) - version[pos]
            rows.append(torch.full((len(pos),), i, dtype=torch.long))
            cols.append(pos)
    if rows:
        at = (torch.cat(rows), torch.cat(cols))
        sampled = [(eps[int(r[0])], len(r)) for r in rows]

        def stacked(name: str, dtype) -> torch.Tensor:
            # lists from older callers, tensors from run_episodes: numpy takes either
            return torch.from_numpy(np.concatenate(
                [np.asarray(getattr(ep, name), dtype=dtype).reshape(n, k) for ep, n in sampled]))

        cand_ids[at] = stacked("candidate_ids", np.int64)
        cand_slp[at] = stacked("candidate_logprobs", np.float32)
        support[at] = stacked("candidate_support", np.bool_)
    rewards = torch.tensor([[ep.reward for ep in u.episodes] for u in units])
    return Batch(ids=ids, attention=attention, mask=mask, sampler_logp=slp, cand_ids=cand_ids,
                 cand_sampler_logp=cand_slp, support=support,
                 advantages=group_advantages(rewards).flatten().float(), staleness=stale,
                 groups=[u.group for u in units for _ in u.episodes])
