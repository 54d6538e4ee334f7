"""The trainer under torch.distributed: FSDP2 (`fully_shard`) over any world size.

Each rank holds a shard of the FP32 master (every decoder layer and the root are `fully_shard`
units, so a layer's parameters are gathered only while it computes) and of the AdamW state. The
mixed-precision policy gathers the parameters in the compute dtype (BF16: the trainer's numerics,
the same cast the single-process `Trainer` makes of its master) and reduces gradients in FP32.

The loss must not depend on how the batch is split. `policy_loss` is a mean over the valid tokens
it sees, so each rank scales its loss by (its tokens × world size / the global token count): the
gradient FSDP2 averages over ranks is then the gradient of the global token mean, exactly as one
process computing the whole batch would take it. Rows are split whole (a GRPO advantage is
computed over the full batch before the split, in `build_batch`).

Backends: gloo on CPU, NCCL on GPUs. Launch with `torchrun` (it sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), or from Ray actors that set the same variables.

    torchrun --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT \\
        -m mismatch.train.distributed --batch batch.pt --out state.pt \\
        [--lr 1e-4 --correction sc+mis]

runs one step on a saved batch and writes the full updated master (rank 0): what the tests
compare with a single-process step.

`ShardedTrainer` is a `trainer.Trainer`: its `step` is the Trainer's one implementation of a
training step, with the hooks that differ overridden — each rank scores its rows of the batch,
scales its loss to the global token mean before the backward, clips the sharded gradients, and
gathers every rank's scores so that the step's metrics are those of the whole batch (the same
on every rank).
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist

from mismatch.io import atomic_path
from mismatch.runtime import torch_threads

from .batch import Batch
from .config import TrainConfig
from .rundir import check_ranks, save_checkpoint
from .trainer import StepMetrics, Trainer, arm_loss, step_metrics

__all__ = ["setup", "shard_rows", "ShardedTrainer"]


def setup(backend: str | None = None) -> tuple[int, int]:
    """Join the process group the environment describes (torchrun's variables); returns
    (rank, world size). gloo on CPU, NCCL when CUDA is there, unless `backend` says."""
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if v not in os.environ]
        if missing:
            raise ValueError(f"torch.distributed needs {', '.join(missing)} in the environment; "
                             "launch with torchrun (or set them in each Ray actor)")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def shard_rows(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's contiguous share of the batch's rows (whole episodes)."""
    n = batch.ids.shape[0]
    lo, hi = n * rank // world, n * (rank + 1) // world
    parts: dict[str, Any] = {}
    for f in fields(Batch):
        value = getattr(batch, f.name)
        parts[f.name] = value[lo:hi]
    return replace(batch, **parts)


class ShardedTrainer(Trainer):
    """FP32 master sharded with FSDP2, AdamW on the shards, loss in `compute_dtype`; `step`
    takes the whole batch (every rank the same) and returns the whole batch's metrics."""

    share_prefix = False
    """Whole rows: FSDP2's hooks gather a module's weights for the backward of one forward, and
    a shared prompt's forward before the rows' own one fails in the backward (measured, torch
    2.13: "setStorage … out of bounds for storage of size 0")."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if cfg.trainer_dtype != "bf16":
            raise ValueError("--trainer-dtype fp32 trains on one trainer rank; leave "
                             "--trainer-ranks at 1")
        if cfg.lm_head != "compute":
            raise ValueError("--lm-head fp32 trains on one trainer rank; leave --trainer-ranks "
                             "at 1 (the sharded trainer's head runs in the compute dtype)")
        self.cfg, self.compute_dtype = cfg, compute_dtype
        self.optim = cfg.optim
        self.threads = None  # the process's count (a rank is a process of its own)
        self.model = copy.deepcopy(model).float()
        self.model.train()
        # buffers (the rotary frequencies) in the compute dtype, as the single-process trainer's
        # cast has them: FSDP's policy casts parameters only, and RoPE in FP32 instead of BF16
        # moves the log-probs by more than the sampler–trainer gap of a BF16 sampler
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point():
                    module._buffers[key] = buf.to(compute_dtype)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(self.model, mp_policy=policy)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.optim.lr, betas=(0.9, 0.999),
                                     weight_decay=0.0)

    # Trainer.step's hooks

    def _loss_model(self) -> torch.nn.Module:
        return self.model

    def _rows(self, batch: Batch) -> Batch:
        return shard_rows(batch, dist.get_rank(), dist.get_world_size())

    def _backward(self, loss: torch.Tensor, m: dict[str, torch.Tensor]) -> float:
        """Scale this rank's token mean by (its tokens × world / global tokens): the gradient
        FSDP2 averages over ranks is then that of the global token mean. Returns the global
        loss (the same on every rank)."""
        world = dist.get_world_size()
        local = torch.tensor([float(m["valid_tokens"]), 0.0])
        local[1] = loss.detach().float() * local[0]
        total = local.clone()
        dist.all_reduce(total)
        tokens = float(total[0])
        scale = local[0] * world / max(tokens, 1.0)
        (loss * scale).backward()
        return float(total[1]) / max(tokens, 1.0)

    def _apply_gradients(self) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm

    def _metrics(self, m: dict, ent: torch.Tensor, logp: torch.Tensor, cand: torch.Tensor,
                 batch: Batch, mask: torch.Tensor) -> StepMetrics:
        """Every rank's scores gathered (rows in rank order: the batch's), and the metrics of
        the whole batch computed from them as one process would."""
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (logp.detach(), cand.detach(), ent))
        logp, cand, ent = (torch.cat([p[i] for p in parts]) for i in range(3))
        _, m, mask = arm_loss(logp, cand, batch, self.cfg.correction)
        return step_metrics(m, ent, logp, cand, batch, mask)

    def state(self) -> dict[str, Any]:
        """The whole FP32 master and AdamW state (keyed by parameter name), gathered to CPU on
        rank 0 (a collective; the other ranks get empty dicts)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        master, optim = get_state_dict(self.model, self.opt, options=opts)
        return {"master": master, "optimizer": optim, "trainer_ranks": dist.get_world_size()}

    def load(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint written by `state` (every rank gets the whole state)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        check_ranks(state, dist.get_world_size())
        set_state_dict(self.model, self.opt, model_state_dict=state["master"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))

    def published(self) -> dict[str, torch.Tensor]:
        """The weights samplers load: the whole master cast to the compute dtype (a collective;
        every rank gets them)."""
        return {n: v.to(self.compute_dtype) for n, v in self.full_state_dict().items()}

    def save(self, out, step: int, next_unit: int,
             older: dict[int, dict[str, torch.Tensor]] | None = None):
        """The checkpoint of `step`, written by rank 0 (a collective: the state is gathered
        from every rank); None on the other ranks."""
        state = self.state()
        if dist.get_rank() != 0:
            return None
        return save_checkpoint(out, step, state, next_unit, self.cfg, older)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole FP32 master, gathered (a collective: every rank must call it)."""
        out = {}
        for name, value in self.model.state_dict().items():
            out[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="One FSDP2 trainer step on a saved batch.")
    ap.add_argument("--batch", required=True, help="torch.save'd train.batch.Batch")
    ap.add_argument("--out", required=True, help="where rank 0 writes the updated master")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--correction", default="sc+mis")
    ap.add_argument("--compute-dtype", default="bf16", choices=("bf16", "fp32"))
    args = ap.parse_args(argv)
    rank, world = setup()
    from mismatch.zoo import load_model

    with torch_threads(1):  # each rank a process on one core
        batch = torch.load(args.batch, weights_only=False)
        cfg = TrainConfig.flat(fleet="homogeneous", correction=args.correction, lr=args.lr)
        dtype = torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32
        trainer = ShardedTrainer(load_model(dtype="float32"), cfg, compute_dtype=dtype)
        metrics = trainer.step(batch)
        state = trainer.full_state_dict()
    if rank == 0:
        with atomic_path(args.out) as tmp:
            torch.save({"master": state, "metrics": metrics, "world": world}, tmp)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
