"""The trainer's CPU attention: torch's BF16 flash forward as SDPA runs it, the backward in FP32
(mismatch/kernels/flash_backward.py). The forward is checked bit for bit against SDPA, the
gradients against a float64 reference and against torch's BF16 backward, and the trainer's step:
the same loss and KL, other gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import grpo_batch

from mismatch.kernels.flash_backward import (flash_attention_fp32_backward,
                                             fp32_attention_backward)

# (rows, query heads, KV heads, queries, keys, mask kind): the trainer's suffix against a shared
# prompt (a boolean mask broadcast over rows and heads), its right-padded rows (causal, no
# mask, grouped-query heads), an additive BF16 mask per row
CASES = [(127, 4, 4, 113, 230, "bool"), (16, 4, 2, 117, 117, "causal"),
         (6, 4, 2, 40, 64, "bool"), (5, 4, 4, 33, 47, "additive")]


def _inputs(b, h, hkv, tq, tk, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, t, 32, generator=g).bfloat16()
               for n, t in ((h, tq), (hkv, tk), (hkv, tk)))
    allowed = (torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None])[None, None]
    if kind == "bool":
        mask = allowed
    elif kind == "additive":
        allowed = allowed & (torch.rand(b, 1, tq, tk, generator=g) > 0.2)
        allowed[..., 0] = True  # every query sees a key
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).bfloat16()
    else:
        mask = None
    kw = dict(attn_mask=mask, is_causal=mask is None, scale=0.17, enable_gqa=h != hkv)
    grad_out = torch.randn(b, h, tq, 32, generator=g).bfloat16()
    return (q, k, v), kw, grad_out


def _run(fn, qkv, kw, grad_out):
    leaves = [t.clone().requires_grad_() for t in qkv]
    out = fn(*leaves, **kw)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def _float64(qkv, kw, grad_out):
    q, k, v = (t.double().requires_grad_() for t in qkv)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * kw["scale"]
    mask = kw["attn_mask"]
    if mask is None:
        tq, tk = s.shape[-2:]
        mask = (torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None])[None, None]
    if mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask.double()
    (torch.softmax(s, -1) @ vv).backward(grad_out.double())
    return [q.grad, k.grad, v.grad]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-{c[1]}q{c[2]}kv" for c in CASES])
def test_the_forward_is_sdpas_and_the_backward_is_closer_to_float64(case):
    qkv, kw, grad_out = _inputs(*case)
    out, grads = _run(flash_attention_fp32_backward, qkv, kw, grad_out)
    ref_out, ref_grads = _run(F.scaled_dot_product_attention, qkv, kw, grad_out)
    assert torch.equal(out, ref_out)  # the same bits: logits, log-probs and KL unchanged
    exact = _float64(qkv, kw, grad_out)
    for name, g, r, x in zip("qkv", grads, ref_grads, exact):
        assert g.dtype == torch.bfloat16 and g.shape == r.shape
        err = float((g.double() - x).norm() / x.norm())
        bf16_err = float((r.double() - x).norm() / x.norm())
        # one BF16 rounding of each gradient: 2^-9 relative at most, ~2^-10 on average
        assert err <= 2.5e-3, (name, err)
        assert err <= 1.05 * bf16_err, (name, err, bf16_err)
        assert not torch.equal(g, r)  # the other kernel: a check that could tell them apart


def test_calls_it_does_not_reroute_are_sdpas_own():
    qkv, kw, grad_out = _inputs(4, 4, 2, 20, 30, "bool")
    with fp32_attention_backward():
        with torch.no_grad():  # the sampler, the scorer: nothing to differentiate
            assert torch.equal(F.scaled_dot_product_attention(*qkv, **kw),
                               F.scaled_dot_product_attention(*qkv, **kw))
        leaves = [t.clone().requires_grad_() for t in qkv]
        rerouted = F.scaled_dot_product_attention(*leaves, **kw)
        f32 = [t.float().requires_grad_() for t in qkv]
        native = F.scaled_dot_product_attention(*f32, **kw)  # FP32: not this module's
        dropped = F.scaled_dot_product_attention(*leaves, dropout_p=0.1, **kw)
    assert type(rerouted.grad_fn).__name__ == "_FlashFP32BackwardBackward"
    assert type(native.grad_fn).__name__ != "_FlashFP32BackwardBackward"
    assert type(dropped.grad_fn).__name__ != "_FlashFP32BackwardBackward"
    outside = F.scaled_dot_product_attention(*leaves, **kw)  # the block is over
    assert type(outside.grad_fn).__name__ != "_FlashFP32BackwardBackward"


def test_the_trainers_step_keeps_its_loss_and_kl_and_moves_its_gradients(model, tok,
                                                                       monkeypatch):
    """One trainer step on a batch of GRPO groups (a shared prompt, suffixes under a mask), with
    the FP32 backward and with torch's BF16 one: the loss and the KL the same bits, the gradient
    norm not (the backward ran). On a CPU where BF16 GEMMs are rerouted to FP32
    (mismatch.kernels.bf16_gemm) the attention is rerouted whole already, and the block is not
    entered: checked as such."""
    import contextlib

    from mismatch.kernels.bf16_gemm import bf16_gemm_policy
    from mismatch.train import trainer as trainer_mod
    from mismatch.train.config import preset_config

    batch = grpo_batch(model, tok, 4)
    cfg = preset_config("homogeneous", prompts_per_step=2, samples_per_prompt=4,
                        tasks="arith", correction="grpo", sync=True, threads=1)
    entered = []

    def spied():
        entered.append(1)
        return fp32_attention_backward()

    out = {}
    for name, block in (("bf16", contextlib.nullcontext), ("fp32", spied)):
        monkeypatch.setattr(trainer_mod, "fp32_attention_backward", block)
        trainer = trainer_mod.Trainer(copy.deepcopy(model), cfg)
        out[name] = trainer.step(batch)
    native = bf16_gemm_policy() == "native"
    assert bool(entered) is native
    assert out["fp32"].loss == out["bf16"].loss and out["fp32"].kl == out["bf16"].kl
    if native:
        assert out["fp32"].grad_norm != out["bf16"].grad_norm
        assert out["fp32"].grad_norm == pytest.approx(out["bf16"].grad_norm, rel=0.02)
