"""The run context of `mismatch probe`: what every probe of one run shares, and how a variant's
view of a batch is computed.

It loads the tokenizer and the prompts (checked against the model's context length), the model
once per compute dtype, the EOS ids, and the static activation scales once per format
(calibrated on the first 8 prompts). Each batch's shared tokens are the target sampler's rollout
(`sample_batch`: emulated, or on the local GPU when measured); a variant's evaluation of them is
computed once per batch and cached by `Variant.key()`: teacher-forced (whole batch, or each
sequence alone; reference or transformer-engine linears; optional MoE routing replay), replayed
through the KV-cache decode path, or decoded in two turns with the second prefilled again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch

from mismatch.profiles import NumericsSpec, resolve, trainer_spec
from mismatch.runtime import default_threads
from mismatch.records import Rollout

from .base import TORCH_DTYPES, Batch, Evaluation, Variant, pad_width
from .tally import Tally

if TYPE_CHECKING:
    from mismatch.probes.config import ProbeConfig

__all__ = ["ProbeContext"]



def _sampler_numerics(model: torch.nn.Module, spec: NumericsSpec, scales: dict):
    """The numerics a measured sampler runs on the local GPU (model already on CUDA): none for
    BF16/FP16 (the GPU's own kernels; an FP8 KV cache stored as such), torch._scaled_mm for FP8
    W8A8 where the GPU has FP8 tensor cores, else the formats through the emulator's GEMMs and
    the Triton kernels on the GPU; attention is torch SDPA."""
    import contextlib

    from mismatch.engines.hf_attention import fp8_kv_cache
    from mismatch.engines.numerics import apply_numerics

    if spec.weight_codec is None and spec.activation_codec is None:
        return contextlib.nullcontext() if spec.kv_codec is None else fp8_kv_cache(model)
    return apply_numerics(model, spec, scales, kernels=False,
                          native_fp8=spec.weight_codec == "fp8" and
                          spec.activation_codec == "fp8-act")


class ProbeContext:
    """The shared state of one `mismatch probe` run: config, tokenizer, models, prompts,
    calibration scales, the target sampler and the trainer.

    measured: the target sampler runs on the local GPU, which is `cfg.gpu` (the caller checked
    it); else it is emulated. seed_per_batch: batch i samples with seed `cfg.seed + i` (the
    source probes); False: every batch with `cfg.seed` (the quick probe's figures)."""

    def __init__(self, cfg: "ProbeConfig",
                 progress: Callable[[str, int, int], None] | None = None, *,
                 measured: bool = False, seed_per_batch: bool = True) -> None:
        from transformers import AutoConfig

        from mismatch.probes.errors import ProbeError
        from mismatch.zoo.prompts import eos_ids, load_prompts
        from mismatch.zoo import check_model_dir, load_model, load_tokenizer

        self.cfg = cfg
        self.spec = replace(resolve(cfg.gpu, cfg.dtype, cfg.kv_cache),
                            lm_head=cfg.head_on("sampler"))
        self.trainer = trainer_spec(cfg.trainer_dtype, cfg.head_on("trainer"))
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
        self.threads: int | None = default_threads(trainer_model, cfg.threads)
        """torch intra-op threads the run should hold (None: torch's default); the runner holds
        them with mismatch.runtime.torch_threads."""
        self.is_moe = getattr(config, "num_experts", 0) > 0 or \
            getattr(config, "num_local_experts", 0) > 0
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = eos_ids(self.tokenizer, trainer_model)
        self.width = cfg.max_new_tokens
        self.batches = [self.prompts[i:i + cfg.batch_size]
                        for i in range(0, len(self.prompts), cfg.batch_size)]
        self._scales: dict[tuple, dict] = {}
        self.measured = measured
        self.mode = "measured" if measured else "emulated"
        self._seed_per_batch = seed_per_batch
        self.sampler = Variant(spec=self.spec, attention=True, path="decode")
        self.reference = Variant(spec=self.trainer, linears=cfg.trainer_kernels)

    def as_sampler(self, spec: NumericsSpec) -> NumericsSpec:
        """`spec` (another GPU or format a source probe compares) with the sampler side's LM head
        (`--lm-head`, `--lm-head-side`)."""
        return replace(spec, lm_head=self.spec.lm_head)

    def lm_heads(self) -> dict[str, str] | None:
        """The LM head's precision on each side, where one of them is FP32 (else None)."""
        heads = {"sampler": self.spec.lm_head, "trainer": self.trainer.lm_head}
        return heads if "fp32" in heads.values() else None

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
                self.cfg.model, dtype=TORCH_DTYPES[compute_dtype])
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
        from mismatch.engines.logits import SamplingParams

        base = dict(max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                    seed=self.cfg.seed)
        base.update(overrides)
        return SamplingParams(**base)

    # ----------------------------------------------------------------------------- running

    def generate(self, variant: Variant, prompts: list[list[int]], *, params=None,
                 forced: torch.Tensor | None = None, seed_offset: int = 0) -> Rollout:
        """Sample (or, with `forced`, replay) completions under `variant` (decode path)."""
        from mismatch.engines.numerics import apply_numerics
        from mismatch.engines.generation import generate

        spec = variant.spec
        model = self.model(spec.compute_dtype)
        if params is None:
            params = self.sampling_params(seed=self.cfg.seed + seed_offset)
        if self.measured and variant == self.sampler and forced is None:
            return self._generate_measured(model, prompts, params)
        with apply_numerics(model, spec, self.scales(spec), kernels=variant.attention):
            return generate(model, prompts, params, pad_id=self.pad_id, eos_ids=self.eos_ids,
                            label=spec.label, mode="emulated", with_routing=self.is_moe,
                            forced=forced, keep_full=True)

    def _generate_measured(self, model: torch.nn.Module, prompts: list[list[int]],
                           params) -> Rollout:
        """The target sampler on the local GPU (the model visits CUDA for the call)."""
        from mismatch.engines.generation import generate

        scales = self.scales(self.spec)  # calibrated on CPU, as for the emulated sampler
        model.cuda()
        try:
            with _sampler_numerics(model, self.spec, scales):
                return generate(model, prompts, params, pad_id=self.pad_id,
                                eos_ids=self.eos_ids, label=self.spec.label, mode="measured",
                                with_routing=self.is_moe, keep_full=True)
        finally:
            model.cpu()

    def sample_batch(self, index: int) -> Batch:
        """Batch `index`: the target sampler's rollout of its prompts (the shared tokens)."""
        prompts = self.batches[index]
        rollout = self.generate(self.sampler, prompts,
                                seed_offset=index if self._seed_per_batch else 0)
        batch = Batch(index=index, prompts=prompts, rollout=rollout,
                      mask=self.completion(rollout, rollout.completion_mask))
        batch.cache[self.sampler.key()] = self._from_decode(rollout)
        return batch

    def completion(self, rollout: Rollout, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → the completion positions [B, W, ...]."""
        return pad_width(x[:, rollout.prompt_width:], self.width)

    def _from_decode(self, rollout: Rollout) -> Evaluation:
        return Evaluation(logprobs=self.completion(rollout, rollout.sampler_logprobs),
                          full=pad_width(rollout.full_logprobs, self.width),
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
        if variant.linears != "torch":
            return self._transformer_engine(model, variant, ro)
        replay = ro.routed_experts if variant.replay else None
        if variant.replay and replay is None:
            raise ValueError("routing replay needs a MoE sampler rollout with recorded routing")
        with apply_numerics(model, spec, self.scales(spec), kernels=variant.attention), \
                router_numerics(model, spec.router_dtype, replay=replay):
            if not variant.alone:
                s = score(model, ro, with_routing=self.is_moe,
                          full_from=ro.prompt_width)
                return Evaluation(logprobs=self.completion(ro, s.logprobs),
                                  full=pad_width(s.full_logprobs, self.width),
                                  routing=s.routed_experts)
            return self._alone(model, ro)

    def _transformer_engine(self, model: torch.nn.Module, variant: Variant,
                            ro: Rollout) -> Evaluation:
        """Teacher-forced scores with transformer-engine's linear layers on the local GPU (the
        model visits CUDA for the call)."""
        from mismatch.engines.scorer import score
        from mismatch.engines.te import te_linears

        if variant.alone or variant.replay:
            raise ValueError("transformer-engine linears score batches as sampled, without "
                             "replay")
        model.cuda()
        try:
            with te_linears(model, variant.linears):
                s = score(model, ro, with_routing=False, full_from=ro.prompt_width)
        finally:
            model.cpu()
        return Evaluation(logprobs=self.completion(ro, s.logprobs.cpu()),
                          full=pad_width(s.full_logprobs.cpu(), self.width))

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
        return Evaluation(logprobs=pad_width(lp, self.width), full=pad_width(full, self.width))

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
        return Evaluation(logprobs=self.completion(ro, lp), full=pad_width(full, self.width))

    def compare(self, tally: Tally, reference: Variant, other: Variant, batch: Batch) -> None:
        """Add `batch`'s tokens to `tally` as `reference` (π) against `other` (μ)."""
        tally.add(self.evaluate(reference, batch), self.evaluate(other, batch), batch.mask)

