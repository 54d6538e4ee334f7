"""Fused-MoE activation quantization as serving kernels do it: once per token, not per expert.

A fused MoE kernel (vLLM's CUTLASS FP4/FP8 MoE, TRT-LLM's) quantizes the layer's input once —
per-token blocks, one global scale for all experts — dispatches the quantized rows to experts,
and quantizes the intermediate activations of all experts in one pass as well. Quantization is
row-wise, so the values equal those of quantizing each expert's gathered rows separately; doing it
once is what makes the emulated W4A4 sampler affordable (two quantization calls per MoE layer
instead of two per expert hit). numerics.py installs `experts_forward` on every fused-experts
module of the Qwen3-MoE layout (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], `act_fn`).
Its arithmetic is transformers' eager experts loop, bit for bit (tests/test_engine_moe.py): the
routing comes from one stable sort instead of a mask per expert, the activation and the routing
weights run over all experts' rows at once (elementwise), and each expert's output is still
added with its own `index_add_`, in expert order. Only the GEMMs and the quantization are the
emulator's. With codes-level GEMM accumulation (FP8 on Hopper) the stage's quantized values
are the E4M3 elements themselves (numerics.py scales each GEMM's output instead), and the
stage's expert GEMMs run as one batched GEMM (`mode.expert_gemms`), bit for bit the per-expert
ones: a decode step's expert GEMMs are a few rows each, so their fixed cost is what they cost.
"""

from __future__ import annotations

import torch

__all__ = ["experts_forward", "is_fused_experts"]


def is_fused_experts(module: torch.nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gu.ndim == 3 and down.ndim == 3 and hasattr(module, "act_fn")
            and not getattr(module, "is_transposed", False)
            and getattr(module, "has_gate", True) and not getattr(module, "has_bias", False))


def _routes(top_k_index: torch.Tensor, n_experts: int):
    """The experts a stage's tokens hit, in expert order, and for each its tokens' (top-k slot,
    token) pairs ordered by slot then token (what `torch.where` over the [k, N] one-hot mask of
    the expert gives): one stable sort of the slot-major expert ids instead of a mask per
    expert."""
    n = top_k_index.shape[0]
    flat = top_k_index.t().reshape(-1)  # slot-major: index = slot * N + token
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    hit = [e for e, c in enumerate(counts) if c]
    slot, token = order.div(n, rounding_mode="floor"), order.remainder(n)
    sizes = [counts[e] for e in hit]
    return hit, list(slot.split(sizes)), list(token.split(sizes))


def experts_forward(module: torch.nn.Module, mode):
    """The experts forward of `mode` (numerics._Emulator): one activation quantization per
    GEMM stage when `mode.batched()`."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, H]; top_k_index, top_k_weights: [N, k]
        final = torch.zeros_like(hidden_states)
        n_experts = module.gate_up_proj.shape[0]
        batched = mode.batched()
        first_gu = mode.table[module.gate_up_proj[0].data_ptr()]  # the stage's activation key
        first_down = mode.table[module.down_proj[0].data_ptr()]
        xq = mode.quantized_input(hidden_states, first_gu) if batched else None  # (N, H), once
        hit, pos, tok = _routes(top_k_index, n_experts)
        if not hit:
            return final
        counts = [len(t) for t in tok]
        gate_up = [mode.table[module.gate_up_proj[e].data_ptr()] for e in hit]
        down = [mode.table[module.down_proj[e].data_ptr()] for e in hit]
        # each expert's rows, quantized where the stage quantized them once (the GEMMs then read
        # only those: the unquantized rows are not gathered)
        gathered = None if xq is not None else [hidden_states[t] for t in tok]
        gus = mode.expert_gemms(gate_up, gathered, None if xq is None else [xq[t] for t in tok])
        # the activation is elementwise: over all the stage's rows at once
        gate, up = torch.cat(gus).to(hidden_states.dtype).chunk(2, dim=-1)  # (Σ n_e, I) each
        inter = module.act_fn(gate) * up
        hq = mode.quantized_input(inter, first_down) if batched else None  # (Σ n_e, I)
        outs = mode.expert_gemms(down, list(inter.split(counts)),
                                 None if hq is None else list(hq.split(counts)))
        weights = top_k_weights[torch.cat(tok), torch.cat(pos), None]
        out = (torch.cat(outs).to(hidden_states.dtype) * weights).to(final.dtype)
        # one index_add_ per expert, in expert order: a single call over all of them would sum
        # a token's outputs in FP32 and round once, not round after each expert's add
        for t, rows in zip(tok, out.split(counts)):
            final.index_add_(0, t, rows)
        return final

    return forward
