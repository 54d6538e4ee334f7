"""accelerator: the same checkpoint on every GPU that can serve it, and the study's mixed fleet.

Headline: the accelerator alone — the same checkpoint moved from the trainer's GPU
(`--trainer-gpu`, served as that GPU natively would, decode path, its kernels) to the target GPU
(its own serving path, accumulation and attention family): one factor changed, on the shared
tokens.

Per GPU: each GPU's real configuration for the `--dtype` checkpoint (mismatch.profiles.resolve:
Marlin weight-only where the GPU lacks the tensor cores, native W8A8/W4A4 where it has them, its
GEMM accumulation and its attention kernel family, decode path), against the trainer, on the
shared tokens. GPUs whose emulation is identical (H100 and H200, B200 and B300: same
architecture, same kernels) are computed once and reported under both names.

Fleet: the study's mixed samplers (mismatch.fleets, the `mixed` fleet: B200 and B300 NVFP4, H100
and H200 FP8 and BF16, A100 and RTX PRO 6000 BF16, every group with an FP8 KV cache). Each
group's KL is reported, and the capacity-weighted mean over groups: the KL of the fleet's token
stream when a router sends each group its share of requests. Equal shares are the default (the
study does not publish its shares as numbers); `--fleet-shares` sets them.

These configurations are the most expensive to emulate (each replays the decode path), so they
run on the first `--subset-prompts` prompts; the headline runs on all.
"""

from __future__ import annotations

import math

from mismatch.fleets import fleet_groups
from mismatch.profiles import GPUS, ProfileError, resolve

from .base import Batch, SourceResult, Variant
from .context import ProbeContext
from .source_figures import AcceleratorFigures, FleetWeighted
from .tally import Tally


class AcceleratorProbe:
    name = "accelerator"

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.gpus: dict[str, Variant] = {}
        self.cannot: dict[str, str] = {}
        for gpu in GPUS:
            try:
                spec = ctx.as_sampler(resolve(gpu, ctx.spec.dtype, ctx.spec.kv_cache))
            except ProfileError as exc:
                self.cannot[gpu] = str(exc).split(";")[0]
                continue
            self.gpus[gpu] = Variant(spec=spec, attention=True, path="decode")
        self.groups = fleet_groups(ctx.cfg.fleet_shares)
        self.fleet = {f"{g}-{d}": Variant(spec=ctx.as_sampler(resolve(g, d, "fp8")),
                                          attention=True, path="decode")
                      for g, d, _ in self.groups}
        self.tallies = {f"gpu {k}": Tally() for k in self.gpus}
        self.tallies.update({f"fleet {k}": Tally() for k in self.fleet})
        from .ladder import checkpoint_on_trainer_gpu

        self.home = Variant(spec=checkpoint_on_trainer_gpu(ctx), attention=True, path="decode")
        self.headline = Tally()
        self.batches_needed: int | None = None  # every batch, extensions included
        self.grid_batches = math.ceil(ctx.cfg.subset_prompts / ctx.cfg.batch_size)

    def on_batch(self, batch: Batch) -> None:
        """The target GPU on every batch; the other GPUs and the fleet on the first
        --subset-prompts."""
        ref = self.ctx.reference
        self.ctx.compare(self.headline, self.home, self.ctx.sampler, batch)
        if batch.index >= self.grid_batches:
            return
        for k, v in self.gpus.items():
            self.ctx.compare(self.tallies[f"gpu {k}"], ref, v, batch)
        for k, v in self.fleet.items():
            self.ctx.compare(self.tallies[f"fleet {k}"], ref, v, batch)

    def finish(self) -> SourceResult:
        seed = self.ctx.cfg.seed
        parts = {name: t.summary(seed) for name, t in self.tallies.items()}
        shares = {f"{g}-{d}": s for g, d, s in self.groups}
        weighted = {key: sum(shares[g] * parts[f"fleet {g}"].figure(key) for g in shares)
                    for key in ("kl_exact", "kl_k3", "abs_logprob_diff_mean",
                                "mis_masked_fraction")}
        # the fleet's interval: share-weighted sums of per-group bounds (groups are sampled on
        # the same prompts, so their errors are positively correlated; this is conservative)
        for key in ("kl_exact_ci95", "kl_k3_ci95"):
            weighted[key] = [sum(shares[g] * parts[f"fleet {g}"].figure(key)[i] for g in shares)
                             for i in (0, 1)]
        target = self.headline.summary(seed)
        by_gpu = {g: parts[f"gpu {g}"].kl_exact for g in self.gpus}
        notes = [f"Headline: the {self.ctx.spec.dtype} checkpoint served on the trainer's GPU "
                 f"({self.ctx.cfg.trainer_gpu}: {self.home.spec.kernel_path}) against the same "
                 f"checkpoint on {self.ctx.spec.gpu} ({self.ctx.spec.kernel_path}). "
                 f"Per GPU: the checkpoint as each GPU serves it "
                 f"(KV {self.ctx.spec.kv_cache}) against the trainer. Fleet: the "
                 f"study's eight groups with FP8 KV caches, "
                 + ("equal shares (the study's per-group shares are not published as numbers)."
                    if not self.ctx.cfg.fleet_shares else "shares from --fleet-shares."),
                 f"Headline on all {self.headline.tokens} completion tokens; the per-GPU and "
                 f"fleet rows on the first {self.tallies[f'gpu {self.ctx.spec.gpu}'].tokens} "
                 f"(--subset-prompts {self.ctx.cfg.subset_prompts})."]
        if self.cannot:
            notes.append("Cannot serve this checkpoint: " + "; ".join(
                f"{g} ({why})" for g, why in self.cannot.items()))
        figures = AcceleratorFigures(
            kl_exact_by_gpu=by_gpu, fleet_shares=shares,
            fleet_weighted=FleetWeighted(**weighted), cannot_serve=self.cannot,
            kernel_path_by_gpu={g: v.spec.kernel_path for g, v in self.gpus.items()})
        return SourceResult(name=self.name, headline=target, parts=parts,
                            extra=figures.to_json(),
                            notes=notes,
                            log_ratio=self.headline.log_ratio())
