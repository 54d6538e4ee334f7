"""Sampling: the processed distribution, the candidate ranking, and one-batch generation.

`generate` runs a batch of prompts through the rollout engine (engine.py: slots, a preallocated
KV cache, per-sequence random streams) — a prefill of each prompt, then one token per step
against the KV cache, the decode path a serving engine runs — under whatever numerics are active
(`numerics.apply_numerics`), and returns a left-padded `Rollout`. For every sampled token it
records the raw log-prob (temperature 1, full vocabulary: what the trainer's log π is compared
with), the processed log-prob (under the distribution actually sampled from, after temperature /
top-k / top-p: what vLLM calls "processed_logprobs" and a known source of spurious mismatch when
confused with the raw one), and the top-K candidates of the raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..records import Rollout

__all__ = ["SamplingParams", "generate", "process_logits", "process_rows", "ranked_topk", "row_seed",
           "to_rollout"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How tokens are drawn."""

    max_new_tokens: int = 64
    """Tokens to generate per prompt at most."""
    temperature: float = 1.0
    """Softmax temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus mass kept (1: no truncation)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: no truncation)."""
    candidates: int = 8
    """Top-K candidates of the raw distribution recorded per position."""
    seed: int = 0
    """Seed of the sampling generator."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.candidates < 1:
            raise ValueError(f"top_k must be >= 0 and candidates >= 1, got {self.top_k}, "
                             f"{self.candidates}")


def process_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, V] FP32 logits with one SamplingParams per row → [B, V] processed log-probs (rows that
    share their params are processed together)."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p, []).append(i)
    if len(groups) == 1:
        return process_logits(logits, next(iter(groups)))
    proc = torch.empty_like(logits)
    for p, idx in groups.items():
        sel = torch.tensor(idx)
        proc[sel] = process_logits(logits[sel], p)
    return proc


def ranked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] → the k best (values, ids) of each row, ranked by value descending, then token id
    ascending: the one ranking rule the candidates and the nucleus (`process_logits`) share.

    torch's `topk` and `sort` leave the order of tied values unspecified (it differs between
    machines), so a candidate list and a nucleus ranked by either alone may disagree on a tie."""
    k = min(k, x.shape[-1])
    kth = x.topk(k, dim=-1).values[:, -1:]
    above, tied = x > kth, x == kth
    need = k - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need))  # ties at the boundary: lowest ids
    ids = chosen.nonzero()[:, 1].view(x.shape[0], k)  # ascending ids per row
    vals = x.gather(-1, ids)
    order = vals.sort(dim=-1, descending=True, stable=True).indices  # stable: ties keep id order
    return vals.gather(-1, order), ids.gather(-1, order)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] FP32 logits → [B, V] log-probs of the sampling distribution (−inf outside it).

    The nucleus is a prefix of the ranking by value descending, then token id ascending (a
    stable sort), the same rule as `ranked_topk`'s candidates."""
    if params.temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    z = logits / params.temperature
    if params.top_k:  # exactly k tokens, ties at the boundary to the lowest ids
        vals, ids = ranked_topk(z, params.top_k)
        z = torch.full_like(z, float("-inf")).scatter(-1, ids, vals)
    if params.top_p < 1:
        sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # keep a token if the mass before it is < top_p (the first token is always kept)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    return torch.log_softmax(z, dim=-1)


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
    from .engine import Engine
    from .requests import Request
    from .routing import routers

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
