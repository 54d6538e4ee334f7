"""Token-aligned pairs of sequences, each scored by itself by the trainer and tallied: the
retokenization probe's comparisons (round_trip.py, multi_turn.py).

Every sequence is scored alone, a batch of one without padding (on the trainer's CPU emulation
left padding alone moves log-probs by up to 0.03 nats), so padding or batch composition can never
pass for retokenization; a sequence that is the same on both sides is scored once and compares
to itself exactly.
"""

from __future__ import annotations

import torch

from mismatch.records import Rollout

from .base import Evaluation
from .context import ProbeContext
from .tally import KLSummary, Tally

__all__ = ["AlignedPairs", "summary_if_interval"]

_FULL_BYTES = 1 << 30  # cap of one side's [rows, width, V] FP32 log-softmax held for exact KL


def _score_alone(model: torch.nn.Module, ids: list[int],
                 positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of `ids` (one sequence, no padding) at `positions` (each >= 1):
    token log-probs [N] and whole log-softmax [N, V], FP32."""
    from mismatch.engines.scorer import score

    n = len(ids)
    if not positions:
        return torch.zeros(0), torch.zeros(0, 0)
    first = min(positions)
    ro = Rollout(token_ids=torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                 completion_mask=torch.zeros(1, n), sampler_logprobs=torch.zeros(1, n),
                 sampler_logprobs_processed=torch.zeros(1, n),
                 candidate_ids=torch.zeros(1, n, 1, dtype=torch.long),
                 candidate_logprobs=torch.zeros(1, n, 1), sampler="trainer", mode="emulated")
    s = score(model, ro, with_routing=False, full_from=first)
    at = torch.tensor(positions)
    return s.logprobs[0, at], s.full_logprobs[0, at - first]  # (N,), (N, V)


class AlignedPairs:
    """Token-aligned pairs of sequences, scored by the trainer into a Tally in chunks."""

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.rows: list[tuple[list[int], list[int], list[int], list[int]]] = []

    def add(self, reference: list[int], other: list[int], ref_pos: list[int],
            other_pos: list[int]) -> None:
        """Compare reference[ref_pos[i]] with other[other_pos[i]] (the same token)."""
        self.rows.append((reference, other, ref_pos, other_pos))

    @torch.no_grad()
    def tally(self, chunk: int) -> Tally:
        """Score every pair (rows of `chunk` at a time, fewer where the vocabulary is large)."""
        from mismatch.engines.numerics import apply_numerics

        ctx = self.ctx
        model = ctx.model(ctx.trainer.compute_dtype)
        tally = Tally()
        width = max([1] + [len(r[2]) for r in self.rows])  # one width: Tally concatenates chunks
        vocab = model.get_output_embeddings().weight.shape[0]
        chunk = max(1, min(chunk, _FULL_BYTES // (4 * width * vocab)))
        with apply_numerics(model, ctx.trainer, ctx.scales(ctx.trainer), kernels=False):
            for c0 in range(0, len(self.rows), chunk):
                rows = self.rows[c0:c0 + chunk]
                evals = []
                memo: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
                for side in (0, 1):
                    lp = torch.zeros(len(rows), width)
                    full = None
                    for i, row in enumerate(rows):
                        key = (tuple(row[side]), tuple(row[2 + side]))
                        if key not in memo:  # identical ids, identical positions: scored once
                            memo[key] = _score_alone(model, row[side], row[2 + side])
                        got_lp, got_full = memo[key]
                        if got_lp.numel() == 0:
                            continue
                        if full is None:
                            full = torch.zeros(len(rows), width, got_full.shape[-1])
                        lp[i, :got_lp.numel()] = got_lp
                        full[i, :got_lp.numel()] = got_full
                    evals.append(Evaluation(logprobs=lp, full=full if full is not None
                                            else torch.zeros(len(rows), width, 1)))
                mask = torch.zeros(len(rows), width)
                for i, row in enumerate(rows):
                    mask[i, :len(row[2])] = 1.0
                tally.add(evals[0], evals[1], mask)
        return tally


def summary_if_interval(tally: Tally, seed: int) -> KLSummary | None:
    """Tally.summary, or None under two sequences with compared tokens (no interval exists)."""
    rows = sum(int((m.sum(-1) > 0).sum()) for m in tally.mask)
    return tally.summary(seed=seed) if rows >= 2 else None

