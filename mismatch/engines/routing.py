"""MoE router numerics: router logits precision, and routing replay.

A Qwen3-MoE-style router computes `logits = hidden @ W_gate.T` in the compute dtype (Hugging Face
and serving engines), takes a softmax in FP32, keeps the top-k experts and (optionally)
renormalizes their weights. Two things about it matter for mismatch:

- **logits precision.** Some trainers compute the router GEMM in FP32 (Megatron-LM's
  `--moe-router-dtype fp32`); the sampler computes it in BF16. Near-tied experts then flip.
- **routing replay.** The trainer can be forced to use the experts the sampler chose (routing
  replay, "R3": Ma et al. 2025, *Stabilizing MoE RL by aligning training and inference
  routers*), keeping its own gate probabilities over those experts. The KL that remains is
  mismatch not due to routing; the difference to the unreplayed KL is routing's share.

`router_numerics(model, dtype, replay)` patches each router's forward for the duration of the
block (instance attribute, removed in `finally`), like numerics.py does for linear layers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["routers", "router_numerics"]


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order."""
    return [m for m in model.modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and hasattr(m, "weight")
            and isinstance(getattr(m, "weight"), torch.nn.Parameter)]


def _forward(router: torch.nn.Module, fp32: bool, replay: torch.Tensor | None):
    def forward(hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, router.weight.shape[-1])
        if fp32:
            logits = F.linear(h.float(), router.weight.float())
        else:
            logits = F.linear(h, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        _, index = torch.topk(probs, router.top_k, dim=-1)
        if replay is not None:
            if replay.shape != index.shape:
                raise ValueError(f"routing replay: router saw {tuple(index.shape)} choices, the "
                                 f"replayed record holds {tuple(replay.shape)}; replay needs the "
                                 f"same sequences in the same layout")
            known = (replay >= 0).all(-1, keepdim=True)  # -1: no record (pad, last token)
            index = torch.where(known, replay.to(index.device), index)
        weights = probs.gather(-1, index)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), index

    return forward


@contextlib.contextmanager
def router_numerics(model: torch.nn.Module, dtype: str = "compute",
                    replay: torch.Tensor | None = None):
    """Inside the block, routers compute their logits in `dtype` ("compute" | "fp32") and, with
    `replay` [B, T, L, k] (the sampler's experts per layer; -1 where unknown), use those experts
    for every call on exactly B·T tokens. Nothing is patched for ("compute", None)."""
    if dtype not in ("compute", "fp32"):
        raise ValueError(f"router dtype must be 'compute' or 'fp32', got {dtype!r}")
    found = routers(model)
    if dtype == "compute" and replay is None or not found:
        yield
        return
    if replay is not None and replay.shape[2] != len(found):
        raise ValueError(f"routing replay holds {replay.shape[2]} layers, the model has "
                         f"{len(found)} routers")
    patched = []  # (router, the instance forward it had: an outer block's patch, or None)
    try:
        for layer, router in enumerate(found):
            chosen = None if replay is None else replay[:, :, layer].reshape(-1, replay.shape[-1])
            patched.append((router, router.__dict__.get("forward")))
            router.forward = _forward(router, dtype == "fp32", chosen)
        yield
    finally:
        for router, previous in patched:
            if previous is None:
                del router.forward
            else:
                router.forward = previous
