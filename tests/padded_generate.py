"""Reference for the engine tests: the static padded-batch sampler the rollout engine replaced."""

from __future__ import annotations

import contextlib

import torch

from mismatch.kernels.bf16_gemm import bf16_module_gemms
from mismatch.engines.logits import SamplingParams, process_logits, ranked_topk
from mismatch.engines.scorer import position_ids, record_routing
from mismatch.records import Rollout


@torch.no_grad()
def padded_generate(model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, *,
             pad_id: int, eos_ids: set[int], label: str, mode: str = "emulated",
             with_routing: bool = True, forced: torch.Tensor | None = None,
             keep_full: bool = False) -> Rollout:
    """The sampler before the rollout engine: one static left-padded batch, a DynamicCache
    grown by concatenation, one torch generator for the whole batch (kept verbatim as the
    reference the engine is tested against).

    forced: [B, n] completion tokens to feed instead of sampling (a replay of an earlier rollout
    of the same prompts through this decode path: its log-probs are what this configuration
    would have reported for those tokens). keep_full: also keep the whole raw log-softmax of
    every step, `full_logprobs` [B, n, V] FP32. `candidate_in_support` [B, T, K]
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
    with ctx, bf16_module_gemms(model):  # the engine's BF16 GEMM numerics (kernels.bf16_gemm)
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
        prompt_width=p,
        candidate_in_support=torch.cat([torch.zeros(b, p, k, dtype=torch.bool),
                                        torch.stack(in_support, 1).cpu()], dim=1))
    if keep_full:
        rollout.full_logprobs = torch.stack(full, 1)
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
