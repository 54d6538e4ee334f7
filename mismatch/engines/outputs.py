"""The engine's per-slot output buffers: what each running sequence produced so far.

One tensor per field, [slots, width] or [slots, width, K]: every engine step writes the whole
batch's log-probs and candidates with one indexed write per buffer (no per-row Python), and a
finished sequence's rows are copied out once. The buffers grow (keeping what running sequences
wrote) when a request needs more steps or candidates than any before it.

    raw   [slots, width]     FP32 raw log-prob of each sampled (or forced) token
    proc  [slots, width]     FP32 log-prob under the distribution sampled from
    cid   [slots, width, K]  int64 top-K candidate ids of the raw distribution
    clp   [slots, width, K]  FP32 their raw log-probs
    sup   [slots, width, K]  bool: the candidate lies in the sampled support
"""

from __future__ import annotations

import torch

from .requests import Request

__all__ = ["SlotOutputs"]


class SlotOutputs:
    """Output buffers of `slots` sequences (see the module docstring)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.buffers: dict[str, torch.Tensor] | None = None

    @property
    def k(self) -> int:
        """Candidates the buffers hold per token."""
        assert self.buffers is not None, "ensure() first"
        return self.buffers["cid"].shape[2]

    def ensure(self, requests: list[Request], vocab: int) -> None:
        """Buffers wide enough for `requests` (a vocabulary of `vocab` caps the candidates)."""
        width = max(len(r.forced) if r.forced else r.params.max_new_tokens for r in requests)
        k = max(r.params.candidates for r in requests)
        k = min(k, vocab)
        have = self.buffers
        if have is not None and have["raw"].shape[1] >= width and have["cid"].shape[2] >= k:
            return
        if have is not None:
            width, k = max(width, have["raw"].shape[1]), max(k, have["cid"].shape[2])
        shape = (self.slots, width)
        out = {"raw": torch.zeros(shape), "proc": torch.zeros(shape),
               "cid": torch.zeros(*shape, k, dtype=torch.long), "clp": torch.zeros(*shape, k),
               "sup": torch.zeros(*shape, k, dtype=torch.bool)}
        if have is not None:  # keep what running sequences wrote
            for name, t in have.items():
                if t.ndim == 2:
                    out[name][:, :t.shape[1]] = t
                else:
                    out[name][:, :t.shape[1], :t.shape[2]] = t
        self.buffers = out

    def write(self, slots: torch.Tensor, steps: torch.Tensor, **rows: torch.Tensor) -> None:
        """slots, steps: [B] int64; rows: each buffer's [B] or [B, K] values for (slot, step)."""
        assert self.buffers is not None, "ensure() first"
        for name, values in rows.items():
            self.buffers[name][slots, steps] = values

    def read(self, slot: int, n: int, k: int) -> dict[str, torch.Tensor]:
        """Copies of one sequence's first `n` steps and `k` candidates, as Completion fields."""
        out = self.buffers
        assert out is not None, "ensure() first"
        return {"logprobs": out["raw"][slot, :n].clone(),
                "logprobs_processed": out["proc"][slot, :n].clone(),
                "candidate_ids": out["cid"][slot, :n, :k].clone(),
                "candidate_logprobs": out["clp"][slot, :n, :k].clone(),
                "candidate_in_support": out["sup"][slot, :n, :k].clone()}
