"""mismatch.plan.hardware and mismatch.plan.throughput: the price table, the bytes each format
moves, the decode roofline against hand arithmetic, the MoE expert expectation against brute
force, and configs' parameter counts against the models transformers builds from them."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from mismatch.plan import PlanInputError
from mismatch.plan.hardware import HARDWARE, PRICES, default_price, hardware
from mismatch.plan.throughput import (BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY,
                                      MEMORY_UTILIZATION, ModelShape, compute_format,
                                      decode_throughput, distinct_experts,
                                      kv_bytes_per_element, weight_bytes_per_element)
from mismatch.profiles import GPUS, resolve

# A dense Llama-style toy: per layer q 64x64, k and v 64x32, o 64x64 (12,288), MLP 3x64x128
# (24,576), two norms (128); two layers plus the final norm: 74,048 dense parameters.
TOY = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
       "tie_word_embeddings": False}
TOY_DENSE = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}


def test_bytes_per_weight_are_exact_per_format():
    cases = {("b200", "nvfp4"): 0.5 + 1 / 16, ("b200", "w4a16-nvfp4"): 0.5 + 1 / 16,
             ("b200", "mxfp4"): 0.5 + 1 / 32, ("h100", "fp8"): 1.0, ("a100", "fp8"): 1.0,
             ("h100", "bf16"): 2.0, ("a100", "fp16"): 2.0}
    for (gpu, dtype), want in cases.items():
        assert weight_bytes_per_element(resolve(gpu, dtype)) == want, (gpu, dtype)
    assert kv_bytes_per_element(resolve("b200", "nvfp4", "fp8")) == 1.0
    assert kv_bytes_per_element(resolve("b200", "nvfp4", "bf16")) == 2.0
    assert [compute_format(resolve(g, d)) for g, d in
            (("a100", "fp8"), ("h100", "fp8"), ("h100", "mxfp4"), ("b200", "nvfp4"),
             ("b300", "mxfp4"), ("h200", "fp16"))] == ["bf16", "fp8", "bf16", "fp4", "fp4", "fp16"]


def test_toy_config_counts_by_hand():
    s = ModelShape.from_config(TOY)
    assert (s.dense_params, s.total_params) == (TOY_DENSE, TOY_DENSE + 2 * 100 * 64)
    assert s.active_params == TOY_DENSE + 100 * 64 + 64  # head + one embedding row
    assert (s.kv_heads, s.head_dim, s.kv_layers, s.experts) == (2, 16, 2, 0)


def test_single_sequence_decode_is_bytes_over_bandwidth():
    """Batch 1 is memory-bound: the step is the bytes read over achieved bandwidth, exactly."""
    s = ModelShape.from_config(TOY)
    e = decode_throughput(s, "h100", "bf16", batch=1, context=10)
    weights = 2.0 * (TOY_DENSE + 100 * 64 + 64)  # dense part, LM head, one embedding row
    kv = 10 * 2 * 2 * 2 * 16 * 2.0  # context x layers x (K, V) x kv heads x head_dim x BF16
    step = (weights + kv) / (3.35e12 * BANDWIDTH_EFFICIENCY)
    assert e.bound == "memory" and e.batch == 1 and e.gpus == 1 and e.batch_limit == "given"
    assert (e.weight_bytes, e.kv_bytes) == (weights, kv)
    assert e.tokens_per_s == pytest.approx(1 / step, rel=1e-12)
    assert e.step_ms == pytest.approx(step * 1e3, rel=1e-12)


def test_fp8_beats_bf16_on_h100_when_memory_bound():
    s = ModelShape.from_config(QWEN3_30B_A3B)
    fp8, bf16 = (decode_throughput(s, "h100", d, batch=16, context=512, gpus=1)
                 for d in ("fp8", "bf16"))
    assert fp8.bound == bf16.bound == "memory"
    assert fp8.weight_bytes < 0.51 * bf16.weight_bytes
    assert 1.5 < fp8.tokens_per_s / bf16.tokens_per_s < 2.0


def test_a100_fp8_moves_fp8_bytes_but_computes_at_the_bf16_peak():
    s = ModelShape.from_config({**TOY, "hidden_size": 1024, "intermediate_size": 4096,
                                "num_attention_heads": 8, "num_key_value_heads": 1})
    a8, a16 = (decode_throughput(s, "a100", d, batch=256, context=1) for d in ("fp8", "bf16"))
    assert a8.compute_format == "bf16" and a8.peak_tflops == hardware("a100").tflops("bf16") == 312
    assert a8.weight_bytes < 0.6 * a16.weight_bytes
    assert a8.bound == a16.bound == "compute"  # 256 tokens per weight byte: past the ridge
    roof = a8.flops / (312e12 * COMPUTE_EFFICIENCY)
    assert a8.step_ms == pytest.approx(roof * 1e3, rel=1e-12) == a16.step_ms
    h8 = decode_throughput(s, "h100", "fp8", batch=256, context=1)
    assert h8.compute_format == "fp8" and h8.peak_tflops == pytest.approx(1979)


def test_distinct_experts_matches_exhaustive_enumeration():
    E, k, b = 6, 2, 3
    choices = list(itertools.combinations(range(E), k))
    counts = [len(set().union(*combo)) for combo in itertools.product(choices, repeat=b)]
    assert distinct_experts(E, k, b) == pytest.approx(np.mean(counts), rel=1e-12)
    assert distinct_experts(E, k, 1) == pytest.approx(k)
    assert distinct_experts(0, 0, 5) == 0.0


def test_distinct_experts_matches_monte_carlo_and_bounds_skewed_routing():
    rng = np.random.default_rng(0)
    E, k, b, n = 128, 8, 16, 4000
    draws = np.array([len(np.unique(np.concatenate([rng.choice(E, k, replace=False)
                                                    for _ in range(b)]))) for _ in range(n)])
    se = draws.std() / math.sqrt(n)
    assert abs(draws.mean() - distinct_experts(E, k, b)) < 4 * se
    p = rng.dirichlet(np.ones(E)) * k  # skewed selection probabilities summing to k
    p = np.minimum(p, 1.0)
    assert np.sum(1 - (1 - p) ** b) <= distinct_experts(E, k, b) + 1e-9


def test_moe_step_reads_top_k_experts_at_batch_one_and_all_at_large_batch():
    s = ModelShape.from_config(QWEN3_30B_A3B)
    expert = 3 * 2048 * 768
    assert s.expert_params == expert and s.moe_layers == 48 and s.experts == 128
    head = 151936 * 2048 * 2.0
    one = s.step_weight_bytes(1, 1.0, 2.0)
    assert one == pytest.approx(s.dense_params + 48 * 8 * expert + head + 2048 * 2.0)
    many = s.step_weight_bytes(10_000, 1.0, 2.0)  # every expert; 10,000 embedding rows
    assert many == pytest.approx(s.dense_params + 48 * 128 * expert + head + 10_000 * 2048 * 2.0,
                                 rel=1e-9)
    assert s.total_params == pytest.approx(30.5e9, rel=0.01)


def test_batch_is_limited_by_memory():
    s = ModelShape.from_config({**TOY, "num_hidden_layers": 64, "num_key_value_heads": 4,
                                "hidden_size": 4096, "intermediate_size": 12288,
                                "num_attention_heads": 32})
    e = decode_throughput(s, "h100", "bf16", context=8192, gpus=1)
    per_seq = 8192 * 64 * 2 * 4 * 128 * 2.0
    fits = int((80e9 * MEMORY_UTILIZATION - e.resident_weight_bytes) // per_seq)
    assert 0 < fits < 256
    assert (e.batch, e.memory_batch, e.batch_limit) == (fits, fits, "memory")
    with pytest.raises(PlanInputError, match="does not fit"):
        decode_throughput(s, "h100", "bf16", context=8192, gpus=1, batch=fits + 1)


def test_tensor_parallel_when_one_gpu_cannot_hold_the_model():
    s = ModelShape.from_config(QWEN3_30B_A3B)  # 61 GB in BF16: one A100 holds it, barely
    e = decode_throughput(s, "a100", "bf16")
    assert e.gpus > 1 and e.resident_weight_bytes > 60e9
    assert e.tokens_per_s * e.gpus == pytest.approx(e.batch / (e.step_ms / 1e3), rel=1e-12)
    big = ModelShape(name="huge", layers=8, hidden=8192, vocab=1000, kv_heads=8, head_dim=128,
                     dense_params=400_000_000_000)
    with pytest.raises(PlanInputError, match="give tokens_per_s") as err:
        decode_throughput(big, "h100", "bf16")
    assert "\n" not in str(err.value)


def test_compute_roof_and_latency_bound():
    s = ModelShape.from_config({**TOY, "hidden_size": 1024, "intermediate_size": 4096,
                                "num_attention_heads": 8, "num_key_value_heads": 1})
    e = decode_throughput(s, "a100", "bf16", context=16, max_batch=4096)
    roof = 312e12 * COMPUTE_EFFICIENCY / (2 * s.active_params)
    assert e.bound == "compute" and e.batch_limit == "compute" and e.batch < e.memory_batch
    assert e.tokens_per_s == pytest.approx(roof, rel=1e-9)
    late = decode_throughput(ModelShape.from_config(QWEN3_30B_A3B), "h100", "fp8", context=2048,
                             max_step_ms=8.0, gpus=1)
    assert late.step_ms <= 8.0 and late.batch_limit == "latency"


def test_bad_gpu_format_and_numbers_are_one_line_plan_errors():
    s = ModelShape.from_config(TOY)
    for args, match in ((("v100", "bf16"), "unknown gpu 'v100'"),
                        (("a100", "nvfp4"), "a100 cannot run nvfp4.*a100 can run"),
                        (("h100", "int3"), "unknown dtype")):
        with pytest.raises(PlanInputError, match=match) as err:
            decode_throughput(s, *args)
        assert "\n" not in str(err.value)
    for kw in ({"context": 0}, {"efficiency": 1.5}, {"max_batch": 2.5}, {"batch": -1}):
        with pytest.raises(PlanInputError):
            decode_throughput(s, "h100", "bf16", **kw)


def test_default_prices_and_hardware_table():
    assert set(HARDWARE) == set(GPUS) == set(PRICES)
    assert {g: default_price(g) for g in GPUS if g != "b300"} == {
        "a100": 2.50, "h100": 3.95, "h200": 4.54, "b200": 6.25, "rtx-pro-6000": 3.03}
    assert default_price("RTX_PRO_6000") == 3.03
    with pytest.raises(PlanInputError) as err:
        default_price("b300")
    assert str(err.value) == ("b300 has no published price in the default table (Modal does not "
                              "list it); give price_per_hour for the group")
    with pytest.raises(PlanInputError, match="unknown gpu 'v100'; known: a100, h100"):
        default_price("v100")
    bw = {g: h.bandwidth_tbs.value for g, h in HARDWARE.items()}
    assert bw == pytest.approx({"a100": 2.04, "h100": 3.35, "h200": 4.8, "b200": 8.0,
                                "b300": 8.0, "rtx-pro-6000": 1.79}, abs=0.005)
    for h in HARDWARE.values():
        assert h.memory_gb.source and h.bandwidth_tbs.source
        assert all(s.source and s.value > 0 for _, s in h.dense_tflops)
        assert h.tflops("fp16") == h.tflops("bf16")
    with pytest.raises(PlanInputError, match="no fp8 tensor cores"):
        hardware("a100").tflops("fp8")


def test_from_config_gives_the_embedded_models_true_parameter_count():
    from mismatch.zoo.loading import default_model_dir, load_model

    model = load_model()
    true = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_dir(default_model_dir()).total_params == true
    assert ModelShape.from_config(model.config).total_params == true


def test_from_config_counts_match_the_models_transformers_builds():
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(0)
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    hybrid = Qwen3_5MoeTextConfig(num_hidden_layers=4, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=8,
                                  linear_value_head_dim=12, linear_conv_kernel_dim=4, **small)
    cases = [
        (LlamaConfig(num_hidden_layers=2, intermediate_size=96, attention_bias=True,
                     mlp_bias=True, **small), LlamaForCausalLM),
        (Qwen3Config(num_hidden_layers=2, head_dim=32, intermediate_size=96,
                     tie_word_embeddings=True, **small), Qwen3ForCausalLM),
        (Qwen2MoeConfig(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                        shared_expert_intermediate_size=80, num_experts=6, num_experts_per_tok=2,
                        mlp_only_layers=[1], **small), Qwen2MoeForCausalLM),
        (hybrid, Qwen3_5MoeForCausalLM),
    ]
    for cfg, cls in cases:
        shape = ModelShape.from_config(cfg)
        assert shape.total_params == sum(p.numel() for p in cls(cfg).parameters()), cls.__name__
    h = ModelShape.from_config(hybrid)
    assert (h.kv_layers, h.moe_layers) == (1, 4)  # one full-attention layer in four
    conv_dim = 2 * 2 * 8 + 4 * 12
    assert h.state_bytes == 3 * (4 * 8 * 12 * 4 + conv_dim * 3 * 2)  # FP32 SSM + BF16 conv state
    wrapped = {"model_type": "qwen3_5_moe", "text_config": hybrid.to_dict()}
    assert ModelShape.from_config(wrapped).total_params == h.total_params


def test_from_dir_and_unsupported_configs_are_plan_errors(tmp_path):
    with pytest.raises(PlanInputError, match="does not exist"):
        ModelShape.from_dir(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlanInputError, match="not a readable JSON"):
        ModelShape.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TOY))
    assert ModelShape.from_dir(tmp_path).name == tmp_path.name
    with pytest.raises(PlanInputError, match="latent attention"):
        ModelShape.from_config({**TOY, "kv_lora_rank": 512})
    with pytest.raises(PlanInputError, match="hidden_size"):
        ModelShape.from_config({k: v for k, v in TOY.items() if k != "hidden_size"})
    with pytest.raises(PlanInputError, match="PretrainedConfig or a dict"):
        ModelShape.from_config(42)
