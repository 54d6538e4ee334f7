"""What the fused scorer head returns, and the one constant its two implementations share (the
PyTorch twin in scorer_head.py and the Triton kernel in _tl_scorer_head.py both import it from
here, so neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HeadOutput", "TAYLOR_SERIES_BELOW"]

# |x| under which q(δ) and g(c) are evaluated as their Taylor series (to the 7th power: remainder
# < 0.1⁸/8 relative to 0.1²/2, ~2.5e-7); above, the closed forms lose < 2e-6 relative to
# cancellation.
TAYLOR_SERIES_BELOW = 0.1


@dataclass(frozen=True)
class HeadOutput:
    """What the scorer head returns (all on the input's device)."""

    logprobs: torch.Tensor
    """[N] float32, log π(label)."""
    entropy: torch.Tensor
    """[N] float32, −Σ_v π_v log π_v."""
    top1: torch.Tensor
    """[N] int64, argmax of the logits (first index on ties)."""
    candidate_logprobs: torch.Tensor | None
    """[N, K] float32, log π at the candidate ids (None without candidates)."""
    kl_candidates: torch.Tensor | None
    """[N] float32, KL(sampler ‖ trainer) over the candidate slots, both renormalized there
    (None without the sampler's candidate log-probs)."""
