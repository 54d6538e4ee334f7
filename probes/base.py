"""What every source probe shares: the run context, configurations (variants), evaluation of one
batch of sampled tokens under a variant, and tallies that compare two variants token by token.

A probe changes exactly one factor between two configurations and scores the *same* tokens under
both. The tokens come from the target sampler (the `--gpu/--dtype` configuration, KV-cache decode
path, its kernel family), one rollout per batch, shared by all probes; every other variant either
re-scores them teacher-forced (`path="teacher"`) or replays them through the KV-cache decode path
(`path="decode"`, tokens fed instead of sampled). Evaluations are cached per batch by numerics, so
two probes that need the same configuration (or two GPUs that compute alike, such as H100 and
H200) pay for it once.

Every comparison reports, besides the token-level estimators of mismatch/metrics.py, the exact
full-vocabulary KL(μ‖π) at each sampled position (`kl_exact`): it needs no sampling of the
compared distributions, so its spread over positions is far smaller than k3's and its 95%
interval (a bootstrap over whole sequences: tokens of a sequence are correlated) is the one the
ladder and the bars are drawn with (scipy's BCa bootstrap). Direction: `reference` plays the trainer π, `other` the
sampler μ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Literal

import torch

from mismatch.metrics import bootstrap_ci, divergence_summary, exact_kl, log_ratio
from mismatch.profiles import NumericsSpec, resolve, trainer_spec
from mismatch.records import Rollout

if TYPE_CHECKING:
    from mismatch.probes.config import ProbeConfig

__all__ = ["Variant", "Evaluation", "Batch", "ProbeContext", "PairedProbe", "Tally",
           "SourceResult",
           "SUMMARY_KEYS", "NOISE_FLOOR", "CI_REL_TARGET"]

SUMMARY_KEYS = ("kl_k3", "kl_k1", "kl_k2", "abs_logprob_diff_mean", "abs_logprob_diff_p99",
                "abs_logprob_diff_max", "token_multiplicative_error", "mis_masked_fraction",
                "ratio_mean", "ess")
NOISE_FLOOR = 1e-7
"""nats/token: exact KL below this is at the resolution of FP32 log-probs on these models; the
interval target does not apply there."""
CI_REL_TARGET = 0.2
"""A figure above the noise floor should have a 95% half-width under 20% of its value."""
_SMALL_MODEL = 50_000_000  # parameters: below this, one intra-op thread is fastest
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One configuration of the model that can score a batch's tokens."""

    spec: NumericsSpec
    """Formats, GEMM accumulation, KV cache, split-K, router precision, attention family."""
    attention: bool = False
    """Run `spec.attention`'s tiled kernel (True) or the reference attention (torch SDPA)."""
    path: Literal["teacher", "decode", "reprefill"] = "teacher"
    """Teacher-forced forward over whole sequences, the sampler's KV-cache decode path, or that
    path with each completion split into two turns at its midpoint and the second turn's
    context prefilled again (a server without prefix caching) instead of kept from decoding."""
    alone: bool = False
    """Score each sequence as a batch of one (teacher path), not with the batch's others."""
    replay: bool = False
    """MoE routing replay: routers forced to the experts the batch's sampler chose."""

    def key(self) -> tuple:
        numerics = self.spec.numerics_key()
        if not self.attention:  # the family does not matter under the reference attention
            numerics = numerics[:5] + ("reference",) + numerics[6:]
        return (numerics, self.attention, self.path, self.alone, self.replay)


@dataclass
class Evaluation:
    """What one variant says about one batch's completion positions."""

    logprobs: torch.Tensor
    """[B, W] float32 log-probs of the sampled tokens (0 past each completion)."""
    full: torch.Tensor
    """[B, W, V] float32 whole log-softmax at each completion position."""
    routing: torch.Tensor | None = None
    """[B, T, L, k] experts per MoE layer over the whole sequence (-1: not recorded)."""


@dataclass
class Batch:
    """One batch of prompts, the target sampler's rollout of them, and cached evaluations."""

    index: int
    prompts: list[list[int]]
    rollout: Rollout
    mask: torch.Tensor
    """[B, W] float32 completion mask."""
    cache: dict = field(default_factory=dict, repr=False)


def _pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, n, ...] → [B, width, ...], zero-padded (or cut)."""
    out = torch.zeros((x.shape[0], width) + tuple(x.shape[2:]), dtype=x.dtype)
    n = min(width, x.shape[1])
    out[:, :n] = x[:, :n]
    return out


class ProbeContext:
    """The shared state of one `mismatch probe --sources` run: config, tokenizer, models,
    prompts, calibration scales, the target sampler and the trainer."""

    def __init__(self, cfg: "ProbeConfig",
                 progress: Callable[[str, int, int], None] | None = None) -> None:
        from transformers import AutoConfig

        from mismatch.probes.config import ProbeError
        from mismatch.zoo.prompts import eos_ids, load_prompts
        from mismatch.zoo import check_model_dir, load_model, load_tokenizer

        self.cfg = cfg
        self.spec = resolve(cfg.gpu, cfg.dtype, cfg.kv_cache)
        self.trainer = trainer_spec(cfg.trainer_dtype)
        self._progress = progress
        self.tokenizer = load_tokenizer(cfg.model)
        self.model_dir = check_model_dir(cfg.model, tokenizer=False)
        self.prompts = load_prompts(self.tokenizer, cfg.prompts, cfg.n_prompts)
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        limit = getattr(config, "max_position_embeddings", None)
        self._context_limit = limit
        longest = max(len(p) for p in self.prompts)
        if limit is not None and longest + cfg.max_new_tokens > limit:
            raise ProbeError(f"a prompt of {longest} tokens plus --max-new-tokens "
                             f"{cfg.max_new_tokens} exceeds the model's context of {limit}; "
                             f"shorten the prompts or lower --max-new-tokens")
        self._load_model = load_model
        self._models: dict[str, torch.nn.Module] = {}
        trainer_model = self.model(self.trainer.compute_dtype)
        n_params = sum(p.numel() for p in trainer_model.parameters())
        threads = cfg.threads if cfg.threads is not None else \
            (1 if n_params < _SMALL_MODEL else None)
        if threads is not None:
            torch.set_num_threads(threads)
        self.is_moe = getattr(config, "num_experts", 0) > 0 or \
            getattr(config, "num_local_experts", 0) > 0
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = eos_ids(self.tokenizer, trainer_model)
        self.width = cfg.max_new_tokens
        self.batches = [self.prompts[i:i + cfg.batch_size]
                        for i in range(0, len(self.prompts), cfg.batch_size)]
        self._scales: dict[tuple, dict] = {}
        self.sampler = Variant(spec=self.spec, attention=True, path="decode")
        self.reference = Variant(spec=self.trainer)

    # ----------------------------------------------------------------------------- resources

    def extend_prompts(self, n: int) -> int:
        """Draw up to `n` more held-out prompts (never past --max-prompts) as new batches;
        returns how many were added (0 for a user's prompt file, which has no more)."""
        from mismatch.zoo.prompts import load_prompts

        n = min(n, self.cfg.max_prompts - len(self.prompts))
        if self.cfg.prompts is not None or n <= 0:
            return 0
        more = load_prompts(self.tokenizer, None, n, start=len(self.prompts))
        limit = self._context_limit
        if limit is not None:
            more = [p for p in more if len(p) + self.cfg.max_new_tokens <= limit]
        self.prompts.extend(more)
        bs = self.cfg.batch_size
        self.batches.extend(more[i:i + bs] for i in range(0, len(more), bs))
        return len(more)

    def progress(self, label: str, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(label, done, total)

    def model(self, compute_dtype: str) -> torch.nn.Module:
        """The model in `compute_dtype` ("bf16" | "fp16"), loaded once."""
        if compute_dtype not in self._models:
            self._models[compute_dtype] = self._load_model(
                self.cfg.model, dtype=_TORCH_DTYPES[compute_dtype])
        return self._models[compute_dtype]

    def scales(self, spec: NumericsSpec) -> dict:
        """Static activation scales of `spec`, calibrated once on the first 8 prompts."""
        from mismatch.engines.numerics import calibrate

        key = (spec.compute_dtype, spec.weight_codec, spec.activation_codec)
        if key not in self._scales:
            calib = [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
                     for p in self.prompts[:8]]
            self._scales[key] = calibrate(self.model(spec.compute_dtype), spec, calib)
        return self._scales[key]

    def sampling_params(self, **overrides):
        from mismatch.engines.sampler import SamplingParams

        base = dict(max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                    seed=self.cfg.seed)
        base.update(overrides)
        return SamplingParams(**base)

    # ----------------------------------------------------------------------------- running

    def generate(self, variant: Variant, prompts: list[list[int]], *, params=None,
                 forced: torch.Tensor | None = None, seed_offset: int = 0) -> Rollout:
        """Sample (or, with `forced`, replay) completions under `variant` (decode path)."""
        from mismatch.engines.numerics import apply_numerics
        from mismatch.engines.sampler import generate

        spec = variant.spec
        model = self.model(spec.compute_dtype)
        if params is None:
            params = self.sampling_params(seed=self.cfg.seed + seed_offset)
        with apply_numerics(model, spec, self.scales(spec), kernels=variant.attention):
            return generate(model, prompts, params, pad_id=self.pad_id, eos_ids=self.eos_ids,
                            label=spec.label, mode="emulated", with_routing=self.is_moe,
                            forced=forced, keep_full=True)

    def sample_batch(self, index: int) -> Batch:
        """Batch `index`: the target sampler's rollout of its prompts (the shared tokens)."""
        prompts = self.batches[index]
        rollout = self.generate(self.sampler, prompts, seed_offset=index)
        batch = Batch(index=index, prompts=prompts, rollout=rollout,
                      mask=self.completion(rollout, rollout.completion_mask))
        batch.cache[self.sampler.key()] = self._from_decode(rollout)
        return batch

    def completion(self, rollout: Rollout, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → the completion positions [B, W, ...]."""
        return _pad_width(x[:, rollout.prompt_width:], self.width)

    def _from_decode(self, rollout: Rollout) -> Evaluation:
        return Evaluation(logprobs=self.completion(rollout, rollout.sampler_logprobs),
                          full=_pad_width(rollout.full_logprobs, self.width),
                          routing=rollout.routed_experts)

    def evaluate(self, variant: Variant, batch: Batch) -> Evaluation:
        """`variant`'s view of `batch`'s tokens (cached per batch)."""
        key = variant.key()
        if key not in batch.cache:
            batch.cache[key] = self._evaluate(variant, batch)
        return batch.cache[key]

    @torch.no_grad()
    def _evaluate(self, variant: Variant, batch: Batch) -> Evaluation:
        from mismatch.engines.numerics import apply_numerics
        from mismatch.engines.routing import router_numerics
        from mismatch.engines.scorer import score

        ro = batch.rollout
        if variant.path in ("decode", "reprefill"):
            if variant.alone or variant.replay:
                raise ValueError("the decode path runs batches as sampled, without replay")
            if variant.path == "reprefill":
                return self._reprefill(variant, batch)
            pw = ro.prompt_width
            replayed = self.generate(variant, batch.prompts, forced=ro.token_ids[:, pw:])
            return self._from_decode(replayed)
        spec = variant.spec
        model = self.model(spec.compute_dtype)
        replay = ro.routed_experts if variant.replay else None
        if variant.replay and replay is None:
            raise ValueError("routing replay needs a MoE sampler rollout with recorded routing")
        with apply_numerics(model, spec, self.scales(spec), kernels=variant.attention), \
                router_numerics(model, spec.router_dtype, replay=replay):
            if not variant.alone:
                s = score(model, ro, with_routing=self.is_moe,
                          full_from=ro.prompt_width)
                return Evaluation(logprobs=self.completion(ro, s.logprobs),
                                  full=_pad_width(s.full_logprobs, self.width),
                                  routing=s.routed_experts)
            return self._alone(model, ro)

    def _reprefill(self, variant: Variant, batch: Batch) -> Evaluation:
        """The decode path in two turns: each completion's first half decoded, then its context
        (prompt + first half) prefilled afresh and the second half decoded against that."""
        from mismatch.engines.engine import Engine
        from mismatch.engines.requests import Request
        from mismatch.engines.numerics import apply_numerics

        ro = batch.rollout
        pw = ro.prompt_width
        spec = variant.spec
        model = self.model(spec.compute_dtype)
        params = self.sampling_params()
        done = [ro.token_ids[i, pw:][ro.completion_mask[i, pw:] > 0].tolist()
                for i in range(len(batch.prompts))]
        cuts = [len(t) // 2 for t in done]
        engine = Engine(model, pad_id=self.pad_id, eos_ids=self.eos_ids,
                        slots=len(batch.prompts), with_routing=False)
        with apply_numerics(model, spec, self.scales(spec), kernels=variant.attention):
            first = engine.run([Request(prompt=p, params=params, forced=t[:c], keep_full=True,
                                        tag=i)
                                for i, (p, t, c) in enumerate(zip(batch.prompts, done, cuts))
                                if c > 0])
            second = engine.run([Request(prompt=p + t[:c], params=params, forced=t[c:],
                                         keep_full=True, tag=i)
                                 for i, (p, t, c) in enumerate(zip(batch.prompts, done, cuts))
                                 if t])
        vocab = second[0].full_logprobs.shape[-1]
        n = max(len(t) for t in done)
        lp = torch.zeros(len(done), n)
        full = torch.zeros(len(done), n, vocab)
        for c, turn in [(c, 0) for c in first] + [(c, 1) for c in second]:
            i = c.request.tag
            at = cuts[i] if turn else 0
            lp[i, at:at + len(c.tokens)] = c.logprobs
            full[i, at:at + len(c.tokens)] = c.full_logprobs
        return Evaluation(logprobs=_pad_width(lp, self.width), full=_pad_width(full, self.width))

    def _alone(self, model, ro: Rollout) -> Evaluation:
        """Score each sequence by itself (no padding, no neighbours) and put it back in place."""
        from mismatch.engines.scorer import score

        pw = ro.prompt_width
        b, t = ro.token_ids.shape
        lp = torch.zeros(b, t)
        full = None
        for i in range(b):
            keep = ro.attention_mask[i].bool()
            pos = keep.nonzero()[:, 0]
            start = int((pos < pw).sum())  # where the completion starts in the unpadded row
            if start == pos.numel():  # no completion token
                continue
            sub = Rollout(token_ids=ro.token_ids[i:i + 1, keep],
                          attention_mask=ro.attention_mask[i:i + 1, keep],
                          completion_mask=ro.completion_mask[i:i + 1, keep],
                          sampler_logprobs=ro.sampler_logprobs[i:i + 1, keep],
                          sampler_logprobs_processed=ro.sampler_logprobs_processed[i:i + 1, keep],
                          candidate_ids=ro.candidate_ids[i:i + 1, keep],
                          candidate_logprobs=ro.candidate_logprobs[i:i + 1, keep],
                          sampler=ro.sampler, mode=ro.mode)
            s = score(model, sub, with_routing=False, full_from=start)
            if full is None:
                full = torch.zeros(b, t - pw, s.full_logprobs.shape[-1])
            lp[i, pos] = s.logprobs[0]
            n = s.full_logprobs.shape[1]
            full[i, :n] = s.full_logprobs[0]
        if full is None:
            full = torch.zeros(b, max(t - pw, 1), 1)
        return Evaluation(logprobs=self.completion(ro, lp), full=_pad_width(full, self.width))

    def compare(self, tally: "Tally", reference: Variant, other: Variant, batch: Batch) -> None:
        """Add `batch`'s tokens to `tally` as `reference` (π) against `other` (μ)."""
        tally.add(self.evaluate(reference, batch), self.evaluate(other, batch), batch.mask)


class Tally:
    """Token-level comparison of two configurations, accumulated batch by batch."""

    def __init__(self) -> None:
        self.reference: list[torch.Tensor] = []
        self.other: list[torch.Tensor] = []
        self.mask: list[torch.Tensor] = []
        self.exact: list[torch.Tensor] = []

    def add(self, reference: Evaluation | torch.Tensor, other: Evaluation | torch.Tensor,
            mask: torch.Tensor, exact: torch.Tensor | None = None) -> None:
        """Add [B, W] token log-probs (or Evaluations, which also give exact KL; or pass the
        per-position exact KL [B, W] computed elsewhere as `exact`)."""
        ref_lp = reference.logprobs if isinstance(reference, Evaluation) else reference
        oth_lp = other.logprobs if isinstance(other, Evaluation) else other
        if ref_lp.shape != oth_lp.shape or ref_lp.shape != mask.shape:
            raise ValueError(f"tally shapes differ: {tuple(ref_lp.shape)}, "
                             f"{tuple(oth_lp.shape)}, mask {tuple(mask.shape)}")
        self.reference.append(ref_lp.float())
        self.other.append(oth_lp.float())
        self.mask.append(mask.float())
        if exact is not None:
            self.exact.append(exact.double() * mask.double())
        elif isinstance(reference, Evaluation) and isinstance(other, Evaluation):
            b, w, v = other.full.shape
            kl = exact_kl(other.full.reshape(b * w, v), reference.full.reshape(b * w, v))
            self.exact.append(kl.view(b, w) * mask.double())

    @property
    def tokens(self) -> int:
        return int(sum(float(m.sum()) for m in self.mask))

    def log_ratio(self) -> torch.Tensor:
        """Per-token log π − log μ of every counted token (for histograms)."""
        out = [log_ratio(r, o)[m.bool()] for r, o, m in zip(self.reference, self.other, self.mask)]
        return torch.cat(out).float() if out else torch.zeros(0)

    def summary(self, seed: int = 0, n_boot: int = 1000) -> dict:
        """The SUMMARY_KEYS figures, `tokens`, `kl_exact` and both 95% intervals."""
        if not self.mask or self.tokens == 0:
            raise ValueError("nothing to summarize: no completion tokens were compared")
        r, o, m = torch.cat(self.reference), torch.cat(self.other), torch.cat(self.mask)
        s = {k: float(v) for k, v in divergence_summary(r, o, m).items()}
        out = {k: s[k] for k in SUMMARY_KEYS}
        out["tokens"] = int(s["tokens"])
        lr = log_ratio(r, o).clamp(-20, 20)
        k3 = (torch.expm1(lr) - lr) * m.double()
        per_n = m.double().sum(-1)
        keep = per_n > 0
        out["kl_k3_ci95"] = bootstrap_ci(k3.sum(-1)[keep], per_n[keep], seed, n_boot)
        if self.exact:
            ex = torch.cat(self.exact)
            out["kl_exact"] = float(ex.sum() / m.double().sum())
            out["kl_exact_ci95"] = bootstrap_ci(ex.sum(-1)[keep], per_n[keep], seed, n_boot)
            half = (out["kl_exact_ci95"][1] - out["kl_exact_ci95"][0]) / 2
            out["kl_exact_ci_rel"] = half / out["kl_exact"] if out["kl_exact"] > 0 else 0.0
            out["ci_target_met"] = bool(out["kl_exact"] < NOISE_FLOOR
                                        or out["kl_exact_ci_rel"] < CI_REL_TARGET)
            if not out["ci_target_met"] and math.isfinite(out["kl_exact_ci_rel"]):
                # the half-width shrinks as 1/sqrt(sequences): what the target would take
                out["sequences_for_ci_target"] = int(math.ceil(
                    int(keep.sum()) * (out["kl_exact_ci_rel"] / CI_REL_TARGET) ** 2))
        return out


class PairedProbe:
    """A batch probe made of named (reference, other) variant pairs, each tallied on every
    batch; subclasses set `self.pairs` and `headline_name`, and write `finish()`."""

    name = "paired"
    headline_name = ""

    def __init__(self, ctx: ProbeContext, pairs: dict[str, tuple[Variant, Variant]]) -> None:
        self.ctx = ctx
        self.pairs = pairs
        self.tallies = {name: Tally() for name in pairs}
        self.batches_needed: int | None = None  # every batch, extensions included

    def on_batch(self, batch: Batch) -> None:
        for name, (a, b) in self.pairs.items():
            self.ctx.compare(self.tallies[name], a, b, batch)

    @property
    def headline(self) -> Tally:
        """The comparison whose interval --ci-target watches."""
        return self.tallies[self.headline_name]

    def summaries(self) -> dict[str, dict]:
        return {name: t.summary(self.ctx.cfg.seed) for name, t in self.tallies.items()}


@dataclass
class SourceResult:
    """What one source probe found."""

    name: str
    headline: dict | None
    """Summary (Tally.summary) of the source's main comparison; None where it does not apply."""
    parts: dict[str, dict] = field(default_factory=dict)
    """Sub-factor name → summary."""
    extra: dict = field(default_factory=dict)
    """Source-specific figures (JSON-ready), e.g. routing.flip_rate_any_layer."""
    notes: list[str] = field(default_factory=list)
    """Sentences for the report: what was compared, and why a figure looks as it does."""
    log_ratio: torch.Tensor | None = field(default=None, repr=False)
    """Per-token log-ratios of the main comparison (histogram)."""

    def to_json(self) -> dict:
        out: dict = dict(self.headline or {})
        out["applies"] = self.headline is not None or bool(self.parts) or bool(self.extra)
        out.update(self.extra)
        out["parts"] = self.parts
        out["notes"] = self.notes
        return out


def with_spec(spec: NumericsSpec, **changes) -> NumericsSpec:
    """A copy of `spec` with fields changed (a dataclasses.replace that reads better here)."""
    return replace(spec, **changes)
