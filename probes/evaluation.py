"""A variant's view of a batch's shared tokens, computed once per batch and cached by
`Variant.key()`: teacher-forced (whole batch, or each sequence alone; reference or
transformer-engine linears; optional MoE routing replay), replayed through the KV-cache decode
path, or decoded in two turns with the second prefilled again."""

from __future__ import annotations

from typing import Callable

import torch

from mismatch.profiles import NumericsSpec
from mismatch.records import Rollout

from .base import Batch, Evaluation, Variant, pad_width
from .generation import generate
from .models import ModelPair

__all__ = ["Evaluator"]


class Evaluator:
    """Evaluations of `pair`'s variants on batches of completions `width` tokens wide.

    params: the sampling parameters the decode-path replays run with (the run's seed);
    scales: a variant's static activation scales (calibrated once, by the context)."""

    def __init__(self, pair: ModelPair, width: int, params,
                 scales: Callable[[NumericsSpec], dict]) -> None:
        self.pair = pair
        self.width = width
        self.params = params
        self.scales = scales

    def completion(self, rollout: Rollout, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → the completion positions [B, W, ...]."""
        return pad_width(x[:, rollout.prompt_width:], self.width)

    def from_decode(self, rollout: Rollout) -> Evaluation:
        """The sampler's own view of the tokens it decoded."""
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
            replayed = generate(self.pair, variant, batch.prompts, self.params,
                                self.scales(variant.spec),
                                forced=ro.token_ids[:, ro.prompt_width:])
            return self.from_decode(replayed)
        spec = variant.spec
        model = self.pair.model(spec.compute_dtype)
        if variant.linears != "torch":
            return self._transformer_engine(model, variant, ro)
        replay = ro.routed_experts if variant.replay else None
        if variant.replay and replay is None:
            raise ValueError("routing replay needs a MoE sampler rollout with recorded routing")
        with apply_numerics(model, spec, self.scales(spec), kernels=variant.attention), \
                router_numerics(model, spec.router_dtype, replay=replay):
            if not variant.alone:
                s = score(model, ro, with_routing=self.pair.is_moe, full_from=ro.prompt_width)
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
        from mismatch.engines.numerics import apply_numerics
        from mismatch.engines.requests import Request

        ro = batch.rollout
        pw = ro.prompt_width
        spec = variant.spec
        model = self.pair.model(spec.compute_dtype)
        params = self.params
        done = [ro.token_ids[i, pw:][ro.completion_mask[i, pw:] > 0].tolist()
                for i in range(len(batch.prompts))]
        cuts = [len(t) // 2 for t in done]
        engine = Engine(model, pad_id=self.pair.pad_id, eos_ids=self.pair.eos_ids,
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
