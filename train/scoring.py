"""The trainer's teacher-forced scores of a batch: log π of each sampled token and of its
candidates, and the entropy of the distribution that predicted it.

Only the sampled positions matter to the loss and the metrics, so only their logits are computed
(the output head runs on their hidden states alone) and only their log-softmax, in FP32, one
cache-sized chunk of rows at a time (`_TokenScores`). The *packed* form holds the N sampled
positions (position 0 excepted: nothing predicts it) row-major: log π [N], candidates [N, K],
entropy [N]; `unpacked_scores` puts them back in place as [B, T], [B, T, K], [B, T-1].

The rows of a GRPO group begin with the same prompt; where nothing before position P is scored,
those P positions run once per group and the group's rows continue from their keys and values
(`shared_prefix`; a 16 × 8 step of the embedded model's arithmetic tasks shares ~116 of its
~270 positions per row), and the rows continue in buckets of similar length (`suffix_buckets`):
a step's longest episode often runs tens of positions past the next, and in one batch every row
would run as long.
"""

from __future__ import annotations

import copy
import inspect

import torch

from .batch import Batch

__all__ = ["token_scores", "right_padded", "sampled_positions", "packed_scores",
           "unpacked_scores", "suffix_buckets"]


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
               seq: torch.Tensor, pos: torch.Tensor, **forward) -> torch.Tensor:
    """The logits [N, V] of positions (seq, pos) of a causal LM's forward over `ids` (`forward`:
    more of its arguments): its output head (get_output_embeddings) is fed those positions'
    hidden states alone."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hook = None
    if isinstance(head, torch.nn.Module):
        def rows_only(_module, args):
            hidden = args[0]
            return (hidden[seq, pos],) + args[1:] if hidden.dim() == 3 else None

        hook = head.register_forward_pre_hook(rows_only)
    try:
        logits = model(input_ids=ids, attention_mask=attention,
                       use_cache="past_key_values" in forward, **forward).logits
    finally:
        if hook is not None:
            hook.remove()
    return logits[seq, pos] if logits.dim() == 3 else logits  # a head that was not hooked


def token_scores(model: torch.nn.Module, batch: Batch, share_prefix: bool = True):
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

    With `share_prefix=False` the loss and the log-probs are those of the full [B, T, V]
    log-softmax bit for bit; the gradients differ by BF16 rounding only: the attention backward
    sums in another order than the masked one, and the output head's weight gradient sums the
    sampled rows alone (a few in 10^4 of its elements round the other way). With it (the
    trainer's default), a prompt the rows of a group share runs once (shared_prefix): the same
    function of the weights, to FP32 rounding in FP32; in BF16 the numbers round otherwise, as
    close to a float64 reference as the per-row forward's."""
    _, at = sampled_positions(batch)
    lp, cl, en = packed_scores(model, batch, at, share_prefix)
    return unpacked_scores(lp, cl, en, at, batch)


def sampled_positions(batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The sampled-token mask [B, T] the loss averages over (position 0 excepted) and its
    positions (rows, columns), row-major."""
    mask = batch.mask.clone()
    mask[:, 0] = False
    return mask, mask.nonzero(as_tuple=True)


_MIN_SHARED = 16
"""Prefix positions shared by the rows of a group at least for `shared_prefix` to use them."""


def shared_prefix(batch: Batch, at) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """Where the rows of a right-padded batch share their first P positions (a GRPO group's
    prompt) and nothing before position P is scored: (P, the distinct prefixes' rows [G], each
    row's prefix [B] as an index into them). None unless P ≥ _MIN_SHARED and there are at most
    half as many distinct prefixes as rows."""
    if at[1].numel() == 0 or not right_padded(batch.attention):
        return None
    p = int(at[1].min()) - 1  # the first scored position (it predicts the first sampled token)
    b = batch.ids.shape[0]
    if p < _MIN_SHARED:
        return None
    _, which = torch.unique(batch.ids[:, :p], dim=0, return_inverse=True)
    g = int(which.max()) + 1
    if 2 * g > b:
        return None
    first = torch.full((g,), b, dtype=torch.long).scatter_reduce_(
        0, which, torch.arange(b), reduce="amin")
    return p, first, which


def _shared_logits_at(model: torch.nn.Module, ids: torch.Tensor, shared, seq: torch.Tensor,
                      pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """_logits_at without attention mask, the shared prefixes computed once: the model runs the
    G distinct prefixes [G, P] into a KV cache (its output head on their last position alone),
    each row takes its prefix's keys and values (an index, so their gradients sum over the
    group's rows in the backward) and the model runs positions P… of every row on them (Prefix
    Grouper: Liu et al. 2025, arXiv:2506.05433). The rows' suffixes run in buckets of similar
    length (`suffix_buckets`), each only as long as its longest row needs. The same function of
    the weights as the per-row forward; in BF16 it rounds otherwise (other GEMM shapes, the
    suffix's attention on its masked path). Returns the logits [N, V] and, when the rows ran in
    more than one bucket, the packed index of each of those logits (bucket by bucket; None: in
    packed order). None for a model without transformers' causal-LM interface
    (`logits_to_keep`, a cache that selects rows): the caller runs the whole rows."""
    p, first, which = shared
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None  # not a transformers causal LM
    # the model's own forward: a sharded model (FSDP2) gathers its weights in its hooks
    out = model(input_ids=ids[first, :p], use_cache=True, logits_to_keep=1)
    cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    b = ids.shape[0]
    need = torch.full((b,), p + 1, dtype=torch.long).scatter_reduce_(0, seq, pos + 2, "amax")
    # a bucket takes its rows from a shallow copy of the cache's layers (transformers' Cache)
    buckets = suffix_buckets(need, p) if hasattr(cache, "layers") else [torch.arange(b)]
    parts, order = [], []
    for rows in buckets:
        whole = len(buckets) == 1
        t = int(need[rows].max())
        if whole:
            part_cache, sel, local = cache, None, seq
        else:
            part_cache = copy.copy(cache)  # the prefix's tensors, this bucket's own selection
            part_cache.layers = [copy.copy(layer) for layer in cache.layers]
            in_bucket = torch.zeros(b, dtype=torch.bool).index_fill_(0, rows, True)
            sel = in_bucket[seq].nonzero()[:, 0]
            local = torch.empty(b, dtype=torch.long).index_copy_(
                0, rows, torch.arange(len(rows)))[seq[sel]]
        part_cache.batch_select_indices(which[rows])
        positions = torch.arange(p, t)[None].expand(len(rows), -1)
        logits = _logits_at(model, ids[rows, p:t], _suffix_mask(model.config, p, t), local,
                            (pos if sel is None else pos[sel]) - p, position_ids=positions,
                            past_key_values=part_cache)
        if whole:
            return logits, None
        parts.append(logits)
        order.append(sel)
    return torch.cat(parts), torch.cat(order)


_BUCKET_KEYS_PER_TOKEN = 400
"""A suffix position's work outside attention, in units of attention against one key (the
embedded model's layers: ~300 kFLOP of projections and experts per position and layer against
~0.5 kFLOP per key, with the attention backward slower per FLOP on CPU)."""
_BUCKET_FIXED = 1.5e6
"""A bucket's fixed cost (one more forward and backward through every layer), in the same
units: ~1% of a 16 × 8 step's suffixes."""
_MAX_BUCKETS = 3
"""Buckets at most: more rarely pay for their fixed cost (a 16 × 8 step measured on two)."""


def suffix_buckets(need: torch.Tensor, p: int, max_buckets: int | None = None
                   ) -> list[torch.Tensor]:
    """The rows [B] split into at most `max_buckets` buckets of rows of similar length, each
    bucket's rows (ascending) running to its longest row's `need` (positions 0 … need−1; the
    rows' shared prefix is 0 … p−1): the split that minimizes the suffixes' modelled cost,
    Σ rows × (len − p) × (len + _BUCKET_KEYS_PER_TOKEN) + _BUCKET_FIXED per bucket (dynamic
    programming over the distinct lengths). A batch whose one long row would make every row
    run as long — a 16 × 8 step's longest episode is often tens of positions past the next —
    runs the others shorter."""
    max_buckets = max_buckets or _MAX_BUCKETS
    values, counts = torch.unique(need, return_counts=True)
    v, c = values.tolist(), counts.tolist()
    d = len(v)
    rows_upto = [0]
    for n in c:
        rows_upto.append(rows_upto[-1] + n)

    def cost(i: int, j: int) -> float:  # one bucket of the lengths v[i..j]
        return ((rows_upto[j + 1] - rows_upto[i]) * (v[j] - p) * (v[j] + _BUCKET_KEYS_PER_TOKEN)
                + _BUCKET_FIXED)

    inf = float("inf")
    best = [[inf] * d for _ in range(max_buckets)]  # best[k][j]: lengths v[0..j] in k+1 buckets
    cut = [[0] * d for _ in range(max_buckets)]
    for j in range(d):
        best[0][j] = cost(0, j)
    for k in range(1, max_buckets):
        for j in range(k, d):
            for i in range(k, j + 1):
                total = best[k - 1][i - 1] + cost(i, j)
                if total < best[k][j]:
                    best[k][j], cut[k][j] = total, i
    k = min(range(max_buckets), key=lambda k: best[k][d - 1])
    bounds, j = [], d - 1
    while k > 0:
        i = cut[k][j]
        bounds.append((i, j))
        j, k = i - 1, k - 1
    bounds.append((0, j))
    return [torch.nonzero((need >= v[i]) & (need <= v[j]))[:, 0] for i, j in reversed(bounds)]


def _suffix_mask(config, p: int, t: int) -> torch.Tensor | None:
    """The suffix's causal mask over the whole row, [1, 1, T − P, T] (position P + i sees
    0 … P + i), one for every row: transformers would build it per row, [B, 1, T − P, T], and
    attention would read (and widen) B copies. None (transformers builds it) for a model with
    sliding-window layers, whose masks differ by layer."""
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types) or (
            getattr(config, "sliding_window", None) is not None
            and getattr(config, "use_sliding_window", True)):
        return None
    return (torch.arange(t)[None, :] <= torch.arange(p, t)[:, None])[None, None]


def packed_scores(model: torch.nn.Module, batch: Batch, at, share_prefix: bool = True):
    """token_scores at the positions `at` only: log π [N], candidates [N, K], entropy [N].
    `share_prefix`: compute a prefix the rows share once (shared_prefix, _shared_logits_at)."""
    attention = None if right_padded(batch.attention) else batch.attention
    seq, pos = at[0], at[1] - 1                                   # position pos predicts pos+1
    shared = shared_prefix(batch, at) if share_prefix else None
    found = None if shared is None else _shared_logits_at(model, batch.ids, shared, seq, pos)
    logits, order = found if found is not None else \
        (_logits_at(model, batch.ids, attention, seq, pos), None)
    rows = max(1, _SCORE_CHUNK // max(1, logits.shape[-1]))
    labels, cands = batch.ids[at], batch.cand_ids[at]
    if order is None:
        return _TokenScores.apply(logits, labels, cands, rows)
    # the logits in bucket order: score them so and put the scores (not the [N, V] logits) back
    scores = _TokenScores.apply(logits, labels[order], cands[order], rows)
    back = torch.argsort(order)
    return tuple(x.index_select(0, back) for x in scores)


def unpacked_scores(lp, cl, en, at, batch: Batch):
    """Packed scores back in place: [B, T], [B, T, K], [B, T-1] (0 elsewhere)."""
    b, t, k = batch.cand_ids.shape
    logp = torch.zeros(b, t, dtype=torch.float32).index_put(at, lp)
    cand = torch.zeros(b, t, k, dtype=torch.float32).index_put(at, cl)
    ent = torch.zeros(b, t - 1, dtype=torch.float32).index_put_((at[0], at[1] - 1), en)
    return logp, cand, ent

