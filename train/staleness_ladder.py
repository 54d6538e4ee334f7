"""The staleness probe's checkpoint ladder: θ_0 … θ_K from K real policy-gradient steps.

The trainer model is copied into train's `Trainer` (an FP32 master and AdamW; the run's shared
model is never touched) and K of its steps (lr = `StalenessConfig.lr`, the run's defaults
otherwise: betas (0.9, 0.999), weight decay 0, gradient-norm clip 1) are taken on the zoo's
training tasks (`mismatch.zoo.tasks`, split "train", rendered with the chat template and
`TOOLS` as the probe renders its prompts).
Each step samples a group of `GROUP_SIZE` completions (temperature 1, at most
`TRAIN_MAX_NEW_TOKENS` tokens: one assistant turn) for each of `PROMPTS_PER_STEP` prompts from
the current policy θ_j — the served-dtype cast of the master, decoded by the emulated sampler in
the trainer numerics. Reward: 1 when the first reply is a well-formed `calc` call whose
expression the tool evaluates to the value of the task's gold first expression, else 0 (the
first step of the episode in `mismatch.zoo.episode`; the final `submit` reward needs that value).
Advantages are group-normalized without std normalization (the study's GRPO baseline, as in
Dr. GRPO: Liu et al., arXiv:2503.20783; train.loss.group_advantages); the step is train's own
(`mismatch.train.trainer.Trainer.step` with arm "grpo", computing in FP32 on the master: the
loss is the token-level mean −A·log π(y_t) over the batch's completion tokens, the gradient is
clipped, and a step whose gradient norm is not finite is skipped, as in every training run).
A batch in which every group's rewards are equal carries no gradient; it is replaced by a fresh
batch of prompts, `MAX_DRAWS` batches at most (a coarse form of DAPO's dynamic sampling), after
which the step is taken anyway (a real AdamW step, zero gradient). After step j the master is
cast to the serving dtype (BF16 by default): that cast is θ_j, what a sampler would serve. The
share of elements whose cast changed is recorded per step.

The ladder is built here, in the train layer, and handed to the staleness probe
(mismatch.probes.staleness.run(ctx, ladder=PolicyGradientLadder)) by the application layer; the
probe only measures KL against the lag.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch

from mismatch.probes.base import TORCH_DTYPES
from mismatch.probes.context import ProbeContext
from mismatch.probes.staleness import fraction_changed
from mismatch.records import Rollout
from mismatch.train.batch import Batch
from mismatch.train.config import TrainConfig
from mismatch.train.loss import group_advantages
from mismatch.train.trainer import Trainer

__all__ = ["PolicyGradientLadder", "GROUP_SIZE", "MAX_DRAWS", "PROMPTS_PER_STEP",
           "TRAIN_MAX_NEW_TOKENS"]

GROUP_SIZE = 4
"""Completions sampled per prompt (one GRPO group)."""
PROMPTS_PER_STEP = 8
"""Training prompts per optimizer step."""
TRAIN_MAX_NEW_TOKENS = 64
"""Cap of a training completion: one assistant turn (the gold first turn is 37-59 tokens)."""
MAX_DRAWS = 4
"""Batches drawn at most per step while every group's rewards are equal (no gradient)."""


class PolicyGradientLadder:
    """θ_0 … θ_K from K real AdamW steps of GRPO on the zoo's training tasks."""

    source = "generated AdamW steps"

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.k_max = ctx.cfg.staleness.max_lag
        self.setup_work = self.k_max
        self.lr = ctx.cfg.staleness.lr
        self.changed_fraction: list[float] = []
        self.mean_reward: list[float] = []
        self.informative_groups: list[int] = []
        self._snapshots: list[dict[str, torch.Tensor]] = []
        self._serve_dtype = TORCH_DTYPES[ctx.trainer.compute_dtype]
        shared = ctx.model(ctx.trainer.compute_dtype)
        self._working = copy.deepcopy(shared)  # the stale sampler: θ_j loaded in turn
        self._trainer = copy.deepcopy(shared)  # θ_K once the steps are taken
        self._tasks_used = 0

    def prepare(self, tick: Callable[[], None]) -> None:
        ctx = self.ctx
        cfg = TrainConfig.flat(correction="grpo", lr=self.lr, trainer_dtype="fp32",
                               samples_per_prompt=GROUP_SIZE, prompts_per_step=PROMPTS_PER_STEP)
        trainer = Trainer(ctx.model(ctx.trainer.compute_dtype), cfg)
        self._snapshots.append(self._cast(trainer.master))
        for step in range(self.k_max):
            _load_weights(self._working, self._snapshots[-1])
            rollout, rewards, informative = self._draw(step)
            trainer.step(_batch(rollout, group_advantages(rewards).reshape(-1), ctx.pad_id))
            self._snapshots.append(self._cast(trainer.master))
            self.changed_fraction.append(fraction_changed(self._snapshots[-1],
                                                           self._snapshots[-2]))
            self.mean_reward.append(float(rewards.mean()))
            self.informative_groups.append(informative)
            tick()
        _load_weights(self._trainer, self._snapshots[-1])

    def _cast(self, master: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(self._serve_dtype).clone()
                for n, p in master.named_parameters()}

    def _draw(self, step: int):
        """One step's batch: (rollout, rewards [G, GROUP_SIZE], informative groups).

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
        return rollout, rewards, informative

    def _sample(self, tasks, *, seed: int):
        from mismatch.engines.numerics import apply_numerics
        from mismatch.engines.generation import generate

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
        _load_weights(self._working, self._snapshots[self.k_max - k])
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
    from mismatch.probes.errors import ProbeError
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


def _batch(rollout: Rollout, advantages: torch.Tensor, pad_id: int) -> Batch:
    """The rollout as train's Batch: each left-padded row moved to the left (the trainer's
    batches are right-padded), its completion tokens the sampled ones, one candidate per
    position (the sampled token's own slot; arm "grpo" reads no candidates)."""
    real = rollout.attention_mask.bool()
    b, t = real.shape
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real tokens first

    def take(x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, order)

    sampled = take(rollout.completion_mask.bool())
    ids = torch.where(take(real), take(rollout.token_ids), pad_id)
    return Batch(ids=ids, attention=take(rollout.attention_mask), mask=sampled,
                 sampler_logp=torch.where(sampled, take(rollout.sampler_logprobs), 0.0),
                 cand_ids=ids[..., None].clone(),
                 cand_sampler_logp=torch.full((b, t, 1), float("-inf")),
                 support=torch.zeros(b, t, 1, dtype=torch.bool),
                 advantages=advantages.float(), staleness=torch.zeros(b, t),
                 groups=[rollout.sampler] * b)


@torch.no_grad()
def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.copy_(weights[name])
