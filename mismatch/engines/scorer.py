"""The trainer side: a teacher-forced forward that scores given tokens.

Per-token log-probs, top-1 ids and candidate log-probs come from the final hidden states through
the fused scorer head (mismatch.kernels.scorer_head: the lm_head GEMM in vocabulary tiles with an
online FP32 log-sum-exp), so at most a [row tile, vocab tile] FP32 tile exists at once (at
V = 152k and T = 256k a full [T, V] FP32 tensor would be 150 GB); on CUDA tensors with Triton
installed it runs as the Triton kernel. Only `full_from` (the whole log-softmax, asked for by the
exact-KL probes) goes through [chunk, V] logits. MoE routing decisions are recorded from the
routers' outputs with forward hooks.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels import scorer_head
from ..kernels.bf16_gemm import bf16_gemms
from ..records import Rollout, Scores
from .routing import routers as find_routers

__all__ = ["score", "position_ids", "record_routing"]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions that skip left padding (what the sampler used)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


@contextlib.contextmanager
def record_routing(model: torch.nn.Module, sink: list[list[torch.Tensor]]):
    """Append each router call's chosen experts [N, k] to sink[layer] while inside."""
    routers = find_routers(model)
    sink.extend([] for _ in routers)
    handles = []
    for i, router in enumerate(routers):
        def hook(_module, _inputs, output, i=i):
            sink[i].append(output[-1].detach())  # (router_logits, scores, indices)
        handles.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
@bf16_gemms()
def score(model: torch.nn.Module, rollout: Rollout, *, row_chunk: int = 1024,
          with_routing: bool = True, full_from: int | None = None) -> Scores:
    """Teacher-forced log-probs of rollout.token_ids under `model` as it is configured now.

    full_from: also return the whole log-softmax [B, T - full_from, V] (FP32) of the positions
    from `full_from` on (the completion, for exact full-vocabulary KL)."""
    device = next(model.parameters()).device  # a CUDA model scores there; results come back
    ids, mask = rollout.token_ids.to(device), rollout.attention_mask.to(device)
    b, t = ids.shape
    routing: list[list[torch.Tensor]] = []
    ctx = record_routing(model, routing) if with_routing else contextlib.nullcontext()
    with ctx:
        hidden = model.model(input_ids=ids, attention_mask=mask,
                             position_ids=position_ids(mask)).last_hidden_state  # (B, T, H)
    head = model.get_output_embeddings()
    flat = hidden[:, :-1].reshape(b * (t - 1), -1)  # position t predicts token t + 1
    targets = ids[:, 1:].reshape(-1)
    cand = rollout.candidate_ids[:, 1:].to(device).reshape(b * (t - 1), -1)
    if full_from is not None and not 1 <= full_from < t:
        raise ValueError(f"full_from must be in [1, {t}), got {full_from}")
    plain_head = isinstance(head, torch.nn.Linear) and head.bias is None and \
        "forward" not in vars(head)  # a patched head keeps its own forward, in chunks
    if full_from is None and plain_head:
        out = scorer_head(targets, hidden=flat, weight=head.weight, candidate_ids=cand)
        lp, top1, cand_lp, full = out.logprobs, out.top1, out.candidate_logprobs, None
        lp, top1, cand_lp = lp.cpu(), top1.cpu(), cand_lp.cpu()
    else:
        keep = None
        if full_from is not None:  # only the rows predicting positions full_from.. get kept
            keep = torch.zeros(b, t - 1, dtype=torch.bool)
            keep[:, full_from - 1:] = True
        lp, top1, cand_lp, full = _chunked(head, flat, targets, cand, row_chunk,
                                           None if keep is None else keep.view(-1))
    pad_f = torch.zeros(b, 1)
    logprobs = torch.cat([pad_f, lp.view(b, t - 1)], dim=1)
    top1_ids = torch.cat([torch.zeros(b, 1, dtype=torch.long), top1.view(b, t - 1)], dim=1)
    cand_out = torch.cat([torch.zeros(b, 1, cand.shape[-1]), cand_lp.view(b, t - 1, -1)], dim=1)
    routed = None
    if routing and all(len(r) == 1 for r in routing):
        # each router saw all B·T tokens once: [B·T, k] per layer → [B, T, L, k]
        routed = torch.stack([r[0].view(b, t, -1) for r in routing], dim=2).cpu()
    return Scores(logprobs=logprobs, top1_ids=top1_ids, candidate_logprobs=cand_out,
                  routed_experts=routed,
                  full_logprobs=None if full is None else full.view(b, t - full_from, -1))


def _chunked(head: torch.nn.Module, flat: torch.Tensor, targets: torch.Tensor,
             cand: torch.Tensor, row_chunk: int, keep_full: torch.Tensor | None):
    """lm_head in row chunks of [chunk, V] FP32 logits: [N] log-probs, [N] top-1, [N, K]
    candidate log-probs, and the whole log-softmax [M, V] of the M rows `keep_full` [N] bool
    marks (in row order; None: none). Only those rows are stored: a prompt's rows never are."""
    n = flat.shape[0]
    lp = torch.empty(n, dtype=torch.float32)
    top1 = torch.empty(n, dtype=torch.long)
    cand_lp = torch.empty(cand.shape, dtype=torch.float32)
    full = None
    if keep_full is not None:
        keep = keep_full.cpu()
        slot = keep.long().cumsum(0) - 1  # row → its place in `full`
        full = torch.empty(int(keep.sum()), head.weight.shape[0], dtype=torch.float32)
    for r0 in range(0, n, row_chunk):
        logits = head(flat[r0:r0 + row_chunk]).float()  # (chunk, V) FP32 tile
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        if full is not None and bool(keep[r0:r0 + row_chunk].any()):
            sel = keep[r0:r0 + row_chunk]
            full[slot[r0:r0 + row_chunk][sel]] = (logits - lse)[sel.to(logits.device)].cpu()
        lp[r0:r0 + row_chunk] = (logits.gather(-1, targets[r0:r0 + row_chunk, None]) - lse)[:, 0]
        top1[r0:r0 + row_chunk] = logits.argmax(-1)
        cand_lp[r0:r0 + row_chunk] = logits.gather(-1, cand[r0:r0 + row_chunk]) - lse
    return lp, top1, cand_lp, full
