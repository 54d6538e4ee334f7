"""The record that flows through probes, metrics and (later) training: token ids in, token ids out.

Dims: B sequences, T positions (prompt + completion, left-padded), K candidates, L MoE layers.
Position t of `sampler_logprobs` holds log μ(token_ids[t] | token_ids[:t]); it is meaningful only
where `completion_mask` is 1. Nothing here is text: prompts are token ids and so are completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Rollout", "Scores"]


@dataclass
class Rollout:
    """What a sampler produced and said about it."""

    token_ids: torch.Tensor
    """[B, T] int64, prompt then completion, left-padded with the pad id."""
    attention_mask: torch.Tensor
    """[B, T] int64, 1 on real tokens."""
    completion_mask: torch.Tensor
    """[B, T] float32, 1 on generated tokens (up to and including EOS)."""
    sampler_logprobs: torch.Tensor
    """[B, T] float32, raw log-probs (temperature 1, full vocabulary) of the sampled tokens."""
    sampler_logprobs_processed: torch.Tensor
    """[B, T] float32, log-probs under the distribution actually sampled from (temperature,
    top-k, top-p applied and renormalized)."""
    candidate_ids: torch.Tensor
    """[B, T, K] int64, the sampler's top-K tokens at each position (raw distribution)."""
    candidate_logprobs: torch.Tensor
    """[B, T, K] float32, their raw log-probs."""
    sampler: str
    """Label of the sampler's numerics."""
    mode: str
    """"emulated" or "measured"."""
    routed_experts: torch.Tensor | None = None
    """[B, T, L, k] int64 experts chosen per MoE layer, where recorded."""
    prompt_width: int = 0
    """Width of the left-padded prompt block: completions start at column `prompt_width`."""
    candidate_in_support: torch.Tensor | None = None
    """[B, T, K] bool, the candidates inside the distribution actually sampled from (the top-p
    support when sampled with top-p), where the sampler reports it."""
    full_logprobs: torch.Tensor | None = None
    """[B, n, V] float32, the sampler's whole raw log-softmax at each of the n completion steps
    (zeros after a row's end), where asked for."""
    meta: dict = field(default_factory=dict)
    """What a live engine said about itself (engine, url, log-prob mode): provenance only."""

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask.sum())


@dataclass
class Scores:
    """What a scorer (the trainer side, or a teacher-forced configuration) says of a rollout."""

    logprobs: torch.Tensor
    """[B, T] float32, log π(token_ids[t] | token_ids[:t]); 0 where there is no previous token."""
    top1_ids: torch.Tensor
    """[B, T] int64, the scorer's most likely token at each position."""
    candidate_logprobs: torch.Tensor | None = None
    """[B, T, K] float32 log-probs at the rollout's candidate ids."""
    routed_experts: torch.Tensor | None = None
    """[B, T, L, k] int64 experts chosen per MoE layer."""
    full_logprobs: torch.Tensor | None = None
    """[B, T', V] float32 whole log-softmax of the last T' positions, where asked for."""
