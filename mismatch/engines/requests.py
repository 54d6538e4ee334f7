"""What a client asks of the rollout engine (engine.py) and what it gets back.

Per generated token a `Completion` holds the raw log-prob (temperature 1, full vocabulary), the
processed log-prob (the distribution sampled from), the top-K candidates of the raw distribution
ranked by `sampler.ranked_topk` with the flags of those inside the sampled support, optionally
the whole raw log-softmax, and (MoE models) the experts each router chose for every position the
engine computed (−1 where none: the last sampled token is never fed back). `EngineStats` counts
an engine's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch

from .logits import SamplingParams

__all__ = ["Request", "Completion", "EngineStats"]


@dataclass
class Request:
    """One sequence to complete."""

    prompt: list[int]
    """Token ids of the context (non-empty)."""
    params: SamplingParams
    """Length cap, temperature, top-k / top-p, candidates recorded (seed unused: see `seed`)."""
    seed: int = 0
    """This sequence's random stream."""
    forced: list[int] | None = None
    """Tokens to feed instead of sampling (teacher forcing through the decode path)."""
    session: Hashable | None = None
    """Keep the KV after finishing, for this session's next request (KV reuse across turns)."""
    keep_full: bool = False
    """Also keep the whole raw log-softmax of every generated position."""
    tag: Any = None
    """The caller's: handed back on the completion."""
    lane: int = 0
    """Whose numerics compute this sequence when several samplers share the batch (lanes.py)."""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a request needs a non-empty prompt")
        if self.forced is not None and not self.forced:
            raise ValueError("forced tokens, when given, must be non-empty")


@dataclass
class Completion:
    """What the engine produced for one request."""

    request: Request
    tokens: list[int]
    """Generated (or forced) ids, EOS included when sampled."""
    logprobs: torch.Tensor
    """[n] FP32 raw log-probs of `tokens`."""
    logprobs_processed: torch.Tensor
    """[n] FP32 log-probs under the distribution sampled from."""
    candidate_ids: torch.Tensor
    """[n, K] int64 top-K of the raw distribution (value descending, then id ascending)."""
    candidate_logprobs: torch.Tensor
    """[n, K] FP32."""
    candidate_in_support: torch.Tensor
    """[n, K] bool: the candidate lies in the distribution sampled from."""
    finish_reason: str
    """"eos", "length" (the request's cap), "forced" (end of forced tokens) or "context" (the
    engine's context limit)."""
    cached_tokens: int
    """Prompt tokens whose KV came from the session's cache (not prefilled again)."""
    routed_experts: torch.Tensor | None = None
    """[len(prompt) + n, L, k] int64 experts per MoE layer for each position, −1 where none."""
    full_logprobs: torch.Tensor | None = None
    """[n, V] FP32 whole raw log-softmax (when the request asked)."""


@dataclass
class EngineStats:
    """Counters of one engine, cumulative."""

    prefill_tokens: int = 0
    """Prompt tokens the prefills covered (shared_tokens of them copied, not computed)."""
    cached_tokens: int = 0
    """Prompt tokens a session's cache held (not prefilled)."""
    shared_tokens: int = 0
    """Prompt tokens whose KV was copied from a row of the same prompt in the same prefill."""
    decode_tokens: int = 0
    steps: int = 0
    requests: int = 0
    evictions: int = 0
    busy_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.busy_s if self.busy_s else 0.0
