"""The canary every remote run starts with: is this server fit to be measured as our sampler?

Two checks, each failing with one `RemoteError` line that says what to do:

(a) tokenizer agreement — the server's tokenizer and the local one (--model's) encode a fixed
    probe text to the same ids. We only ever send token ids, so a server with another
    tokenizer would still answer, but every id would mean another piece of text to it and every
    figure would be noise. vLLM and newer SGLang have `POST /tokenize`; an SGLang without it is
    asked to encode the text through `/generate` (its prompt ids come back as input-token
    log-probs), with the server's default special tokens, which the local encode then adds too.
(b) one log-prob per token — a 4-token generation (EOS ignored, so exactly 4 tokens) must
    report exactly one finite log-prob (≤ 0: a log-prob, not a logit) per generated token, and
    no sampled token may be more likely than the server's own top-1 candidate.
"""

from __future__ import annotations

from .clients import RemoteError, SamplerClient

__all__ = ["CANARY_TEXT", "run_canary"]

CANARY_TEXT = ('Canary check: 12 + 30 = 42, "naïve café" — 東京 🙂\n'
               '<tool_call>{"name": "probe", "arguments": {"x": [1, 2]}}</tool_call>')
"""Digits, punctuation runs, non-ASCII and multi-byte text, a newline, and markup tokens."""

_SLACK = 1e-3  # servers round log-probs; a sampled token may tie its top-1 within this


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """ids from a transformers tokenizer (a list) or a `tokenizers.Tokenizer` (an Encoding)."""
    out = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return [int(t) for t in getattr(out, "ids", out)]


def run_canary(client: SamplerClient, tokenizer, *, text: str = CANARY_TEXT,
               new_tokens: int = 4) -> dict:
    """Run both checks against `client`'s server; → a small report (raises RemoteError)."""
    server = client.tokenize(text)
    local = _encode(tokenizer, text, server.add_special_tokens)
    if server.ids != local:
        i = next((j for j, (a, b) in enumerate(zip(server.ids, local)) if a != b),
                 min(len(server.ids), len(local)))
        raise RemoteError(
            f"the server's tokenizer disagrees with --model's on the canary text: first "
            f"difference at token {i} (server {server.ids[i:i + 3]}, local {local[i:i + 3]}; "
            f"{len(server.ids)} vs {len(local)} tokens); serve the same checkpoint "
            f"({client.label})")
    rollout = client.generate([local], max_new_tokens=new_tokens, temperature=1.0, top_p=1.0,
                              top_k=0, seed=0, candidates=1, ignore_eos=True)
    done = rollout.completion_mask[0] > 0
    n = int(done.sum())
    if n != new_tokens:
        raise RemoteError(f"the server generated {n} tokens for the {new_tokens}-token canary "
                          f"with EOS ignored; it does not honour max tokens / ignore_eos "
                          f"({client.label})")
    logprobs = rollout.sampler_logprobs[0][done]
    top1 = rollout.candidate_logprobs[0, :, 0][done]
    worst = float(logprobs.max())
    if worst > _SLACK:
        raise RemoteError(f"the server reported log-prob {worst:.3g} > 0 for a canary token: "
                          f"those are logits, not log-probs (vLLM: --logprobs-mode "
                          f"raw_logprobs) ({client.label})")
    excess = float((logprobs - top1).max())
    if excess > _SLACK:
        raise RemoteError(f"the server reported a canary token {excess:.3g} nats more likely "
                          f"than its own top-1 candidate; its log-probs and candidates "
                          f"disagree, check the server version ({client.label})")
    mode, source = client.logprob_mode(1.0)
    return {"sampler": client.label, "tokenizer": "agrees", "canary_tokens": len(local),
            "generated_tokens": n, "logprob_mode": mode, "logprob_mode_source": source}
