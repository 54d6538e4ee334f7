"""The embedded model's architecture: a tiny Qwen3-MoE, as `transformers` defines it.

Every layer is a sparse MoE block (8 experts, top-2 with renormalized weights as Qwen3-MoE's
`norm_topk_prob`), attention is grouped-query with per-head RMSNorm on q and k (4 query heads and
2 KV heads of dim 32) and rotary positions. At the defaults (675 tokens padded to 768) it has
1.97M parameters, 0.79M of them active per token, and ships in BF16 (3.9 MB).

The sizes are chosen so the numerics the profiler studies are all present at a scale a CPU trains
in minutes: BF16 GEMMs with real reductions (K = 128), a router whose top-2 choice can flip under
perturbation, softmax attention over 32-dim heads, KV heads shared by two query heads.

The vocabulary is padded up to a multiple of `vocab_multiple` (as Qwen pads 151,669 tokens to
151,936); the padding rows are never the target of a training token, so training drives their
logits down and the model never samples them in practice.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelSpec", "hf_config", "padded_vocab_size"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Sizes of the tiny Qwen3-MoE."""

    hidden_size: int = 128
    """Residual stream width (H)."""
    num_layers: int = 4
    """Decoder layers (L), all MoE."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Width of each head (≥ 32 so attention kernels tile it like a real model's)."""
    num_experts: int = 8
    """Routed experts per layer (E)."""
    experts_per_token: int = 2
    """Top-k of the router (k)."""
    moe_intermediate_size: int = 128
    """Hidden width of each expert's SwiGLU."""
    max_position_embeddings: int = 1024
    """Longest sequence the rotary table is meant for."""
    rope_theta: float = 10_000.0
    """Rotary base."""
    router_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss during training (keeps all experts in use)."""
    vocab_multiple: int = 128
    """The embedding and output rows are padded to a multiple of this."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"ModelSpec.experts_per_token must be in [1, {self.num_experts}], "
                             f"got {self.experts_per_token}")
        if self.head_dim % 2 or min(self.hidden_size, self.num_layers, self.vocab_multiple) < 1:
            raise ValueError("ModelSpec: head_dim must be even; sizes must be >= 1")


def padded_vocab_size(n_tokens: int, multiple: int) -> int:
    """`n_tokens` rounded up to a multiple of `multiple`."""
    return -(-n_tokens // multiple) * multiple


def hf_config(spec: ModelSpec, *, n_tokens: int, eos_token_id: int, pad_token_id: int):
    """The `transformers.Qwen3MoeConfig` of `spec` for a tokenizer of `n_tokens` tokens."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=padded_vocab_size(n_tokens, spec.vocab_multiple),
        hidden_size=spec.hidden_size,
        intermediate_size=4 * spec.moe_intermediate_size,  # unused: no dense MLP layers
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        router_aux_loss_coef=spec.router_aux_loss_coef,
        output_router_logits=False,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="bfloat16",
    )
