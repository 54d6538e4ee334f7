"""Staleness: KL between a sampler k optimizer steps behind and the trainer, for k = 0 … K.

In asynchronous RL the sampler serves weights θ_{j−k} while the trainer computes gradients with
θ_j. This probe measures what that costs in the same units as the numerics sources, with the
numerics held fixed so that only the weights differ:

1. Checkpoints θ_0 … θ_K, either
   - generated (default): the trainer model is deep-copied into an FP32 master (the shared model
     is never touched) and K real AdamW steps (lr = `staleness_lr`, betas (0.9, 0.999), weight
     decay 0, gradient-norm clip 1) of a GRPO policy-gradient update are taken on the zoo's
     training tasks (`mismatch.zoo.tasks`, split "train", rendered with the chat template and
     `TOOLS` as the probe renders its prompts). Each step samples a group of
     `GROUP_SIZE` completions (temperature 1, at most `TRAIN_MAX_NEW_TOKENS` tokens: one
     assistant turn) for each of `PROMPTS_PER_STEP` prompts from the current policy θ_j — the
     served-dtype cast of the master, decoded by the emulated sampler in the trainer numerics.
     Reward: 1 when the first reply is a well-formed `calc` call whose expression the tool
     evaluates to the value of the task's gold first expression, else 0 (the first step of the
     episode in `mismatch.zoo.episode`; the final `submit` reward needs that value). Advantages
     are group-normalized without std normalization (NUMERICS.md §5's GRPO baseline), the loss
     is REINFORCE, −A·Σ_t log π(y_t), averaged over the batch's completion tokens, computed on
     the FP32 master (rows with zero advantage add exactly nothing to it and are not run). A
     batch in which every group's rewards are equal carries no gradient; it is replaced by a
     fresh batch of prompts, `MAX_DRAWS` batches at most (a coarse form of DAPO's dynamic
     sampling), after which the step is taken anyway (a real AdamW step, zero gradient). After
     step j the master is cast to the serving dtype (BF16 by default): that cast is θ_j, what a
     sampler would serve. At lr 1e-5 most BF16 elements do not move in one step (the update is
     below half a BF16 ulp of all but the smallest weights), so the share of elements whose
     cast changed is recorded per step (and against the trainer per lag): it shows that, and
     how much, the served weights moved.
   - the user's checkpoints (`staleness_checkpoints`): the subdirectories of that directory,
     naturally sorted by name (step_9 before step_10), each a Hugging Face model directory; the
     last is the trainer and lag k is the k-th before it, K = min(`staleness_max_lag`, n − 1).

2. For each lag k, the stale policy θ_{K−k} samples the first `subset_prompts` probe prompts
   (KV-cache decode path, trainer numerics, reference attention; the same sampling seeds at
   every lag, `GENERATION_BATCHES` scoring batches per `generate` call), and both θ_{K−k} (the
   sampler, μ) and θ_K (the trainer, π) score the same tokens teacher-forced in the trainer
   numerics, `batch_size` sequences at a time. The tally compares them token by token and with
   the exact full-vocabulary KL(μ‖π). Both sides use one numerics configuration, so lag 0 is
   exactly 0 and every other lag is the weights' difference alone — add the numerics sources on
   top for the total an asynchronous sampler sees. With common seeds most batches of
   neighbouring lags draw identical tokens; the trainer's scores of those are computed once.

What to expect. Published magnitude (NUMERICS.md §3): "KL 0.002 at staleness 0 → ~0.01 at ~2
steps (one public dashboard)" — a large model at its own learning rate, with the numerics
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

import copy
import itertools
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from mismatch.records import Rollout

from .base import (
    _TORCH_DTYPES,
    Evaluation,
    ProbeContext,
    SourceResult,
    Tally,
    _pad_width,
)

__all__ = ["GROUP_SIZE", "MAX_DRAWS", "PROMPTS_PER_STEP", "TRAIN_MAX_NEW_TOKENS", "run"]

GROUP_SIZE = 4
"""Completions sampled per prompt (one GRPO group)."""
PROMPTS_PER_STEP = 8
"""Training prompts per optimizer step."""
TRAIN_MAX_NEW_TOKENS = 64
"""Cap of a training completion: one assistant turn (the gold first turn is 37-59 tokens)."""
MAX_DRAWS = 4
"""Batches drawn at most per step while every group's rewards are equal (no gradient)."""
BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0


def run(ctx: ProbeContext) -> SourceResult:
    """KL(θ_{K−k} ‖ θ_K) on the stale sampler's tokens for k = 0 … K."""
    cfg = ctx.cfg
    n_batches = -(-min(cfg.subset_prompts, len(ctx.prompts)) // cfg.batch_size)
    if cfg.staleness_checkpoints is not None:
        policies: _Generated | _Checkpoints = _Checkpoints(ctx, Path(cfg.staleness_checkpoints))
    else:
        policies = _Generated(ctx)
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
        moved[str(k)] = _changed_fraction(_weights(stale), _weights(trainer))
        tallies[k] = _measure(ctx, stale, trainer, trainer_scores, tick)
    summaries = {k: t.summary(seed=cfg.seed) for k, t in tallies.items()}
    extra = {
        "kl_k3_by_lag": {str(k): s["kl_k3"] for k, s in summaries.items()},
        "kl_exact_by_lag": {str(k): s["kl_exact"] for k, s in summaries.items()},
        "kl_exact_ci95_by_lag": {str(k): s["kl_exact_ci95"] for k, s in summaries.items()},
        "tokens_by_lag": {str(k): s["tokens"] for k, s in summaries.items()},
        "lr": policies.lr,
        "steps": k_max,
        "source": policies.source,
        "bf16_changed_fraction_by_step": policies.changed_fraction,
        "bf16_changed_fraction_vs_trainer_by_lag": moved,
        "mean_reward_by_step": policies.mean_reward,
    }
    if isinstance(policies, _Generated):
        extra["informative_groups_by_step"] = policies.informative_groups
    kl = [summaries[k]["kl_exact"] for k in range(k_max + 1)]
    return SourceResult(name="staleness", headline=summaries[1],
                        parts={f"lag {k}": s for k, s in summaries.items()}, extra=extra,
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
    from mismatch.engines.sampler import generate

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
            part = _rows(rollout, torch.arange(r0, min(r0 + cfg.batch_size,
                                                       rollout.token_ids.shape[0])))
            mu = _score(ctx, stale, part)
            pi = trainer_scores.evaluate(ctx, trainer, index, part)
            tally.add(pi, mu, ctx.completion(part, part.completion_mask))
            index += 1
            tick()
    return tally


def _rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
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
                      full=_pad_width(s.full_logprobs, ctx.width))


def _changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Share of weight elements that differ between two state dicts of one architecture."""
    changed = sum(int((a[n] != b[n]).sum()) for n in a)
    return changed / sum(t.numel() for t in a.values())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ generated


class _Generated:
    """θ_0 … θ_K from K real AdamW steps of GRPO on the zoo's training tasks."""

    source = "generated AdamW steps"

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.k_max = ctx.cfg.staleness_max_lag
        self.setup_work = self.k_max
        self.lr = ctx.cfg.staleness_lr
        self.changed_fraction: list[float] = []
        self.mean_reward: list[float] = []
        self.informative_groups: list[int] = []
        self._snapshots: list[dict[str, torch.Tensor]] = []
        self._serve_dtype = _TORCH_DTYPES[ctx.trainer.compute_dtype]
        shared = ctx.model(ctx.trainer.compute_dtype)
        self._working = copy.deepcopy(shared)  # the stale sampler: θ_j loaded in turn
        self._trainer = copy.deepcopy(shared)  # θ_K once the steps are taken
        self._tasks_used = 0

    def prepare(self, tick: Callable[[], None]) -> None:
        ctx = self.ctx
        master = copy.deepcopy(ctx.model(ctx.trainer.compute_dtype)).float()
        optimizer = torch.optim.AdamW(master.parameters(), lr=self.lr, betas=BETAS,
                                      weight_decay=0.0, foreach=False)
        self._snapshots.append(self._cast(master))
        for step in range(self.k_max):
            _load(self._working, self._snapshots[-1])
            rollout, advantages, rewards, informative = self._draw(step)
            rows = advantages.nonzero()[:, 0]
            if rows.numel():  # rows with A = 0 add exactly nothing to the gradient: skip them
                with torch.enable_grad():
                    _policy_gradient_loss(master, _rows(rollout, rows), advantages[rows],
                                          tokens=float(rollout.completion_mask.sum())).backward()
                torch.nn.utils.clip_grad_norm_(master.parameters(), GRAD_CLIP)
            else:  # a zero gradient, still a step: AdamW skips parameters without a .grad
                for p in master.parameters():
                    p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self._snapshots.append(self._cast(master))
            self.changed_fraction.append(_changed_fraction(self._snapshots[-1],
                                                           self._snapshots[-2]))
            self.mean_reward.append(float(rewards.mean()))
            self.informative_groups.append(informative)
            tick()
        _load(self._trainer, self._snapshots[-1])

    def _cast(self, master: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(self._serve_dtype).clone()
                for n, p in master.named_parameters()}

    def _draw(self, step: int):
        """One step's batch: (rollout, advantages [B], rewards [B], informative groups).

        A batch whose groups all have equal rewards is replaced by fresh prompts, at most
        MAX_DRAWS batches in all (the last one drawn is used either way)."""
        from mismatch.zoo.tasks import generate_tasks

        ctx = self.ctx
        for draw in range(MAX_DRAWS):
            tasks = generate_tasks("train", PROMPTS_PER_STEP, start=self._tasks_used)
            self._tasks_used += PROMPTS_PER_STEP
            rollout = self._sample(tasks, seed=ctx.cfg.seed + 10_000 + 100 * step + draw)
            texts = _completions(ctx.tokenizer, rollout)
            rewards = torch.tensor([_reward(tasks[i // GROUP_SIZE], text)
                                    for i, text in enumerate(texts)]).view(-1, GROUP_SIZE)
            informative = int((rewards.amax(1) > rewards.amin(1)).sum())
            if informative:
                break
        advantages = rewards - rewards.mean(1, keepdim=True)  # GRPO, no std normalization
        return rollout, advantages.reshape(-1), rewards.reshape(-1), informative

    def _sample(self, tasks, *, seed: int):
        from mismatch.engines.numerics import apply_numerics
        from mismatch.engines.sampler import generate

        ctx = self.ctx
        prompts = [p for p in _render(ctx.tokenizer, tasks) for _ in range(GROUP_SIZE)]
        params = ctx.sampling_params(max_new_tokens=TRAIN_MAX_NEW_TOKENS, temperature=1.0,
                                     top_p=1.0, seed=seed)
        with apply_numerics(self._working, ctx.trainer, kernels=False):
            return generate(self._working, prompts, params, pad_id=ctx.pad_id,
                            eos_ids=ctx.eos_ids, label=f"{ctx.trainer.label} policy",
                            with_routing=False)

    def trainer(self) -> torch.nn.Module:
        return self._trainer

    def stale(self, k: int) -> torch.nn.Module:
        _load(self._working, self._snapshots[self.k_max - k])
        return self._working

    def notes(self, kl: list[float]) -> list[str]:
        dtype = self.ctx.trainer.compute_dtype.upper()
        out = [(f"KL(μ‖π) of a sampler serving the {dtype} weights of k real AdamW steps ago "
                f"(μ) against the trainer's current weights (π), both scoring the stale "
                f"sampler's tokens teacher-forced in the trainer numerics; the {self.k_max} "
                f"steps are GRPO policy-gradient updates on the zoo's training tasks at lr "
                f"{self.lr:g}.")]
        if any(b < a for a, b in itertools.pairwise(kl[1:])):
            share = sum(self.changed_fraction) / len(self.changed_fraction)
            out.append(f"KL does not grow steadily with the lag here: a step changes only "
                       f"{share:.1%} of the served {dtype} elements, those whose FP32 master "
                       f"crosses a rounding midpoint, and they can flip back on a later step, "
                       f"so rounding moves the served policy about as much as the update does "
                       f"(a larger learning rate gives steady growth).")
        flat = [j + 1 for j, n in enumerate(self.informative_groups) if n == 0]
        if flat:
            out.append(f"Steps {flat} drew no group with a reward spread in {MAX_DRAWS} "
                       f"batches: their gradient was zero (the weights moved only by "
                       f"AdamW's momentum, if at all).")
        return out


def _render(tokenizer, tasks) -> list[list[int]]:
    """Task prompts as the probe renders its own (chat template with the zoo's tools)."""
    from mismatch.probes.config import ProbeError
    from mismatch.zoo.tasks import TOOLS

    if not getattr(tokenizer, "chat_template", None):
        raise ProbeError("the staleness probe's generated steps train on the zoo's tool-use "
                         "tasks and need a tokenizer with a chat template, which this model's "
                         "has not; pass --staleness-checkpoints with your own checkpoints "
                         "instead")
    return [list(tokenizer.apply_chat_template(t.prompt_messages(), tools=TOOLS,
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for t in tasks]


def _completions(tokenizer, rollout) -> list[str]:
    """The text of each sampled completion (through its end-of-turn token)."""
    pw = rollout.prompt_width
    ids, keep = rollout.token_ids[:, pw:], rollout.completion_mask[:, pw:].bool()
    return [tokenizer.decode(row[m].tolist(), skip_special_tokens=False)
            for row, m in zip(ids, keep)]


def _reward(task, text: str) -> float:
    """1.0 when the reply's first tool call is `calc` and returns the gold first value."""
    from mismatch.zoo.tool_calls import execute_call, parse_reply
    from mismatch.zoo.tool_lang import evaluate

    calls = parse_reply(text).tool_calls
    if not calls or calls[0].name != "calc":
        return 0.0
    result = execute_call(calls[0])["content"]
    return 1.0 if result == str(evaluate(task.expressions[0])) else 0.0


def _policy_gradient_loss(model: torch.nn.Module, rollout: Rollout, advantages: torch.Tensor,
                          *, tokens: float) -> torch.Tensor:
    """REINFORCE: −Σ A·log π(y_t) over the rollout's completion tokens, divided by `tokens`
    (the completion tokens of the whole batch the rows were drawn from)."""
    from mismatch.engines.scorer import position_ids

    ids, mask = rollout.token_ids, rollout.attention_mask
    n = ids.shape[1] - rollout.prompt_width  # completion width
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                   logits_to_keep=n + 1).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, -n:, None])[..., 0]
    completion = rollout.completion_mask[:, -n:]
    return -(advantages[:, None] * completion * lp).sum() / max(tokens, 1.0)


@torch.no_grad()
def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.copy_(weights[name])


# ------------------------------------------------------------------------------------ checkpoints


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


class _Checkpoints:
    """θ_0 … θ_K from the user's checkpoint directories (the last K + 1 of them)."""

    setup_work = 0

    def __init__(self, ctx: ProbeContext, root: Path) -> None:
        from mismatch.probes.config import ProbeError
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
        self.k_max = min(ctx.cfg.staleness_max_lag, len(dirs) - 1)
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
        from mismatch.probes.config import ProbeError
        from mismatch.zoo import load_model

        path = self.dirs[index]
        try:
            model = load_model(path, dtype=_TORCH_DTYPES[self.ctx.trainer.compute_dtype])
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
            self._changed_back.append(_changed_fraction(self._previous, weights))
            self.changed_fraction = self._changed_back[::-1]  # training order
        self._previous = weights
        return model

    def notes(self, kl: list[float]) -> list[str]:
        return [(f"KL(μ‖π) of a sampler serving checkpoint K−k (μ) against the last "
                 f"checkpoint (π) of {self.root}, both scoring the stale sampler's tokens "
                 f"teacher-forced in the trainer numerics; the learning rate is whatever "
                 f"trained those checkpoints (K = {self.k_max}).")]
