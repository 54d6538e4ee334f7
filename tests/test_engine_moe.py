"""The emulated fused-MoE forward (mismatch/engines/moe.py) against the plain per-expert loop.

`experts_forward` routes a stage's tokens with one sort, runs the activation over all experts'
rows at once and adds every expert's output back with one `index_add_`. Each of those must give
what transformers' eager loop gives (a one-hot mask per expert, `torch.where` for its tokens,
one `index_add_` per expert in expert order): checked here bit for bit, on the embedded model's
logits under BF16, NVFP4 W4A4 and FP8 W8A8 with Hopper's accumulation model (and on a random
Qwen3-MoE that sends each token to 4 experts, where the order of a token's adds shows), and the
routing on random expert choices.
"""

from __future__ import annotations

import pytest
import torch

from mismatch.engines import moe, numerics
from mismatch.engines.numerics import apply_numerics
from mismatch.profiles import resolve
from mismatch.train.batch import task_of
from mismatch.train.rollout import calibration_scales


def _mask_routes(top_k_index: torch.Tensor, n_experts: int):
    """transformers' eager routing: a [E, k, N] one-hot mask, `torch.where` per expert hit."""
    mask = torch.nn.functional.one_hot(top_k_index, n_experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
    pos, tok = zip(*(torch.where(mask[e]) for e in hit)) if hit else ((), ())
    return hit, list(pos), list(tok)


def _loop_experts_forward(module, mode):
    """The per-expert loop the engine ran before (the reference): each expert's rows gathered,
    its GEMMs, its activation, its weighted output added to the tokens' rows, expert by expert."""

    def forward(hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        n_experts = module.gate_up_proj.shape[0]
        gate_up = [mode.table[module.gate_up_proj[e].data_ptr()] for e in range(n_experts)]
        down = [mode.table[module.down_proj[e].data_ptr()] for e in range(n_experts)]
        batched = mode.batched()
        xq = mode.quantized_input(hidden_states, gate_up[0]) if batched else None
        hit, poss, toks = _mask_routes(top_k_index, n_experts)
        if not hit:
            return final
        gus = mode.expert_gemms([gate_up[e] for e in hit], [hidden_states[t] for t in toks],
                                None if xq is None else [xq[t] for t in toks])
        inter = []
        for gu in gus:
            gate, up = gu.to(hidden_states.dtype).chunk(2, dim=-1)
            inter.append(module.act_fn(gate) * up)
        hq = mode.quantized_input(torch.cat(inter), down[0]) if batched else None
        hqs = None if hq is None else list(hq.split([h.shape[0] for h in inter]))
        outs = mode.expert_gemms([down[e] for e in hit], inter, hqs)
        for pos, tok, out in zip(poss, toks, outs):
            out = out.to(hidden_states.dtype) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, out.to(final.dtype))
        return final

    return forward


@pytest.mark.parametrize("n,k,experts", [(1, 2, 8), (7, 2, 8), (64, 2, 8), (33, 4, 16), (5, 1, 3)])
def test_routes_are_the_masks_routes(n, k, experts):
    g = torch.Generator().manual_seed(n * 100 + k)
    pool = experts - 1 if n > 4 else experts  # larger batches: the last expert never picked
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(n)])
    hit, pos, tok = moe._routes(idx, experts)
    ref_hit, ref_pos, ref_tok = _mask_routes(idx, experts)
    assert hit == ref_hit
    assert [p.tolist() for p in pos] == [p.tolist() for p in ref_pos]
    assert [t.tolist() for t in tok] == [t.tolist() for t in ref_tok]
    if n > 4:
        assert experts - 1 not in hit


@pytest.fixture(scope="module")
def top4_model(model):
    """A random Qwen3-MoE shaped like the embedded model but routing each token to 4 of its 8
    experts (in BF16): with more than two adds per token, their order changes the sum."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(5)
    config = model.config.__class__(**{**model.config.to_dict(), "num_experts_per_tok": 4})
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("which", ["embedded", "top4"])
@pytest.mark.parametrize("gpu,dtype", [("b200", "bf16"), ("b200", "nvfp4"), ("h100", "fp8")])
def test_experts_forward_equals_the_per_expert_loop(request, tok, which, gpu, dtype,
                                                     monkeypatch):
    model = request.getfixturevalue("model" if which == "embedded" else "top4_model")
    spec = resolve(gpu, dtype, "bf16")
    cal = [task_of(100 + i, 0, ("arith",)) for i in range(4)]
    scales = calibration_scales(model, tok, spec, cal) or None
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 700, (6, 23), generator=g)

    def logits():
        with torch.no_grad(), apply_numerics(model, spec, scales):
            return model(input_ids=ids).logits

    fast = logits()
    monkeypatch.setattr(numerics, "experts_forward", _loop_experts_forward)
    loop = logits()
    assert torch.equal(fast.view(torch.int16), loop.view(torch.int16))
    # and the emulation did something: not the plain BF16 model (except the BF16 spec itself)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert (dtype == "bf16") or not torch.equal(fast, plain)
