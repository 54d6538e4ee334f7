"""The fused scorer head: hidden states (or logits) → what the trainer side needs per token.

Per row n (a position) and its label y_n, over the vocabulary V, in vocabulary tiles:

    logits  l = h · Wᵀ rounded once to the input dtype (what an lm_head GEMM writes), then FP32
    lse     = m + log s,  s = Σ_v e^{l_v − m}                 online over tiles (running max m)
    logprob = l_y − lse
    entropy = log s − t / s,  t = Σ_v e^{l_v − m} (l_v − m)    (= −Σ p log p, no cancellation
              against lse: t is rescaled as m grows, t ← e^{m−m'} (t + (m − m') s))
    top1    = first index of the largest logit (torch.argmax's tie rule)
    cand    = l_c − lse for K candidate ids c (the sampler's top-K)
    kl_cand = KL(μ̃ ‖ π̃) over the K candidate slots, μ̃ = softmax of the sampler's candidate
              log-probs, π̃ = the trainer's distribution renormalized over the same slots (what
              top-p mask replay trains with). With δ_k = sampler_lp_k − cand_k,
              KL = E_μ̃[δ] + log E_μ̃[e^{−δ}], which holds for δ shifted by any constant; so δ is
              first centred (δ ← δ − E_μ̃[δ]), then with a = E_μ̃[δ] (≈ 0), b = E_μ̃[q(δ)],
              q(δ) = e^{−δ} − 1 + δ ≥ 0, c = b − a:  KL = b − g(c),  g(c) = c − log1p(c) ≥ 0.
              b is a sum of non-negative terms and g(c) ≈ c²/2 is second order, so in FP32 a
              KL of ~3e-11 keeps 3e-6 relative accuracy (median; 7e-5 worst of 256 seeded rows)
              and one of ~3e-7 keeps 6e-8 (the direct a + log1p(b − a) of
              mismatch.metrics.exact_kl needs float64 for that).

At most a [row_tile, vocab_tile] FP32 tile exists at once: at V = 152k and T = 256k a full
[T, V] FP32 log-softmax would be 150 GB. Dims: N rows (B·T positions), H hidden, V vocabulary,
K candidates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .head_output import TAYLOR_SERIES_BELOW, HeadOutput
from .runtime import KernelError, use_triton

__all__ = ["HeadOutput", "scorer_head", "scorer_head_torch", "scorer_head_triton", "q_delta",
           "g_log1p", "default_blocks"]

_KL_MIN = 0.0  # a KL is >= 0; FP32 rounding of b − g(b − a) can dip below it by an ulp


def q_delta(delta: torch.Tensor) -> torch.Tensor:
    """q(δ) = e^{−δ} − 1 + δ in FP32: the series below |δ| = 0.1, the closed form above."""
    d = delta
    series = d * d * (0.5 - d * (1.0 / 6 - d * (1.0 / 24 - d * (1.0 / 120 - d * (
        1.0 / 720 - d * (1.0 / 5040))))))
    return torch.where(d.abs() < TAYLOR_SERIES_BELOW, series, torch.exp(-d) - 1.0 + d)


def g_log1p(c: torch.Tensor) -> torch.Tensor:
    """g(c) = c − log1p(c) in FP32 (c > −1): the series below |c| = 0.1, the closed form above."""
    series = c * c * (0.5 - c * (1.0 / 3 - c * (0.25 - c * (0.2 - c * (1.0 / 6 - c * (
        1.0 / 7))))))
    return torch.where(c.abs() < TAYLOR_SERIES_BELOW, series, c - torch.log1p(c))


def _kl_from_candidates(cand_lp: torch.Tensor, sampler_lp: torch.Tensor) -> torch.Tensor:
    """[N, K] trainer log-probs at the candidates, [N, K] sampler log-probs → [N] FP32 KL."""
    mu = torch.softmax(sampler_lp.float(), dim=-1)
    delta = sampler_lp.float() - cand_lp
    delta = delta - (mu * delta).sum(-1, keepdim=True)  # centred: KL is shift-invariant in δ
    a = (mu * delta).sum(-1)
    b = (mu * q_delta(delta)).sum(-1)
    return (b - g_log1p(b - a)).clamp_min(_KL_MIN)


def _check(hidden, weight, logits, labels, candidate_ids, sampler_lp, row_tile, vocab_tile):
    """Shapes, dtypes and id ranges at the public entry; returns (N, V)."""
    if (logits is None) == (hidden is None or weight is None) or \
            (logits is not None and (hidden is not None or weight is not None)):
        raise KernelError("scorer_head needs either hidden [N, H] and weight [V, H], or logits "
                          "[N, V]")
    if logits is not None:
        if logits.ndim != 2 or not logits.is_floating_point():
            raise KernelError(f"logits must be a float [N, V] tensor, got {logits.dtype} "
                              f"{tuple(logits.shape)}")
        n, v = logits.shape
    else:
        if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
            raise KernelError(f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
                              f"and {tuple(weight.shape)}")
        if hidden.dtype != weight.dtype or not hidden.is_floating_point():
            raise KernelError(f"hidden and weight must share a float dtype, got {hidden.dtype} "
                              f"and {weight.dtype}")
        n, v = hidden.shape[0], weight.shape[0]
    if labels.shape != (n,) or labels.dtype not in (torch.int64, torch.int32):
        raise KernelError(f"labels must be [N={n}] int64, got {labels.dtype} {tuple(labels.shape)}")
    if n and not bool(((labels >= 0) & (labels < v)).all()):
        raise KernelError(f"labels must lie in [0, {v}), got min {int(labels.min())} max "
                          f"{int(labels.max())}")
    if candidate_ids is not None:
        if candidate_ids.ndim != 2 or candidate_ids.shape[0] != n or candidate_ids.shape[1] < 1:
            raise KernelError(f"candidate_ids must be [N={n}, K>=1], got "
                              f"{tuple(candidate_ids.shape)}")
        if n and not bool(((candidate_ids >= 0) & (candidate_ids < v)).all()):
            raise KernelError(f"candidate_ids must lie in [0, {v})")
    if sampler_lp is not None:
        if candidate_ids is None or sampler_lp.shape != candidate_ids.shape:
            raise KernelError("sampler_candidate_logprobs needs candidate_ids of the same [N, K] "
                              "shape")
        if not bool(torch.isfinite(sampler_lp).all()):
            raise KernelError("sampler_candidate_logprobs must be finite")
    if row_tile < 1 or vocab_tile < 1:
        raise KernelError(f"row_tile and vocab_tile must be >= 1, got {row_tile}, {vocab_tile}")
    return n, v


@torch.no_grad()
def scorer_head_torch(labels: torch.Tensor, *, hidden: torch.Tensor | None = None,
                      weight: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                      candidate_ids: torch.Tensor | None = None,
                      sampler_candidate_logprobs: torch.Tensor | None = None,
                      row_tile: int = 256, vocab_tile: int = 8192) -> HeadOutput:
    """The torch twin (reference and CPU path). labels: [N] int64; hidden: [N, H] and weight:
    [V, H] of one float dtype, or logits: [N, V]; candidate_ids: [N, K] int64;
    sampler_candidate_logprobs: [N, K] float. Tiles of [row_tile, vocab_tile] FP32."""
    n, v = _check(hidden, weight, logits, labels, candidate_ids, sampler_candidate_logprobs,
                  row_tile, vocab_tile)
    device = labels.device
    k = 0 if candidate_ids is None else candidate_ids.shape[1]
    out_lp = torch.empty(n, dtype=torch.float32, device=device)
    out_ent = torch.empty(n, dtype=torch.float32, device=device)
    out_top = torch.empty(n, dtype=torch.long, device=device)
    out_cand = torch.empty(n, k, dtype=torch.float32, device=device)
    for r0 in range(0, n, row_tile):
        r1 = min(n, r0 + row_tile)
        rows = r1 - r0
        lab = labels[r0:r1].long()
        cid = None if candidate_ids is None else candidate_ids[r0:r1].long()
        m = torch.full((rows,), -torch.inf, device=device)
        s = torch.zeros(rows, device=device)
        t = torch.zeros(rows, device=device)
        best = torch.full((rows,), -torch.inf, device=device)
        best_i = torch.zeros(rows, dtype=torch.long, device=device)
        lab_l = torch.zeros(rows, device=device)
        cand_l = torch.zeros(rows, k, device=device)
        for v0 in range(0, v, vocab_tile):
            v1 = min(v, v0 + vocab_tile)
            if logits is not None:
                tile = logits[r0:r1, v0:v1].float()  # (rows, bv)
            else:
                tile = F.linear(hidden[r0:r1], weight[v0:v1]).float()  # rounded once, as lm_head
            tm, ti = tile.max(-1)
            new_m = torch.maximum(m, tm)
            alpha = torch.exp(m - new_m)
            p = torch.exp(tile - new_m[:, None])
            corr = (torch.where(s > 0, m, new_m) - new_m) * s  # m is -inf until the first tile
            t = alpha * (t + corr) + (p * (tile - new_m[:, None])).sum(-1)
            s = alpha * s + p.sum(-1)
            m = new_m
            better = tm > best
            best_i = torch.where(better, ti + v0, best_i)
            best = torch.where(better, tm, best)
            inside = (lab >= v0) & (lab < v1)
            picked = tile.gather(-1, (lab - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            lab_l = torch.where(inside, picked, lab_l)
            if cid is not None:
                inside_c = (cid >= v0) & (cid < v1)
                picked_c = tile.gather(-1, (cid - v0).clamp(0, v1 - v0 - 1))
                cand_l = torch.where(inside_c, picked_c, cand_l)
        log_s = torch.log(s)
        lse = m + log_s
        out_lp[r0:r1] = lab_l - lse
        out_ent[r0:r1] = log_s - t / s
        out_top[r0:r1] = best_i
        out_cand[r0:r1] = cand_l - lse[:, None]
    kl = None
    if sampler_candidate_logprobs is not None:
        kl = _kl_from_candidates(out_cand, sampler_candidate_logprobs)
    return HeadOutput(logprobs=out_lp, entropy=out_ent, top1=out_top,
                      candidate_logprobs=out_cand if candidate_ids is not None else None,
                      kl_candidates=kl)


@torch.no_grad()
def scorer_head_triton(labels: torch.Tensor, *, hidden: torch.Tensor | None = None,
                       weight: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                       candidate_ids: torch.Tensor | None = None,
                       sampler_candidate_logprobs: torch.Tensor | None = None,
                       block_rows: int | None = None, block_vocab: int | None = None,
                       block_hidden: int | None = None) -> HeadOutput:
    """The Triton kernel: one program per `block_rows` rows loops over the vocabulary in
    `block_vocab` tiles (and, from hidden states, over H in `block_hidden` slices of a tl.dot
    with an FP32 accumulator). Same arguments and results as the twin; blocks default to
    `default_blocks`."""
    from ._tl_scorer_head import launch

    rows, vocab, hid = default_blocks(logits is not None, labels.is_cuda)
    block_rows, block_vocab, block_hidden = (block_rows or rows, block_vocab or vocab,
                                             block_hidden or hid)
    _check(hidden, weight, logits, labels, candidate_ids, sampler_candidate_logprobs, 1, 1)
    return launch(labels, hidden, weight, logits, candidate_ids, sampler_candidate_logprobs,
                  block_rows, block_vocab, block_hidden)


def default_blocks(from_logits: bool, cuda: bool) -> tuple[int, int, int]:
    """(rows, vocabulary, hidden) per program. From logits nothing is reused across rows, so a
    program takes 8 rows and wide 512-column tiles (64-row tiles of this kernel took ptxas ~4
    minutes for sm80). From hidden states the weight tile is reused by every row of the program:
    64 rows, 128 columns, 64-wide H slices on CUDA; under the interpreter 16 and 32, tl.dot's
    smallest tiles, to keep the tests fast."""
    if from_logits:
        return 8, 512, 0
    return (64, 128, 64) if cuda else (16, 128, 32)


def scorer_head(labels: torch.Tensor, *, hidden: torch.Tensor | None = None,
                weight: torch.Tensor | None = None, logits: torch.Tensor | None = None,
                candidate_ids: torch.Tensor | None = None,
                sampler_candidate_logprobs: torch.Tensor | None = None,
                backend: str = "auto") -> HeadOutput:
    """Dispatch: the Triton kernel for CUDA tensors when Triton is installed, else the twin."""
    tensors = [t for t in (labels, hidden, weight, logits) if t is not None]
    fn = scorer_head_triton if use_triton(backend, *tensors) else scorer_head_torch
    return fn(labels, hidden=hidden, weight=weight, logits=logits, candidate_ids=candidate_ids,
              sampler_candidate_logprobs=sampler_candidate_logprobs)
