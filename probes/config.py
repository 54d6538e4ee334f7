"""What one probe run is: the sampler's GPU and precision, the model, the prompts, the lengths.

`ProbeConfig` is shared by the quick probe (`mismatch.app.probe`) and the source probes
(`mismatch.probes.runner`); `ProbeError` is their one exception for bad input (the CLI turns it
into a one-line error).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProbeConfig", "ProbeError"]


class ProbeError(ValueError):
    """Bad probe input (prompt file, lengths, model); the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """One probe run."""

    gpu: str
    """Sampler GPU profile (mismatch.profiles.GPUS)."""
    dtype: str
    """Sampler serving precision (mismatch.profiles.DTYPES)."""
    kv_cache: str | None = None
    """KV-cache storage ("bf16" | "fp8"; default: the compute dtype)."""
    trainer_dtype: str = "bf16"
    """Trainer-side dtype ("bf16" | "fp16")."""
    model: Path | None = None
    """Hugging Face model directory (None: the embedded model)."""
    prompts: Path | None = None
    """JSONL prompt file (None: the shipped held-out tool-use prompts)."""
    n_prompts: int = 512
    """Prompts to sample from."""
    max_new_tokens: int = 48
    """Completion length cap."""
    batch_size: int = 16
    """Sequences per generation batch."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Seed of prompt choice and sampling."""
    threads: int | None = None
    """torch intra-op threads (None: 1 for models under 50M parameters, whose many small ops
    only lose to thread synchronization, else torch's default)."""
    sources: tuple[str, ...] = ()
    """Source probes to run (probes.SOURCES); empty: the quick total/precision/accelerator probe."""
    ladder: bool = False
    """Also add the sources one at a time (kernels → + precision → + accelerator)."""
    trainer_gpu: str = "b200"
    """The trainer's GPU (the study trains on B200): the ladder's first rungs run there."""
    subset_prompts: int = 128
    """Prompts for the per-GPU, fleet and sampling configurations (the expensive ones)."""
    fleet_shares: tuple[tuple[str, float], ...] = ()
    """Capacity shares of the fleet's groups ("gpu-dtype", share); empty: equal shares."""
    top_p: float = 0.9
    """Top-p of the sampling probe's sampler."""
    staleness_max_lag: int = 8
    """Largest staleness (optimizer steps behind) the staleness probe measures."""
    staleness_lr: float = 1e-4
    """AdamW learning rate of the staleness probe's policy-gradient steps."""
    staleness_checkpoints: Path | None = None
    """A directory of the user's checkpoints in training order (replaces the generated steps)."""
    ci_target: float = 0.0
    """Keep drawing held-out prompts until every headline KL's 95% half-width is under this
    fraction of its value (0: off; the study's target is 0.2)."""
    max_prompts: int = 4096
    """Cap on prompts drawn for --ci-target."""
    emulate: bool = False
    """Emulate `gpu` even on a CUDA machine whose GPU is another one (else that is an error)."""
    trainer_kernels: str = "torch"
    """What the trainer side's linear layers run on (mismatch.engines.te.TRAINER_KERNELS):
    the reference GEMM model, or transformer-engine (CUDA only) in BF16 or a TE recipe."""

    def __post_init__(self) -> None:
        if self.n_prompts < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise ProbeError("--n-prompts, --batch-size and --max-new-tokens must be >= 1")
        if self.subset_prompts < 1 or self.staleness_max_lag < 1 or not 0 < self.top_p <= 1:
            raise ProbeError("--subset-prompts and --staleness-max-lag must be >= 1 and "
                             "--top-p in (0, 1]")
        if self.staleness_lr <= 0:
            raise ProbeError("--staleness-lr must be > 0")
        if not 0 <= self.ci_target < 1 or self.max_prompts < self.n_prompts:
            raise ProbeError("--ci-target must be in [0, 1) and --max-prompts >= --n-prompts")
        from mismatch.engines.te import TRAINER_KERNELS

        if self.trainer_kernels not in TRAINER_KERNELS:
            raise ProbeError(f"unknown --trainer-kernels {self.trainer_kernels!r}; valid: "
                             f"{', '.join(TRAINER_KERNELS)}")
