"""kernels: what the sampler's kernels cost at the trainer's own precision.

Both sides compute in the trainer dtype with no quantized format; each sub-factor changes one kernel
habit of the trainer's teacher-forced forward (the reference: whole sequences in one batch,
reference attention, GEMMs with one FP32 sum, router logits in the compute dtype):

    batch        each sequence scored alone vs within its batch of mixed lengths (left padding,
                 other rows in the same GEMMs)
    decode       the KV-cache decode path (prefill of the prompt, then one token per step) vs the
                 teacher-forced pass over the whole sequence
    attention    the target GPU's attention kernel family, teacher-forced: FP32 online softmax
                 over key tiles, P rounded to BF16 before P·V (engines/attention.py)
    split_kv     decoding with that family (split-KV partials merged in FP32) vs decoding with the
                 reference attention
    kv_reuse     KV reuse across turns (prefix caching): each completion split into two turns at
                 its midpoint, the second turn decoding against the first turn's KV as decoding
                 wrote it vs against its context prefilled afresh (a server without prefix
                 caching re-prefills every turn); the target family's attention on both sides
    split_k      GEMMs split 4 ways along K, FP32 partials summed at the end (split-K / stream-K
                 reduction order) — a choice the emulated sampler does not make by default
    router_fp32  MoE router logits in FP32 (as trainers that keep the router in FP32) vs the
                 compute dtype — again not part of the default emulated sampler

    combined     the target GPU's sampler at the trainer precision (decode path, its attention
                 family, batched as sampled) vs the trainer: what kernels alone cost on that GPU

Published magnitude (He et al., "Defeating Nondeterminism in LLM Inference", Thinking Machines
Lab, 2025): KL ~1e-3 between sampler and trainer at the same precision on large models, 0 with
batch-invariant kernels. On a 2M-parameter model with short contexts the figures are far smaller.
"""

from __future__ import annotations

from .base import SourceResult, Variant, with_spec
from .context import ProbeContext
from .paired import PairedProbe


class KernelsProbe(PairedProbe):
    name = "kernels"
    headline_name = "combined"

    def __init__(self, ctx: ProbeContext) -> None:
        t = ctx.trainer
        family = with_spec(t, attention=ctx.spec.attention)
        ref = ctx.reference
        pairs: dict[str, tuple[Variant, Variant]] = {
            "batch": (Variant(spec=t, alone=True), ref),
            "decode": (ref, Variant(spec=t, path="decode")),
            "attention": (ref, Variant(spec=family, attention=True)),
            "split_kv": (Variant(spec=t, path="decode"),
                         Variant(spec=family, attention=True, path="decode")),
            "kv_reuse": (Variant(spec=family, attention=True, path="reprefill"),
                         Variant(spec=family, attention=True, path="decode")),
            "split_k": (ref, Variant(spec=with_spec(t, split_k=4))),
        }
        if ctx.is_moe:
            pairs["router_fp32"] = (ref, Variant(spec=with_spec(t, router_dtype="fp32")))
        pairs["combined"] = (ref, Variant(spec=family, attention=True, path="decode"))
        super().__init__(ctx, pairs)

    def finish(self) -> SourceResult:
        parts = self.summaries()
        combined = parts.pop("combined")
        notes = [f"All at {self.ctx.trainer.dtype.upper()} on both sides; `combined` is the "
                 f"{self.ctx.spec.gpu} sampler's kernels ({self.ctx.spec.attention} attention, "
                 f"decode path, batched) against the trainer's teacher-forced forward.",
                 "`split_k` and `router_fp32` are kernel choices the emulated sampler does not "
                 "make by default: they show what such a kernel would add, and are not in "
                 "`combined`."]
        return SourceResult(name=self.name, headline=combined, parts=parts, notes=notes,
                            log_ratio=self.tallies["combined"].log_ratio())
