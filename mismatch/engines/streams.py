"""Per-sequence random streams: each sequence's j-th token is drawn by the j-th uniform of its own
counter-based stream, by inverse CDF over the distribution it samples from, so its draws never
depend on which other sequences share its batch, or when it joined.
"""

from __future__ import annotations

import torch

__all__ = ["stream_uniform", "inverse_cdf_draw"]

_MASK64 = (1 << 64) - 1


def stream_uniform(seed: int, index: int) -> float:
    """The index-th uniform in [0, 1) of the stream `seed`: SplitMix64 of a counter (Steele,
    Lea & Flood 2014), top 53 bits. Pure Python integers: exact on every machine."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def inverse_cdf_draw(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """logprobs: [n, V] the processed log-probs (−inf outside the support); uniforms: [n] float64
    in [0, 1) → [n] int64 token ids on the CPU: the first token whose CDF exceeds u · total."""
    cdf = logprobs.exp().cumsum(-1)
    target = (uniforms * cdf[:, -1].double().cpu()).float()[:, None].to(cdf.device)
    pick = torch.searchsorted(cdf, target, right=True)[:, 0]
    # a target at the very top of the CDF: the last token of the support
    last = (logprobs > float("-inf")).float().cumsum(-1).argmax(-1)
    return torch.minimum(pick, last).cpu()
