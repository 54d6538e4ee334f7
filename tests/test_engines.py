"""Engines on a tiny random Qwen3-MoE: attention emulation, numerics, sampler and scorer."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from mismatch.engines.attention import KERNEL_FAMILIES, KernelFamily, quantize_kv, tiled_attention
from mismatch.engines.hf_attention import ATTN_IMPL
from mismatch.engines.numerics import apply_numerics, calibrate
from mismatch.engines.served_weights import quantizable_weights
from mismatch.engines.logits import SamplingParams, process_logits, process_rows
from mismatch.engines.generation import generate
from mismatch.engines.scorer import score
from mismatch.metrics import kl_estimators
from mismatch.profiles import resolve
from mismatch.quantize import decode, encode


@pytest.fixture(scope="module")
def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=256)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)  # peakier next-token distributions than the default init
    return model


PROMPTS = [[5, 9, 13, 200, 7], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def _reference_attention(q, k, v, allowed, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, -math.inf)
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("tq,tk", [(7, 7), (1, 300), (5, 260)])
def test_tiled_attention_matches_float64_reference(tq, tk):
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q, k, v = (torch.randn(2, 3, t, 32, generator=g) for t in (tq, tk, tk))
    allowed = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)[None, None].expand(2, 1, tq, tk)
    allowed = allowed.clone()
    allowed[1, :, :, :3] = False  # left padding in the second sequence
    ref = _reference_attention(q, k, v, allowed, 0.17)
    live = allowed.any(-1, keepdim=True).expand_as(ref[..., :1]).expand_as(ref)  # padded queries
    ref = torch.where(live, ref, torch.zeros_like(ref))  # fully masked rows: 0, as kernels give
    exact_family = KernelFamily(name="t", tile_k=64, decode_tile_k=96, decode_splits=3,
                                 p_in_input_dtype=False)
    out = tiled_attention(q, k, v, allowed, 0.17, exact_family)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5)
    # with BF16 inputs and P rounded to BF16 before P·V (FlashAttention's habit) it stays close
    bf = tiled_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), allowed, 0.17,
                         KERNEL_FAMILIES["fa2"])
    assert bf.dtype == torch.bfloat16
    assert torch.allclose(bf.double(), ref, atol=3e-2, rtol=3e-2)


def _online_softmax_written_out(q, k, v, allowed, scale, family):
    """tiled_attention as its docstring states it, every step from the empty state (m = −inf,
    l = 0, o = 0) and the split merge from zeros: the bits `tiled_attention` must give."""
    b, h, tq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    decode = tq == 1
    tile = family.decode_tile_k if decode else family.tile_k
    tk = k.shape[2]
    per = max(tile, math.ceil(tk / (family.decode_splits if decode else 1) / tile) * tile)
    qf, kf, vf = q.float().reshape(b, hkv, g * tq, d), k.float(), v.float()
    allowed = allowed.expand(allowed.shape[0], 1, tq, tk).repeat(1, 1, g, 1)
    parts = []
    for s0 in range(0, tk, per):
        m = torch.full((b, hkv, g * tq), -math.inf)
        l, o = torch.zeros_like(m), torch.zeros(b, hkv, g * tq, d)
        for k0 in range(s0, min(tk, s0 + per), tile):
            k1 = min(k0 + tile, s0 + per)
            s = torch.matmul(qf, kf[:, :, k0:k1].transpose(-1, -2)) * scale
            s = s.masked_fill(~allowed[..., k0:k1], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf),
                                          m - m_safe))
            l = l * alpha + p.sum(-1)
            if family.p_in_input_dtype:
                p = p.to(v.dtype).float()
            o = o * alpha[..., None] + torch.matmul(p, vf[:, :, k0:k1])
            m = m_new
        parts.append((m, l, o))
    if len(parts) == 1:
        m, l, o = parts[0]
    else:
        m = torch.stack([x[0] for x in parts]).amax(0)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        l, o = torch.zeros_like(m), torch.zeros_like(parts[0][2])
        for pm, pl, po in parts:
            w = torch.exp(torch.where(torch.isinf(pm), torch.full_like(pm, -math.inf), pm - m_safe))
            l = l + pl * w
            o = o + po * w[..., None]
    out = o / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.reshape(b, h, tq, -1).to(q.dtype)


@pytest.mark.parametrize("family", ["fa2", "fa3", "flashinfer", "trtllm", "fp32-p"])
def test_tiled_attention_is_the_online_softmax_bit_for_bit(family):
    """The kernel skips the rescaling of the empty state (it multiplies zeros) and merges split
    partials without zero tensors; the bits are those of the online softmax written out: decode
    with one and several tiles per split, ragged last tiles, prefill, a fully masked row."""
    fam = KERNEL_FAMILIES.get(family) or KernelFamily(
        name="t", tile_k=48, decode_tile_k=32, decode_splits=3, p_in_input_dtype=False)
    g = torch.Generator().manual_seed(len(family))
    for tq, tk in [(1, 1), (1, 70), (1, 300), (1, 900), (1, 1500), (9, 9), (6, 260)]:
        q = torch.randn(5, 4, tq, 32, generator=g).bfloat16()
        k, v = (torch.randn(5, 2, tk, 32, generator=g).bfloat16() for _ in range(2))
        allowed = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)[None, None].repeat(5, 1, 1, 1)
        allowed[1, ..., :min(tk, 7)] = False  # left padding
        allowed[3] = False  # a row with no key (its values negative: P·V of zeros is ±0)
        v[3] = -v[3].abs()
        got = tiled_attention(q, k, v, allowed, 0.17, fam)
        want = _online_softmax_written_out(q, k, v, allowed, 0.17, fam)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tq, tk)


def test_quantize_kv_is_an_fp8_round_trip():
    x = torch.tensor([0.1, -3.3, 500.0, 1e-4]).bfloat16()
    ref = x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float().bfloat16()
    assert torch.equal(quantize_kv(x), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_kv_is_idempotent_on_every_value(dtype):
    """Every finite value of the compute dtype: a key rounded once as the cache stores it is
    unchanged by rounding it again (what lets the engine's cache round each position once, at
    write, while attention skips the values it marks as stored; hf_attention)."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    once = quantize_kv(x)
    assert torch.equal(quantize_kv(once).view(torch.int16), once.view(torch.int16))
    ref = x.double().clamp(-448, 448).to(torch.float8_e4m3fn).double()  # float64 reference
    assert torch.equal(once.double(), ref)


def test_a_kv_cache_serves_one_kv_format_and_blocks_are_per_thread(tiny_moe):
    import threading

    from mismatch.engines.hf_attention import emulated_attention, kv_store_rounding
    from mismatch.engines.kv_cache import SlotCache

    with emulated_attention(tiny_moe, KERNEL_FAMILIES["fa3"], True):
        rounding = kv_store_rounding()
        assert rounding is not None and kv_store_rounding() is rounding  # one for the block
        cache = SlotCache(1, 1, 2, 32, 8, torch.bfloat16, torch.device("cpu"))
        cache.plan(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), 1, 1)
        seen = []
        worker = threading.Thread(target=lambda: seen.append(kv_store_rounding()))
        worker.start()
        worker.join()
        assert seen == [None]  # another thread's block is not this one's
        k = torch.full((1, 2, 1, 32), 0.1003, dtype=torch.bfloat16)
        stored, _ = cache.update(k, k, 0)
        assert torch.equal(stored, quantize_kv(k))  # rounded once, as it was written
    assert kv_store_rounding() is None
    with pytest.raises(RuntimeError, match="one engine per apply_numerics block"):
        cache.update(k, k, 0)


def test_quantizable_weights_group_and_exclude(tiny_moe):
    groups = quantizable_weights(tiny_moe)
    assert "model.layers.0.self_attn.qkv" in groups
    assert len(groups["model.layers.0.self_attn.qkv"]) == 3
    assert "model.layers.1.mlp.experts.7.gate_up" in groups
    names = [n for members in groups.values() for n, _ in members]
    assert not any("lm_head" in n or "embed" in n or n.endswith("mlp.gate") for n in names)


def test_weight_only_linear_uses_decoded_codec_weights(tiny_moe):
    spec = resolve("h100", "w4a16-nvfp4")
    proj = tiny_moe.model.layers[0].self_attn.o_proj
    x = torch.randn(3, proj.in_features).bfloat16()
    with apply_numerics(tiny_moe, spec):
        y = proj(x)
    w = proj.weight.detach()
    ref = (x.float() @ decode(encode(w, "w4a16-nvfp4",
                                     global_scale=w.float().abs().amax() / 2688)).t()).bfloat16()
    assert torch.equal(y, ref)
    assert tiny_moe.config._attn_implementation != ATTN_IMPL  # restored


def test_numerics_are_restored_after_an_exception(tiny_moe):
    before = tiny_moe.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with apply_numerics(tiny_moe, resolve("a100", "bf16")):
            raise RuntimeError("boom")
    assert tiny_moe.config._attn_implementation == before
    proj = tiny_moe.model.layers[0].self_attn.o_proj
    x = torch.randn(2, proj.in_features).bfloat16()
    assert torch.equal(proj(x), torch.nn.functional.linear(x, proj.weight))


def test_sampler_and_scorer_agree_without_numerics(tiny_moe):
    """The same model sampling (decode path) and scoring (prefill path) agrees to BF16 noise,
    and every recorded field has its documented shape."""
    r = generate(tiny_moe, PROMPTS, SamplingParams(max_new_tokens=12, seed=1), pad_id=0,
                 eos_ids={255}, label="plain")
    b, t = r.token_ids.shape
    assert b == 3 and t == 9 + r.completion_mask[:, 9:].shape[1]
    assert r.candidate_ids.shape == (b, t, 8) and r.routed_experts.shape[:3] == (b, t, 2)
    s = score(tiny_moe, r)
    m = r.completion_mask
    kl = kl_estimators(s.logprobs, r.sampler_logprobs, m)["kl_k3"].item()
    assert 0 <= kl < 1e-3
    # the trainer's log-prob of each sampled token is within BF16 noise of the sampler's
    assert float(((s.logprobs - r.sampler_logprobs).abs() * m).max()) < 0.1
    # routing recorded on the same tokens agrees for most token-layer pairs
    have = r.routed_experts[..., 0] >= 0
    same = (r.routed_experts.sort(-1).values == s.routed_experts.sort(-1).values).all(-1)
    assert float(same[have].float().mean()) > 0.9


def test_sampling_is_seeded_and_processed_logprobs_are_renormalized(tiny_moe):
    params = SamplingParams(max_new_tokens=8, top_p=0.8, temperature=0.7, seed=3)
    a = generate(tiny_moe, PROMPTS, params, pad_id=0, eos_ids={255}, label="x")
    b = generate(tiny_moe, PROMPTS, params, pad_id=0, eos_ids={255}, label="x")
    assert torch.equal(a.token_ids, b.token_ids)
    # at temperature 1, top-p only renormalizes: processed = raw − log(kept mass) ≥ raw
    c = generate(tiny_moe, PROMPTS, SamplingParams(max_new_tokens=8, top_p=0.8, seed=3),
                 pad_id=0, eos_ids={255}, label="x")
    m = c.completion_mask.bool()
    assert bool((c.sampler_logprobs_processed[m] >= c.sampler_logprobs[m] - 1e-6).all())
    assert bool((c.sampler_logprobs_processed[m] > c.sampler_logprobs[m]).any())
    logits = torch.randn(4, 50)
    lp = process_logits(logits, params)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(4), atol=1e-5)
    assert bool((torch.isinf(lp).sum(-1) > 0).all())  # top-p dropped something


@pytest.mark.parametrize("gpu,dtype,kv", [("b200", "nvfp4", None), ("h100", "fp8", None),
                                          ("a100", "bf16", "fp8")])
def test_emulated_samplers_run_and_diverge(tiny_moe, gpu, dtype, kv):
    spec = resolve(gpu, dtype, kv)
    calib = [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long)) for p in PROMPTS]
    scales = calibrate(tiny_moe, spec, calib)
    if spec.activation_codec is not None:
        assert scales and all(float(v) > 0 for v in scales.values())
    with apply_numerics(tiny_moe, spec, scales):
        r = generate(tiny_moe, PROMPTS, SamplingParams(max_new_tokens=10), pad_id=0,
                     eos_ids={255}, label=spec.label)
    s = score(tiny_moe, r)
    kl = kl_estimators(s.logprobs, r.sampler_logprobs, r.completion_mask)["kl_k3"].item()
    assert math.isfinite(kl) and kl > 0


def test_activation_quantization_without_calibration_is_an_error(tiny_moe):
    with pytest.raises(ValueError, match="calibrated scales"):
        with apply_numerics(tiny_moe, resolve("b200", "nvfp4")):
            pass


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_emulated_weights_are_what_a_server_loads(fmt, tmp_path):
    """The emulated sampler's weights equal a real modelopt export read back with the engine's
    fusion rules (q/k/v and gate/up requantized or rescaled as vLLM does), bit for bit."""
    pytest.importorskip("modelopt", reason="nvidia-modelopt not installed (pip install -e '.[quantize]')")
    from conftest import build_tiny_model
    from mismatch.engines.served_weights import serve_weights
    from mismatch.quantize.checkpoint import QuantizeConfig, quantize_checkpoint
    from mismatch.quantize.loader import load_quantized
    from transformers import AutoModelForCausalLM

    src = build_tiny_model(tmp_path / "src", kind="moe")
    quantize_checkpoint(QuantizeConfig(model=src, format=fmt, out=tmp_path / "q", calib_samples=2,
                                       calib_seq_len=16))
    served = load_quantized(tmp_path / "q", engine_fusion=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    compared = 0
    for group, members in quantizable_weights(model).items():
        ours = torch.cat([decode(q) for q in serve_weights(group, members, fmt)])
        if group.endswith(".qkv"):
            name = group[:-len("qkv")] + "qkv_proj"
        elif group.endswith(".gate_up"):
            name = group + "_proj"
        else:
            name = members[0][0]
            name = name[:-len(".weight")] if name.endswith(".weight") else name
        if ".experts." in name and name.endswith("down"):
            name += "_proj"
        assert name in served.weights, (name, sorted(served.weights)[:5])
        assert torch.equal(ours, decode(served.weights[name])), name
        compared += 1
    assert compared >= 2 * (1 + 1 + 2 * 8)  # per layer: qkv, o, 8 experts × (gate_up, down)


def test_experts_are_intercepted(tiny_moe):
    """Fused experts must run through the emulated GEMMs (not a grouped GEMM that bypasses
    F.linear): NVFP4 weight-only changes the output of an MoE block."""
    block = tiny_moe.model.layers[0].mlp
    x = torch.randn(1, 6, 128).bfloat16()
    plain = block(x)
    with apply_numerics(tiny_moe, resolve("h100", "w4a16-nvfp4")):
        emulated = block(x)
    assert not torch.equal(plain, emulated)


def test_candidates_and_nucleus_break_ties_by_token_id():
    """One ranking rule for ties (value descending, then id ascending), whatever torch's sort and
    topk do with equal values on this machine: candidates and nucleus agree, support is a prefix."""
    from mismatch.engines.logits import ranked_topk

    logits = torch.full((3, 50), -9.0)
    logits[:, [40, 7, 23]] = 2.0        # a three-way tie at the top
    logits[:, [31, 5]] = 1.0            # a two-way tie below it
    logits[1] = logits[1].flip(-1)      # the same values at other ids
    vals, ids = ranked_topk(logits, 6)
    for row in range(3):
        want = sorted(range(50), key=lambda t: (-float(logits[row, t]), t))[:6]
        assert ids[row].tolist() == want
        assert torch.equal(vals[row], logits[row, want])
    params = SamplingParams(top_p=0.5, top_k=4, candidates=6)
    proc = process_logits(logits, params)
    support = torch.isfinite(proc.gather(-1, ids))
    for row in range(3):
        flags = support[row].tolist()
        n = sum(flags)
        assert flags == [True] * n + [False] * (6 - n)
        assert n == 2  # 3 tied tokens hold ~1/3 each: the first two reach p = 0.5
    kept = torch.isfinite(process_logits(logits, SamplingParams(top_k=4))).sum(-1)
    assert kept.tolist() == [4, 4, 4]  # exactly k, ties at the boundary to the lowest ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ranked_topk_selects_as_torch_topk_does(dtype):
    """The k-th largest value found by numpy's selection (FP32/FP64 rows without NaN) or torch's
    topk (anything else) gives the same ranking: against a plain sort by (value descending, id
    ascending), on rows with ties, −inf (tokens outside a nucleus) and ±0; the k-th value of a
    row with NaN is torch's."""
    from mismatch.engines import logits as lg

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 200, generator=g).round(decimals=1).to(dtype)  # many ties
    x[1, 50:] = float("-inf")
    x[2, :10] = 0.0
    x[2, 10:20] = -0.0
    for k in (1, 16, 150, 200):
        vals, ids = lg.ranked_topk(x, k)
        for row in range(6):
            key = [(-v, t) for t, v in enumerate(x[row].tolist())]
            want = [t for _, t in sorted(key)][:k]
            assert ids[row].tolist() == want, (k, row)
            assert torch.equal(vals[row].view(torch.uint8), x[row, want].view(torch.uint8))
        assert torch.equal(lg._kth_largest(x, k), x.topk(k, dim=-1).values[:, -1:])
    x[4, [3, 77]] = float("nan")  # NaN: the largest for both; numpy is not asked
    assert torch.equal(lg._kth_largest(x, 16)[[0, 1, 2, 3, 5]],
                       x.topk(16, dim=-1).values[[0, 1, 2, 3, 5], -1:])
    assert lg._kth_largest(x, 1)[4].isnan()


def test_ranked_topk_ranks_nan_first():
    """A row with NaN (which the engine screens before sampling; a user's logits processor may
    not) ranks its NaNs first by id, then the numbers: fewer NaNs than k, as many, and more."""
    from mismatch.engines.logits import ranked_topk

    x = torch.tensor([[0.5, float("nan"), 2.0, -1.0, float("nan"), float("inf")],
                      [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    for k in (1, 2, 3, 6):
        vals, ids = ranked_topk(x, k)
        assert ids[0].tolist() == [1, 4, 5, 2, 0, 3][:k], k
        assert ids[1].tolist() == [5, 4, 3, 2, 1, 0][:k], k
        assert torch.equal(vals.view(torch.int32), x.gather(-1, ids).view(torch.int32))


def test_the_kv_cache_hands_tiled_attention_a_view_and_sdpa_a_copy(model):
    """Tiled attention reads K and V in FP32, so under a block where every row attends with it
    the cache hands attention a view of its store (no compact copy), and, where the rows attend in
    one call, stores them widened as they are written (no widening per call); torch SDPA, any
    lane on it, or no block at all get a compact copy in the compute dtype. The values are the same bits either way, and a cache made
    under one block hands another block what it reads."""
    from mismatch.engines.hf_attention import (emulated_attention, kv_store_rounding,
                                               lane_attention, reads_widened, stores_widened)
    from mismatch.engines.kv_cache import SlotCache

    fa3 = KERNEL_FAMILIES["fa3"]
    # (block, attention reads FP32, the cache stores FP32): a lane block whose rows attend in
    # several calls (one per kernel family and cache format) keeps the compute dtype
    cases = [(contextlib.nullcontext(), False, False),
             (emulated_attention(model, None, False), False, False),
             (emulated_attention(model, fa3, True), True, True),
             (lane_attention(model, [(fa3, True), (fa3, True)]), True, True),
             (lane_attention(model, [(fa3, True), (KERNEL_FAMILIES["fa2"], False)]), True, False),
             (lane_attention(model, [(fa3, True), (None, False)]), False, False)]
    for block, widened, wide_store in cases:
        with block:
            assert reads_widened() is widened and stores_widened() is wide_store
            cache = SlotCache(1, 4, 2, 8, 16, torch.bfloat16, torch.device("cpu"))
            cache.plan(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([3, 3]), 3, 3)
            new = torch.randn(2, 2, 3, 8).bfloat16()
            k, v = cache.update(new, new + 1, 0)
            assert k.is_contiguous() is not widened
            assert (k.data_ptr() == cache.keys[0][1:3, :, :3].data_ptr()) is widened
            assert torch.equal(k, cache.keys[0][1:3, :, :3]) and k.shape == (2, 2, 3, 8)
            assert torch.equal(v, cache.values[0][1:3, :, :3])
            assert k.dtype == v.dtype == cache.keys[0].dtype == \
                (torch.float32 if wide_store else torch.bfloat16)
            # an FP8 cache (where the block has lanes, the first one's) rounds what it stores
            fp8 = kv_store_rounding() is not None
            want_k, want_v = (quantize_kv(new), quantize_kv(new + 1)) if fp8 else (new, new + 1)
            assert torch.equal(k, want_k.to(k.dtype)) and torch.equal(v, want_v.to(v.dtype))
    fa2 = KERNEL_FAMILIES["fa2"]
    with emulated_attention(model, fa2, False):  # made for a tiled kernel: stored in FP32
        cache = SlotCache(1, 4, 2, 8, 16, torch.bfloat16, torch.device("cpu"))
    rows = torch.tensor([1, 2])
    cache.plan(rows, torch.tensor([0, 0]), torch.tensor([3, 3]), 3, 3)
    new = torch.randn(2, 2, 3, 8).bfloat16()
    with emulated_attention(model, None, False):  # read by torch SDPA: a BF16 copy
        k, v = cache.update(new, new + 1, 0)
    assert cache.keys[0].dtype == torch.float32 and k.dtype == v.dtype == torch.bfloat16
    assert k.is_contiguous() and torch.equal(k, new) and torch.equal(v, new + 1)


def test_the_nucleus_after_top_k_is_the_sorted_one_bit_for_bit(monkeypatch):
    """With top-k truncation the nucleus is cut from the top-k ranking the step already has, not
    from a stable sort of the whole row: the same log-probs to the bit, on BF16-valued logits
    (ties everywhere, as a BF16 head gives) and ±0; a batch with a row of fewer finite values
    than k, or with NaN, takes the sort."""
    from mismatch.engines import logits as lg

    g = torch.Generator().manual_seed(7)
    clean = (torch.randn(40, 768, generator=g) * 4).bfloat16().float()  # many equal values
    clean[4, :300] = 0.0
    clean[4, 300:400] = -0.0
    clean[6] = 1.5  # one value everywhere
    short = clean.clone()
    short[3, 20:] = float("-inf")  # fewer finite values than k
    nan = clean.clone()
    nan[5, 9] = float("nan")

    def sorting(*args, **kwargs):
        raise AssertionError("the nucleus sorted a batch it had the ranking of")

    for x, ranked_path in ((clean, True), (short, False), (nan, False)):
        for top_k, top_p, temperature in [(64, 0.97, 1.0), (8, 0.5, 0.7), (1, 0.9, 1.0),
                                           (700, 0.99, 1.3), (768, 0.9, 1.0), (64, 1.0, 1.0)]:
            params = SamplingParams(top_k=top_k, top_p=top_p, temperature=temperature)
            got = lg.process_logits(x, params)
            z = x / temperature
            vals, ids = lg.ranked_topk(z, top_k)
            z = torch.full_like(z, float("-inf")).scatter(-1, ids, vals)
            want = torch.log_softmax(lg._nucleus(z, top_p, None) if top_p < 1 else z, dim=-1)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (top_k, top_p)
            kept = torch.isfinite(got).sum(-1)
            assert int(kept.max()) <= top_k and int(kept[[0, 1, 2]].min()) >= 1
            if ranked_path and top_p < 1 and top_k < x.shape[-1]:
                with monkeypatch.context() as m:
                    m.setattr(torch.Tensor, "sort", sorting)
                    fast = lg._nucleus(z, top_p, (vals, ids))
                assert torch.equal(fast, lg._nucleus(z, top_p, None))


def test_process_rows_takes_the_raw_log_softmax_where_nothing_truncates():
    """Rows at temperature 1 without top-k or top-p get the caller's log-softmax itself (the
    engine's `raw`), the bits `process_logits` computes; the other rows are processed as before,
    on rows with ties, −inf, +inf and NaN."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 4
    logits[1, :10] = float("-inf")
    logits[2, 3] = float("inf")
    logits[3, 7] = float("nan")
    logits[4] = logits[4].round()
    raw = torch.log_softmax(logits, dim=-1)
    plain, nucleus = SamplingParams(), SamplingParams(top_p=0.9)
    hot, topk = SamplingParams(temperature=0.7), SamplingParams(top_k=5)
    assert process_rows(logits, [plain] * 6, raw) is raw
    want = process_logits(logits, plain)
    assert torch.equal(raw.view(torch.int32), want.view(torch.int32))
    mixed = [plain, nucleus, hot, plain, topk, plain]
    got, ref = process_rows(logits, mixed, raw), process_rows(logits, mixed)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    for i, p in enumerate(mixed):
        assert torch.equal(got[i].view(torch.int32),
                           process_logits(logits[i:i + 1], p)[0].view(torch.int32))
