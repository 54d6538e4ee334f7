"""The trainer and the asynchronous loop: sampler workers generate with the weights they hold,
the trainer takes corrected GRPO steps and publishes new weights, the collapse monitor watches.

One *unit* of work is one prompt's group of `samples_per_prompt` episodes. Units are numbered in
the order they are claimed; the router (fleet.Router, capacity-proportional) assigns each unit to
a sampler group, and all its episodes are sampled by that group's numerics (a GRPO group is one
request to one server, as an n-sample request is in a real fleet).

Asynchrony (`run`):

- A worker thread claims a unit, picks up the newest published weights if it holds an older
  version (only between units, never mid-episode), and drives the episodes (rollout.py). Each
  sampled token carries the version that generated it.
- The trainer takes the first `prompts_per_step` finished units off the queue, computes the loss
  of the chosen correction arm (loss.py) in BF16 on its FP32 master's cast, steps AdamW on the
  master, and publishes the BF16 cast as version step+1. Staleness of a token = the optimizer step
  that consumes it − the version that generated it.
- Unbounded staleness (default): workers claim a new unit while fewer than `queue_steps` steps'
  worth of units are claimed and not yet consumed (back-pressure, not a staleness bound).
  `max_staleness` = s: a unit is claimed only while claimed < (version + 1 + s)·prompts_per_step
  (the gate of an AReaL-style bounded-staleness pipeline), and a unit staler than s when it is
  consumed is discarded and counted. `sync` = staleness 0: exactly one step of units per version,
  sampled, then trained on, with the workers idle while the trainer steps. `staleness` = K forces
  the lag exactly: one step of units per version as in sync, sampled with the weights of K
  versions before (the publisher holds them; checkpoints save them, so a resume keeps the lag).
  In these lockstep modes a worker claims the step's units together and each sampler group
  generates its units' episodes as one batch (seeded by the first unit's number), as a server
  batches the requests it holds.

Run directory (`out`):

- `metrics.jsonl`: one object per optimizer step (`step` = steps completed), the monitor's native
  format (probes.alerts.SIGNALS), so `mismatch monitor out/metrics.jsonl` reads it.
- `alerts.jsonl`: the collapse monitor's alerts (probes.sinks.JsonlSink).
- `checkpoints/step-NNNNNN/`: FP32 master, AdamW state, the unit cursor and the config, written
  to a temporary sibling and renamed; the newest two are kept.
- `config.json`; `eval.json`, the held-out reward before the first and after the last step
  (`eval_tasks` > 0), and every `eval_every` steps between; `final/`, the BF16 policy with its
  tokenizer, when the run ends.

Resume after a kill: the newest checkpoint is loaded; `metrics.jsonl` and `alerts.jsonl` are cut
back to its step (a torn last line dropped), the monitor replays the kept records to rebuild its
baselines, and the units claimed after the checkpoint — in flight or queued at the kill — are
counted, logged and regenerated. No optimizer step is lost (they are recomputed from the
checkpoint) and none is duplicated (the log is cut back first). In `sync` mode the resumed run is
bit-identical to an uninterrupted one: the batch of step s is units [s·P, (s+1)·P), each seeded by
its number, sampled with version s.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from mismatch.fleets import FLEETS as FLEET_PRESETS
from mismatch.metrics import kl_estimators

from .fleet import Router, SamplerGroup, fleet
from .loss import ARMS, group_advantages, policy_loss, sc_tail_ratio
from .rollout import COMPUTE_DTYPES, Trajectory, run_episodes

__all__ = ["TrainConfig", "RUN_PRESETS", "preset_config", "run", "RunResult", "read_metrics",
           "latest_checkpoint"]

log = logging.getLogger("mismatch.train")

_CHECKPOINTS_KEPT = 2
EXIT_STOPPED = 3


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a run (saved as out/config.json; a resume must match it)."""

    fleet: str = "mixed"
    """Sampler fleet preset (train.fleet.PRESETS): homogeneous, precision or mixed."""
    correction: str = "sc+mis+topp"
    """Loss arm (train.loss.ARMS)."""
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
        if self.fleet not in FLEET_PRESETS:
            raise ValueError(f"unknown fleet preset {self.fleet!r}; presets: "
                             f"{', '.join(FLEET_PRESETS)}")
        if self.correction not in ARMS:
            raise ValueError(f"unknown correction {self.correction!r}; arms: {', '.join(ARMS)}")
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

    # fields a resume may change without changing what the run computes
    RESUMABLE = ("steps", "checkpoint_every", "threads", "workers", "eval_tasks",
                 "eval_samples", "eval_every", "sampler_processes")


RUN_PRESETS: dict[str, dict[str, Any]] = {
    "homogeneous": {"fleet": "homogeneous", "eval_tasks": 64},
    "precision": {"fleet": "precision", "eval_tasks": 64},
    "mixed": {"fleet": "mixed", "eval_tasks": 64},
    # a few small steps on the mixed fleet: every code path (quantized groups, calibration,
    # checkpoints, the monitor) in well under a minute on 2 cores
    "smoke": {"fleet": "mixed", "steps": 3, "prompts_per_step": 2, "samples_per_prompt": 4,
              "max_turns": 2, "max_new_tokens": 48, "candidates": 32, "checkpoint_every": 2},
}
"""`mismatch train --preset`: a fleet plus defaults sized for it."""


def preset_config(preset: str, **overrides: Any) -> TrainConfig:
    """The config of a run preset with explicit overrides (None values are ignored)."""
    if preset not in RUN_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(RUN_PRESETS)}")
    values = dict(RUN_PRESETS[preset])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig(**values)


# ---------------------------------------------------------------------------------------------
# units and the batch


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


def _unit_seed(index: int, seed: int) -> int:
    return (seed * 1_000_003 + index * 104_729) % (2**31 - 1)


@dataclass
class Batch:
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


# ---------------------------------------------------------------------------------------------
# the trainer


class _TokenScores(torch.autograd.Function):
    """logits [N, V] of N predicting positions → the FP32 log-softmax of each row gathered at
    its `labels` [N] and `cand_ids` [N, K], and its entropy [N] (not differentiable), `rows`
    rows at a time: the FP32 log-softmax exists for one cache-sized chunk at a time, never for
    the whole batch. Every number equals torch's own `log_softmax(logits.float(), -1).gather(…)`
    bit for bit, forward and backward: each chunk runs the same row-wise kernels (log-softmax,
    gather's scatter-add backward, the log-softmax backward, the cast back to the logits' dtype)
    on the same rows; the backward recomputes the chunk's log-softmax instead of keeping it."""

    @staticmethod
    def forward(ctx, logits, labels, cand_ids, rows):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32)
        cand = torch.empty(n, cand_ids.shape[-1], dtype=torch.float32)
        ent = torch.empty(n, dtype=torch.float32)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            lsm = torch.log_softmax(logits[r0:r1].float(), dim=-1)
            logp[r0:r1] = lsm.gather(-1, labels[r0:r1, None])[:, 0]
            cand[r0:r1] = lsm.gather(-1, cand_ids[r0:r1])
            ent[r0:r1] = -(lsm.exp() * lsm).sum(-1)
        ctx.save_for_backward(logits, labels, cand_ids)
        ctx.rows = rows
        ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return logp, cand, ent

    @staticmethod
    def backward(ctx, g_logp, g_cand, _):
        logits, labels, cand_ids = ctx.saved_tensors
        if g_logp is None and g_cand is None:
            return torch.zeros_like(logits), None, None, None
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        for r0 in range(0, n, ctx.rows):
            r1 = min(n, r0 + ctx.rows)
            lsm = torch.log_softmax(logits[r0:r1].float(), dim=-1)
            g = None
            if g_logp is not None:
                g = torch.zeros_like(lsm).scatter_add_(-1, labels[r0:r1, None],
                                                       g_logp[r0:r1, None])
            if g_cand is not None:
                gc = torch.zeros_like(lsm).scatter_add_(-1, cand_ids[r0:r1], g_cand[r0:r1])
                g = gc if g is None else g + gc
            grad[r0:r1] = torch._log_softmax_backward_data(g, lsm, -1, torch.float32)
        return grad, None, None, None


_SCORE_CHUNK = 1 << 18
"""Logit elements (rows × V) per chunk of `token_scores`: ~1 MiB of FP32, cache-sized."""


def right_padded(attention: torch.Tensor) -> bool:
    """Whether every row of a [B, T] attention mask is ones then zeros (padding on the right)."""
    a = attention.bool()
    return bool((a[:, 1:] <= a[:, :-1]).all())


def _logits_at(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor | None,
               seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The logits [N, V] of positions (seq, pos) of a causal LM's forward over `ids`: its output
    head (get_output_embeddings) is fed those positions' hidden states alone."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hook = None
    if isinstance(head, torch.nn.Module):
        def rows_only(_module, args):
            hidden = args[0]
            return (hidden[seq, pos],) + args[1:] if hidden.dim() == 3 else None

        hook = head.register_forward_pre_hook(rows_only)
    try:
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    finally:
        if hook is not None:
            hook.remove()
    return logits[seq, pos] if logits.dim() == 3 else logits  # a head that was not hooked


def token_scores(model: torch.nn.Module, batch: Batch):
    """The trainer's teacher-forced scores of `batch` under `model` (FP32 log-softmax of its
    logits) at the sampled tokens (`batch.mask`, position 0 excepted: nothing predicts it):
    log π of each token [B, T] and of each candidate [B, T, K], and the entropy [B, T-1] of
    the distribution that predicts position t+1 (detached); 0 at every other position. The loss
    and the metrics read the sampled positions only, so only their logits are computed (the
    output head runs on their hidden states alone) and only their log-softmax.

    A right-padded batch (what build_batch makes) runs without its attention mask: under causal
    attention a real token never sees the padding after it, so the logits of every real position
    are the same bit for bit, and attention takes its causal path (half the score blocks, no
    [B, 1, T, T] mask) instead of the masked one.

    The loss and the log-probs are those of the full [B, T, V] log-softmax bit for bit; the
    gradients differ by BF16 rounding only: the attention backward sums in another order than
    the masked one, and the output head's weight gradient sums the sampled rows alone (a few
    in 10^4 of its elements round the other way)."""
    _, at = _sampled(batch)
    lp, cl, en = _packed_scores(model, batch, at)
    return _unpacked(lp, cl, en, at, batch)


def _sampled(batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The sampled-token mask [B, T] the loss averages over (position 0 excepted) and its
    positions (rows, columns), row-major."""
    mask = batch.mask.clone()
    mask[:, 0] = False
    return mask, mask.nonzero(as_tuple=True)


def _packed_scores(model: torch.nn.Module, batch: Batch, at):
    """token_scores at the positions `at` only: log π [N], candidates [N, K], entropy [N]."""
    attention = None if right_padded(batch.attention) else batch.attention
    seq, pos = at[0], at[1] - 1                                   # position pos predicts pos+1
    logits = _logits_at(model, batch.ids, attention, seq, pos)
    rows = max(1, _SCORE_CHUNK // max(1, logits.shape[-1]))
    return _TokenScores.apply(logits, batch.ids[at], batch.cand_ids[at], rows)


def _unpacked(lp, cl, en, at, batch: Batch):
    """Packed scores back in place: [B, T], [B, T, K], [B, T-1] (0 elsewhere)."""
    b, t, k = batch.cand_ids.shape
    logp = torch.zeros(b, t, dtype=torch.float32).index_put(at, lp)
    cand = torch.zeros(b, t, k, dtype=torch.float32).index_put(at, cl)
    ent = torch.zeros(b, t - 1, dtype=torch.float32).index_put_((at[0], at[1] - 1), en)
    return logp, cand, ent


def batch_loss(model: torch.nn.Module, batch: Batch, correction: str):
    """The arm's loss of `batch` under `model` (teacher-forced, FP32 log-softmax of its logits;
    token_scores): (loss — a mean over the batch's valid tokens —, the loss's metrics, and, at
    the sampled tokens (0 elsewhere), the entropy [B, T-1] of each position predicting one,
    log π of each token [B, T] and log π of each candidate [B, T, K]; the sampled-token mask)."""
    mask, at = _sampled(batch)
    lp, cl, en = _packed_scores(model, batch, at)
    loss, m = _packed_loss(lp, cl, batch, at, correction)
    logp, cand, ent = _unpacked(lp.detach(), cl.detach(), en, at, batch)
    return loss, m, ent, logp, cand, mask


def arm_loss(logp: torch.Tensor, cand: torch.Tensor, batch: Batch, correction: str):
    """The arm's loss given the trainer's log π of each token [B, T] and of each candidate
    [B, T, K]: (loss, its metrics, the sampled-token mask [B, T] it averaged over).

    policy_loss runs on the sampled tokens alone, packed into one row ([1, N], [1, N, K]; each
    token with its sequence's advantage): the loss is a token mean, so padding, prompt and tool
    tokens only ever entered it as zeros, and its [B, T, K] float64 coefficients shrink to the
    N sampled tokens. Every token's gradient is the same; the loss and the metrics' means are
    summed in another order (equal to float rounding), the ratio quantiles are the same."""
    mask, at = _sampled(batch)
    loss, m = _packed_loss(logp[at], cand[at], batch, at, correction)
    return loss, m, mask


def _packed_loss(lp: torch.Tensor, cl: torch.Tensor, batch: Batch, at, correction: str):
    """policy_loss of the tokens at positions `at`, given their log π [N] and candidates' [N, K],
    as one row."""
    arm = ARMS[correction]

    def packed(x: torch.Tensor) -> torch.Tensor:
        return x[at].unsqueeze(0)

    kwargs = {}
    if arm.centered or arm.top_p:
        kwargs = dict(cand_logp=cl.unsqueeze(0),
                      cand_sampler_logp=packed(batch.cand_sampler_logp))
        if arm.top_p:
            kwargs["support_mask"] = packed(batch.support)
    adv = batch.advantages[at[0]].unsqueeze(0)
    return policy_loss(lp.unsqueeze(0), packed(batch.sampler_logp), adv,
                       torch.ones_like(adv, dtype=torch.bool), arm=correction, **kwargs)


def step_metrics(m: dict, ent: torch.Tensor, logp: torch.Tensor, cand: torch.Tensor,
                 batch: Batch, mask: torch.Tensor) -> dict[str, Any]:
    """A step's numerics metrics from the loss's metrics `m`, the trainer's entropy [B, T-1] and
    log-probs (tokens [B, T], candidates [B, T, K]) of the whole batch (read at the sampled
    tokens `mask` only)."""
    valid = mask & torch.isfinite(batch.sampler_logp)
    kl = kl_estimators(logp, batch.sampler_logp, valid)
    ent_mean = float(ent[valid[:, 1:]].mean()) if valid.any() else float("nan")
    per_group: dict[str, float] = {}
    for g in sorted(set(batch.groups)):
        rows = torch.tensor([x == g for x in batch.groups])
        gm = valid & rows[:, None]
        per_group[g] = float(kl_estimators(logp, batch.sampler_logp, gm)["kl_k3"])
    out = {"kl": float(kl["kl_k3"]), "kl_k1": float(kl["kl_k1"]),
           "mis_masked_fraction": float(m["mis_masked_fraction"]),
           "ratio_p05": float(m["ratio_p05"]), "ratio_p50": float(m["ratio_p50"]),
           "ratio_p95": float(m["ratio_p95"]), "entropy": ent_mean, "group_kl": per_group,
           "valid_tokens": int(m["valid_tokens"])}
    if "sc_tail_ratio" in m:
        out["sc_tail_ratio"] = float(m["sc_tail_ratio"])
    else:  # over the valid tokens alone, packed (the same rows, the same mean)
        at = valid.nonzero(as_tuple=True)
        out["sc_tail_ratio"] = sc_tail_ratio(cand[at][None], batch.cand_sampler_logp[at][None],
                                             torch.ones(1, len(at[0]), dtype=torch.bool))
    for key in ("head_mass_sampler", "support_mass_sampler", "support_mass_trainer"):
        if key in m:
            out[key] = float(m[key])
    return out


def lockstep_threads(cfg: TrainConfig) -> int | None:
    """The trainer's threads while it steps in a lockstep mode (sync, forced staleness): the
    samplers wait for its weights then, so it takes their threads as well as its own,
    `threads` × (`workers` + 1), capped at the CPUs this process may use. None (the process's
    setting, shared with sampling) in the pipelined modes."""
    if not cfg.lockstep:
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(cfg.threads, min(cpus, cfg.threads * (cfg.workers + 1)))


class Trainer:
    """FP32 master + AdamW; the loss runs on the master's BF16 cast (the trainer's numerics;
    `compute_dtype` FP32 for reference comparisons)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        self.cfg = cfg
        self.master = copy.deepcopy(model).float()
        self.compute = copy.deepcopy(model).to(compute_dtype)
        self.master.train()
        self.compute.train()
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=cfg.lr, betas=(0.9, 0.999),
                                     weight_decay=0.0)
        self.threads: int | None = lockstep_threads(cfg)
        """torch intra-op threads while `step` runs (restored after); None: leave them."""
        self._sync_compute()

    def _sync_compute(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.compute.parameters(), self.master.parameters()):
                p.copy_(m)

    def published(self) -> dict[str, torch.Tensor]:
        """The BF16 weights samplers load (a copy: safe to hand to other threads)."""
        return {n: p.detach().clone() for n, p in self.compute.state_dict().items()}

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds of the trainer (`trainer_ranks` 1: AdamW state by index)."""
        return {"master": self.master.state_dict(), "optimizer": self.opt.state_dict(),
                "trainer_ranks": 1}

    def load(self, state: dict[str, Any]) -> None:
        """Restore the FP32 master and AdamW state of a checkpoint."""
        check_ranks(state, 1)
        self.master.load_state_dict(state["master"])
        self.opt.load_state_dict(state["optimizer"])
        self._sync_compute()

    def policy(self) -> torch.nn.Module:
        """A copy of the policy as it is now (the BF16 cast), for evaluation and export."""
        return copy.deepcopy(self.compute)

    def save(self, out: Path, step: int, next_unit: int,
             older: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
        """Write the checkpoint of `step` into out/checkpoints (see save_checkpoint)."""
        return save_checkpoint(out, step, self, next_unit, self.cfg, older)

    def step(self, batch: Batch) -> dict[str, Any]:
        """One corrected GRPO step; returns its metrics (floats). Runs on `self.threads`
        intra-op threads when set (the process's count is restored after)."""
        held = torch.get_num_threads()
        if not self.threads or self.threads == held:
            return self._step(batch)
        torch.set_num_threads(self.threads)
        try:
            return self._step(batch)
        finally:
            torch.set_num_threads(held)

    def _step(self, batch: Batch) -> dict[str, Any]:
        cfg = self.cfg
        self.compute.zero_grad(set_to_none=True)
        loss, m, ent, logp, cand, mask = batch_loss(self.compute, batch, cfg.correction)
        loss.backward()
        with torch.no_grad():
            for p, mp in zip(self.compute.parameters(), self.master.parameters()):
                mp.grad = None if p.grad is None else p.grad.float()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.master.parameters(), cfg.grad_clip)
            if torch.isfinite(grad_norm):
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self._sync_compute()
            out = step_metrics(m, ent, logp.detach(), cand.detach(), batch, mask)
        out.update(loss=float(loss.detach()), grad_norm=float(grad_norm),
                   skipped_nonfinite=not bool(torch.isfinite(grad_norm)))
        return out


# ---------------------------------------------------------------------------------------------
# publication and the sampler workers


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
        episode_seeds=[_unit_seed(u, cfg.seed) * 1_009 + j for u in units for j in range(n)])


def sample_in_worker(cfg: TrainConfig, group: SamplerGroup, units: list[int], version: int,
                     weights: dict[str, torch.Tensor]) -> tuple[list[Trajectory], float]:
    """`sample_units` inside a sampler process (mismatch.engines.workers): the process keeps its
    model per compute dtype and loads `weights` (mapped from shared memory) only when `version`
    changes. Returns the episodes and the seconds spent sampling them."""
    from mismatch.engines.workers import worker_state

    state = worker_state()
    base, tokenizer = state["setup"]
    model = model_at(state.setdefault("models", {}), base,
                     COMPUTE_DTYPES[group.spec.compute_dtype], version, weights)
    t0 = time.perf_counter()
    eps = sample_units(model, tokenizer, cfg, group, units, version)
    return eps, time.perf_counter() - t0


def split_units(eps: list[Trajectory], batch: list[tuple[int, Any]], group: str, version: int,
                seconds: float, n: int) -> list[Unit]:
    """The units of one batched generation (n episodes each, in claim order)."""
    return [Unit(index=u, group=group, version=version, episodes=eps[i * n:(i + 1) * n],
                 seconds=seconds / len(batch)) for i, (u, _) in enumerate(batch)]


def _spread(batches: list[list], n: int) -> list[list]:
    """Split the largest batches in halves (by units) until there are `n` batches or none has two
    units: every sampler process gets a share of a step (each episode's draws are its own)."""
    out = [list(b) for b in batches]
    while len(out) < n:
        big = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[big]) < 2:
            break
        half = len(out[big]) // 2
        out[big:big + 1] = [out[big][:half], out[big][half:]]
    return out


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Pipeline:
    """Sampler worker threads feeding finished units into a queue, gated as the config says."""

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
        threads = max(self.cfg.workers, self.pool.size if self.pool is not None else 0)
        for w in range(threads):
            th = threading.Thread(target=self._work, name=f"sampler-{w}", daemon=True)
            th.start()
            self._threads.append(th)

    def _may_claim(self) -> bool:
        p, bound = self.cfg.prompts_per_step, self.cfg.staleness_bound
        if self.cfg.lockstep:
            return self.cursor < (self.publisher.version + 1) * p
        if bound is not None:
            return self.cursor < (self.publisher.version + 1 + bound) * p
        return self.cursor < self.consumed + self.cfg.queue_steps * p

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
        threads = max(self.cfg.workers, pool.size if pool is not None else 0)
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
        generation per sampler group, as a server batches the requests it holds)."""
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
        cfg = self.cfg
        try:
            while True:
                if cfg.lockstep:
                    claims = self._claim_step()
                else:
                    claims = self._claim_some(self._chunk)
                if not claims:
                    return
                version, weights = self.publisher.latest(cfg.lag)
                by_group: dict[str, list[tuple[int, SamplerGroup]]] = defaultdict(list)
                for u, group in claims:
                    by_group[group.name].append((u, group))
                done = self._generate(list(by_group.values()), version, weights, models)
                for unit in sorted(done, key=lambda x: x.index):
                    self.results.put(unit)
        except BaseException as exc:  # handed to the trainer thread, which raises it
            self.results.put(_Failure(exc))

    def _generate(self, batches: list[list[tuple[int, SamplerGroup]]], version: int, weights,
                  models: dict) -> list[Unit]:
        """Sample the claimed units, one batch per sampler group, with weight `version` (in the
        sampler processes, spread over them, when the pipeline has a pool)."""
        done: list[Unit] = []
        if self.pool is not None:
            batches = _spread(batches, self.pool.size)
            calls = [(self.cfg, batch[0][1], [u for u, _ in batch], version, weights)
                     for batch in batches]
            for batch, (eps, dt) in zip(batches, self.pool.map(sample_in_worker, calls)):
                with self._cond:
                    self.busy_seconds += dt
                done += split_units(eps, batch, batch[0][1].name, version, dt,
                                    self.cfg.samples_per_prompt)
            return done
        for batch in batches:
            group = batch[0][1]
            model = model_at(models, self._base, COMPUTE_DTYPES[group.spec.compute_dtype],
                             version, weights)
            t0 = time.perf_counter()
            eps = sample_units(model, self.tokenizer, self.cfg, group,
                               [u for u, _ in batch], version)
            dt = time.perf_counter() - t0
            with self._cond:
                self.busy_seconds += dt
            done += split_units(eps, batch, group.name, version, dt, self.cfg.samples_per_prompt)
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


# ---------------------------------------------------------------------------------------------
# checkpoints and the run directory


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (renamed into place only when whole)."""
    root = Path(out) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and (p / "state.pt").exists())
    return done[-1] if done else None


def save_checkpoint(out: Path, step: int, trainer: Trainer | dict[str, Any], next_unit: int,
                    cfg: TrainConfig, older: dict[int, dict[str, torch.Tensor]] | None = None
                    ) -> Path:
    """Write checkpoints/step-NNNNNN (temporary sibling, then renamed; the newest two kept).
    `trainer`: a Trainer, or the trainer state to save ({"master", "optimizer", ...})."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = trainer if isinstance(trainer, dict) else trainer.state()
    torch.save({"step": step, "next_unit": next_unit, "config": asdict(cfg), **state,
                "older_versions": older or {}},
               tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-_CHECKPOINTS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def check_ranks(state: dict[str, Any], ranks: int) -> None:
    """A checkpoint's optimizer state is laid out for the trainer that wrote it."""
    saved = int(state.get("trainer_ranks", 1))
    if (saved == 1) != (ranks == 1):
        raise ValueError(f"the checkpoint was written by a {saved}-rank trainer; resume with "
                         f"--trainer-ranks {'1' if saved == 1 else 'N > 1'} (not {ranks})")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics.jsonl (a torn last line — a kill mid-write — dropped)."""
    out = []
    path = Path(path)
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def _cut_jsonl(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the records with step <= `step`, rewritten atomically; return them."""
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    if path.exists():
        _write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _check_resume(cfg: TrainConfig, saved: dict[str, Any]) -> None:
    changed = [f.name for f in fields(TrainConfig) if f.name not in TrainConfig.RESUMABLE
               and saved.get(f.name) != getattr(cfg, f.name)]
    if changed:
        name = changed[0]
        raise ValueError(f"the run was started with {name.replace('_', '-')}="
                         f"{saved.get(name)!r}, not {getattr(cfg, name)!r}; resume with the "
                         f"same settings or use another --out")


# ---------------------------------------------------------------------------------------------
# the run


def check_out(out: Path, resume: bool, cfg: TrainConfig | None = None) -> Path | None:
    """Validate a run directory for a new run or a resume (of the same `cfg`); returns the
    checkpoint to resume."""
    out = Path(out)
    ckpt = latest_checkpoint(out) if resume else None
    if resume and ckpt is None:
        raise ValueError(f"{out} has no checkpoint to resume from; start it without --resume")
    saved = out / "config.json"
    if resume and cfg is not None and saved.exists():
        try:
            _check_resume(cfg, json.loads(saved.read_text()))
        except json.JSONDecodeError:
            pass  # the checkpoint's own copy of the config is checked when it is loaded
    if not resume and ((out / "metrics.jsonl").exists() or (out / "checkpoints").exists()):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose "
                         "another --out")
    return ckpt


@dataclass
class RunResult:
    out: Path
    steps_done: int
    stopped: str | None = None
    """Why the run stopped early (a critical alert), or None."""
    resumed_from: int | None = None
    discarded_units: int = 0
    alerts: list = field(default_factory=list)
    evaluation: dict[str, Any] = field(default_factory=dict)
    """{"base": …, "during": {"<step>": …}, "final": …} mean reward on the held-out tasks (when
    eval_tasks > 0; "during" with eval_every > 0)."""


def evaluate(model: torch.nn.Module, tokenizer, cfg: TrainConfig,
             top_p: bool | None = None) -> dict[str, Any]:
    """Mean reward and end reasons of the policy on `cfg.eval_tasks` held-out tasks, each played
    `cfg.eval_samples` times at temperature 1 under the trainer's numerics (B200 BF16, BF16 KV
    cache: the `homogeneous` group), sampled as the arm's samplers sample (the top-p nucleus for
    top-p arms, whose loss never sees the tail) unless `top_p` says otherwise."""
    top = cfg.samples_top_p if top_p is None else top_p
    from mismatch.zoo.tasks import make_task, task_seeds

    kinds = cfg.task_kinds
    tasks = [make_task(seed, kinds[i % len(kinds)] if kinds else None)
             for i, seed in enumerate(task_seeds("heldout", cfg.eval_tasks))]
    group = fleet("homogeneous")[0]
    model = model.to(torch.bfloat16).eval()
    n = cfg.eval_samples
    with torch.no_grad():  # all episodes in one engine run; each on its own (task, sample) stream
        eps = run_episodes(model, tokenizer, [t for t in tasks for _ in range(n)], group,
                           version=-1, max_turns=cfg.max_turns,
                           max_new_tokens=cfg.max_new_tokens, top_p=cfg.top_p if top else 1.0,
                           top_k=cfg.top_p_max_tokens if top else 0, top_k_candidates=1,
                           episode_seeds=[_unit_seed(i, cfg.seed + 1) * 1_009 + j
                                          for i in range(len(tasks)) for j in range(n)])
    ends = Counter(ep.end_reason for ep in eps)
    return {"reward": sum(ep.reward for ep in eps) / len(eps), "episodes": len(eps),
            "sampling": f"top-p {cfg.top_p}, top-k {cfg.top_p_max_tokens}" if top else "full",
            "format_error_rate": ends.get("format_errors", 0) / len(eps),
            "end_reasons": dict(sorted(ends.items()))}


class LocalBackend:
    """The trainer in this process; samplers in its worker threads, or (cfg.sampler_processes)
    in worker processes of one torch thread each, fed weights through shared memory
    (`--backend local`)."""

    name = "local"

    def __init__(self) -> None:
        self.pool = None

    def trainer(self, model: torch.nn.Module, cfg: TrainConfig) -> Trainer:
        return Trainer(model, cfg)

    def pipeline(self, cfg: TrainConfig, groups: list[SamplerGroup], model, tokenizer,
                 publisher: Publisher, start_unit: int) -> Pipeline:
        if cfg.sampler_processes and self.pool is None:
            from mismatch.engines.workers import WorkerPool

            log.info("starting %d sampler processes", cfg.sampler_processes)
            self.pool = WorkerPool(cfg.sampler_processes, (copy.deepcopy(model), tokenizer))
        return Pipeline(cfg, groups, model, tokenizer, publisher, start_unit, pool=self.pool)

    def put(self, weights: dict[str, torch.Tensor]):
        """A published weight version as the pipeline holds it (here: the tensors)."""
        return weights

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def run(cfg: TrainConfig, out: Path, *, resume: bool = False, stop_on: str | None = None,
        model=None, tokenizer=None, progress: Callable[[dict], None] | None = None,
        log_alerts: bool = True, monitor_config=None, backend=None) -> RunResult:
    """Train `cfg.steps` steps into `out` (see the module docstring). `stop_on`: end the run,
    with a checkpoint, on the first alert of that severity or worse. `monitor_config`: the
    collapse monitor's rules (probes.monitor.MonitorConfig; its defaults otherwise).
    `backend`: where the samplers and the trainer run (LocalBackend when None;
    train.ray_backend.RayBackend for Ray actors). The run owns it: it is closed at the end."""
    backend = backend or LocalBackend()
    try:
        if stop_on not in (None, "warning", "critical"):
            raise ValueError(f"stop-on must be warning or critical, got {stop_on!r}")
        out = Path(out)
        ckpt = check_out(out, resume, cfg)
        torch.set_num_threads(cfg.threads)
        if model is None or tokenizer is None:
            from mismatch.zoo import load_model, load_tokenizer

            model = model or load_model(cfg.model, dtype="bfloat16")
            tokenizer = tokenizer or load_tokenizer(cfg.model)
        out.mkdir(parents=True, exist_ok=True)
        return _run(cfg, out, ckpt, backend, stop_on=stop_on, model=model, tokenizer=tokenizer,
                    progress=progress, log_alerts=log_alerts, monitor_config=monitor_config)
    finally:
        backend.close()


def _run(cfg: TrainConfig, out: Path, ckpt: Path | None, backend, *, stop_on, model, tokenizer,
         progress, log_alerts, monitor_config) -> RunResult:
    from mismatch.probes.monitor import CollapseMonitor, JsonlSink, TerminalSink

    metrics_path, alerts_path = out / "metrics.jsonl", out / "alerts.jsonl"
    trainer = backend.trainer(model, cfg)
    step, next_unit, discarded = 0, 0, 0
    history: list[dict[str, Any]] = []
    if ckpt is not None:
        try:
            state = torch.load(ckpt / "state.pt", weights_only=False)
        except Exception as exc:  # a checkpoint that cannot be read is bad input, not a bug
            raise ValueError(f"checkpoint {ckpt} is unreadable ({type(exc).__name__}); delete "
                             "it to resume from the one before") from exc
        _check_resume(cfg, state["config"])
        trainer.load(state)
        step, next_unit = int(state["step"]), int(state["next_unit"])
        before = read_metrics(metrics_path)
        claimed = max((r.get("units_claimed", 0) for r in before), default=next_unit)
        discarded = max(0, claimed - next_unit)
        history = _cut_jsonl(metrics_path, step)
        _cut_jsonl(alerts_path, step)
        log.warning("resuming %s at step %d: %d later step(s) of the log dropped; %d unit(s) "
                    "(%d episodes) claimed after the checkpoint are discarded and regenerated",
                    out, step, len(before) - len(history), discarded,
                    discarded * cfg.samples_per_prompt)
    _write_atomic(out / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")

    eval_path = out / "eval.json"
    evaluation = json.loads(eval_path.read_text()) if eval_path.exists() else {}
    if cfg.eval_tasks and "base" not in evaluation:
        log.info("evaluating the base policy on %d held-out tasks × %d", cfg.eval_tasks,
                 cfg.eval_samples)
        evaluation = {"tasks": cfg.eval_tasks, "samples": cfg.eval_samples,
                      "base": evaluate(trainer.policy(), tokenizer, cfg)}
        _write_atomic(eval_path, json.dumps(evaluation, indent=2) + "\n")

    groups = fleet(cfg.fleet)
    monitor = CollapseMonitor(monitor_config)
    for rec in history:  # rebuild baselines and debouncing state from the kept log
        monitor.update(rec)
    monitor.sinks = [JsonlSink(alerts_path)] + ([TerminalSink()] if log_alerts else [])
    older = state.get("older_versions") if ckpt is not None else None
    publisher = Publisher(step, trainer.published(), keep=cfg.lag,
                          history={v: backend.put(w) for v, w in (older or {}).items()})
    pipe = backend.pipeline(cfg, groups, model, tokenizer, publisher, next_unit)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = RunResult(out=out, steps_done=step, resumed_from=step if ckpt else None,
                       discarded_units=discarded)
    consumed_max = next_unit - 1
    consumed_total = next_unit
    pipe.start()
    try:
        with open(metrics_path, "a") as mfile:
            last_ckpt = step
            while step < cfg.steps:
                t0 = time.perf_counter()
                units: list[Unit] = []
                stale_dropped = 0
                while len(units) < cfg.prompts_per_step:
                    unit = pipe.take()
                    bound = cfg.staleness_bound
                    if bound is not None and step - unit.version > bound:
                        stale_dropped += 1
                        continue
                    units.append(unit)
                waited = time.perf_counter() - t0
                depth = pipe.results.qsize()
                units.sort(key=lambda x: x.index)
                t1 = time.perf_counter()
                batch = build_batch(units, step, pad_id)
                m = trainer.step(batch)
                step += 1
                publisher.publish(step, trainer.published())
                consumed_total += len(units)
                consumed_max = max([consumed_max] + [u.index for u in units])
                pipe.notify(consumed=consumed_total)
                train_s = time.perf_counter() - t1
                wall = time.perf_counter() - t0
                rec = _record(step, units, batch, m, waited=waited, train_s=train_s, wall=wall,
                              stale_dropped=stale_dropped, claimed=pipe.cursor)
                rec.update(queue_depth=depth, backend=backend.name, **pipe.faults)
                if step == (result.resumed_from or 0) + 1 and result.resumed_from is not None:
                    rec["resumed_discarded_units"] = discarded
                mfile.write(json.dumps(rec) + "\n")
                mfile.flush()
                alerts = monitor.update(rec)  # also written to the alert file and the log
                result.alerts.extend(alerts)
                if progress:
                    progress(rec)
                stop_now = stop_on is not None and any(
                    a.severity == "critical" or stop_on == "warning" for a in alerts)
                if (cfg.eval_tasks and cfg.eval_every and step % cfg.eval_every == 0
                        and step < cfg.steps and str(step) not in evaluation.get("during", {})):
                    log.info("evaluating the policy at step %d", step)
                    evaluation.setdefault("during", {})[str(step)] = dict(
                        evaluate(trainer.policy(), tokenizer, cfg), step=step)
                    _write_atomic(eval_path, json.dumps(evaluation, indent=2) + "\n")
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or stop_now:
                    trainer.save(out, step, consumed_max + 1, publisher.older())
                    last_ckpt = step
                if stop_now:
                    worst = max(alerts, key=lambda a: a.severity == "critical")
                    result.stopped = (f"{worst.severity} alert on {worst.signal} at step "
                                      f"{worst.step}")
                    break
            if last_ckpt != step:
                trainer.save(out, step, consumed_max + 1, publisher.older())
    finally:
        pipe.stop()
        monitor.close()
    result.steps_done = step
    if cfg.eval_tasks:
        log.info("evaluating the trained policy (step %d)", step)
        evaluation["final"] = dict(evaluate(trainer.policy(), tokenizer, cfg), step=step)
        _write_atomic(eval_path, json.dumps(evaluation, indent=2) + "\n")
    result.evaluation = evaluation
    _save_final(out, trainer.policy(), tokenizer)
    return result


def _record(step: int, units: list[Unit], batch: Batch, m: dict[str, Any], *, waited: float,
            train_s: float, wall: float, stale_dropped: int, claimed: int) -> dict[str, Any]:
    eps = [ep for u in units for ep in u.episodes]
    ends = Counter(ep.end_reason for ep in eps)
    sampled = int(batch.mask.sum())
    st = batch.staleness[batch.mask]
    by_group: dict[str, list[float]] = defaultdict(list)
    for ep, g in zip(eps, batch.groups):
        by_group[g].append(ep.reward)
    # per group: tokens sampled over the seconds its samplers spent generating them
    gen: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for u in units:
        gen[u.group][0] += sum(sum(ep.sampled_mask) for ep in u.episodes)
        gen[u.group][1] += u.seconds
    rec = {
        "step": step,
        "reward": sum(ep.reward for ep in eps) / len(eps),
        "kl": m["kl"], "kl_k1": m["kl_k1"],
        "format_error_rate": ends.get("format_errors", 0) / len(eps),
        "mis_masked_fraction": m["mis_masked_fraction"],
        "sc_tail_ratio": m["sc_tail_ratio"],
        "entropy": m["entropy"],
        "grad_norm": m["grad_norm"],
        "staleness_mean": float(st.mean()) if st.numel() else 0.0,
        "staleness_max": int(st.max()) if st.numel() else 0,
        "staleness_tokens": {str(int(k)): int(v) for k, v in
                             zip(*torch.unique(st, return_counts=True))},
        "tokens_per_s": sampled / wall if wall > 0 else None,
        "response_length": sampled / len(eps),
        "group_kl": m["group_kl"],
        "group_reward": {g: sum(v) / len(v) for g, v in sorted(by_group.items())},
        "group_tokens_per_s": {g: tok / sec if sec > 0 else None
                               for g, (tok, sec) in sorted(gen.items())},
        "end_reasons": dict(sorted(ends.items())),
        "loss": m["loss"],
        "ratio_p05": m["ratio_p05"], "ratio_p50": m["ratio_p50"], "ratio_p95": m["ratio_p95"],
        "n_episodes": len(eps), "sampled_tokens": sampled,
        "units": [u.index for u in units], "units_claimed": claimed,
        "stale_units_dropped": stale_dropped,
        "step_seconds": wall, "trainer_wait_seconds": waited, "train_seconds": train_s,
        "trainer_idle_share": waited / wall if wall > 0 else None,
    }
    for key in ("head_mass_sampler", "support_mass_sampler", "support_mass_trainer"):
        if key in m:
            rec[key] = m[key]
    if m.get("skipped_nonfinite"):
        rec["skipped_nonfinite_grad"] = True
    return rec


def _save_final(out: Path, policy: torch.nn.Module, tokenizer) -> None:
    from mismatch.io import atomic_directory

    with atomic_directory(Path(out) / "final") as tmp:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
