"""`mismatch probe`: sample with an emulated (or real) sampler, re-score with the trainer, attribute.

For a (GPU, precision) the probe builds three configurations of the same model on the same
prompts and compares them on the same sampled tokens:

    trainer     BF16 (or --trainer-dtype) teacher-forced forward, reference kernels: GEMMs with
                exact products and FP32 sums rounded once (what a GPU trainer's GEMMs do,
                whatever CPU kernel torch would pick), torch SDPA attention
    precision   teacher-forced, reference kernels, but the sampler's formats: weights decoded
                from their real storage, activations and KV cache quantized as the GPU does
    sampler     the full sampler: KV-cache decode path, the GPU's attention kernel family and
                GEMM accumulation, and the formats

    total        = divergence(trainer, sampler)
    precision    = divergence(trainer, precision)      what the formats alone cost
    accelerator  = divergence(precision, sampler)      what the GPU's kernels add on top

Figures are labeled `emulated` unless the sampler ran on the named GPU itself (`measured`). On a
CUDA machine the local GPU must be the named one (name and compute capability) unless
`emulate` is set; measured samplers run the GPU's own kernels: cuBLAS BF16/FP16 GEMMs and torch
SDPA attention, FP8 W8A8 GEMMs through torch._scaled_mm on GPUs with FP8 tensor cores, and the
Triton fake-quant / accumulation kernels (mismatch.kernels) for the formats torch has no GEMM
for. Without CUDA everything is emulated, as before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .metrics import bootstrap_ci, divergence_summary, log_ratio
from .profiles import NumericsSpec, check_local_gpu, local_gpu, resolve, trainer_spec
from .records import Rollout

__all__ = ["ProbeConfig", "ProbeError", "run_probe", "load_prompts", "SOURCES_REPORTED"]

SOURCES_REPORTED = ("precision", "accelerator")
_KEYS = ("kl_k3", "kl_k1", "kl_k2", "abs_logprob_diff_mean", "abs_logprob_diff_p99",
         "abs_logprob_diff_max", "mis_masked_fraction", "ratio_mean", "ess")


_SMALL_MODEL = 50_000_000  # parameters: below this, one intra-op thread is fastest


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
        from .engines.te import TRAINER_KERNELS

        if self.trainer_kernels not in TRAINER_KERNELS:
            raise ProbeError(f"unknown --trainer-kernels {self.trainer_kernels!r}; valid: "
                             f"{', '.join(TRAINER_KERNELS)}")


def load_prompts(tokenizer, path: Path | None, n: int, *, start: int = 0) -> list[list[int]]:
    """Token-id prompts: the shipped held-out tasks rendered with the chat template (from task
    `start` on), or a JSONL file of {"messages": [...]} (rendered with the template) or
    {"prompt": "text"} lines."""
    if path is None:
        from .zoo.tasks import TOOLS, generate_tasks

        tasks = generate_tasks("heldout", n, start=start)
        return [list(tokenizer.apply_chat_template(t.prompt_messages(), tools=TOOLS,
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)) for t in tasks]
    path = Path(path)
    if not path.is_file():
        raise ProbeError(f"prompt file {path} does not exist")
    prompts: list[list[int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ProbeError(f"{path}:{lineno}: not JSON ({exc.msg}); one object per line") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        else:
            raise ProbeError(f"{path}:{lineno}: need {{\"messages\": [...]}} or "
                             f"{{\"prompt\": \"...\"}}")
        if len(ids) == 0:
            raise ProbeError(f"{path}:{lineno}: the prompt is empty")
        prompts.append(list(ids))
        if len(prompts) == n:
            break
    if not prompts:
        raise ProbeError(f"prompt file {path} holds no prompts")
    return prompts


def _sampler_numerics(model: torch.nn.Module, spec: NumericsSpec, scales: dict):
    """The numerics a measured sampler runs on the local GPU (model already on CUDA): none for
    BF16/FP16 (the GPU's own kernels; an FP8 KV cache stored as such), torch._scaled_mm for FP8
    W8A8 where the GPU has FP8 tensor cores, else the formats through the emulator's GEMMs and
    the Triton kernels on the GPU; attention is torch SDPA."""
    import contextlib

    from .engines.numerics import apply_numerics, fp8_kv_cache

    if spec.weight_codec is None and spec.activation_codec is None:
        return contextlib.nullcontext() if spec.kv_codec is None else fp8_kv_cache(model)
    return apply_numerics(model, spec, scales, kernels=False,
                          native_fp8=spec.weight_codec == "fp8" and
                          spec.activation_codec == "fp8-act")


def _summary(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor,
             seed: int) -> dict:
    s = {k: float(v) for k, v in divergence_summary(reference, other, mask).items()}
    out = {k: s[k] for k in _KEYS}
    out["tokens"] = int(s["tokens"])
    out["kl_k3_ci95"] = list(_bootstrap_ci(reference, other, mask, seed))
    return out


def _bootstrap_ci(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor,
                  seed: int) -> tuple[float, float]:
    """95% interval of mean k3 resampling whole sequences (tokens of a sequence are correlated)."""
    r = log_ratio(reference, other).clamp(-20, 20)
    k3 = (torch.expm1(r) - r) * mask.double()
    per_seq_sum, per_seq_n = k3.sum(-1), mask.double().sum(-1)
    keep = per_seq_n > 0
    lo, hi = bootstrap_ci(per_seq_sum[keep], per_seq_n[keep], seed)
    return lo, hi


@dataclass
class ProbeResult:
    """Everything the probe measured, plus the raw per-token arrays for plots."""

    summary: dict
    log_ratio_total: torch.Tensor = field(repr=False)
    per_position: dict[str, list[float]] = field(repr=False)


def run_probe(cfg: ProbeConfig, progress: Callable[[int, int], None] | None = None) -> ProbeResult:
    """Run the probe; `progress(done, total)` is called after each batch."""
    from .engines.numerics import apply_numerics, calibrate
    from .engines.sampler import SamplingParams, generate
    from .engines.scorer import score
    from .engines.te import check_te
    from .zoo import load_model, load_tokenizer

    spec = resolve(cfg.gpu, cfg.dtype, cfg.kv_cache)
    trainer = trainer_spec(cfg.trainer_dtype)
    measured = check_local_gpu(spec.gpu, local_gpu(), cfg.emulate)
    check_te(cfg.trainer_kernels)
    tokenizer = load_tokenizer(cfg.model)
    prompts = load_prompts(tokenizer, cfg.prompts, cfg.n_prompts)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}
    from transformers import AutoConfig

    from .zoo import check_model_dir

    config = AutoConfig.from_pretrained(check_model_dir(cfg.model, tokenizer=False),
                                        local_files_only=True)
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + cfg.max_new_tokens > limit:
        raise ProbeError(f"a prompt of {longest} tokens plus --max-new-tokens "
                         f"{cfg.max_new_tokens} exceeds the model's context of {limit}; "
                         f"shorten the prompts or lower --max-new-tokens")
    trainer_model = load_model(cfg.model, dtype=torch_dtype[trainer.compute_dtype])
    n_params = sum(p.numel() for p in trainer_model.parameters())
    threads = cfg.threads if cfg.threads is not None else (1 if n_params < _SMALL_MODEL else None)
    if threads is not None:
        torch.set_num_threads(threads)
    sampler_model = trainer_model if spec.compute_dtype == trainer.compute_dtype else \
        load_model(cfg.model, dtype=torch_dtype[spec.compute_dtype])
    mode = "measured" if measured else "emulated"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = _eos_ids(tokenizer, trainer_model)
    calib = [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long)) for p in prompts[:8]]
    scales = calibrate(sampler_model, spec, calib)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            seed=cfg.seed)
    batches = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    rows = {"trainer": [], "precision": [], "sampler": [], "mask": []}
    width = cfg.max_new_tokens
    for i, batch in enumerate(batches):
        if measured:
            sampler_model.cuda()
            try:
                with _sampler_numerics(sampler_model, spec, scales):
                    rollout = generate(sampler_model, batch, params, pad_id=pad_id,
                                       eos_ids=eos, label=spec.label, mode=mode)
            finally:
                sampler_model.cpu()
        else:
            with apply_numerics(sampler_model, spec, scales):
                rollout = generate(sampler_model, batch, params, pad_id=pad_id, eos_ids=eos,
                                   label=spec.label, mode=mode)
        trainer_scores = _trainer_scores(trainer_model, trainer, rollout, cfg.trainer_kernels)
        with apply_numerics(sampler_model, spec, scales, kernels=False):
            precision_scores = score(sampler_model, rollout, with_routing=False)
        completion = _completion_slice(rollout.completion_mask, rollout, width)
        rows["trainer"].append(_completion_slice(trainer_scores.logprobs, rollout, width))
        rows["precision"].append(_completion_slice(precision_scores.logprobs, rollout, width))
        rows["sampler"].append(_completion_slice(rollout.sampler_logprobs, rollout, width))
        rows["mask"].append(completion)
        if progress:
            progress(i + 1, len(batches))
    t, p, s, m = (torch.cat(rows[k]) for k in ("trainer", "precision", "sampler", "mask"))
    summary = {
        "gpu": spec.gpu, "dtype": spec.dtype, "kv_cache": spec.kv_cache,
        "trainer_dtype": trainer.dtype, "trainer_kernels": cfg.trainer_kernels, "mode": mode,
        "model": str(cfg.model) if cfg.model else "embedded",
        "kernel_path": spec.kernel_path, "attention": spec.attention,
        "prompts": len(prompts), "tokens": int(m.sum()),
        "total": _summary(t, s, m, cfg.seed),
        "sources": {"precision": _summary(t, p, m, cfg.seed),
                    "accelerator": _summary(p, s, m, cfg.seed)},
    }
    r = (log_ratio(t, s) * m.double())
    per_pos = {name: _per_position(a, b, m) for name, (a, b) in
               {"total": (t, s), "precision": (t, p), "accelerator": (p, s)}.items()}
    return ProbeResult(summary=summary, log_ratio_total=r[m.bool()].float(), per_position=per_pos)


def _trainer_scores(model: torch.nn.Module, trainer: NumericsSpec, rollout: Rollout,
                    kernels: str):
    """The trainer side's scores: the reference GEMM model on CPU, or transformer-engine's
    linear layers on the local GPU (the model visits CUDA for the call)."""
    from .engines.numerics import apply_numerics
    from .engines.scorer import score
    from .engines.te import te_linears

    if kernels == "torch":
        with apply_numerics(model, trainer, kernels=False):
            return score(model, rollout, with_routing=False)
    model.cuda()
    try:
        with te_linears(model, kernels):
            return score(model, rollout, with_routing=False)
    finally:
        model.cpu()


def _eos_ids(tokenizer, model) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen if isinstance(gen, (list, tuple)) else [gen])
    return {i for i in ids if isinstance(i, int)}


def _completion_slice(x: torch.Tensor, rollout: Rollout, width: int) -> torch.Tensor:
    """The completion part [B, width] (zero-padded): the positions after the padded prompt."""
    part = x[:, int(rollout.meta["prompt_width"]):]
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    out[:, :part.shape[1]] = part[:, :width]
    return out


def _per_position(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Mean k3 at each completion position (NaN where no sequence reaches it)."""
    r = log_ratio(reference, other).clamp(-20, 20)
    k3 = (torch.expm1(r) - r) * mask.double()
    n = mask.double().sum(0)
    return [float(v) if c > 0 else math.nan for v, c in zip(k3.sum(0) / n.clamp_min(1), n)]
