"""Lanes: several sampler groups' numerics in one engine batch.

A mixed fleet (mismatch.fleets) samples with several numerics at once: NVFP4 on B200s, FP8 on
H100s, BF16 with an FP8 KV cache on A100s. Served group by group, each group's episodes form a
small batch of their own, and small batches are what a CPU decodes worst (the model's weights
are streamed once per forward whatever its row count). Lanes put every group's sequences into
one batch and give each its own numerics inside each forward:

- the engine tags each request with a lane (`Request.lane`) and, around each forward, records
  which batch rows belong to which lane (`batch_lanes`);
- each emulated linear layer (lane_numerics.apply_lane_numerics) splits its input rows by lane and
  runs every lane's GEMM on its own rows — weights in the lane's format, activations quantized
  with the lane's scales — writing each lane's rows of one output;
- fused MoE experts, whose input rows are tokens (batch-major), run each lane's tokens through
  the lane's expert GEMMs; routers compute as the lanes share them (one router precision);
- attention (hf_attention) runs each lane's rows with the lane's kernel family, and the KV cache
  (kv_cache) rounds only the positions of lanes with an FP8 cache.

Every computation a row sees is the one its own group's batch would give it; what differs is the
batch's composition, which a real server's batch changes too (engine.py: the decode attention's
split-KV partition covers the longest context in the batch, and a CPU GEMM may block its
reduction by row count). Lanes that compute in different dtypes (one model holds one) or route
in different precisions cannot share a batch: `lanes_possible` says so, and callers serve each
group on its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch

from ..profiles import NumericsSpec

__all__ = ["batch_lanes", "rows_by_lane", "lanes_possible", "attention_of"]

_STATE = threading.local()  # .parts: this thread's current forward's [(lane, rows | None)]


def rows_by_lane() -> list[tuple[int, torch.Tensor | None]]:
    """The current forward's [(lane, batch rows)], lanes in increasing order; rows None when one
    lane holds the whole batch. Outside an engine forward: [(0, None)]."""
    return getattr(_STATE, "parts", None) or [(0, None)]


@contextlib.contextmanager
def batch_lanes(lanes: Sequence[int], device: torch.device | str = "cpu"):
    """Inside the block, batch row i of the forward belongs to lane `lanes[i]`."""
    present = sorted(set(lanes))
    if len(present) == 1:
        parts = [(present[0], None)]
    else:
        lane_of = torch.tensor(list(lanes), dtype=torch.long)
        parts = [(lane, (lane_of == lane).nonzero()[:, 0].to(device)) for lane in present]
    previous = getattr(_STATE, "parts", None)
    _STATE.parts = parts
    try:
        yield
    finally:
        _STATE.parts = previous


def lanes_possible(specs: Sequence[NumericsSpec]) -> bool:
    """Whether one batch can hold sequences of every spec in `specs`: one model in one compute
    dtype, its routers and its LM head in one precision each."""
    return all(len({getattr(s, f) for s in specs}) <= 1
               for f in ("compute_dtype", "router_dtype", "lm_head"))


def attention_of(spec: NumericsSpec) -> tuple[str, bool]:
    """What a lane's rows attend with: (kernel family name, FP8 KV cache). Lanes alike in it
    share one attention call in a batch (hf_attention); a lockstep step keeps their units in one
    sampler process (train.pipeline)."""
    return spec.attention, spec.kv_codec is not None
