"""sampling: top-p support mismatch, and raw vs processed log-prob reporting.

The target sampler draws each token from its top-p set (`--top-p`, default 0.9): the smallest set
of most likely tokens whose mass reaches p, renormalized. The trainer scores the full vocabulary.
On those tokens, per position:

    sampler mass outside      1 − μ(S): what the sampler's truncation cut off
    outside trainer's top-p   whether the sampled token lies outside the trainer's own top-p set
    trainer mass on S         π(S): the trainer's mass on the sampler's set (mask replay
                              renormalizes π over S, so this is what replay keeps)

and three comparisons with the trainer:

    raw           trainer raw log π vs the sampler's raw log μ (temperature 1, full vocabulary):
                  the numerics alone
    processed     trainer raw log π vs the processed log μ_p the sampler drew from (what an
                  engine reports as "processed log-probs", and the true sampling distribution):
                  bias −log μ(S) ≤ −log p per token (−log 0.97 ≈ 0.03 at p = 0.97)
    mask_replay   the trainer renormalized over S (top-p mask replay) vs μ_p: the support
                  mismatch removed

Exact KL per position is computed over the support: KL(μ_p‖π) = E_μp[log μ − log π] − log μ(S),
and with replay + log π(S).
"""

from __future__ import annotations

import math

import torch

from mismatch.engines.logits import process_logits
from mismatch.metrics import exact_kl, second_order

from .base import SourceResult, pad_width
from .config import SamplingConfig  # the probe's options (config.py: no torch)
from .context import ProbeContext
from .source_figures import SamplingFigures
from .tally import Tally

__all__ = ["SamplingConfig", "run"]

_MIN_MASS = 1e-300
"""Floor of π(S) before its log (FP64): keeps log finite when the trainer puts no mass on the
sampler's support."""
_MAX_OUTSIDE_MASS = 1 - 1e-12
"""Cap of π(¬S) in log1p(−π(¬S)): keeps the term finite when π lies wholly outside S."""


def run(ctx: ProbeContext) -> SourceResult:
    from mismatch.engines.numerics import apply_numerics
    from mismatch.engines.scorer import score

    cfg = ctx.cfg
    top_p = cfg.sampling.top_p
    params = ctx.sampling_params(top_p=top_p)  # what the masks below are computed with
    prompts = ctx.prompts[:cfg.subset_prompts]
    batches = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    tallies = {"processed": Tally(), "raw": Tally(), "mask_replay": Tally()}
    outside_sampler, outside_trainer, trainer_mass, bias, n_tok = 0.0, 0.0, 0.0, 0.0, 0
    model = ctx.model(ctx.trainer.compute_dtype)
    for i, batch in enumerate(batches):
        ro = ctx.generate(ctx.sampler, batch,
                          params=ctx.sampling_params(top_p=top_p, seed=cfg.seed + 7919 + i))
        with apply_numerics(model, ctx.trainer, kernels=False):
            s = score(model, ro, with_routing=False, full_from=ro.prompt_width)
        mask = ctx.completion(ro, ro.completion_mask)
        b, w = mask.shape
        mu = pad_width(ro.full_logprobs, w)  # [B, W, V] the sampler's raw log-softmax
        pi = torch.zeros_like(mu)
        n = min(w, s.full_logprobs.shape[1])
        pi[:, :n] = s.full_logprobs[:, :n]
        flat_mu, flat_pi = mu.reshape(b * w, -1), pi.reshape(b * w, -1)
        keep = torch.isfinite(process_logits(flat_mu, params)).view(b, w, -1)  # sampler's S
        keep_t = torch.isfinite(process_logits(flat_pi, params)).view(b, w, -1)  # trainer's
        mu64, pi64 = mu.double(), pi.double()
        mass_s = (mu64.exp() * keep).sum(-1)  # μ(S)
        mass_t = (pi64.exp() * keep).sum(-1)  # π(S)
        tokens = ctx.completion(ro, ro.token_ids)
        sampler_raw = ctx.completion(ro, ro.sampler_logprobs)
        sampler_proc = ctx.completion(ro, ro.sampler_logprobs_processed)
        trainer_lp = ctx.completion(ro, s.logprobs)
        in_trainer = keep_t.gather(-1, tokens[..., None])[..., 0]
        m = mask.bool()
        log_mt = mass_t.clamp_min(_MIN_MASS).log()
        # KL over the support S without cancellation (mismatch.metrics.exact_kl's form): with
        # δ = log μ − log π on S and μ_p = μ renormalized on S, KL(μ_p‖π_S) = a + log1p(b − a),
        # a = E_μp[δ], b = E_μp[e^{−δ} − 1 + δ]; without replay add −log π(S) = −log1p(−π(¬S)).
        neg = torch.tensor(float("-inf"), dtype=torch.float64)
        mu_s = torch.where(keep, mu64, neg)
        p_mu = (mu_s - torch.logsumexp(mu_s, -1, keepdim=True)).exp()
        delta = torch.where(keep, mu64 - pi64, torch.zeros_like(mu64))
        a = (p_mu * delta).sum(-1)
        b2 = (p_mu * second_order(delta)).sum(-1)
        e_replay = a + torch.log1p(b2 - a)  # KL(μ_p‖π_S)
        pi_out = (pi64.exp() * ~keep).sum(-1)
        e_no = e_replay - torch.log1p(-pi_out.clamp(max=_MAX_OUTSIDE_MASS))  # KL(μ_p‖π)
        tallies["processed"].add(trainer_lp, sampler_proc, mask, exact=e_no.clamp_min(0))
        tallies["mask_replay"].add(trainer_lp - log_mt.float(), sampler_proc, mask,
                                   exact=e_replay.clamp_min(0))
        raw_exact = exact_kl(mu.reshape(b * w, -1), pi.reshape(b * w, -1)).view(b, w)
        tallies["raw"].add(trainer_lp, sampler_raw, mask, exact=raw_exact.clamp_min(0))
        outside_sampler += float((1 - mass_s)[m].sum())
        outside_trainer += float((~in_trainer)[m].sum())
        trainer_mass += float(mass_t[m].sum())
        bias += float((sampler_proc - sampler_raw)[m].double().sum())
        n_tok += int(m.sum())
        ctx.progress("sampling", i + 1, len(batches))
    seed = cfg.seed
    parts = {k: t.summary(seed) for k, t in tallies.items()}
    figures = SamplingFigures(
        top_p=top_p,
        sampler_mass_outside=outside_sampler / max(n_tok, 1),
        outside_trainer_top_p_fraction=outside_trainer / max(n_tok, 1),
        trainer_mass_on_support=trainer_mass / max(n_tok, 1),
        processed_minus_raw_mean=bias / max(n_tok, 1),
        bias_bound=-math.log(top_p),
        tokens=n_tok)
    notes = [f"The {ctx.spec.label} sampler drew with top-p {top_p} on the first "
             f"{len(prompts)} prompts; the trainer scored the full vocabulary. Headline: "
             f"`processed` — the trainer's raw log-probs against the distribution the tokens "
             f"were drawn from; `mask_replay` renormalizes the trainer over the same support.",
             f"Processed minus raw log-prob per token: {figures.processed_minus_raw_mean:.4f} "
             f"nats (bound −log p = {figures.bias_bound:.4f}): a trainer that compares its raw "
             f"log-probs with an engine's processed ones sees this as mismatch."]
    return SourceResult(name="sampling", headline=parts["processed"], parts=parts,
                        extra=figures.to_json(), notes=notes,
                        log_ratio=tallies["processed"].log_ratio())

