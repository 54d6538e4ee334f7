"""The model pair of a probe run and its numerics: the sampler's and the trainer's
configurations (resolved once, by the config), the tokenizer, the model loaded once per compute
dtype, the EOS ids, and the static activation scales calibrated once per format."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from mismatch.profiles import NumericsSpec
from mismatch.runtime import default_threads

from .base import TORCH_DTYPES

__all__ = ["ModelPair"]


class ModelPair:
    """The models a probe compares and how each side computes.

    sampler / trainer: the two sides' numerics (ProbeConfig.sampler_numerics /
    trainer_numerics). threads: --threads (None: the default for the trainer model's size)."""

    def __init__(self, model: Path | None, *, sampler: NumericsSpec, trainer: NumericsSpec,
                 threads: int | None = None) -> None:
        from transformers import AutoConfig

        from mismatch.zoo import check_model_dir, load_model, load_tokenizer
        from mismatch.zoo.prompts import eos_ids

        self.path = model
        self.sampler = sampler
        self.trainer = trainer
        self.tokenizer = load_tokenizer(model)
        self.model_dir = check_model_dir(model, tokenizer=False)
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        self.context_limit: int | None = getattr(config, "max_position_embeddings", None)
        self.is_moe = getattr(config, "num_experts", 0) > 0 or \
            getattr(config, "num_local_experts", 0) > 0
        self._load_model = load_model
        self._models: dict[str, torch.nn.Module] = {}
        self._scales: dict[tuple, dict] = {}
        trainer_model = self.model(trainer.compute_dtype)
        self.threads: int | None = default_threads(trainer_model, threads)
        """torch intra-op threads the run should hold (None: torch's default)."""
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.eos_ids = eos_ids(self.tokenizer, trainer_model)

    def model(self, compute_dtype: str) -> torch.nn.Module:
        """The model in `compute_dtype` ("bf16" | "fp16" | "fp32"), loaded once."""
        if compute_dtype not in self._models:
            self._models[compute_dtype] = self._load_model(self.path,
                                                           dtype=TORCH_DTYPES[compute_dtype])
        return self._models[compute_dtype]

    def scales(self, spec: NumericsSpec, calibration: list[list[int]]) -> dict:
        """Static activation scales of `spec`, calibrated once (on `calibration`, the run's
        first prompts, at the first call for `spec`'s formats)."""
        from mismatch.engines.numerics import calibrate

        key = (spec.compute_dtype, spec.weight_codec, spec.activation_codec)
        if key not in self._scales:
            calib = [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
                     for p in calibration]
            self._scales[key] = calibrate(self.model(spec.compute_dtype), spec, calib)
        return self._scales[key]

    def as_sampler(self, spec: NumericsSpec) -> NumericsSpec:
        """`spec` (another GPU or format a source probe compares) with the sampler side's LM head
        (`--lm-head`, `--lm-head-side`)."""
        return replace(spec, lm_head=self.sampler.lm_head)

    def lm_heads(self) -> dict[str, str] | None:
        """The LM head's precision on each side, where one of them is FP32 (else None)."""
        heads = {"sampler": self.sampler.lm_head, "trainer": self.trainer.lm_head}
        return heads if "fp32" in heads.values() else None
