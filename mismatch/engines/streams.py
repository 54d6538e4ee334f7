"""Per-sequence random streams: each sequence's j-th token is drawn by the j-th uniform of its own
counter-based stream, by inverse CDF over the distribution it samples from, so its draws never
depend on which other sequences share its batch, or when it joined.
"""

from __future__ import annotations

import torch

__all__ = ["stream_uniform", "inverse_cdf_draw", "next_tokens"]

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


def next_tokens(proc: torch.Tensor, requests: list, positions: list[int]) -> torch.Tensor:
    """Row i's next token ([n] int64, CPU) given its processed log-probs proc[i], its request
    (engine `Request`) and how many tokens it has generated (`positions[i]`): the request's forced
    token there, the argmax at temperature 0, else the positions[i]-th uniform of its own stream
    (its `seed`) drawn by inverse CDF."""
    n = len(requests)
    tokens = torch.empty(n, dtype=torch.long)
    draw, greedy = [], []
    for i, r in enumerate(requests):
        if r.forced is not None:
            tokens[i] = r.forced[positions[i]]
        elif r.params.temperature == 0:
            greedy.append(i)
        else:
            draw.append(i)
    if greedy:
        g = torch.tensor(greedy)
        tokens[g] = proc[g].argmax(-1).cpu()
    if draw:
        d = torch.tensor(draw) if len(draw) < n else None
        u = torch.tensor([stream_uniform(requests[i].seed, positions[i]) for i in draw],
                         dtype=torch.float64)
        picked = inverse_cdf_draw(proc if d is None else proc[d], u)
        if d is None:
            return picked
        tokens[d] = picked
    return tokens
