"""Sampling parameters and the processing of logits: the distribution actually sampled from
(temperature, top-k, top-p; `process_logits`, `process_rows`) and the candidate ranking
(`ranked_topk`) — what the rollout engine (engine.py) applies at every decode step, and what the
probes replay. vLLM calls log-probs under the processed distribution "processed_logprobs", those
of the temperature-1 full distribution "raw_logprobs"; confusing them is a known source of
spurious mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mismatch.kernels import native

__all__ = ["SamplingParams", "process_logits", "process_rows", "ranked_topk", "ranked_topk_torch"]


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


def process_rows(logits: torch.Tensor, params: list[SamplingParams],
                 raw: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] FP32 logits with one SamplingParams per row → [B, V] processed log-probs (rows that
    share their params are processed together). `raw`: the logits' log-softmax, where the caller
    has it: rows sampled at temperature 1 without truncation take it as it is (`logits / 1.0` is
    `logits`, bit for bit, so their processed log-probs are those very values)."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p, []).append(i)

    def processed(rows: torch.Tensor | None, p: SamplingParams) -> torch.Tensor:
        if raw is not None and _untruncated(p):
            return raw if rows is None else raw[rows]
        return process_logits(logits if rows is None else logits[rows], p)

    if len(groups) == 1:
        return processed(None, next(iter(groups)))
    proc = torch.empty_like(logits)
    for p, idx in groups.items():
        sel = torch.tensor(idx)
        proc[sel] = processed(sel, p)
    return proc


def _untruncated(p: SamplingParams) -> bool:
    """Whether `process_logits` under `p` is the plain log-softmax of the logits."""
    return p.temperature == 1 and not p.top_k and p.top_p >= 1


_NUMPY_SELECT = (torch.float32, torch.float64)


def _has_nan(x: torch.Tensor) -> bool:
    return x.is_floating_point() and bool(torch.isnan(x).any())


def _kth_largest(x: torch.Tensor, k: int, nan: bool | None = None) -> torch.Tensor:
    """[B, V] → [B, 1]: each row's k-th largest value (a value of the row; ties do not change
    it). On a CPU, rows of FP32/FP64 without NaN go through numpy's introselect
    (`np.partition`), 5-10× faster than torch's `topk` on a decode step's [64, 768] logits; torch
    and numpy agree on NaN (the largest) but are kept apart where one occurs. `nan`: whether x
    holds a NaN, where the caller knows (checked here otherwise)."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_SELECT and x.dim() == 2 \
            and not x.requires_grad and not (_has_nan(x) if nan is None else nan):
        a = x.numpy()
        v = a.shape[-1]
        return torch.from_numpy(np.partition(a, v - k, axis=-1)[:, v - k:v - k + 1])
    return x.topk(k, dim=-1).values[:, -1:]


def ranked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] → the k best (values, ids) of each row, ranked by value descending, then token id
    ascending: the one ranking rule the candidates and the nucleus (`process_logits`) share.

    torch's `topk` and `sort` leave the order of tied values unspecified (it differs between
    machines), so a candidate list and a nucleus ranked by either alone may disagree on a tie.
    NaN ranks above every number (as `topk` and a descending `sort` put it), NaNs by id; −0 and
    +0 tie. FP32 rows on a CPU go through the native kernel (mismatch.kernels.native, one pass a
    row instead of a dozen tensor operations: the same values and ids, it only compares), the
    rest through `ranked_topk_torch`."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 \
            and not x.requires_grad and 0 < min(k, x.shape[-1]) and native.available():
        return native.ranked_topk(x, k)
    return ranked_topk_torch(x, k)


def ranked_topk_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_topk` in tensor operations (any dtype and device)."""
    k = min(k, x.shape[-1])
    nan_found = _has_nan(x)
    kth = _kth_largest(x, k, nan_found)
    above, tied = x > kth, x == kth
    if nan_found:  # NaN ranks first, as in topk
        nan, kth_nan = torch.isnan(x), torch.isnan(kth)
        above = (above | nan) & ~kth_nan
        tied = torch.where(kth_nan, nan, tied)
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
    ranked = None
    if params.top_k:  # exactly k tokens, ties at the boundary to the lowest ids
        vals, ids = ranked_topk(z, params.top_k)
        z = torch.full_like(z, float("-inf")).scatter(-1, ids, vals)
        ranked = vals, ids
    if params.top_p < 1:
        z = _nucleus(z, params.top_p, ranked)
    return torch.log_softmax(z, dim=-1)


def _nucleus(z: torch.Tensor, top_p: float,
             ranked: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """[B, V] → z with −inf outside each row's nucleus: the tokens ranked by value descending,
    then id ascending (a stable sort), kept while the mass before them is < top_p under the
    softmax of the whole sorted row.

    `ranked`: the rows' top-k (values, ids) by that same rule when z is −inf everywhere else
    (top-k truncation). The stable sort of such a row is then the top-k ranking followed by the
    −inf entries, so the sorted row is built from it instead of sorted again — the same tensor,
    so the same softmax and cumulative sums to the bit — except where a top-k value is itself
    −inf (fewer finite values than k: the −inf entries interleave by id) or NaN, which sort."""
    width = z.shape[-1]
    sorted_z = None
    if ranked is not None and ranked[0].shape[-1] < width:
        vals, order = ranked
        if not bool((torch.isneginf(vals[:, -1]) | torch.isnan(vals).any(-1)).any()):
            tail = vals.new_full((vals.shape[0], width - vals.shape[-1]), float("-inf"))
            sorted_z = torch.cat([vals, tail], dim=-1)
    if sorted_z is None:
        sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_z, dim=-1)
    # keep a token if the mass before it is < top_p (the first token is always kept); the
    # −inf tail of a ranked row stays −inf, so only the ranked head is written back
    drop = (probs.cumsum(-1) - probs) >= top_p
    n = order.shape[-1]
    kept = sorted_z[:, :n].masked_fill(drop[:, :n], float("-inf"))
    return torch.full_like(z, float("-inf")).scatter(-1, order, kept)
