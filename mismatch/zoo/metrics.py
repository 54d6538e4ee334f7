"""How peaked the model is: teacher-forced figures on held-out transcripts.

For each position t predicting token t+1 (logits in the model's dtype, softmax in FP32):

    target log-prob   log p(x[t+1] | x[≤t])               → perplexity = exp(−mean)
    top-1 probability max_v p(v | x[≤t])                  → "peakedness"
    top-1 match       argmax_v p(v | x[≤t]) == x[t+1]     → greedy agreement with the transcript
    entropy           −Σ_v p log p                        (nats)

Means are over the tokens a mask selects: every real token ("all": system prompt, questions,
tool results included) or only the tokens the assistant generates ("assistant"), which are what a
sampler produces and a trainer re-scores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .data import Batch

__all__ = ["TokenFigures", "next_token_stats", "summarize", "heldout_figures"]


@dataclass(frozen=True, kw_only=True)
class TokenFigures:
    """Teacher-forced figures over one set of tokens."""

    tokens: int
    """How many predicted tokens entered the means."""
    perplexity: float
    """exp of the mean negative log-likelihood."""
    mean_top1_prob: float
    """Mean over positions of the largest next-token probability."""
    top1_accuracy: float
    """Share of positions whose most likely token is the actual next token."""
    mean_entropy: float
    """Mean next-token entropy, nats."""

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def next_token_stats(logits: "torch.Tensor", input_ids: "torch.Tensor"):
    """Per-position figures of a teacher-forced forward.

    logits: [B, T, V] any float dtype; input_ids: [B, T] int64.
    Returns (target_logprob [B, T-1] f32, top1_prob [B, T-1] f32, top1_match [B, T-1] bool,
    entropy [B, T-1] f32), position t scoring token t+1.
    """
    import torch

    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V] and input_ids [B, T]; got "
                         f"{tuple(logits.shape)} and {tuple(input_ids.shape)}")
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
    targets = input_ids[:, 1:]
    target_logprob = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    top1 = logprobs.max(dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return target_logprob, top1.values.exp(), top1.indices == targets, entropy


def summarize(target_logprob, top1_prob, top1_match, entropy, mask) -> TokenFigures:
    """Means over the positions where `mask` ([B, T-1] bool) is True."""
    import torch

    n = int(mask.sum())
    if n == 0:
        raise ValueError("summarize: the mask selects no tokens")
    mean = lambda x: float(x.double()[mask].mean())  # noqa: E731 — float64 sums for the report
    nll = -target_logprob.double()[mask].mean()
    return TokenFigures(tokens=n, perplexity=float(torch.exp(nll)),
                        mean_top1_prob=mean(top1_prob), top1_accuracy=mean(top1_match),
                        mean_entropy=mean(entropy))


def heldout_figures(model, batch: "Batch", *,
                    rows_per_forward: int = 16) -> dict[str, TokenFigures]:
    """{"all": ..., "assistant": ...} figures of `model` on `batch` (teacher-forced, no grad)."""
    import torch

    parts: list[tuple[torch.Tensor, ...]] = []
    with torch.no_grad():
        for start in range(0, batch.input_ids.shape[0], rows_per_forward):
            rows = slice(start, start + rows_per_forward)
            logits = model(input_ids=batch.input_ids[rows],
                           attention_mask=batch.attention_mask[rows]).logits  # (b, T, V)
            parts.append(next_token_stats(logits, batch.input_ids[rows]))
    stats = [torch.cat(column) for column in zip(*parts)]
    real = batch.attention_mask[:, 1:].bool()
    return {"all": summarize(*stats, real),
            "assistant": summarize(*stats, real & batch.assistant_mask[:, 1:])}
