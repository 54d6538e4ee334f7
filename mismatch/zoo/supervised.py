"""Supervised training of the embedded model on gold transcripts (FP32, one CPU thread).

Loss = mean next-token cross-entropy over every real token of the batch (prompt, questions and
tool results included, so the model's distribution is peaked everywhere, as a pretrained model's
is) + `router_aux_loss_coef` × the load-balancing loss of Qwen3-MoE's router, which keeps all
experts in use (a collapsed router would make routing probes meaningless).

AdamW; linear warm-up, optionally a constant stretch, then cosine decay to `min_lr_ratio` × lr;
global gradient-norm clipping.
Deterministic: the caller seeds torch before building the model and the batch stream is seeded;
with a fixed thread count every run is bitwise identical on the same machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from .data import Batch

__all__ = ["TrainConfig", "lr_factor", "train"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimizer and schedule of the supervised build."""

    steps: int = 1000
    """Optimizer steps (one batch each). Copying numbers from the question into the tool call
    (induction) emerges abruptly, around steps 450-650 at these settings for seeds 0, 1 and 2;
    the rest of the run settles it. Stopped before it, the model keeps the format but solves
    almost nothing."""
    batch_size: int = 8
    """Transcripts per batch (B)."""
    lr: float = 2e-3
    """Peak learning rate (3e-3 delayed or stalled the copying transition at batch 8)."""
    warmup_steps: int = 20
    """Linear warm-up length (capped at steps)."""
    min_lr_ratio: float = 0.05
    """Final learning rate as a share of the peak."""
    decay_from: float = 0.6
    """Share of the steps after which the cosine decay starts (before it: warm-up, then the
    peak rate held constant — a warmup-stable-decay schedule when > 0)."""
    weight_decay: float = 0.05
    """AdamW decoupled weight decay (applied to matrices only)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    max_tokens: int = 1024
    """Longest transcript accepted (the model's position range)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"TrainConfig: steps and batch_size must be >= 1, got "
                             f"{self.steps}, {self.batch_size}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.grad_clip > 0):
            raise ValueError("TrainConfig: need lr > 0, 0 <= min_lr_ratio <= 1, grad_clip > 0")
        if not 0 <= self.decay_from < 1:
            raise ValueError(f"TrainConfig.decay_from must be in [0, 1), got {self.decay_from}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("TrainConfig: warmup_steps and weight_decay must be >= 0")


def lr_factor(step: int, config: TrainConfig) -> float:
    """Learning-rate multiplier at optimizer step `step` (0-based)."""
    warmup = min(config.warmup_steps, config.steps)
    if step < warmup:
        return (step + 1) / warmup
    decay_start = max(warmup, int(config.decay_from * config.steps))
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, config.steps - decay_start)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def train(model, batches: Iterable[Batch], config: TrainConfig,
          log: Callable[[str], None] | None = None) -> list[float]:
    """Train `model` (FP32, in place) on `config.steps` batches; returns the loss of each step."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=config.betas, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    model.train()
    model.config.output_router_logits = True  # adds the load-balancing loss to `loss`
    losses: list[float] = []
    started = time.perf_counter()
    try:
        for step, batch in zip(range(config.steps), batches):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        labels=batch.labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            if log and (step % 20 == 0 or step == config.steps - 1):
                log(f"step {step + 1}/{config.steps}  loss {losses[-1]:.4f}  "
                    f"lr {scheduler.get_last_lr()[0]:.2e}  {time.perf_counter() - started:.0f}s")
    finally:
        model.config.output_router_logits = False
        model.eval()
    if len(losses) < config.steps:
        raise ValueError(f"the batch stream ended after {len(losses)} of {config.steps} steps")
    return losses
