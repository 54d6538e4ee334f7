"""One-batch generation: `generate` runs a batch of prompts through the rollout engine
(engine.py: slots, a preallocated KV cache, per-sequence random streams) — a prefill of each
prompt, then one token per step against the KV cache, the decode path a serving engine runs —
under whatever numerics are active (`numerics.apply_numerics`), and returns a left-padded
`Rollout`. For every sampled token it records the raw log-prob (temperature 1, full vocabulary:
what the trainer's log π is compared with), the processed log-prob (under the distribution
actually sampled from, after temperature / top-k / top-p; logits.py), and the top-K candidates of
the raw distribution.
"""

from __future__ import annotations

import torch

from ..records import Rollout
from .engine import Engine
from .logits import SamplingParams
from .requests import Request
from .routing import routers

__all__ = ["generate", "row_seed", "to_rollout"]


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, *,
             pad_id: int, eos_ids: set[int], label: str, mode: str = "emulated",
             with_routing: bool = True, forced: torch.Tensor | None = None,
             keep_full: bool = False) -> Rollout:
    """Sample completions for token-id prompts under the numerics active on `model`: one batch
    through the rollout engine (engine.py), every prompt in its own slot from the first step,
    returned as a left-padded `Rollout`. Row i draws from the random stream
    `row_seed(params.seed, i)`.

    forced: [B, n] completion tokens to feed instead of sampling (a replay of an earlier rollout
    of the same prompts through this decode path: its log-probs are what this configuration
    would have reported for those tokens; a row ends at its first EOS). keep_full: also keep the
    whole raw log-softmax of every step, `full_logprobs` [B, n, V] FP32 (zeros after a
    row's end). `candidate_in_support` [B, T, K] bool marks the candidates inside the
    distribution sampled from (top-k / top-p support)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if forced is not None and (forced.ndim != 2 or forced.shape[0] != len(prompts)
                               or forced.shape[1] < 1):
        raise ValueError(f"forced tokens must be [{len(prompts)}, n >= 1], got "
                         f"{tuple(forced.shape)}")
    requests = [Request(prompt=list(p), params=params, seed=row_seed(params.seed, i),
                        forced=None if forced is None else forced[i].tolist(),
                        keep_full=keep_full) for i, p in enumerate(prompts)]
    engine = Engine(model, pad_id=pad_id, eos_ids=eos_ids, slots=len(prompts),
                    with_routing=with_routing and bool(routers(model)))
    return to_rollout(engine.run(requests), pad_id=pad_id, label=label, mode=mode)


def row_seed(seed: int, row: int) -> int:
    """The random stream of row `row` of a `generate` call seeded `seed`."""
    return seed * 1_000_003 + row


def to_rollout(completions: list, *, pad_id: int, label: str, mode: str) -> Rollout:
    """Engine completions → one left-padded `Rollout` (prompt right-aligned at `prompt_width`,
    completions after it, pad and zeros beyond each row's end)."""
    b = len(completions)
    p = max(len(c.request.prompt) for c in completions)
    n = max(len(c.tokens) for c in completions)
    k = completions[0].candidate_ids.shape[-1]
    ids = torch.full((b, p + n), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p + n), dtype=torch.long)
    comp = torch.zeros(b, p + n)
    raw, proc = torch.zeros(b, p + n), torch.zeros(b, p + n)
    cand_ids = torch.zeros(b, p + n, k, dtype=torch.long)
    cand_lp = torch.zeros(b, p + n, k)
    support = torch.zeros(b, p + n, k, dtype=torch.bool)
    routed = None
    if all(c.routed_experts is not None for c in completions):
        shape = completions[0].routed_experts.shape[1:]
        routed = torch.full((b, p + n, *shape), -1, dtype=torch.long)
    full = None
    if all(c.full_logprobs is not None for c in completions):
        full = torch.zeros(b, n, completions[0].full_logprobs.shape[-1])
    for i, c in enumerate(completions):
        lp, m = len(c.request.prompt), len(c.tokens)
        ids[i, p - lp:p] = torch.tensor(c.request.prompt)
        ids[i, p:p + m] = torch.tensor(c.tokens)
        mask[i, p - lp:p + m] = 1
        comp[i, p:p + m] = 1.0
        raw[i, p:p + m], proc[i, p:p + m] = c.logprobs, c.logprobs_processed
        cand_ids[i, p:p + m], cand_lp[i, p:p + m] = c.candidate_ids, c.candidate_logprobs
        support[i, p:p + m] = c.candidate_in_support
        if routed is not None:
            routed[i, p - lp:p + m] = c.routed_experts
        if full is not None:
            full[i, :m] = c.full_logprobs
    rollout = Rollout(token_ids=ids, attention_mask=mask, completion_mask=comp,
                      sampler_logprobs=raw, sampler_logprobs_processed=proc,
                      candidate_ids=cand_ids, candidate_logprobs=cand_lp, sampler=label,
                      mode=mode, routed_experts=routed,
                      prompt_width=p, candidate_in_support=support)
    if full is not None:
        rollout.full_logprobs = full
    return rollout
