"""Fused-MoE activation quantization as serving kernels do it: once per token, not per expert.

A fused MoE kernel (vLLM's CUTLASS FP4/FP8 MoE, TRT-LLM's) quantizes the layer's input once —
per-token blocks, one global scale for all experts — dispatches the quantized rows to experts,
and quantizes the intermediate activations of all experts in one pass as well. Quantization is
row-wise, so the values equal those of quantizing each expert's gathered rows separately; doing it
once is what makes the emulated W4A4 sampler affordable (two quantization calls per MoE layer
instead of two per expert hit). numerics.py installs `experts_forward` on every fused-experts
module of the Qwen3-MoE layout (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], `act_fn`).
Its control flow is transformers' eager experts loop; only the GEMMs and the quantization are
the emulator's. With codes-level GEMM accumulation (FP8 on Hopper) the stage's quantized values
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


def experts_forward(module: torch.nn.Module, mode):
    """The experts forward of `mode` (numerics._Emulator): one activation quantization per
    GEMM stage when `mode.batched()`."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, H]; top_k_index, top_k_weights: [N, k]
        final = torch.zeros_like(hidden_states)
        n_experts = module.gate_up_proj.shape[0]
        gate_up = [mode.table[module.gate_up_proj[e].data_ptr()] for e in range(n_experts)]
        down = [mode.table[module.down_proj[e].data_ptr()] for e in range(n_experts)]
        batched = mode.batched()
        xq = mode.quantized_input(hidden_states, gate_up[0]) if batched else None  # (N, H), once
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, n_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
        routes = []
        for e in hit:
            pos, tok = torch.where(mask[e])
            routes.append((e, pos, tok))
        if not routes:
            return final
        gus = mode.expert_gemms([gate_up[e] for e, _, _ in routes],
                                [hidden_states[tok] for _, _, tok in routes],
                                None if xq is None else [xq[tok] for _, _, tok in routes])
        inter = []
        for gu in gus:
            gate, up = gu.to(hidden_states.dtype).chunk(2, dim=-1)  # (n_e, I) each
            inter.append(module.act_fn(gate) * up)
        hq = mode.quantized_input(torch.cat(inter), down[0]) if batched else None  # (Σ n_e, I)
        hqs = None if hq is None else list(hq.split([h.shape[0] for h in inter]))
        outs = mode.expert_gemms([down[e] for e, _, _ in routes], inter, hqs)
        for (e, pos, tok), out in zip(routes, outs):
            out = out.to(hidden_states.dtype) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, out.to(final.dtype))
        return final

    return forward
