"""Staleness: KL between a sampler k optimizer steps behind and the trainer, for k = 0 … K.

In asynchronous RL the sampler serves weights θ_{j−k} while the trainer computes gradients with
θ_j. This probe measures what that costs in the same units as the numerics sources, with the
numerics held fixed so that only the weights differ:

1. Checkpoints θ_0 … θ_K, from a `Ladder`, either
   - generated (default): K real policy-gradient steps taken by train's own Trainer, built in
     the train layer (mismatch.train.staleness_ladder.PolicyGradientLadder) and passed in by
     the application layer that wires the probe (mismatch.app.sources). At lr 1e-5 most BF16 elements do not
     move in one step (the update is below half a BF16 ulp of all but the smallest weights), so
     the share of elements whose cast changed is recorded per step (and against the trainer
     per lag): it shows that, and how much, the served weights moved.
   - the user's checkpoints (`StalenessConfig.checkpoints`): the subdirectories of that
     directory, naturally sorted by name (step_9 before step_10), each a Hugging Face model
     directory; the last is the trainer and lag k is the k-th before it,
     K = min(`StalenessConfig.max_lag`, n − 1).

2. For each lag k, the stale policy θ_{K−k} samples the first `subset_prompts` probe prompts
   (KV-cache decode path, trainer numerics, reference attention; the same sampling seeds at
   every lag, `GENERATION_BATCHES` scoring batches per `generate` call), and both θ_{K−k} (the
   sampler, μ) and θ_K (the trainer, π) score the same tokens teacher-forced in the trainer
   numerics, `batch_size` sequences at a time. The tally compares them token by token and with
   the exact full-vocabulary KL(μ‖π). Both sides use one numerics configuration, so lag 0 is
   exactly 0 and every other lag is the weights' difference alone — add the numerics sources on
   top for the total an asynchronous sampler sees. With common seeds most batches of
   neighbouring lags draw identical tokens; the trainer's scores of those are computed once.

What to expect. A reported magnitude (one public training dashboard; no paper): "KL 0.002 at
staleness 0 → ~0.01 at ~2 steps" — a large model at its own learning rate, with the numerics
mismatch included at staleness 0 (here lag 0 is 0 by construction). The embedded 2M-parameter
model at lr 1e-5 gives KL ~1e-5 per token that need not grow with the lag: the FP32 masters
drift steadily apart, but the served BF16 casts change only where a master crosses a rounding
midpoint, and such elements flip back and forth from step to step, so rounding moves the
served policy about as much as the update does. At lr 1e-4 — the default — the update
dominates and KL grows steadily with the lag, by ~5e-4 per step: what counts as a realistic
learning rate is the policy change per step it causes, and 1e-6…1e-5 (usual for billion-
parameter models) moves a 2M-parameter BF16 policy by rounding noise only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from mismatch.records import Rollout

from .base import TORCH_DTYPES, Evaluation, SourceResult, pad_width
from .config import StalenessConfig  # the probe's options (config.py: no torch)
from .context import ProbeContext
from .errors import ProbeError
from .source_figures import StalenessByLag
from .tally import Tally

__all__ = ["StalenessConfig", "Ladder", "run", "rows_of", "fraction_changed"]


class Ladder(Protocol):
    """θ_0 … θ_K: the trainer θ_K and the stale policies behind it."""

    k_max: int
    setup_work: int
    """Progress ticks `prepare` makes."""
    lr: float | None
    source: str
    changed_fraction: list[float]
    """Share of served elements each step changed, in training order."""
    mean_reward: list[float]

    def prepare(self, tick: Callable[[], None]) -> None: ...
    def trainer(self) -> torch.nn.Module: ...
    def stale(self, k: int) -> torch.nn.Module: ...
    def notes(self, kl: list[float]) -> list[str]: ...


def run(ctx: ProbeContext, *,
        ladder: Callable[[ProbeContext], Ladder] | None = None) -> SourceResult:
    """KL(θ_{K−k} ‖ θ_K) on the stale sampler's tokens for k = 0 … K. The checkpoints are
    the user's (`StalenessConfig.checkpoints`) or `ladder(ctx)`'s, the generated steps."""
    cfg = ctx.cfg
    n_batches = -(-min(cfg.subset_prompts, len(ctx.prompts)) // cfg.batch_size)
    if cfg.staleness.checkpoints is not None:
        policies: Ladder = _Checkpoints(ctx, Path(cfg.staleness.checkpoints))
    elif ladder is not None:
        policies = ladder(ctx)
    else:
        raise ProbeError("the staleness probe needs checkpoints: pass --staleness-checkpoints, "
                         "or run it through `mismatch probe --sources staleness`, which "
                         "generates policy-gradient steps")
    k_max = policies.k_max
    total = policies.setup_work + (k_max + 1) * n_batches
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        ctx.progress("staleness", done, total)

    policies.prepare(tick)
    trainer = policies.trainer()
    trainer_scores = _Memo()
    tallies: dict[int, Tally] = {}
    moved: dict[str, float] = {}
    for k in range(k_max + 1):
        stale = policies.stale(k)
        moved[str(k)] = fraction_changed(_weights(stale), _weights(trainer))
        tallies[k] = _measure(ctx, stale, trainer, trainer_scores, tick)
    summaries = {k: t.summary(seed=cfg.seed) for k, t in tallies.items()}
    figures = StalenessByLag(
        kl_k3_by_lag={str(k): s.kl_k3 for k, s in summaries.items()},
        kl_exact_by_lag={str(k): s.kl_exact for k, s in summaries.items()},
        kl_exact_ci95_by_lag={str(k): s.kl_exact_ci95 for k, s in summaries.items()},
        tokens_by_lag={str(k): s.tokens for k, s in summaries.items()},
        lr=policies.lr,
        steps=k_max,
        source=policies.source,
        bf16_changed_fraction_by_step=policies.changed_fraction,
        bf16_changed_fraction_vs_trainer_by_lag=moved,
        mean_reward_by_step=policies.mean_reward,
        # generated steps: groups with a reward spread
        informative_groups_by_step=getattr(policies, "informative_groups", None))
    kl = [summaries[k].kl_exact for k in range(k_max + 1)]
    return SourceResult(name="staleness", headline=summaries[1],
                        parts={f"lag {k}": s for k, s in summaries.items()},
                        extra=figures.to_json(),
                        notes=policies.notes(kl), log_ratio=tallies[1].log_ratio())


# ------------------------------------------------------------------------------------ measuring

GENERATION_BATCHES = 4
"""Scoring batches (`batch_size` sequences each) sampled by one `generate` call: the decode
loop's per-token overhead dominates on small models, and how the stale sampler's batch is
composed does not enter the comparison (both sides score teacher-forced, batch by batch)."""
MEMO_BYTES = 1 << 30
"""Most bytes of the trainer's scores kept for reuse across lags."""


class _Memo:
    """The trainer's (π's) evaluations by scoring batch, reused when a later lag's stale sampler
    drew exactly the same tokens (same seeds, nearby weights: most batches)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[torch.Tensor, torch.Tensor, Evaluation]] = {}
        self.bytes = 0

    def evaluate(self, ctx: ProbeContext, model: torch.nn.Module, index: int,
                 rollout: Rollout) -> Evaluation:
        hit = self.entries.get(index)
        if hit is not None and torch.equal(hit[0], rollout.token_ids) and \
                torch.equal(hit[1], rollout.attention_mask):
            return hit[2]
        ev = _score(ctx, model, rollout)
        if hit is not None:
            self.bytes -= hit[2].full.numel() * hit[2].full.element_size()
            del self.entries[index]
        size = ev.full.numel() * ev.full.element_size()
        if self.bytes + size <= MEMO_BYTES:
            self.entries[index] = (rollout.token_ids, rollout.attention_mask, ev)
            self.bytes += size
        return ev


def _measure(ctx: ProbeContext, stale: torch.nn.Module, trainer: torch.nn.Module,
             trainer_scores: _Memo, tick: Callable[[], None]) -> Tally:
    """Tally of `trainer` (π) against `stale` (μ) on `stale`'s rollouts of the probe subset."""
    from mismatch.engines.numerics import apply_numerics
    from mismatch.engines.generation import generate

    cfg = ctx.cfg
    prompts = ctx.prompts[:cfg.subset_prompts]
    chunk = cfg.batch_size * GENERATION_BATCHES
    tally = Tally()
    index = 0
    for c0 in range(0, len(prompts), chunk):
        params = ctx.sampling_params(seed=cfg.seed + c0 // chunk)  # the same at every lag
        with apply_numerics(stale, ctx.trainer, kernels=False):
            rollout = generate(stale, prompts[c0:c0 + chunk], params, pad_id=ctx.pad_id,
                               eos_ids=ctx.eos_ids, label=f"{ctx.trainer.label} stale",
                               with_routing=False)
        for r0 in range(0, rollout.token_ids.shape[0], cfg.batch_size):
            part = rows_of(rollout, torch.arange(r0, min(r0 + cfg.batch_size,
                                                       rollout.token_ids.shape[0])))
            mu = _score(ctx, stale, part)
            pi = trainer_scores.evaluate(ctx, trainer, index, part)
            tally.add(pi, mu, ctx.completion(part, part.completion_mask))
            index += 1
            tick()
    return tally


def rows_of(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """Rows of a rollout as if they had been sampled alone: columns that are padding in every
    one of them (left of the longest prompt, right of the longest completion) are dropped."""
    pw = rollout.prompt_width
    real = rollout.attention_mask[rows].bool().any(0).nonzero()[:, 0]
    lo, hi = int(real[0]), int(real[-1]) + 1  # lo < pw: every prompt ends at column pw - 1

    def cut(x: torch.Tensor) -> torch.Tensor:
        return x[rows, lo:hi]

    return replace(rollout, token_ids=cut(rollout.token_ids),
                   attention_mask=cut(rollout.attention_mask),
                   completion_mask=cut(rollout.completion_mask),
                   sampler_logprobs=cut(rollout.sampler_logprobs),
                   sampler_logprobs_processed=cut(rollout.sampler_logprobs_processed),
                   candidate_ids=cut(rollout.candidate_ids),
                   candidate_logprobs=cut(rollout.candidate_logprobs),
                   routed_experts=None, prompt_width=pw - lo)


def _score(ctx: ProbeContext, model: torch.nn.Module, rollout: Rollout) -> Evaluation:
    """Teacher-forced log-probs (and whole log-softmax) of the completion in trainer numerics."""
    from mismatch.engines.numerics import apply_numerics
    from mismatch.engines.scorer import score

    pw = rollout.prompt_width
    with apply_numerics(model, ctx.trainer, kernels=False):
        s = score(model, rollout, with_routing=False, full_from=pw)
    return Evaluation(logprobs=ctx.completion(rollout, s.logprobs),
                      full=pad_width(s.full_logprobs, ctx.width))


def fraction_changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Share of weight elements that differ between two state dicts of one architecture."""
    changed = sum(int((a[n] != b[n]).sum()) for n in a)
    return changed / sum(t.numel() for t in a.values())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ generated


# ------------------------------------------------------------------------------------ checkpoints


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


class _Checkpoints:
    """θ_0 … θ_K from the user's checkpoint directories (the last K + 1 of them)."""

    setup_work = 0

    def __init__(self, ctx: ProbeContext, root: Path) -> None:
        from mismatch.zoo import ZooError, check_model_dir

        self.ctx = ctx
        self.root = root
        usage = ("pass a directory whose subdirectories are Hugging Face model directories "
                 "(save_pretrained) in training order")
        if not root.is_dir():
            raise ProbeError(f"--staleness-checkpoints {root} is not a directory; {usage}")
        dirs = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                      key=lambda p: _natural_key(p.name))
        if len(dirs) < 2:
            raise ProbeError(f"--staleness-checkpoints {root} holds {len(dirs)} checkpoint "
                             f"subdirector{'y' if len(dirs) == 1 else 'ies'}; need at least 2 "
                             f"(the last is the trainer); {usage}")
        for d in dirs:
            try:
                check_model_dir(d, tokenizer=False)
            except ZooError as exc:
                raise ProbeError(f"checkpoint {d.name} is not loadable: {exc}") from None
        self.k_max = min(ctx.cfg.staleness.max_lag, len(dirs) - 1)
        self.dirs = dirs[len(dirs) - 1 - self.k_max:]  # θ_0 … θ_K
        self.source = f"checkpoints: {root}"
        self.lr: float | None = None  # unknown: whatever trained the checkpoints
        self.mean_reward: list[float] = []
        self.changed_fraction: list[float] = []
        self._changed_back: list[float] = []
        self._trainer: torch.nn.Module | None = None
        self._previous: dict[str, torch.Tensor] | None = None
        self._vocab = ctx.model(ctx.trainer.compute_dtype).get_input_embeddings().weight.shape[0]

    def prepare(self, tick: Callable[[], None]) -> None:
        self._trainer = self._load(self.k_max)

    def _load(self, index: int) -> torch.nn.Module:
        from mismatch.zoo import load_model

        path = self.dirs[index]
        try:
            model = load_model(path, dtype=TORCH_DTYPES[self.ctx.trainer.compute_dtype])
        except Exception as exc:  # noqa: BLE001 — any loader failure is bad user input here
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ProbeError(f"checkpoint {path.name} is not loadable ({reason}); every "
                             f"subdirectory of --staleness-checkpoints must be a model "
                             f"directory written by save_pretrained") from None
        vocab = model.get_input_embeddings().weight.shape[0]
        if vocab != self._vocab:
            raise ProbeError(f"checkpoint {path.name} has a vocabulary of {vocab} but --model "
                             f"has {self._vocab}; pass --model one of the checkpoints")
        if self._trainer is not None:
            mine, theirs = _weights(model), _weights(self._trainer)
            if {n: t.shape for n, t in mine.items()} != {n: t.shape for n, t in theirs.items()}:
                raise ProbeError(f"checkpoint {path.name} does not have the architecture of "
                                 f"{self.dirs[-1].name}; the checkpoints must be of one model")
        return model

    def trainer(self) -> torch.nn.Module:
        assert self._trainer is not None
        return self._trainer

    def stale(self, k: int) -> torch.nn.Module:
        """Checkpoint K − k (lags are visited in order, so consecutive loads are neighbours)."""
        model = self._load(self.k_max - k)
        weights = _weights(model)
        if self._previous is not None:
            self._changed_back.append(fraction_changed(self._previous, weights))
            self.changed_fraction = self._changed_back[::-1]  # training order
        self._previous = weights
        return model

    def notes(self, kl: list[float]) -> list[str]:
        return [(f"KL(μ‖π) of a sampler serving checkpoint K−k (μ) against the last "
                 f"checkpoint (π) of {self.root}, both scoring the stale sampler's tokens "
                 f"teacher-forced in the trainer numerics; the learning rate is whatever "
                 f"trained those checkpoints (K = {self.k_max}).")]
