"""A model's shape for the decode roofline (mismatch.plan.throughput): parameters, the ones a
token touches, layers, KV heads and recurrent state, counted from a Hugging Face config as
transformers builds the model (dense Llama / Qwen2 / Qwen3, Qwen3-MoE, Qwen3.5 hybrids)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from mismatch.plan import PlanInputError

__all__ = ["ModelShape", "distinct_experts"]


def distinct_experts(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts b tokens touch in one layer, each routing to `top_k` of
    `experts` uniformly: E · (1 − (1 − k/E)^b)."""
    if experts <= 0 or top_k <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What decode throughput needs of a model: its parameter split and its KV cache."""

    name: str = "model"
    layers: int
    """Decoder layers."""
    hidden: int
    vocab: int
    kv_heads: int
    head_dim: int
    dense_params: int
    """Parameters every step reads whatever the routing: attention and linear-attention
    projections, dense MLPs, shared experts, routers, norms (not the embedding or the head)."""
    kv_layers: int = -1
    """Layers that keep a KV cache (hybrid linear-attention models: the full-attention ones);
    -1: all `layers`."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense)."""
    experts_per_token: int = 0
    expert_params: int = 0
    """Parameters of one routed expert in one layer."""
    moe_layers: int = 0
    tied_embeddings: bool = False
    """The LM head is the embedding table (stored and counted once)."""
    state_bytes: int = 0
    """Recurrent state per sequence (linear-attention layers), bytes, all layers."""

    def __post_init__(self) -> None:
        if self.kv_layers == -1:
            object.__setattr__(self, "kv_layers", self.layers)
        for f in ("layers", "hidden", "vocab", "kv_heads", "head_dim"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) > 0):
                raise PlanInputError(f"model {self.name}: {f} must be a positive integer, got "
                                     f"{getattr(self, f)!r}")
        for f in ("dense_params", "kv_layers", "experts", "experts_per_token", "expert_params",
                  "moe_layers", "state_bytes"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) >= 0):
                raise PlanInputError(f"model {self.name}: {f} must be an integer >= 0, got "
                                     f"{getattr(self, f)!r}")
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.moe_layers
                                 and self.expert_params):
            raise PlanInputError(f"model {self.name}: a MoE needs 0 < experts_per_token <= "
                                 f"experts and positive moe_layers and expert_params")
        if self.kv_layers > self.layers or self.moe_layers > self.layers:
            raise PlanInputError(f"model {self.name}: kv_layers and moe_layers cannot exceed "
                                 f"layers ({self.layers})")

    @property
    def head_params(self) -> int:
        """The LM head (vocab · hidden)."""
        return self.vocab * self.hidden

    @property
    def routed_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def total_params(self) -> int:
        """Every parameter, the tied table counted once."""
        return (self.dense_params + self.routed_params + self.head_params
                * (1 if self.tied_embeddings else 2))

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: dense part, top-k experts, the LM head and one
        embedding row (model cards count the whole input table; it is a gather, not a GEMM)."""
        return (self.dense_params + self.moe_layers * self.experts_per_token * self.expert_params
                + self.head_params + (0 if self.tied_embeddings else self.hidden))

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to one sequence's cache."""
        return self.kv_layers * 2 * self.kv_heads * self.head_dim

    def resident_weight_bytes(self, per_weight: float, head_bytes: float) -> float:
        """Bytes the weights occupy: every expert in the serving format, embedding and head in
        the compute dtype."""
        return ((self.dense_params + self.routed_params) * per_weight
                + self.head_params * (1 if self.tied_embeddings else 2) * head_bytes)

    def step_weight_bytes(self, batch: int, per_weight: float, head_bytes: float) -> float:
        """Weight bytes one decode step at `batch` reads (module docstring)."""
        routed = self.moe_layers * distinct_experts(self.experts, self.experts_per_token,
                                                    batch) * self.expert_params
        rows = 0 if self.tied_embeddings else min(batch, self.vocab) * self.hidden
        return (self.dense_params + routed) * per_weight + (self.head_params + rows) * head_bytes

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """The shape of a Hugging Face config: a `PretrainedConfig` or a config.json dict.

        Reads the keys of dense Llama / Qwen2 / Qwen3, Qwen2-MoE / Qwen3-MoE (num_experts or
        num_local_experts, num_experts_per_tok, moe_intermediate_size, decoder_sparse_step,
        mlp_only_layers, shared_expert_intermediate_size) and the hybrid Qwen3-Next / Qwen3.5
        layouts (layer_types or full_attention_interval, linear_* Gated DeltaNet sizes, gated
        attention); a multimodal config's `text_config` is used. Parameters are counted as
        transformers builds these models (q/k norms of the Qwen3 family, biases where the config
        asks); sliding-window layers are counted as full attention (an upper bound on their KV).
        Multi-head latent attention (DeepSeek's kv_lora_rank) is refused: its cache is not
        heads · head_dim."""
        d = _config_dict(cfg)
        mt = str(d.get("model_type") or "")
        if d.get("kv_lora_rank"):
            raise PlanInputError(f"{mt or 'this model'} uses multi-head latent attention, which "
                                 f"the throughput model does not cover; give tokens_per_s")
        L = _need_int(d, "num_hidden_layers")
        h = _need_int(d, "hidden_size")
        V = _need_int(d, "vocab_size")
        heads = _need_int(d, "num_attention_heads")
        kv = int(d.get("num_key_value_heads") or heads)
        hd = int(d.get("head_dim") or h // heads)
        E = int(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts")
                or 0)
        k = int(d.get("num_experts_per_tok") or 0)
        types = _layer_types(d, L)
        moe = [E > 0 and _is_moe_layer(d, i) for i in range(L)]

        qwen3 = mt.startswith("qwen3")
        gate = bool(d.get("attn_output_gate", mt.startswith(("qwen3_next", "qwen3_5"))))
        if d.get("attention_bias"):
            attn_bias = heads * hd * (2 if gate else 1) + 2 * kv * hd + h
        elif mt.startswith("qwen2"):
            attn_bias = heads * hd + 2 * kv * hd  # Qwen2's q/k/v always carry a bias
        else:
            attn_bias = 0
        full_attn = (h * heads * hd * (2 if gate else 1) + 2 * h * kv * hd + heads * hd * h
                     + attn_bias + (2 * hd if qwen3 else 0))
        nk, nv = int(d.get("linear_num_key_heads") or 0), int(d.get("linear_num_value_heads") or 0)
        dk, dv = int(d.get("linear_key_head_dim") or 0), int(d.get("linear_value_head_dim") or 0)
        conv_k = int(d.get("linear_conv_kernel_dim") or 4)
        key_dim, value_dim = nk * dk, nv * dv
        conv_dim = 2 * key_dim + value_dim
        linear_attn = (h * (2 * key_dim + 2 * value_dim) + 2 * h * nv + conv_dim * conv_k
                       + 2 * nv + dv + value_dim * h)
        ssm_bytes = 2 if str(d.get("mamba_ssm_dtype", "float32")) in ("bfloat16", "float16") else 4
        linear_state = nv * dk * dv * ssm_bytes + conv_dim * (conv_k - 1) * 2

        bias = bool(d.get("mlp_bias"))
        dense_mlp_i = int(d.get("intermediate_size") or 0)
        moe_i = int(d.get("moe_intermediate_size") or dense_mlp_i)
        shared_i = int(d.get("shared_expert_intermediate_size") or 0)
        shared_i += int(d.get("n_shared_experts") or 0) * moe_i
        expert = 3 * h * moe_i + (2 * moe_i + h if bias else 0)
        shared_gate = h if shared_i and mt.startswith(("qwen2_moe", "qwen3_next", "qwen3_5")) else 0
        moe_dense = h * E + (3 * h * shared_i if shared_i else 0) + shared_gate
        dense_mlp = 3 * h * dense_mlp_i + (2 * dense_mlp_i + h if bias else 0)

        dense = h  # final norm
        state = 0
        for i in range(L):
            dense += 2 * h  # input and post-attention norms
            if types[i] == "linear_attention":
                dense += linear_attn
                state += linear_state
            else:
                dense += full_attn
            dense += moe_dense if moe[i] else dense_mlp
        if any(t == "linear_attention" for t in types) and not (nk and nv and dk and dv):
            raise PlanInputError("model config: linear_attention layers need linear_num_key_heads, "
                                 "linear_num_value_heads, linear_key_head_dim and "
                                 "linear_value_head_dim")
        n_moe = sum(moe)
        name = str(d.get("_name_or_path") or mt or "model")
        return cls(name=name, layers=L, hidden=h, vocab=V, kv_heads=kv, head_dim=hd,
                   dense_params=dense, kv_layers=sum(t != "linear_attention" for t in types),
                   experts=E if n_moe else 0, experts_per_token=k if n_moe else 0,
                   expert_params=expert if n_moe else 0, moe_layers=n_moe,
                   tied_embeddings=bool(d.get("tie_word_embeddings", False)), state_bytes=state)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        """The shape of a model directory's config.json (a PlanInputError when it is missing
        or not JSON)."""
        f = Path(path).expanduser() / "config.json"
        try:
            d = json.loads(f.read_text())
        except FileNotFoundError:
            raise PlanInputError(f"{f} does not exist; pass a model directory with a "
                                 f"config.json") from None
        except (OSError, ValueError) as exc:
            raise PlanInputError(f"{f} is not a readable JSON config ({type(exc).__name__})") \
                from None
        if isinstance(d, dict) and not d.get("_name_or_path"):
            d = {**d, "_name_or_path": Path(path).name}
        return cls.from_config(d)


def _config_dict(cfg: Any) -> dict:
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise PlanInputError(f"a model config must be a PretrainedConfig or a dict, got "
                             f"{type(cfg).__name__}")
    d = dict(cfg)
    text = d.get("text_config")
    if isinstance(text, Mapping) and "hidden_size" in text:
        d = {**dict(text), "_name_or_path": d.get("_name_or_path") or text.get("_name_or_path")}
    return d


def _need_int(d: Mapping, key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise PlanInputError(f"model config: {key} must be a positive integer, got {v!r}")
    return v


def _layer_types(d: Mapping, n: int) -> list[str]:
    types = d.get("layer_types")
    if types is None:
        every = int(d.get("full_attention_interval") or 0)
        if every and (d.get("linear_num_value_heads") or 0):
            return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                    for i in range(n)]
        return ["full_attention"] * n
    types = [str(t) for t in types]
    if len(types) != n:
        raise PlanInputError(f"model config: layer_types has {len(types)} entries for "
                             f"{n} layers")
    bad = sorted(set(types) - {"full_attention", "sliding_attention", "linear_attention"})
    if bad:
        raise PlanInputError(f"model config: unknown layer type {bad[0]!r}")
    return types


def _is_moe_layer(d: Mapping, i: int) -> bool:
    if i in (d.get("mlp_only_layers") or ()):
        return False
    if i < int(d.get("first_k_dense_replace") or 0):
        return False
    step = int(d.get("decoder_sparse_step") or 1)
    return (i + 1) % step == 0
