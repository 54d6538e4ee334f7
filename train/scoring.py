"""The trainer's teacher-forced scores of a batch: log π of each sampled token and of its
candidates, and the entropy of the distribution that predicted it.

Only the sampled positions matter to the loss and the metrics, so only their logits are computed
(the output head runs on their hidden states alone) and only their log-softmax, in FP32, one
cache-sized chunk of rows at a time (`_TokenScores`). The *packed* form holds the N sampled
positions (position 0 excepted: nothing predicts it) row-major: log π [N], candidates [N, K],
entropy [N]; `unpacked_scores` puts them back in place as [B, T], [B, T, K], [B, T-1].
"""

from __future__ import annotations

import torch

from .batch import Batch

__all__ = ["token_scores", "right_padded", "sampled_positions", "packed_scores",
           "unpacked_scores"]


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
    _, at = sampled_positions(batch)
    lp, cl, en = packed_scores(model, batch, at)
    return unpacked_scores(lp, cl, en, at, batch)


def sampled_positions(batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The sampled-token mask [B, T] the loss averages over (position 0 excepted) and its
    positions (rows, columns), row-major."""
    mask = batch.mask.clone()
    mask[:, 0] = False
    return mask, mask.nonzero(as_tuple=True)


def packed_scores(model: torch.nn.Module, batch: Batch, at):
    """token_scores at the positions `at` only: log π [N], candidates [N, K], entropy [N]."""
    attention = None if right_padded(batch.attention) else batch.attention
    seq, pos = at[0], at[1] - 1                                   # position pos predicts pos+1
    logits = _logits_at(model, batch.ids, attention, seq, pos)
    rows = max(1, _SCORE_CHUNK // max(1, logits.shape[-1]))
    return _TokenScores.apply(logits, batch.ids[at], batch.cand_ids[at], rows)


def unpacked_scores(lp, cl, en, at, batch: Batch):
    """Packed scores back in place: [B, T], [B, T, K], [B, T-1] (0 elsewhere)."""
    b, t, k = batch.cand_ids.shape
    logp = torch.zeros(b, t, dtype=torch.float32).index_put(at, lp)
    cand = torch.zeros(b, t, k, dtype=torch.float32).index_put(at, cl)
    ent = torch.zeros(b, t - 1, dtype=torch.float32).index_put_((at[0], at[1] - 1), en)
    return logp, cand, ent

