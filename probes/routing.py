"""routing (MoE): how often the sampler's experts differ from the trainer's, and what that costs.

On the shared tokens, the target sampler recorded the top-k experts of every MoE layer at every
position it ran (the prompt's prefill and each decode step; the last sampled token is never run,
so it has no record). The trainer's teacher-forced forward records its own. Per layer, a *flip*
is a position whose top-k expert *set* differs (order within the set does not matter: the
weighted sum is the same). Reported: the share of positions with a flip in each layer, and the
share with a flip in at least one layer.

The KL with and without routing replay: without, the trainer routes by its own router; with,
each router is forced to the sampler's experts (keeping its own gate probabilities over them —
routing replay, engines/routing.py). The difference is routing's share of the mismatch; what
remains with replay is the mismatch that is not due to routing.

Published magnitudes (R3, Ma et al. 2025, arXiv:2510.11370): ~10% of router decisions differ,
94% of tokens differ in at least one layer (a 48-layer model), and KL 1.5e-3 → 7.5e-4 with routing replay.
"""

from __future__ import annotations

import torch

from .base import Batch, SourceResult, Variant
from .context import ProbeContext
from .source_figures import RoutingFlips
from .tally import Tally


def routing_flips(sampler: torch.Tensor, trainer: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sampler, trainer: [B, T, L, k] experts (-1: no record); mask [B, T] real positions →
    (flips per layer [L], positions with a flip in any layer, positions counted), counted where
    the sampler has a record."""
    known = (sampler >= 0).all(-1).all(-1) & mask.bool()  # [B, T]
    same = (sampler.sort(-1).values == trainer.sort(-1).values).all(-1)  # [B, T, L]
    flip = ~same & known[..., None]
    return flip.sum((0, 1)), flip.any(-1).sum(), known.sum()


class RoutingProbe:
    name = "routing"

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.applies = ctx.is_moe
        self.replayed = Variant(spec=ctx.trainer, replay=True)
        self.tallies = {"no_replay": Tally(), "replay": Tally(), "routing_alone": Tally()}
        self.layer_flips: torch.Tensor | None = None
        self.any_flips = 0
        self.positions = 0
        self.completion_any = 0
        self.completion_positions = 0
        self.batches_needed: int | None = None if self.applies else 0

    def on_batch(self, batch: Batch) -> None:
        ctx = self.ctx
        sampler = ctx.evaluate(ctx.sampler, batch)
        trainer = ctx.evaluate(ctx.reference, batch)
        ro = batch.rollout
        per_layer, any_layer, n = routing_flips(sampler.routing, trainer.routing,
                                                ro.attention_mask)
        self.layer_flips = per_layer if self.layer_flips is None else self.layer_flips + per_layer
        self.any_flips += int(any_layer)
        self.positions += int(n)
        # the same, restricted to completion tokens (the ones whose log-probs are compared)
        _, any_c, n_c = routing_flips(sampler.routing, trainer.routing,
                                      ro.completion_mask.bool() & ro.attention_mask.bool())
        self.completion_any += int(any_c)
        self.completion_positions += int(n_c)
        ctx.compare(self.tallies["no_replay"], ctx.reference, ctx.sampler, batch)
        ctx.compare(self.tallies["replay"], self.replayed, ctx.sampler, batch)
        # routing alone: the trainer's numerics, its own experts vs the sampler's
        ctx.compare(self.tallies["routing_alone"], ctx.reference, self.replayed, batch)

    @property
    def headline(self) -> Tally:
        return self.tallies["routing_alone"]

    def finish(self) -> SourceResult:
        if not self.applies:
            return SourceResult(name=self.name, headline=None,
                                notes=["The model has no MoE routers: nothing to flip."])
        seed = self.ctx.cfg.seed
        without = self.tallies["no_replay"].summary(seed)
        with_replay = self.tallies["replay"].summary(seed)
        alone = self.tallies["routing_alone"].summary(seed)
        assert self.layer_flips is not None
        per_layer = (self.layer_flips.double() / max(self.positions, 1)).tolist()
        share = without.kl_exact - with_replay.kl_exact
        flips = RoutingFlips(
            flip_rate_by_layer=per_layer,
            flip_rate_mean=sum(per_layer) / len(per_layer),
            flip_rate_any_layer=self.any_flips / max(self.positions, 1),
            flip_rate_any_layer_completion=self.completion_any
            / max(self.completion_positions, 1),
            positions=self.positions,
            kl_exact_no_replay=without.kl_exact,
            kl_exact_replay=with_replay.kl_exact,
            kl_k3_no_replay=without.kl_k3,
            kl_k3_replay=with_replay.kl_k3,
            routing_kl_share=share,
            routing_kl_share_fraction=share / without.kl_exact if without.kl_exact > 0 else 0.0)
        notes = [f"Sampler: {self.ctx.spec.label} (decode path); trainer: teacher-forced "
                 f"{self.ctx.trainer.dtype.upper()}. Flips are counted over all "
                 f"{self.positions} routed positions (prompt and completion); the KL over the "
                 f"completion tokens. Routing's share = KL without replay − KL with replay. "
                 f"Headline (`routing_alone`): the trainer's numerics with its own experts "
                 f"against the same numerics forced to the sampler's experts — routing alone."]
        return SourceResult(name=self.name, headline=alone,
                            parts={"no_replay": without, "replay": with_replay,
                                   "routing_alone": alone}, extra=flips.to_json(),
                            notes=notes, log_ratio=self.tallies["routing_alone"].log_ratio())
