"""Remote samplers against a stand-in server (tests/fault_server.py) in each failure mode.

A stand-in, because a real engine cannot be made to hang, answer 5xx and recover, send invalid
JSON, drop or shorten its log-probs, or lack /tokenize on demand. The real servers (vLLM's CPU
build, SGLang) run in tests/test_engine_vllm.py and tests/test_engine_sglang.py.

Every fault must surface as one RemoteError line; the happy paths must lay the server's answer
out exactly as the emulated sampler lays out its own. Each server is a subprocess on a free
port, killed after its test; every client timeout is small, so the file runs in seconds.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import fault_server
from mismatch.remote import (CANARY_TEXT, RemoteError, SglangClient, VllmClient,
                             run_canary)

SERVER = Path(__file__).with_name("fault_server.py")
PAD = 0
# lengths 3, 3, 1; with max_new_tokens 6 and seeds 0, 1, 2 the fake server answers 5, 4 and 6
# tokens: two end with EOS ("stop"), one at the limit ("length")
PROMPTS = [[5, 17, 42], [9, 300, 11], [99]]
FAST = dict(timeout=5.0, attempts=3, backoff=0.05, pad_id=PAD)
VOCAB = 683  # the embedded tokenizer's (checked below)


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (its tokenizer.json, through `tokenizers`: no torch)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(fault_server.TOKENIZER))


def stats(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/stats", timeout=5) as r:
        return json.loads(r.read())


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert message and "\n" not in message and message == message.strip()
    return message


def generate(client, prompts=PROMPTS, **kwargs):
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, seed=0, candidates=4)
    return client.generate(prompts, **{**kw, **kwargs})


def check_layout(rollout, prompts, *, max_new_tokens, k, seed, vocab):
    """The rollout holds exactly what the fake server sent, laid out as sampler.generate does."""
    expected = [fault_server.sample(pr, max_new_tokens, k, seed + i, vocab)
                for i, pr in enumerate(prompts)]
    b, p = len(prompts), max(len(x) for x in prompts)
    n = max(len(e[0]) for e in expected)
    assert rollout.token_ids.shape == rollout.attention_mask.shape == (b, p + n)
    assert rollout.completion_mask.shape == rollout.sampler_logprobs.shape == (b, p + n)
    assert rollout.candidate_ids.shape == rollout.candidate_logprobs.shape == (b, p + n, k)
    assert rollout.token_ids.dtype == torch.long and rollout.completion_mask.dtype == torch.float32
    assert rollout.mode == "measured" and rollout.prompt_width == p
    assert rollout.n_tokens == sum(len(e[0]) for e in expected)
    assert rollout.meta["finish_reasons"] == [e[3] for e in expected]
    assert torch.equal(rollout.sampler_logprobs_processed, rollout.sampler_logprobs)
    for i, (prompt, (ids, lps, tops, _)) in enumerate(zip(prompts, expected)):
        m, start = len(ids), p - len(prompt)
        assert rollout.token_ids[i, :start].eq(PAD).all()
        assert rollout.token_ids[i, start:p].tolist() == prompt
        assert rollout.token_ids[i, p:p + m].tolist() == ids
        assert rollout.token_ids[i, p + m:].eq(PAD).all()
        assert rollout.attention_mask[i].tolist() == [0] * start + [1] * (len(prompt) + m) + \
            [0] * (n - m)
        assert rollout.completion_mask[i].tolist() == [0.0] * p + [1.0] * m + [0.0] * (n - m)
        want = torch.tensor(lps, dtype=torch.float64).float()
        assert torch.equal(rollout.sampler_logprobs[i, p:p + m], want)
        assert rollout.sampler_logprobs[i, :p].eq(0).all()
        assert rollout.sampler_logprobs[i, p + m:].eq(0).all()
        assert rollout.candidate_ids[i, p:p + m].tolist() == [[c for c, _ in t] for t in tops]
        cand = torch.tensor([[v for _, v in t] for t in tops], dtype=torch.float64).float()
        assert torch.equal(rollout.candidate_logprobs[i, p:p + m], cand)
        # each sampled token is no more likely than the top candidate of its step
        assert (rollout.sampler_logprobs[i, p:p + m] <= rollout.candidate_logprobs[i, p:p + m, 0]
                ).all()
    return expected


# ------------------------------------------------------------------------------ happy paths
def test_vllm_rollout_matches_what_the_server_sent(serve, tokenizer):
    url = serve("vllm-ok")
    client = VllmClient(url + "/v1/", **FAST)  # a /v1 suffix is the server root too
    rollout = generate(client)
    assert tokenizer.get_vocab_size() == VOCAB
    expected = check_layout(rollout, PROMPTS, max_new_tokens=6, k=4, seed=0, vocab=VOCAB)
    assert {e[3] for e in expected} == {"stop", "length"}
    assert rollout.sampler == f"vllm {url}"
    assert rollout.meta["model"] == fault_server.MODEL  # from GET /v1/models
    assert rollout.meta["logprob_mode"] == "raw"
    assert "assumed" in rollout.meta["logprob_mode_source"]
    t = client.throughput
    assert t["requests"] == 1 + len(PROMPTS) and t["retries"] == 0
    assert t["completion_tokens"] == rollout.n_tokens and t["tokens_per_s"] > 0
    assert rollout.meta["throughput"]["completion_tokens"] == rollout.n_tokens


def test_sglang_rollout_matches_what_the_server_sent(serve, tokenizer):
    url = serve("sglang-ok")
    client = SglangClient(url, **FAST)
    rollout = generate(client, seed=3, candidates=2)
    check_layout(rollout, PROMPTS, max_new_tokens=6, k=2, seed=3,
                 vocab=tokenizer.get_vocab_size())
    assert rollout.sampler == f"sglang {url}"
    assert rollout.meta["logprob_mode"] == "raw"  # temperature 1
    assert generate(client, temperature=0.7, max_new_tokens=2).meta["logprob_mode"] == \
        "temperature-scaled"
    assert client.throughput["requests"] == 2 * len(PROMPTS)


def test_eos_ids_cut_a_completion_after_its_first_eos(serve):
    url = serve("vllm-ok")
    ids = fault_server.sample(PROMPTS[2], 6, 1, 2, VOCAB)[0]  # 6 tokens, no EOS among them
    cut = VllmClient(url, eos_ids={ids[1]}, **FAST).generate(
        [PROMPTS[2]], max_new_tokens=6, seed=2, candidates=1)
    assert cut.n_tokens == 2 and cut.token_ids[0, 1:].tolist() == ids[:2]
    assert cut.meta["finish_reasons"] == ["stop"]


def test_concurrency_is_bounded(serve):
    url = serve("vllm-ok", "--delay", "0.2")
    client = VllmClient(url, model=fault_server.MODEL, max_concurrency=2, **FAST)
    rollout = generate(client, prompts=[[3 + i, 4] for i in range(6)], max_new_tokens=2)
    seen = stats(url)
    assert seen["requests"] == 6 and seen["max_inflight"] == 2
    assert rollout.token_ids.shape[0] == 6


# --------------------------------------------------------------------------- transport faults
def test_connection_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteError) as e:
        generate(VllmClient(f"http://127.0.0.1:{port}", **FAST))
    assert "refused the connection" in one_line(e) and "is the server running" in str(e.value)


def test_not_an_http_url():
    with pytest.raises(RemoteError) as e:
        SglangClient("127.0.0.1:30000")
    assert "not an http(s) URL" in one_line(e)


def test_hang_times_out(serve):
    url = serve("hang")
    start = time.perf_counter()
    with pytest.raises(RemoteError) as e:
        generate(VllmClient(url, model=fault_server.MODEL, **{**FAST, "timeout": 1.0}),
                 prompts=[[5, 6]])
    assert time.perf_counter() - start < 8  # 1 s timeout, not the 3600 s hang
    assert "did not answer prompt 0 within 1 s" in one_line(e)


def test_http500_is_retried_with_backoff_then_fails(serve):
    url = serve("http500")
    client = VllmClient(url, model=fault_server.MODEL, **FAST)
    start = time.perf_counter()
    with pytest.raises(RemoteError) as e:
        generate(client, prompts=[[5, 6]])
    assert time.perf_counter() - start >= 0.05 + 0.1  # backoff 0.05 · 2^i between 3 attempts
    message = one_line(e)
    assert "failed prompt 0 3 times" in message and "HTTP 500" in message
    assert "internal server error (fault server)" in message
    assert stats(url)["requests"] == 3 and client.throughput["retries"] == 2


@pytest.mark.parametrize("mode", ["http500-then-ok", "drop-then-ok"])
def test_transient_failures_are_retried_then_succeed(serve, tokenizer, mode):
    url = serve(mode)
    client = VllmClient(url, model=fault_server.MODEL, **FAST)
    rollout = generate(client, prompts=[PROMPTS[0]])
    check_layout(rollout, [PROMPTS[0]], max_new_tokens=6, k=4, seed=0,
                 vocab=tokenizer.get_vocab_size())
    assert client.throughput["retries"] == 2 and stats(url)["requests"] == 3


def test_4xx_is_not_retried_and_carries_the_servers_message(serve):
    url = serve("vllm-ok")
    client = VllmClient(url, model=fault_server.MODEL, **FAST)
    with pytest.raises(RemoteError) as e:
        generate(client, prompts=[[5, 6]], candidates=30)
    message = one_line(e)
    assert "HTTP 400" in message and "greater than max allowed: 20" in message
    assert stats(url)["requests"] == 1 and client.throughput["retries"] == 0


# ----------------------------------------------------------------------------- content faults
CLIENTS = {"vllm": lambda url: VllmClient(url, **FAST),
           "sglang": lambda url: SglangClient(url, **FAST)}
POISON = 77  # the content faults hit only prompts that start with this id


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("mode, expect", [
    ("malformed", "invalid JSON"),
    ("no-logprobs", "returned no log-probs for prompt 2"),
    ("short-logprobs", "log-probs for {n} generated tokens of prompt 2 (fewer than tokens)"),
])
def test_content_faults_name_the_prompt(serve, engine, mode, expect):
    url = serve(mode, "--fault-token", str(POISON))
    prompts = PROMPTS[:2] + [[POISON, 1, 2]]
    n = len(fault_server.sample(prompts[2], 6, 4, 2, VOCAB)[0])
    with pytest.raises(RemoteError) as e:
        generate(CLIENTS[engine](url), prompts=prompts)
    message = one_line(e)
    assert expect.format(n=n) in message
    if mode == "short-logprobs":
        assert f"returned {n - 1} log-probs" in message


# ------------------------------------------------------------------------------------- canary
class _ListTokenizer:
    """A transformers-style tokenizer: encode returns a list of ids."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        return self.inner.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.mark.parametrize("mode, make", [
    ("vllm-ok", lambda url: VllmClient(url, **FAST)),
    ("sglang-ok", lambda url: SglangClient(url, **FAST)),
    ("sglang-no-tokenize", lambda url: SglangClient(url, **FAST)),  # falls back to /generate
])
def test_canary_passes_on_a_sound_server(serve, tokenizer, mode, make):
    url = serve(mode)
    report = run_canary(make(url), _ListTokenizer(tokenizer) if "sglang" in mode else tokenizer)
    assert report["tokenizer"] == "agrees" and report["logprob_mode"] == "raw"
    assert report["canary_tokens"] == len(tokenizer.encode(CANARY_TEXT).ids)
    assert report["generated_tokens"] == 4  # EOS ignored: exactly the 4 asked
    seen = stats(url)
    assert seen["tokenize"] == 1 and seen["requests"] == (2 if mode == "sglang-no-tokenize" else 1)


def test_canary_catches_a_tokenizer_disagreement(serve, tokenizer):
    url = serve("bad-tokenizer")
    with pytest.raises(RemoteError) as e:
        run_canary(VllmClient(url, **FAST), tokenizer)
    message = one_line(e)
    assert message.startswith("the server's tokenizer disagrees with --model's on the canary")
    assert "first difference at token 1" in message and "serve the same checkpoint" in message
    assert stats(url)["requests"] == 0  # nothing generated with a mismatched tokenizer


@pytest.mark.parametrize("mode, expect", [
    ("short-logprobs", "(fewer than tokens)"),
    ("logits", "those are logits, not log-probs"),
])
def test_canary_catches_log_probs_that_do_not_fit(serve, tokenizer, mode, expect):
    url = serve(mode)
    with pytest.raises(RemoteError) as e:
        run_canary(VllmClient(url, **FAST), tokenizer)
    assert expect in one_line(e)


@pytest.mark.parametrize("body, expect", [
    # the three error bodies a real SGLang 0.5.23 server sent (tests/test_engine_sglang.py)
    ({"error": {"message": "The input (1100 tokens) is longer than the model's context length "
                           "(1024 tokens)."}}, "The input (1100 tokens) is longer than"),
    ({"error": "unknown field `bogus`, expected one of `max_new_tokens`"}, "unknown field `bogus`"),
    ({"object": "error", "message": "1 validation error:\n  {'type': 'json_invalid'}\n\n  File "
      "\"/x/sglang/srt/entrypoints/http_server.py\", line 928, in generate_request\n    POST "
      "/generate", "type": "Bad Request", "code": 400},
     "1 validation error: {'type': 'json_invalid'}"),
])
def test_error_bodies_become_one_line_without_tracebacks(body, expect):
    from mismatch.remote.clients import _server_message

    message = _server_message(json.dumps(body).encode())
    assert message.startswith(expect) and "\n" not in message and "File" not in message
