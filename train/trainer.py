"""The trainer: an FP32 master and AdamW, one corrected GRPO step per batch.

The loss of the chosen correction arm (loss.py) runs on the master's BF16 cast (the trainer's
numerics; FP32 for reference comparisons) over the batch's sampled tokens, teacher-forced
(scoring.py). `Trainer.step` is the one implementation of a training step: score, loss,
backward, clip, AdamW, the step's metrics. Its hooks (`_rows`, `_backward`, `_apply_gradients`,
`_metrics`) are what a trainer that shards the master overrides (distributed.ShardedTrainer,
FSDP2): the rows it scores, how the loss is scaled to the global token mean, where the gradients
land, and how the metrics see the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mismatch.kernels.bf16_gemm import bf16_gemms
from mismatch.kernels.flash_backward import fp32_attention_backward
from mismatch.metrics import kl_estimators
from mismatch.runtime import torch_threads

from mismatch.engines.head import head_numerics
from mismatch.probes.base import TORCH_DTYPES

from .batch import Batch
from .components import OptimConfig, PipelineConfig
from .config import TrainConfig
from .loss import ARMS, policy_loss, sc_tail_ratio
from .record import StepMetrics
from .rundir import check_ranks, save_checkpoint
from .scoring import packed_scores, sampled_positions, unpacked_scores

__all__ = ["Trainer", "StepMetrics", "batch_loss", "arm_loss", "step_metrics",
           "lockstep_threads", "OptimConfig"]


def batch_loss(model: torch.nn.Module, batch: Batch, correction: str, share_prefix: bool = True):
    """The arm's loss of `batch` under `model` (teacher-forced, FP32 log-softmax of its logits;
    token_scores): (loss — a mean over the batch's valid tokens —, the loss's metrics, and, at
    the sampled tokens (0 elsewhere), the entropy [B, T-1] of each position predicting one,
    log π of each token [B, T] and log π of each candidate [B, T, K]; the sampled-token mask)."""
    mask, at = sampled_positions(batch)
    lp, cl, en = packed_scores(model, batch, at, share_prefix)
    loss, m = _packed_loss(lp, cl, batch, at, correction)
    logp, cand, ent = unpacked_scores(lp.detach(), cl.detach(), en, at, batch)
    return loss, m, ent, logp, cand, mask


def arm_loss(logp: torch.Tensor, cand: torch.Tensor, batch: Batch, correction: str):
    """The arm's loss given the trainer's log π of each token [B, T] and of each candidate
    [B, T, K]: (loss, its metrics, the sampled-token mask [B, T] it averaged over).

    policy_loss runs on the sampled tokens alone, packed into one row ([1, N], [1, N, K]; each
    token with its sequence's advantage): the loss is a token mean, so padding, prompt and tool
    tokens only ever entered it as zeros, and its [B, T, K] float64 coefficients shrink to the
    N sampled tokens. Every token's gradient is the same; the loss and the metrics' means are
    summed in another order (equal to float rounding), the ratio quantiles are the same."""
    mask, at = sampled_positions(batch)
    loss, m = _packed_loss(logp[at], cand[at], batch, at, correction)
    return loss, m, mask


def _packed_loss(lp: torch.Tensor, cl: torch.Tensor, batch: Batch, at, correction: str):
    """policy_loss of the tokens at positions `at`, given their log π [N] and candidates' [N, K],
    as one row."""
    arm = ARMS[correction]

    def packed(x: torch.Tensor) -> torch.Tensor:
        return x[at].unsqueeze(0)

    kwargs = {}
    if arm.centered or arm.top_p:
        kwargs = dict(cand_logp=cl.unsqueeze(0),
                      cand_sampler_logp=packed(batch.cand_sampler_logp))
        if arm.top_p:
            kwargs["support_mask"] = packed(batch.support)
    adv = batch.advantages[at[0]].unsqueeze(0)
    return policy_loss(lp.unsqueeze(0), packed(batch.sampler_logp), adv,
                       torch.ones_like(adv, dtype=torch.bool), arm=arm, **kwargs)


def step_metrics(m: dict, ent: torch.Tensor, logp: torch.Tensor, cand: torch.Tensor,
                 batch: Batch, mask: torch.Tensor) -> StepMetrics:
    """A step's numerics metrics from the loss's metrics `m`, the trainer's entropy [B, T-1] and
    log-probs (tokens [B, T], candidates [B, T, K]) of the whole batch (read at the sampled
    tokens `mask` only). `nonfinite_tokens`: sampled tokens whose sampler or trainer log-prob
    is NaN or ±inf (policy_loss's count; the KL figures leave them out)."""
    valid = mask & torch.isfinite(batch.sampler_logp)
    kl = kl_estimators(logp, batch.sampler_logp, valid)
    ent_mean = float(ent[valid[:, 1:]].mean()) if valid.any() else float("nan")
    per_group: dict[str, float] = {}
    for g in sorted(set(batch.groups)):
        rows = torch.tensor([x == g for x in batch.groups])
        gm = valid & rows[:, None]
        per_group[g] = float(kl_estimators(logp, batch.sampler_logp, gm)["kl_k3"])
    if "sc_tail_ratio" in m:
        tail = float(m["sc_tail_ratio"])
    else:  # over the valid tokens alone, packed (the same rows, the same mean)
        at = valid.nonzero(as_tuple=True)
        tail = sc_tail_ratio(cand[at][None], batch.cand_sampler_logp[at][None],
                             torch.ones(1, len(at[0]), dtype=torch.bool))

    def optional(key: str) -> float | None:
        return float(m[key]) if key in m else None

    return StepMetrics(
        kl=float(kl["kl_k3"]), kl_k1=float(kl["kl_k1"]),
        mis_masked_fraction=float(m["mis_masked_fraction"]),
        ratio_p05=float(m["ratio_p05"]), ratio_p50=float(m["ratio_p50"]),
        ratio_p95=float(m["ratio_p95"]), entropy=ent_mean, group_kl=per_group,
        valid_tokens=int(m["valid_tokens"]), nonfinite_tokens=int(m["nonfinite_tokens"]),
        sc_tail_ratio=float(tail), head_mass_sampler=optional("head_mass_sampler"),
        support_mass_sampler=optional("support_mass_sampler"),
        support_mass_trainer=optional("support_mass_trainer"))


def lockstep_threads(pipeline: PipelineConfig) -> int | None:
    """The trainer's threads while it steps in a lockstep mode (sync, forced staleness): the
    samplers wait for its weights then, so it takes their threads as well as its own,
    `threads` × (`workers` + 1), capped at the CPUs this process may use. None (the process's
    setting, shared with sampling) in the pipelined modes."""
    if not pipeline.lockstep:
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(pipeline.threads, min(cpus, pipeline.threads * (pipeline.workers + 1)))


class Trainer:
    """FP32 master + AdamW; the loss runs on the master's BF16 cast (the trainer's numerics;
    `compute_dtype`, by default `cfg.trainer_dtype`, FP32 for reference comparisons). Samplers
    get BF16 weights whatever the trainer computes in."""

    share_prefix = True
    """Score a prompt the rows of a group share once (scoring.shared_prefix)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig,
                 compute_dtype: torch.dtype | None = None) -> None:
        compute_dtype = compute_dtype or TORCH_DTYPES[cfg.trainer_dtype]
        self.cfg = cfg
        self.master = copy.deepcopy(model).float()
        self.compute = copy.deepcopy(model).to(compute_dtype)
        self.master.train()
        self.compute.train()
        self.optim: OptimConfig = cfg.optim
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=self.optim.lr, betas=(0.9, 0.999),
                                     weight_decay=0.0)
        self.threads: int | None = lockstep_threads(cfg.pipeline)
        """torch intra-op threads while `step` runs (restored after); None: leave them."""
        self._sync_compute()

    def _sync_compute(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.compute.parameters(), self.master.parameters()):
                p.copy_(m)

    def published(self) -> dict[str, torch.Tensor]:
        """The BF16 weights samplers load (a copy: safe to hand to other threads)."""
        return {n: p.detach().to(torch.bfloat16, copy=True)
                if p.is_floating_point() else p.detach().clone()
                for n, p in self.compute.state_dict().items()}

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds of the trainer (`trainer_ranks` 1: AdamW state by index)."""
        return {"master": self.master.state_dict(), "optimizer": self.opt.state_dict(),
                "trainer_ranks": 1}

    def load(self, state: dict[str, Any]) -> None:
        """Restore the FP32 master and AdamW state of a checkpoint."""
        check_ranks(state, 1)
        self.master.load_state_dict(state["master"])
        self.opt.load_state_dict(state["optimizer"])
        self._sync_compute()

    def policy(self) -> torch.nn.Module:
        """A copy of the policy as it is now (the BF16 cast), for evaluation and export."""
        return copy.deepcopy(self.compute).to(torch.bfloat16)

    def save(self, out: Path, step: int, next_unit: int,
             older: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
        """Write the checkpoint of `step` into out/checkpoints (see save_checkpoint)."""
        return save_checkpoint(out, step, self.state(), next_unit, self.cfg, older)

    def step(self, batch: Batch) -> StepMetrics:
        """One corrected GRPO step; returns its metrics. Runs on `self.threads`
        intra-op threads when set (the process's count is restored after)."""
        with torch_threads(self.threads), bf16_gemms(masked=True) as rerouted, \
                (contextlib.nullcontext() if rerouted else fp32_attention_backward()), \
                head_numerics(self._loss_model(), self.cfg.lm_head):
            return self._step(batch)

    def _step(self, batch: Batch) -> StepMetrics:
        model = self._loss_model()
        model.zero_grad(set_to_none=True)
        loss, m, ent, logp, cand, mask = batch_loss(model, self._rows(batch), self.cfg.correction,
                                                    self.share_prefix)
        loss_value = self._backward(loss, m)
        with torch.no_grad():
            grad_norm = self._apply_gradients()
            out = self._metrics(m, ent, logp, cand, batch, mask)
        return replace(out, loss=loss_value, grad_norm=float(grad_norm),
                       skipped_nonfinite=not bool(torch.isfinite(grad_norm)))

    # the step's hooks (single process: the whole batch on the BF16 cast, gradients to the master)

    def _loss_model(self) -> torch.nn.Module:
        """The module the loss runs on."""
        return self.compute

    def _rows(self, batch: Batch) -> Batch:
        """The rows of the batch this trainer scores."""
        return batch

    def _backward(self, loss: torch.Tensor, m: dict[str, torch.Tensor]) -> float:
        """Backpropagate the loss (a mean over the scored rows' valid tokens); returns the
        batch's loss."""
        loss.backward()
        return float(loss.detach())

    def _apply_gradients(self) -> torch.Tensor:
        """Clip, step AdamW (skipped on a non-finite gradient norm), zero the gradients; returns
        the global gradient norm before clipping."""
        for p, mp in zip(self.compute.parameters(), self.master.parameters()):
            mp.grad = None if p.grad is None else p.grad.float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.optim.grad_clip)
        if torch.isfinite(grad_norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._sync_compute()
        return grad_norm

    def _metrics(self, m: dict, ent: torch.Tensor, logp: torch.Tensor, cand: torch.Tensor,
                 batch: Batch, mask: torch.Tensor) -> StepMetrics:
        """The step's metrics (step_metrics) from the scored rows' loss metrics and scores."""
        return step_metrics(m, ent, logp.detach(), cand.detach(), batch, mask)
