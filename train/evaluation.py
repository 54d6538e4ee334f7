"""Held-out evaluation of a policy: mean reward and end reasons on the zoo's held-out tasks,
sampled under the trainer's numerics (the `homogeneous` group: B200 BF16, BF16 KV cache) at
temperature 1.

A run evaluates its base policy before the first step, after every `eval_every` steps and after
the last (out/eval.json), so that the reward it learned is measured on tasks it never trained on.
A top-p arm samples its held-out episodes through its nucleus, as it trains, and also from the
full vocabulary, as the reference study evaluated (reference/synopsis.txt), under eval.json's
"full_vocab": {"base", "during", "final"}.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from .batch import unit_seed
from .components import EvalConfig
from .config import TrainConfig
from .fleet import fleet
from .heldout import HeldOut, HeldOutScore
from .rollout import run_episodes

__all__ = ["EvalConfig", "evaluate", "evaluate_into"]


def evaluate(model: torch.nn.Module, tokenizer, cfg: TrainConfig,
             top_p: bool | None = None) -> HeldOutScore:
    """Mean reward and end reasons of the policy on `cfg.eval.eval_tasks` held-out tasks, each
    played `cfg.eval.eval_samples` times at temperature 1 under the trainer's numerics (B200
    BF16, BF16 KV cache: the `homogeneous` group), sampled as the arm's samplers sample (the
    top-p nucleus for top-p arms, whose loss never sees the tail) unless `top_p` says
    otherwise; turns, tokens and the nucleus as `cfg.rollout` says."""
    top = cfg.samples_top_p if top_p is None else top_p
    from mismatch.zoo.tasks import make_task, task_seeds

    kinds = cfg.task_kinds
    tasks = [make_task(seed, kinds[i % len(kinds)] if kinds else None)
             for i, seed in enumerate(task_seeds("heldout", cfg.eval.eval_tasks))]
    group = fleet("homogeneous")[0]
    model = model.to(torch.bfloat16).eval()
    n = cfg.eval.eval_samples
    with torch.no_grad():  # all episodes in one engine run; each on its own (task, sample) stream
        eps = run_episodes(model, tokenizer, [t for t in tasks for _ in range(n)], group,
                           version=-1, **cfg.rollout.episode_limits(top), top_k_candidates=1,
                           episode_seeds=[unit_seed(i, cfg.seed + 1) * 1_009 + j
                                          for i in range(len(tasks)) for j in range(n)])
    ends, ro = Counter(ep.end_reason for ep in eps), cfg.rollout
    return HeldOutScore(reward=sum(ep.reward for ep in eps) / len(eps), episodes=len(eps),
                        sampling=f"top-p {ro.top_p}, top-k {ro.top_p_max_tokens}" if top
                        else "full",
                        format_error_rate=ends.get("format_errors", 0) / len(eps),
                        end_reasons=dict(sorted(ends.items())))


def evaluate_into(held: HeldOut, at: str | int, model: torch.nn.Module, tokenizer,
                  cfg: TrainConfig, step: int | None = None) -> HeldOut:
    """`held` with the policy evaluated at `at` ("base", "final", or a step of "during"), `step`
    recorded; a top-p arm's policy also from the full vocabulary, in `held.full_vocab` at the
    same point."""
    def placed(into: HeldOut, score: HeldOutScore) -> HeldOut:
        if isinstance(at, int):
            return replace(into, during={**into.during, at: score})
        if at not in ("base", "final"):
            raise ValueError(f"an evaluation is at base, final or a step, not {at!r}")
        return replace(into, **{at: score})

    held = placed(held, replace(evaluate(model, tokenizer, cfg), step=step))
    if cfg.samples_top_p:
        full = replace(evaluate(model, tokenizer, cfg, top_p=False), step=step)
        held = replace(held, full_vocab=placed(held.full_vocab or HeldOut(), full))
    return held
