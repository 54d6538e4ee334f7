"""The emulated sampler: batched KV-cache generation that reports log-probs as engines do.

Generation runs the decode path a serving engine runs — a prefill of the (left-padded) prompts,
then one token per step against the KV cache — under whatever numerics are active
(`numerics.apply_numerics`). For every sampled token it records the raw log-prob (temperature 1,
full vocabulary: what the trainer's log π is compared with), the processed log-prob (under the
distribution actually sampled from, after temperature / top-k / top-p: what vLLM calls
"processed_logprobs" and a known source of spurious mismatch when confused with the raw one),
and the top-K candidates of the raw distribution.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..records import Rollout
from .scorer import position_ids, record_routing

__all__ = ["SamplingParams", "generate", "process_logits", "ranked_topk"]


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
    """Sample completions for token-id prompts under the numerics active on `model`.

    forced: [B, n] completion tokens to feed instead of sampling (a replay of an earlier rollout
    of the same prompts through this decode path: its log-probs are what this configuration
    would have reported for those tokens). keep_full: also keep the whole raw log-softmax of
    every step, `meta["full_logprobs"]` [B, n, V] FP32. `meta["candidate_in_support"]` [B, T, K]
    bool marks the candidates inside the distribution sampled from (top-k / top-p support)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if forced is not None and (forced.ndim != 2 or forced.shape[0] != len(prompts)
                               or forced.shape[1] < 1):
        raise ValueError(f"forced tokens must be [{len(prompts)}, n >= 1], got "
                         f"{tuple(forced.shape)}")
    b, p = len(prompts), max(len(x) for x in prompts)
    ids = torch.full((b, p), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, p - len(prompt):] = torch.tensor(prompt)
        mask[i, p - len(prompt):] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    g = torch.Generator(device=device).manual_seed(params.seed)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    raw_lp, proc_lp, cand_ids, cand_lp, done_masks, tokens = [], [], [], [], [], []
    in_support: list[torch.Tensor] = []
    full: list[torch.Tensor] = []
    steps = params.max_new_tokens if forced is None else forced.shape[1]
    routing: list[list[torch.Tensor]] = []
    ctx = record_routing(model, routing) if with_routing else contextlib.nullcontext()
    with ctx:
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        for step in range(steps):
            logits = out.logits[:, -1].float()
            raw = torch.log_softmax(logits, dim=-1)
            proc = process_logits(logits, params)
            if forced is None:
                token = torch.multinomial(proc.exp(), 1, generator=g)[:, 0]
            else:
                token = forced[:, step].to(device)
            if keep_full:
                full.append(raw.cpu())
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            live = ~finished
            raw_lp.append(raw.gather(-1, token[:, None])[:, 0])
            proc_lp.append(proc.gather(-1, token[:, None])[:, 0])
            top_lp, top_ids = ranked_topk(raw, params.candidates)
            cand_ids.append(top_ids)
            cand_lp.append(top_lp)
            in_support.append(torch.isfinite(proc.gather(-1, top_ids)))
            done_masks.append(live.float())
            tokens.append(token)
            finished = finished | torch.isin(token, eos)
            mask = torch.cat([mask, live.long()[:, None]], dim=1)
            if bool(finished.all()):
                break
            out = model(input_ids=token[:, None], attention_mask=mask,
                        position_ids=position_ids(mask)[:, -1:], past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
    n = len(tokens)
    ids, mask = ids.cpu(), mask.cpu()
    tokens, done_masks = [x.cpu() for x in tokens], [x.cpu() for x in done_masks]
    raw_lp, proc_lp = [x.cpu() for x in raw_lp], [x.cpu() for x in proc_lp]
    cand_ids, cand_lp = [x.cpu() for x in cand_ids], [x.cpu() for x in cand_lp]
    routing = [[c.cpu() for c in calls] for calls in routing]
    zeros = torch.zeros(b, p)
    k = cand_ids[0].shape[-1]
    rollout = Rollout(
        token_ids=torch.cat([ids, torch.stack(tokens, 1)], dim=1),
        attention_mask=mask[:, :p + n],
        completion_mask=torch.cat([zeros, torch.stack(done_masks, 1)], dim=1),
        sampler_logprobs=torch.cat([zeros, torch.stack(raw_lp, 1)], dim=1),
        sampler_logprobs_processed=torch.cat([zeros, torch.stack(proc_lp, 1)], dim=1),
        candidate_ids=torch.cat([torch.zeros(b, p, k, dtype=torch.long),
                                 torch.stack(cand_ids, 1)], dim=1),
        candidate_logprobs=torch.cat([torch.zeros(b, p, k), torch.stack(cand_lp, 1)], dim=1),
        sampler=label, mode=mode,
        meta={"prompt_width": p,
              "candidate_in_support": torch.cat([torch.zeros(b, p, k, dtype=torch.bool),
                                                 torch.stack(in_support, 1).cpu()], dim=1)})
    if keep_full:
        rollout.meta["full_logprobs"] = torch.stack(full, 1)
    if routing and all(r for r in routing):
        # per layer: the prefill call [B·P, k], then one [B, k] call per generated token but
        # the last (whose KV was never needed) — so the last generated position has no routing
        per_layer = []
        for calls in routing:
            steps = [calls[0].view(b, p, -1)] + [c.view(b, 1, -1) for c in calls[1:]]
            seq = torch.cat(steps, dim=1)
            pad = torch.full((b, p + n - seq.shape[1], seq.shape[-1]), -1, dtype=torch.long)
            per_layer.append(torch.cat([seq, pad], dim=1))
        rollout.routed_experts = torch.stack(per_layer, dim=2)
    return rollout
