"""A stand-in for vLLM / SGLang: a local HTTP server that answers in their formats, or fails in
one chosen way (the faults a real engine cannot be made to produce on demand).

    python tests/fault_server.py --mode MODE --port P [--delay S] [--fault-token ID]

Binds 127.0.0.1 (port 0: a free one) and prints "READY <port>" once listening. Every mode serves
vLLM's `GET /v1/models`, `POST /tokenize`, `POST /v1/completions` and SGLang's `POST /generate`,
in the formats the engines' sources define (see mismatch/remote/vllm_client.py and
sglang_client.py), plus `GET /stats` ({"requests", "max_inflight", "tokenize"}: generation
requests seen, most at once).

Modes: vllm-ok, sglang-ok (answer correctly), sglang-no-tokenize (no /tokenize: 404, as older
SGLang), hang (accept, never answer), http500 (generation always 500), http500-then-ok (the
first 2 generation requests 500), drop-then-ok (the first 2 closed without an answer),
malformed (invalid JSON), no-logprobs (log-probs null / absent), short-logprobs (one log-prob
fewer than tokens), bad-tokenizer (/tokenize returns other ids), logits (vLLM answers logits,
+8 on every log-prob, as under --logprobs-mode raw_logits). --fault-token: the content faults
(malformed, no-logprobs, short-logprobs) hit only prompts that start with this id.

Completions are deterministic (`sample`): per step a seeded Gaussian logit vector over the
vocabulary, its exact log-softmax, a sampled token, the top-K; a completion of length
1 + (sum(prompt) + seed) % max_tokens ends with EOS when shorter than max_tokens (with
ignore_eos it runs to max_tokens).
Only the standard library and `tokenizers` are imported, so it starts in a blink.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EOS = 2
MODEL = "fault-model"
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
TOKENIZER = Path(__file__).resolve().parents[1] / "mismatch" / "zoo" / "data" / "tokenizer.json"


def sample(prompt: list[int], max_tokens: int, k: int, seed: int, vocab: int,
           ignore_eos: bool = False):
    """→ (token ids, their log-probs, per step the top-k [(id, log-prob)] sorted), finish."""
    rng = random.Random(f"{seed}|{','.join(map(str, prompt))}")
    length = max_tokens if ignore_eos else 1 + (sum(prompt) + seed) % max_tokens
    ids, lps, tops = [], [], []
    for step in range(length):
        logits = [rng.gauss(0.0, 3.0) for _ in range(vocab)]
        m = max(logits)
        lse = m + math.log(sum(math.exp(x - m) for x in logits))
        lp = [x - lse for x in logits]
        if step == length - 1 and length < max_tokens:
            tok = EOS
        else:
            u, acc, tok = rng.random(), 0.0, vocab - 1
            for t, v in enumerate(lp):
                acc += math.exp(v)
                if acc > u:
                    tok = t
                    break
            if tok == EOS:
                tok = EOS + 1
        ids.append(tok)
        lps.append(lp[tok])
        tops.append([(t, lp[t]) for t in sorted(range(vocab), key=lambda t: (-lp[t], t))[:k]])
    return ids, lps, tops, ("stop" if ids[-1] == EOS else "length")


class State:
    def __init__(self, mode: str, delay: float, fault_token: int | None, tokenizer):
        self.mode, self.delay, self.fault_token = mode, delay, fault_token
        self.tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab_size()
        self.lock = threading.Lock()
        self.requests = self.inflight = self.max_inflight = self.tokenize = 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: State

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(body).encode()
        self._done()  # before the answer leaves: the client may send its next request at once
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str):
        # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}
        self._send(code, {"error": {"message": message, "type": "BadRequestError",
                                    "param": None, "code": code}})

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def do_GET(self):
        s = self.state
        if s.mode == "hang":
            time.sleep(3600)
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 1024}]})
        elif self.path == "/stats":
            with s.lock:
                self._send(200, {"requests": s.requests, "max_inflight": s.max_inflight,
                                 "tokenize": s.tokenize})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        s = self.state
        if s.mode == "hang":
            time.sleep(3600)
        body = self._body()
        if self.path == "/tokenize":
            with s.lock:
                s.tokenize += 1
            if s.mode == "sglang-no-tokenize":
                return self._send(404, {"detail": "Not Found"})
            if not isinstance(body.get("prompt"), str):
                return self._error(400, "prompt must be a string")
            ids = s.tokenizer.encode(body["prompt"],
                                     add_special_tokens=body.get("add_special_tokens", True)).ids
            if s.mode == "bad-tokenizer":
                ids = [ids[0]] + [t + 1 for t in ids[1:]]
            return self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": 1024})
        if self.path not in ("/v1/completions", "/generate"):
            return self._send(404, {"detail": "Not Found"})
        with s.lock:
            s.requests += 1
            n = s.requests
            s.inflight += 1
            s.max_inflight = max(s.max_inflight, s.inflight)
        self._in_flight = True
        try:
            if s.delay:
                time.sleep(s.delay)
            if s.mode == "http500" or (s.mode == "http500-then-ok" and n <= 2):
                return self._error(500, "internal server error (fault server)")
            if s.mode == "drop-then-ok" and n <= 2:
                self.close_connection = True
                return None
            if self.path == "/v1/completions":
                return self._vllm(body)
            return self._sglang(body)
        finally:
            self._done()

    def _done(self):
        """The request no longer counts as in flight (once per counted request)."""
        if getattr(self, "_in_flight", False):
            self._in_flight = False
            with self.state.lock:
                self.state.inflight -= 1

    def _faulty(self, prompt: list[int]) -> bool:
        s = self.state
        return s.fault_token is None or (bool(prompt) and prompt[0] == s.fault_token)

    def _vllm(self, body: dict):
        s = self.state
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return self._error(400, "this fault server only takes token-id prompts")
        if body.get("model") != MODEL:
            return self._error(404, f"The model `{body.get('model')}` does not exist.")
        k = body.get("logprobs")
        if not isinstance(k, int) or body.get("return_tokens_as_token_ids") is not True:
            return self._error(400, "logprobs and return_tokens_as_token_ids are required here")
        if k > MAX_LOGPROBS:
            return self._error(400, f"Requested sample logprobs of {k}, which is greater than "
                                    f"max allowed: {MAX_LOGPROBS}")
        ids, lps, tops, finish = sample(prompt, body["max_tokens"], k, body.get("seed") or 0,
                                        s.vocab, bool(body.get("ignore_eos")))
        faulty = self._faulty(prompt)
        if faulty and s.mode == "malformed":
            return self._send(200, None, raw=b'{"id": "cmpl-1", "choices": [{"text": ')
        if s.mode == "logits":
            lps = [v + 8.0 for v in lps]
            tops = [[(c, cv + 8.0) for c, cv in top] for top in tops]
        logprobs = {
            "text_offset": list(range(len(ids))),
            "tokens": [f"token_id:{t}" for t in ids],
            "token_logprobs": [max(v, -9999.0) for v in lps],
            # the sampled token, then the top-k (vLLM's step dict; k or k + 1 entries)
            "top_logprobs": [{f"token_id:{t}": v, **{f"token_id:{c}": cv for c, cv in top}}
                             for t, v, top in zip(ids, lps, tops)]}
        if faulty and s.mode == "short-logprobs":
            logprobs["token_logprobs"] = logprobs["token_logprobs"][:-1]
        if faulty and s.mode == "no-logprobs":
            logprobs = None
        self._send(200, {
            "id": "cmpl-fault", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "", "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": None,
                         "token_ids": ids if body.get("return_token_ids") else None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)}})

    def _sglang(self, body: dict):
        s = self.state
        sp = body.get("sampling_params") or {}
        if isinstance(body.get("text"), str) and body.get("input_ids") is None:
            prompt = s.tokenizer.encode(body["text"], add_special_tokens=True).ids
        else:
            prompt = body.get("input_ids")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return self._error(400, "input_ids must be a list of token ids")
        if sp.get("top_k") == 0:
            return self._error(400, "top_k must be -1 (disable) or at least 1, got 0.")
        k = int(body.get("top_logprobs_num") or 0)
        ids, lps, tops, finish = sample(prompt, int(sp.get("max_new_tokens", 128)), max(k, 1),
                                        sp.get("sampling_seed") or 0, s.vocab,
                                        bool(sp.get("ignore_eos")))
        faulty = self._faulty(prompt)
        if faulty and s.mode == "malformed":
            return self._send(200, None, raw=b"<html>502 Bad Gateway</html>")
        finish_reason = ({"type": "stop", "matched": EOS} if finish == "stop"
                         else {"type": "length", "length": len(ids)})
        meta = {"id": "fault", "finish_reason": finish_reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(ids), "cached_tokens": 0}
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", -1)
            start = len(prompt) if start is None or start < 0 else start
            meta["input_token_logprobs"] = [[None if j == 0 else -1.0, t, None]
                                            for j, t in enumerate(prompt) if j >= start]
            meta["output_token_logprobs"] = [[v, t, None] for t, v in zip(ids, lps)]
            if k > 0:
                meta["output_top_logprobs"] = [[[v, t, None] for t, v in top] for top in tops]
            if faulty and s.mode == "short-logprobs":
                meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
            if faulty and s.mode == "no-logprobs":
                del meta["output_token_logprobs"]
        self._send(200, {"text": "", "output_ids": ids, "meta_info": meta})


def main(argv: list[str] | None = None) -> None:
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", required=True, choices=[
        "vllm-ok", "sglang-ok", "sglang-no-tokenize", "hang", "http500", "http500-then-ok",
        "drop-then-ok", "malformed", "no-logprobs", "short-logprobs", "bad-tokenizer", "logits"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--fault-token", type=int, default=None)
    ap.add_argument("--tokenizer", default=str(TOKENIZER))
    args = ap.parse_args(argv)
    Handler.state = State(args.mode, args.delay, args.fault_token,
                          Tokenizer.from_file(args.tokenizer))
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"READY {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
