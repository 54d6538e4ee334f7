"""What one probe run is: the sampler's GPU and precision, the model, the prompts, the lengths.

`ProbeConfig` is shared by the quick probe (`mismatch.app.probe`) and the source probes
(`mismatch.probes.runner`). It holds what the run shares and composes the options of the source
probes that take any, each checked in its own config here: `sampling` (SamplingConfig),
`staleness` (StalenessConfig) and `retokenization` (RetokenizationConfig); each probe's module
re-exports its own. Nothing here imports torch, so the command line reads these names (and
`LM_HEAD_SIDES`) without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from mismatch.engines.te import TRAINER_KERNELS
from mismatch.profiles import LM_HEADS, NumericsSpec, resolve, trainer_spec

from .errors import ProbeError

__all__ = ["ProbeConfig", "LM_HEAD_SIDES", "SamplingConfig", "StalenessConfig",
           "RetokenizationConfig"]

LM_HEAD_SIDES = ("trainer", "sampler", "both")
"""Where a probe's `lm_head` applies (`--lm-head-side`): the trainer side, the sampler's, or
both."""


# the options of the source probes that take any (each probe module re-exports its own)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """What the sampling probe samples with."""

    top_p: float = 0.9
    """Nucleus mass of the probe's sampler (1: the full distribution, raw = processed)."""

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ProbeError(f"the sampling probe's top-p must be in (0, 1], got {self.top_p}; "
                             f"pass --top-p 0.9 for a typical nucleus or 1 for none")


@dataclass(frozen=True, kw_only=True)
class StalenessConfig:
    """What the staleness probe measures."""

    max_lag: int = 8
    """Largest staleness (optimizer steps behind the trainer) measured."""
    lr: float = 1e-4
    """AdamW learning rate of the generated policy-gradient steps."""
    checkpoints: Path | None = None
    """A directory of the user's checkpoints in training order (replaces the generated steps)."""

    def __post_init__(self) -> None:
        if self.max_lag < 1:
            raise ProbeError(f"the staleness probe's largest lag must be >= 1, got "
                             f"{self.max_lag}; pass --staleness-max-lag 8 for the study's range")
        if not self.lr > 0:
            raise ProbeError(f"the staleness probe's learning rate must be > 0, got {self.lr}; "
                             f"pass --staleness-lr 1e-4 (the default)")


@dataclass(frozen=True, kw_only=True)
class RetokenizationConfig:
    """How many episodes the multi-turn measurement drives, and how long."""

    episodes: int = 32
    """Conversations driven with the target sampler (held-out zoo tasks)."""
    questions: int = 2
    """Zoo tasks per conversation: the user asks the next one once an episode ends (one: the
    RL environment's single-question episodes, where nothing but a nudge is a user message)."""
    max_turns: int = 4
    """Assistant turns per question at most (a calc call then a submit solve most tasks)."""
    turn_tokens: int = 64
    """Token cap of one assistant turn (the longest gold turn of the zoo tasks is 55 tokens)."""
    examples: int = 2
    """Changed sequences, and changed episodes, shown as text."""

    def __post_init__(self) -> None:
        if min(self.episodes, self.questions, self.max_turns, self.turn_tokens) < 1 \
                or self.examples < 0:
            raise ProbeError(f"the retokenization probe's episodes, questions, max_turns and "
                             f"turn_tokens must be >= 1 and examples >= 0, got {self.episodes}, "
                             f"{self.questions}, {self.max_turns}, {self.turn_tokens}, "
                             f"{self.examples}; leave them at their defaults (32, 2, 4, 64, 2) "
                             f"unless you size a test")


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
    """Trainer-side dtype ("bf16" | "fp16" | "fp32"; FP32 is a reference, for the quick probe)."""
    lm_head: str = "compute"
    """The LM head's precision ("compute": the side's compute dtype, or "fp32"), on the side(s)
    `lm_head_side` names (mismatch.engines.head)."""
    lm_head_side: str = "both"
    """Where `lm_head` applies: "trainer", "sampler" or "both"."""
    fp32_reference: bool = False
    """The quick probe also scores the tokens with an FP32 model and reports each side against
    it (`references` in results.json)."""
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
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """The sampling probe's options."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """The staleness probe's options."""
    retokenization: RetokenizationConfig = field(default_factory=RetokenizationConfig)
    """The retokenization probe's multi-turn sizes (no CLI options: the defaults)."""
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
        if self.subset_prompts < 1:
            raise ProbeError(f"--subset-prompts must be >= 1, got {self.subset_prompts}")
        if not 0 <= self.ci_target < 1 or self.max_prompts < self.n_prompts:
            raise ProbeError("--ci-target must be in [0, 1) and --max-prompts >= --n-prompts")
        if self.lm_head not in LM_HEADS:
            raise ProbeError(f"--lm-head must be {' or '.join(LM_HEADS)}, got {self.lm_head!r}")
        if self.lm_head_side not in LM_HEAD_SIDES:
            raise ProbeError(f"--lm-head-side must be {', '.join(LM_HEAD_SIDES[:-1])} or "
                             f"{LM_HEAD_SIDES[-1]}, got {self.lm_head_side!r}")
        if self.fp32_reference and (self.sources or self.ladder):
            raise ProbeError("--fp32-reference is a column of the quick probe; run it without "
                             "--sources and --ladder")
        if self.trainer_dtype == "fp32" and (self.sources or self.ladder):
            raise ProbeError("--trainer-dtype fp32 is a reference for the quick probe; the "
                             "source probes (--sources, --ladder) run a bf16 or fp16 trainer")
        if self.trainer_kernels not in TRAINER_KERNELS:
            raise ProbeError(f"unknown --trainer-kernels {self.trainer_kernels!r}; valid: "
                             f"{', '.join(TRAINER_KERNELS)}")

    @cached_property
    def sampler_numerics(self) -> NumericsSpec:
        """The sampler's configuration: `gpu` × `dtype` × `kv_cache` with its side's LM head,
        resolved once per config (ProfileError for an unknown or impossible combination)."""
        return replace(resolve(self.gpu, self.dtype, self.kv_cache),
                       lm_head=self.head_on("sampler"))

    @cached_property
    def trainer_numerics(self) -> NumericsSpec:
        """The trainer's configuration (`trainer_dtype`, its side's LM head), resolved once."""
        return trainer_spec(self.trainer_dtype, self.head_on("trainer"))

    @cached_property
    def trainer_gpu_numerics(self) -> NumericsSpec | None:
        """`trainer_dtype` served on `trainer_gpu` (the ladder's first rungs), resolved once;
        None for the FP32 reference, which no GPU serves."""
        if self.trainer_dtype == "fp32":
            return None
        return resolve(self.trainer_gpu, self.trainer_dtype)

    def head_on(self, side: str) -> str:
        """The LM head's precision on `side` ("trainer" | "sampler")."""
        return self.lm_head if self.lm_head_side in (side, "both") else "compute"
