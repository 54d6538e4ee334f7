"""The fused scorer head: the torch twin against float64 references, the Triton kernel against
the twin under Triton's CPU interpreter.

TRITON_INTERPRET=1 is set before anything imports triton (Triton reads it when a kernel is
decorated). The interpreter computes with numpy, which has no bfloat16: BF16 cases cast to FP32
(exact) before the kernel and say so. Tolerances: FP32 results agree to ~1e-6 relative (two
FP32 sums over V in different orders, plus exp/log); FP16 logits from hidden states may differ by
one FP16 rounding of the GEMM output (numpy's and torch's FP32 dot products sum in another order).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mismatch.kernels import KernelError, scorer_head, scorer_head_torch  # noqa: E402

# the interpreter evaluates both sides of every tl.where with numpy, which warns on the side
# that is discarded (a division by a zero scale)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# (N, H, V, K): ragged against every block (rows 16, vocab 128, hidden 32) and one exact fit
SHAPES = [(37, 40, 1000, 5), (16, 32, 256, 1), (5, 17, 259, 3)]


def _inputs(n, h, v, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.4).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    cand = torch.randint(0, v, (n, k), generator=g)
    return hidden, weight, labels, cand, g


def _reference(logits64: torch.Tensor, labels, cand, sampler_lp):
    """float64 log-softmax, entropy, top-1, candidate log-probs and candidate-set KL."""
    lp = torch.log_softmax(logits64, -1)
    ent = -(lp.exp() * lp).sum(-1)
    cand_lp = lp.gather(-1, cand)
    mu = torch.log_softmax(sampler_lp.double(), -1)
    pi = torch.log_softmax(cand_lp, -1)
    kl = (mu.exp() * (mu - pi)).sum(-1)
    return lp.gather(-1, labels[:, None])[:, 0], ent, logits64.argmax(-1), cand_lp, kl


@pytest.mark.parametrize("shape", SHAPES)
def test_twin_matches_float64_reference(shape):
    hidden, weight, labels, cand, g = _inputs(*shape, seed=1)
    logits64 = hidden.double() @ weight.double().T
    slp = torch.log_softmax(logits64, -1).gather(-1, cand).float() + \
        0.02 * torch.randn(cand.shape, generator=g)
    out = scorer_head_torch(labels, hidden=hidden, weight=weight, candidate_ids=cand,
                            sampler_candidate_logprobs=slp, row_tile=8, vocab_tile=100)
    lp, ent, top, cand_lp, kl = _reference(logits64, labels, cand, slp)
    assert (out.logprobs.double() - lp).abs().max() < 2e-6 * lp.abs().max()
    assert (out.entropy.double() - ent).abs().max() < 2e-6 * ent.abs().max()
    assert (out.candidate_logprobs.double() - cand_lp).abs().max() < 2e-6 * cand_lp.abs().max()
    assert torch.equal(out.top1, top)
    # the KL from the twin's own candidate log-probs: only the formula's accuracy is tested
    mu = torch.log_softmax(slp.double(), -1)
    pi = torch.log_softmax(out.candidate_logprobs.double(), -1)
    own = (mu.exp() * (mu - pi)).sum(-1)
    assert (out.kl_candidates.double() - own).abs().max() <= 1e-5 * own.abs().max() + 1e-12
    assert (out.kl_candidates.double() - kl).abs().max() <= 1e-3 * kl.abs().max() + 1e-12


def test_twin_kl_is_exact_for_tiny_divergence():
    """A KL of ~1e-11 keeps ~1e-4 relative accuracy in FP32 (centred δ, b − g(b − a))."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 300, generator=g)
    cand = torch.randint(0, 300, (64, 8), generator=g)
    lp64 = torch.log_softmax(logits.double(), -1).gather(-1, cand)
    slp = (lp64 + 1e-5 * torch.randn(lp64.shape, generator=g, dtype=torch.float64)).float()
    out = scorer_head_torch(torch.zeros(64, dtype=torch.long), logits=logits, candidate_ids=cand,
                            sampler_candidate_logprobs=slp)
    mu = torch.log_softmax(slp.double(), -1)
    pi = torch.log_softmax(out.candidate_logprobs.double(), -1)
    ref = (mu.exp() * (mu - pi)).sum(-1)
    assert float(ref.max()) < 1e-8
    assert (out.kl_candidates.double() - ref).abs().max() < 1e-4 * ref.max()


def test_twin_tiles_change_nothing_but_rounding_and_rows_are_independent():
    hidden, weight, labels, cand, _ = _inputs(50, 24, 700, 4, seed=3)
    a = scorer_head_torch(labels, hidden=hidden, weight=weight, candidate_ids=cand,
                          row_tile=7, vocab_tile=64)
    b = scorer_head_torch(labels, hidden=hidden, weight=weight, candidate_ids=cand,
                          row_tile=50, vocab_tile=700)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5 and torch.equal(a.top1, b.top1)
    # from logits or from hidden states: the same numbers up to the GEMM's summation order
    logits = F.linear(hidden, weight)
    d = scorer_head_torch(labels, logits=logits, candidate_ids=cand, row_tile=7, vocab_tile=64)
    assert (d.logprobs - a.logprobs).abs().max() < 1e-5 and torch.equal(d.top1, a.top1)
    # row tiles never change a number given the logits: f(batch)[:3] == f(batch[:3]) (from
    # hidden states a 1-row GEMM may sum in another order than a 7-row one: that is the GEMM's
    # batch variance, not the head's)
    c = scorer_head_torch(labels[:3], logits=logits[:3], candidate_ids=cand[:3], row_tile=1,
                          vocab_tile=64)
    assert torch.equal(c.logprobs, d.logprobs[:3]) and torch.equal(c.entropy, d.entropy[:3])


def test_bad_input_is_one_line():
    hidden, weight, labels, cand, _ = _inputs(4, 8, 50, 2, seed=4)
    with pytest.raises(KernelError, match=r"labels must lie in \[0, 50\)"):
        scorer_head_torch(labels + 50, hidden=hidden, weight=weight)
    with pytest.raises(KernelError, match="either hidden"):
        scorer_head_torch(labels, hidden=hidden)
    with pytest.raises(KernelError, match="unknown kernel backend"):
        scorer_head(labels, hidden=hidden, weight=weight, backend="cuda")
    assert torch.equal(scorer_head(labels, hidden=hidden, weight=weight).logprobs,
                       scorer_head_torch(labels, hidden=hidden, weight=weight).logprobs)


# ----------------------------------------------------------------------------- Triton kernel

def _triton():
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'mismatch[gpu]')")
    from mismatch.kernels import scorer_head_triton

    return scorer_head_triton


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    scale = float(b.abs().max().clamp_min(1.0))
    err = float((a - b).abs().max())
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("source", ["hidden", "logits"])
def test_triton_matches_twin_fp32(shape, source):
    kernel = _triton()
    hidden, weight, labels, cand, g = _inputs(*shape, seed=5)
    slp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, cand) + \
        0.02 * torch.randn(cand.shape, generator=g)
    args = dict(hidden=hidden, weight=weight) if source == "hidden" else \
        dict(logits=F.linear(hidden, weight))
    want = scorer_head_torch(labels, candidate_ids=cand, sampler_candidate_logprobs=slp, **args)
    got = kernel(labels, candidate_ids=cand, sampler_candidate_logprobs=slp, **args)
    _close(got.logprobs, want.logprobs, 1e-6)
    _close(got.entropy, want.entropy, 1e-6)
    _close(got.candidate_logprobs, want.candidate_logprobs, 1e-6)
    assert torch.equal(got.top1, want.top1)
    # KL inherits the candidate log-probs' last-bit differences: compare on the KL's own scale
    assert float((got.kl_candidates - want.kl_candidates).abs().max()) <= \
        1e-3 * float(want.kl_candidates.abs().max()) + 1e-12


def test_triton_matches_twin_fp16_and_bf16_cast():
    kernel = _triton()
    hidden, weight, labels, cand, _ = _inputs(37, 40, 1000, 5, seed=6, dtype=torch.float16)
    logits16 = F.linear(hidden, weight)  # FP16 logits: loaded exactly, widened in the kernel
    want = scorer_head_torch(labels, logits=logits16, candidate_ids=cand)
    got = kernel(labels, logits=logits16, candidate_ids=cand)
    _close(got.logprobs, want.logprobs, 1e-6)
    _close(got.entropy, want.entropy, 1e-6)
    assert torch.equal(got.top1, want.top1)
    # FP16 GEMM in the kernel: logits rounded once to FP16 like the twin's, up to one FP16 ulp
    got_h = kernel(labels, hidden=hidden, weight=weight, candidate_ids=cand)
    ulp = 2.0 ** (int(torch.frexp(logits16.float().abs().max()).exponent) - 11)
    assert float((got_h.logprobs - want.logprobs).abs().max()) <= 2 * ulp
    # BF16: the interpreter cannot hold bfloat16, so the test widens BF16 logits to FP32 (exact)
    logits_bf = F.linear(hidden.float(), weight.float()).bfloat16()
    want_bf = scorer_head_torch(labels, logits=logits_bf, candidate_ids=cand)
    got_bf = kernel(labels, logits=logits_bf.float(), candidate_ids=cand)
    _close(got_bf.logprobs, want_bf.logprobs, 1e-6)
    assert torch.equal(got_bf.top1, want_bf.top1)


def test_triton_handles_ties_and_no_candidates():
    kernel = _triton()
    logits = torch.zeros(3, 300)
    logits[:, 7] = logits[:, 250] = 2.0  # a tie across two vocabulary tiles: first index wins
    labels = torch.tensor([7, 250, 0])
    got = kernel(labels, logits=logits)
    want = scorer_head_torch(labels, logits=logits)
    assert got.top1.tolist() == [7, 7, 7] == want.top1.tolist()
    assert got.candidate_logprobs is None and got.kl_candidates is None
    _close(got.logprobs, want.logprobs, 1e-6)


def test_trainer_scorer_runs_the_fused_head():
    """score() through the fused head agrees with its former [chunk, V] path (kept for
    full_from and for patched heads) at a vocabulary wider than one tile."""
    from types import SimpleNamespace

    from mismatch.engines.scorer import score
    from mismatch.records import Rollout

    v, h, b, t, k = 20000, 16, 2, 7, 3  # V spans three 8192-wide vocabulary tiles

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(v, h)
            self.head = torch.nn.Linear(h, v, bias=False)
            self.model = lambda input_ids, attention_mask, position_ids: SimpleNamespace(
                last_hidden_state=self.emb(input_ids))

        def get_output_embeddings(self):
            return self.head

    torch.manual_seed(0)
    model = Tiny().bfloat16()
    ids = torch.randint(0, v, (b, t))
    ones = torch.ones(b, t)
    rollout = Rollout(token_ids=ids, attention_mask=ones.long(), completion_mask=ones,
                      sampler_logprobs=ones, sampler_logprobs_processed=ones,
                      candidate_ids=torch.randint(0, v, (b, t, k)),
                      candidate_logprobs=torch.zeros(b, t, k), sampler="s", mode="emulated")
    fused = score(model, rollout, with_routing=False)
    model.head.forward = model.head.forward  # an instance forward: the chunked path
    chunked = score(model, rollout, with_routing=False)
    full = score(model, rollout, with_routing=False, full_from=3)
    del model.head.forward
    assert (fused.logprobs - chunked.logprobs).abs().max() < 1e-5
    assert (fused.candidate_logprobs - chunked.candidate_logprobs).abs().max() < 1e-5
    assert torch.equal(fused.top1_ids, chunked.top1_ids)
    assert full.full_logprobs.shape == (b, t - 3, v)
    assert torch.allclose(full.full_logprobs.exp().sum(-1), torch.ones(b, t - 3))
    # only the completion rows are kept, each in its place, whatever the row chunk
    model.head.forward = model.head.forward
    small = score(model, rollout, with_routing=False, full_from=3, row_chunk=4)
    del model.head.forward
    assert torch.equal(small.full_logprobs, full.full_logprobs)
    at_token = full.full_logprobs.gather(-1, ids[:, 3:, None])[..., 0]
    assert torch.equal(at_token, full.logprobs[:, 3:])
