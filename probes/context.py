"""The run context of `mismatch probe`: what every probe of one run shares.

It composes the model pair and its numerics (models.py), sampling (generation.py) and the
variants' evaluations (evaluation.py) with the run's prompts, checked against the model's
context length, and its batches. Each batch's shared tokens are the target sampler's rollout
(`sample_batch`: emulated, or on the local GPU when measured); a variant's view of them is the
evaluator's, computed once per batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from mismatch.profiles import NumericsSpec
from mismatch.records import Rollout

from .base import Batch, Evaluation, Variant
from .evaluation import Evaluator
from .generation import generate, generate_measured
from .models import ModelPair
from .tally import Tally

if TYPE_CHECKING:
    from mismatch.probes.config import ProbeConfig

__all__ = ["ProbeContext"]

CALIBRATION_PROMPTS = 8
"""Static activation scales are calibrated on the run's first 8 prompts."""


class ProbeContext:
    """The shared state of one `mismatch probe` run: config, model pair, prompts and batches,
    the target sampler and the trainer.

    measured: the target sampler runs on the local GPU, which is `cfg.gpu` (the caller checked
    it); else it is emulated. seed_per_batch: batch i samples with seed `cfg.seed + i` (the
    source probes); False: every batch with `cfg.seed` (the quick probe's figures)."""

    def __init__(self, cfg: "ProbeConfig",
                 progress: Callable[[str, int, int], None] | None = None, *,
                 measured: bool = False, seed_per_batch: bool = True) -> None:
        from mismatch.probes.errors import ProbeError
        from mismatch.zoo.prompts import load_prompts

        self.cfg = cfg
        self.pair = pair = ModelPair(cfg.model, sampler=cfg.sampler_numerics,
                                     trainer=cfg.trainer_numerics, threads=cfg.threads)
        self.spec, self.trainer = pair.sampler, pair.trainer
        self.tokenizer, self.model_dir = pair.tokenizer, pair.model_dir
        self.threads = pair.threads
        """torch intra-op threads the run should hold (None: torch's default); the runner holds
        them with mismatch.runtime.torch_threads."""
        self.is_moe, self.pad_id, self.eos_ids = pair.is_moe, pair.pad_id, pair.eos_ids
        self._progress = progress
        self.prompts = load_prompts(self.tokenizer, cfg.prompts, cfg.n_prompts)
        limit = pair.context_limit
        longest = max(len(p) for p in self.prompts)
        if limit is not None and longest + cfg.max_new_tokens > limit:
            raise ProbeError(f"a prompt of {longest} tokens plus --max-new-tokens "
                             f"{cfg.max_new_tokens} exceeds the model's context of {limit}; "
                             f"shorten the prompts or lower --max-new-tokens")
        self.width = cfg.max_new_tokens
        self.batches = [self.prompts[i:i + cfg.batch_size]
                        for i in range(0, len(self.prompts), cfg.batch_size)]
        self.measured = measured
        self.mode = "measured" if measured else "emulated"
        self._seed_per_batch = seed_per_batch
        self.sampler = Variant(spec=self.spec, attention=True, path="decode")
        self.reference = Variant(spec=self.trainer, linears=cfg.trainer_kernels)
        self.evaluator = Evaluator(pair, self.width, self.sampling_params(), self.scales)

    def as_sampler(self, spec: NumericsSpec) -> NumericsSpec:
        """`spec` with the sampler side's LM head (ModelPair.as_sampler)."""
        return self.pair.as_sampler(spec)

    def lm_heads(self) -> dict[str, str] | None:
        """The LM head's precision on each side, where one of them is FP32 (else None)."""
        return self.pair.lm_heads()

    # ----------------------------------------------------------------------------- resources

    def extend_prompts(self, n: int) -> int:
        """Draw up to `n` more held-out prompts (never past --max-prompts) as new batches;
        returns how many were added (0 for a user's prompt file, which has no more)."""
        from mismatch.zoo.prompts import load_prompts

        n = min(n, self.cfg.max_prompts - len(self.prompts))
        if self.cfg.prompts is not None or n <= 0:
            return 0
        more = load_prompts(self.tokenizer, None, n, start=len(self.prompts))
        limit = self.pair.context_limit
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
        return self.pair.model(compute_dtype)

    def scales(self, spec: NumericsSpec) -> dict:
        """Static activation scales of `spec`, calibrated once on the first 8 prompts."""
        return self.pair.scales(spec, self.prompts[:CALIBRATION_PROMPTS])

    def sampling_params(self, **overrides):
        from mismatch.engines.logits import SamplingParams

        base = dict(max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                    seed=self.cfg.seed)
        base.update(overrides)
        return SamplingParams(**base)

    # ----------------------------------------------------------------------------- running

    def generate(self, variant: Variant, prompts: list[list[int]], *, params=None,
                 forced: torch.Tensor | None = None, seed_offset: int = 0) -> Rollout:
        """Sample (or, with `forced`, replay) completions under `variant` (decode path); the
        target sampler on the local GPU when the run is measured."""
        if params is None:
            params = self.sampling_params(seed=self.cfg.seed + seed_offset)
        if self.measured and variant == self.sampler and forced is None:
            return generate_measured(self.pair, prompts, params, self.scales(self.spec))
        return generate(self.pair, variant, prompts, params, self.scales(variant.spec),
                        forced=forced)

    def sample_batch(self, index: int) -> Batch:
        """Batch `index`: the target sampler's rollout of its prompts (the shared tokens)."""
        prompts = self.batches[index]
        rollout = self.generate(self.sampler, prompts,
                                seed_offset=index if self._seed_per_batch else 0)
        batch = Batch(index=index, prompts=prompts, rollout=rollout,
                      mask=self.completion(rollout, rollout.completion_mask))
        batch.cache[self.sampler.key()] = self.evaluator.from_decode(rollout)
        return batch

    def completion(self, rollout: Rollout, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → the completion positions [B, W, ...]."""
        return self.evaluator.completion(rollout, x)

    def evaluate(self, variant: Variant, batch: Batch) -> Evaluation:
        """`variant`'s view of `batch`'s tokens (cached per batch)."""
        return self.evaluator.evaluate(variant, batch)

    def compare(self, tally: Tally, reference: Variant, other: Variant, batch: Batch) -> None:
        """Add `batch`'s tokens to `tally` as `reference` (π) against `other` (μ)."""
        tally.add(self.evaluate(reference, batch), self.evaluate(other, batch), batch.mask)
