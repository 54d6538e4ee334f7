"""Clients that use a live inference server as the sampler: token ids in, ids and log-probs out.

A client sends each prompt as token ids (never text), one HTTP request per prompt, at most
`max_concurrency` at a time, and lays the answers out exactly as the emulated sampler does
(`mismatch.engines.sampler.generate`): prompts left-padded to a common width, the completion
after them, padded after EOS / the last token, `sampler_logprobs` at the completion positions,
the top-K candidates of each step, `meta["prompt_width"]`. The trainer side then re-scores the
same tokens locally (`mismatch.engines.scorer.score`) and the same metrics apply.

Only the standard library speaks HTTP here (urllib.request, json, concurrent.futures).

Schemas implemented (read from the engines' sources):

vLLM, OpenAI-compatible `POST /v1/completions`
  request  (vllm/entrypoints/openai/completion/protocol.py, CompletionRequest): `prompt` as a
           list of token ids, `max_tokens`, `temperature`, `top_p`, `top_k` (-1: off), `seed`,
           `logprobs` (top-K per step; the server caps it at --max-logprobs, default 20),
           `return_tokens_as_token_ids: true`, plus `min_p`/penalties pinned to neutral so a
           model's generation_config.json cannot change the distribution behind our back.
  response (same file, CompletionLogProbs; built in completion/serving.py,
           _create_completion_logprobs): `choices[0].logprobs` = {tokens: ["token_id:123", ...],
           token_logprobs: [float, ...] (clamped at -9999.0), top_logprobs: [{"token_id:N": lp}]
           holding the sampled token and the top-K, so K or K + 1 entries}, `finish_reason`
           "stop" | "length"; newer servers also return `choices[0].token_ids` (return_token_ids).
  log-prob mode: `--logprobs-mode`, default "raw_logprobs" (vllm/config/model.py, ModelConfig):
           raw = before temperature, penalties, top-k/top-p. The server does not report it, so
           the client records the mode it was told (`logprobs_mode=`), marked as assumed.
  model:   `GET /v1/models` → {data: [{id: ...}]}; tokenizer: `POST /tokenize`
           {prompt, add_special_tokens} → {tokens, count, max_model_len}.

SGLang, native `POST /generate` (paths in sgl-project/sglang@v0.5.23; the format below was
checked against a real 0.5.23 server in tests/test_engine_sglang.py)
  request  (python/sglang/srt/managers/io_struct.py, GenerateReqInput): `input_ids`,
           `sampling_params` {max_new_tokens, temperature, top_p, top_k (-1: off), min_p,
           penalties, sampling_seed} (python/sglang/srt/sampling/sampling_params.py),
           `return_logprob: true`, `logprob_start_len: -1` (output tokens only),
           `top_logprobs_num`, `return_text_in_logprobs: false`.
  response (python/sglang/srt/managers/tokenizer_manager.py, convert_logprob_style /
           detokenize_logprob_tokens): {text, output_ids, meta_info: {finish_reason: {type:
           "stop" | "length" | "abort", ...}, prompt_tokens, completion_tokens,
           output_token_logprobs: [[logprob, token_id, null], ...], output_top_logprobs:
           [[[logprob, token_id, null] × K] | null, ...]}}.
  log-prob mode: python/sglang/srt/layers/sampler.py returns log(softmax(logits / T)) — after
           temperature, before top-k/top-p — unless the server runs with
           SGLANG_RETURN_ORIGINAL_LOGPROB (raw, pre-temperature); greedy (T = 0) is raw.
  tokenizer: `POST /tokenize` (python/sglang/srt/entrypoints/openai/serving_tokenize.py, same
           shape as vLLM's) where it exists; older servers answer 404 and the prompt's ids come
           from `/generate` with `text` and `logprob_start_len: 0` (meta_info.input_token_logprobs).
  seeds:   SGLang honours `sampling_seed` only under --enable-deterministic-inference.
  errors:  HTTP 400 with {"error": {"message"}} (context overflow, bad sampling params),
           {"error": "text"} (unknown sampling field) or {"object": "error", "message": text +
           traceback} (request validation). Not rejected but fatal to the server: a prompt id
           outside the vocabulary, top_logprobs_num above the vocabulary size (the connection
           drops, then nothing listens).

Every failure is a `RemoteError`: one line saying what happened and what to do.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import http.client
import json
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["RemoteError", "SamplerClient", "ServerTokens", "SglangClient", "VllmClient"]


class RemoteError(ValueError):
    """A remote sampler failed or answered something unusable (the message is one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ServerTokens(NamedTuple):
    """The server's tokenization of a text."""

    ids: list[int]
    add_special_tokens: bool
    """Whether the server added its special tokens (compare with a local encode that does too)."""


@dataclass
class _Completion:
    """One prompt's answer, parsed."""

    token_ids: list[int]
    logprobs: list[float]
    candidate_ids: list[list[int]]
    candidate_logprobs: list[list[float]]
    finish_reason: str | None


_RETRYABLE_OS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _server_message(raw: bytes) -> str:
    """The human part of an error body: vLLM's and SGLang's {"error": {"message"}}, SGLang's
    {"error": "text"} (sampling-params errors) and {"object": "error", "message"} (request
    validation, followed by a traceback, which is dropped), FastAPI's {"detail"}, else the text
    itself (shortened)."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str) and err:
            text = err
        elif body.get("message"):
            text = str(body["message"])
        elif body.get("detail"):
            text = str(body["detail"])
    text = re.split(r'\n\s*File "', text, maxsplit=1)[0]  # a traceback after the message
    text = " ".join(text.split())
    return (text[:300] + "…") if len(text) > 300 else (text or "(empty body)")


class SamplerClient(abc.ABC):
    """Base of the remote samplers: HTTP with retries, bounded concurrency, Rollout layout.

    base_url: the server's root, e.g. http://127.0.0.1:8000. timeout: seconds without an answer
    before a request fails (socket-level, per request). attempts: tries per request on HTTP 5xx
    or a dropped connection, with exponential backoff `backoff · 2^i` s between them; 4xx,
    refused connections and timeouts are not retried. pad_id: fills the padding (use the
    tokenizer's pad id). eos_ids: if given, a completion is cut after its first EOS even if the
    server went on (as the emulated sampler does). Proxies from the environment are not used:
    the client talks to the server directly.
    """

    engine = "remote"
    engine_name = "remote"
    _crash_hint = ""
    """Appended to the error for a server that went down during a request."""

    def __init__(self, base_url: str, *, timeout: float = 60.0, max_concurrency: int = 8,
                 attempts: int = 3, backoff: float = 0.5, pad_id: int = 0,
                 eos_ids: set[int] | None = None):
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise RemoteError(f"sampler URL {base_url!r} is not an http(s) URL; pass the "
                              f"server's root, e.g. http://127.0.0.1:8000 (check --sampler)")
        if timeout <= 0 or max_concurrency < 1 or attempts < 1 or backoff < 0:
            raise ValueError(f"need timeout > 0, max_concurrency >= 1, attempts >= 1, "
                             f"backoff >= 0; got {timeout}, {max_concurrency}, {attempts}, "
                             f"{backoff}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.max_concurrency = int(max_concurrency)
        self.attempts = int(attempts)
        self.backoff = float(backoff)
        self.pad_id = int(pad_id)
        self.eos_ids = set(eos_ids) if eos_ids else set()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0, "completion_tokens": 0, "seconds": 0.0}

    # ----------------------------------------------------------------------------- reporting
    @property
    def label(self) -> str:
        return f"{self.engine} {self.base_url}"

    @property
    def throughput(self) -> dict:
        """Totals over every generate() call: completion tokens/s (wall clock), requests,
        retries."""
        with self._lock:
            s = dict(self._stats)
        s["tokens_per_s"] = s["completion_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0
        return s

    def logprob_mode(self, temperature: float) -> tuple[str, str]:
        """(mode, where that comes from) of the log-probs this server reports."""
        return "unknown", "not known for this engine"

    # ---------------------------------------------------------------------------------- HTTP
    def _http(self, method: str, path: str, body: Any = None, *, what: str,
              missing_ok: bool = False) -> Any:
        """JSON request with retries; `what` names it in errors. missing_ok: 404 → None."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                with self._lock:
                    self._stats["retries"] += 1
                time.sleep(self.backoff * 2 ** (attempt - 1))
            with self._lock:
                self._stats["requests"] += 1
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as e:
                try:
                    message = _server_message(e.read())
                except (OSError, http.client.HTTPException):
                    message = "(body unreadable)"
                if e.code == 404 and missing_ok:
                    return None
                if e.code >= 500:
                    last = f"HTTP {e.code}: {message}"
                    continue
                raise RemoteError(f"sampler {self.label} rejected {what} with HTTP {e.code}: "
                                  f"{message} (fix the request or the server's settings)") from None
            except urllib.error.URLError as e:
                reason = e.reason
                if isinstance(reason, ConnectionRefusedError) and last.startswith("connection"):
                    raise RemoteError(f"sampler {self.label} dropped the connection for {what} "
                                      f"and then refused new ones: the server went down while "
                                      f"answering it; check its log{self._crash_hint}") from None
                if isinstance(reason, ConnectionRefusedError):
                    raise RemoteError(f"sampler {self.label} refused the connection; is the "
                                      f"server running? (start it, or check --sampler)") from None
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    raise self._timeout_error(what) from None
                if isinstance(reason, _RETRYABLE_OS):
                    last = f"connection dropped ({type(reason).__name__})"
                    continue
                if isinstance(reason, socket.gaierror):
                    raise RemoteError(f"sampler host in {self.base_url} does not resolve "
                                      f"({reason}); check --sampler") from None
                raise RemoteError(f"could not reach sampler {self.label} for {what}: {reason}; "
                                  f"check --sampler and the network") from None
            except (TimeoutError, socket.timeout):
                raise self._timeout_error(what) from None
            except (http.client.HTTPException, *_RETRYABLE_OS) as e:
                # RemoteDisconnected (closed without an answer), IncompleteRead, resets
                last = f"connection dropped ({type(e).__name__})"
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise RemoteError(f"sampler {self.label} answered {what} with invalid JSON "
                                  f"({raw[:60]!r}…); is --sampler a {self.engine_name} server?"
                                  ) from None
        raise RemoteError(f"sampler {self.label} failed {what} {self.attempts} times "
                          f"(last: {last}); check the server's log (it may be out of memory "
                          f"or restarting)")

    def _timeout_error(self, what: str) -> RemoteError:
        return RemoteError(f"sampler {self.label} did not answer {what} within {self.timeout:g} s;"
                           f" is it overloaded or stuck? (check its log, or raise the timeout)")

    # ------------------------------------------------------------------------ engine-specific
    @abc.abstractmethod
    def tokenize(self, text: str) -> ServerTokens:
        """The server's tokenization of `text`."""

    @abc.abstractmethod
    def _complete(self, index: int, prompt: list[int], *, max_new_tokens: int,
                  temperature: float, top_p: float, top_k: int, seed: int, candidates: int,
                  ignore_eos: bool) -> _Completion:
        """One request for prompt `index`, parsed (checked and cut by `_finish`)."""

    def _describe(self) -> dict:
        return {}

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 candidates: int = 8, ignore_eos: bool = False):
        """Sample one completion per token-id prompt on the server → `Rollout` (mode "measured").

        Prompt i is sent with seed `seed + i`. Log-probs are what the server reports (its
        log-prob mode is in `meta["logprob_mode"]`); `sampler_logprobs_processed` holds the same
        numbers, since a server reports one kind. ignore_eos: generate max_new_tokens regardless
        of EOS (the canary uses it to see a fixed number of log-probs)."""
        from ..engines.sampler import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, candidates=candidates, seed=seed)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, and no empty prompt")
        prompts = [[int(t) for t in p] for p in prompts]
        if any(t < 0 for p in prompts for t in p):
            raise ValueError("a prompt holds a negative token id; token ids are >= 0 (an SGLang "
                             "server exits on one)")
        kwargs = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                      top_p=params.top_p, top_k=params.top_k, candidates=params.candidates,
                      ignore_eos=bool(ignore_eos))
        described = self._describe()  # resolves what every request needs (vLLM: the model)
        start = time.perf_counter()
        results: list[_Completion | None] = [None] * len(prompts)
        with self._lock:
            before = dict(self._stats)
        pool = cf.ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts)),
                                     thread_name_prefix="sampler")
        try:
            futures = {pool.submit(self._complete, i, p, seed=params.seed + i, **kwargs): i
                       for i, p in enumerate(prompts)}
            for future in cf.as_completed(futures):
                results[futures[future]] = self._finish(
                    futures[future], future.result(), params.max_new_tokens, params.candidates,
                    cut_at_eos=not ignore_eos)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        elapsed = time.perf_counter() - start
        n_tokens = sum(len(r.token_ids) for r in results)
        with self._lock:
            self._stats["completion_tokens"] += n_tokens
            self._stats["seconds"] += elapsed
            call = {"requests": self._stats["requests"] - before["requests"],
                    "retries": self._stats["retries"] - before["retries"]}
        mode, source = self.logprob_mode(params.temperature)
        meta = {"engine": self.engine, "url": self.base_url, **described,
                "logprob_mode": mode, "logprob_mode_source": source,
                "finish_reasons": [r.finish_reason for r in results],
                "seeds": "seed + prompt index", "ignore_eos": bool(ignore_eos), "sampling": {
                    "max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
                    "candidates": params.candidates},
                "throughput": {"completion_tokens": n_tokens, "seconds": elapsed,
                               "tokens_per_s": n_tokens / elapsed if elapsed > 0 else 0.0,
                               **call}}
        return self._rollout(prompts, results, params.candidates, meta)

    def _finish(self, index: int, c: _Completion, max_new_tokens: int, candidates: int, *,
                cut_at_eos: bool = True) -> _Completion:
        """Check one parsed answer and cut it after EOS."""
        where = f"prompt {index}"
        if not c.token_ids:
            raise RemoteError(f"sampler {self.label} generated no token for {where}; check the "
                              f"server's log and its max-model-len")
        if len(c.logprobs) != len(c.token_ids):
            fewer = "fewer" if len(c.logprobs) < len(c.token_ids) else "more"
            raise RemoteError(f"sampler {self.label} returned {len(c.logprobs)} log-probs for "
                              f"{len(c.token_ids)} generated tokens of {where} ({fewer} than "
                              f"tokens); its log-probs cannot be matched to tokens (serve with "
                              f"log-probs enabled, one per sampled token)")
        if len(c.candidate_ids) != len(c.token_ids):
            raise RemoteError(f"sampler {self.label} returned top candidates for "
                              f"{len(c.candidate_ids)} of {len(c.token_ids)} generated tokens of "
                              f"{where}; ask for fewer candidates or check the server")
        for t, (lp, ids) in enumerate(zip(c.logprobs, c.candidate_ids)):
            if lp is None or not math.isfinite(lp):
                raise RemoteError(f"sampler {self.label} returned log-prob {lp} for generated "
                                  f"token {t} of {where}; serve with log-probs enabled")
            if len(ids) < candidates:
                raise RemoteError(f"sampler {self.label} returned {len(ids)} top candidates at "
                                  f"generated token {t} of {where}, {candidates} asked; lower "
                                  f"the candidates or raise the server's max log-probs")
        if len(c.token_ids) > max_new_tokens:
            raise RemoteError(f"sampler {self.label} generated {len(c.token_ids)} tokens for "
                              f"{where}, {max_new_tokens} asked; the server ignores max tokens")
        eos = self.eos_ids if cut_at_eos else set()
        cut = next((t + 1 for t, tok in enumerate(c.token_ids) if tok in eos), None)
        if cut is not None and cut < len(c.token_ids):
            c = _Completion(c.token_ids[:cut], c.logprobs[:cut], c.candidate_ids[:cut],
                            c.candidate_logprobs[:cut], "stop")
        return c

    def _rollout(self, prompts: list[list[int]], results: list[_Completion], k: int,
                 meta: dict):
        import torch

        from ..records import Rollout

        b, p = len(prompts), max(len(x) for x in prompts)
        n = max(len(r.token_ids) for r in results)
        ids = torch.full((b, p + n), self.pad_id, dtype=torch.long)
        attention = torch.zeros((b, p + n), dtype=torch.long)
        completion = torch.zeros((b, p + n), dtype=torch.float32)
        logprobs = torch.zeros((b, p + n), dtype=torch.float32)
        cand_ids = torch.zeros((b, p + n, k), dtype=torch.long)
        cand_lp = torch.zeros((b, p + n, k), dtype=torch.float32)
        for i, (prompt, r) in enumerate(zip(prompts, results)):
            m = len(r.token_ids)
            ids[i, p - len(prompt):p] = torch.tensor(prompt)
            attention[i, p - len(prompt):p + m] = 1
            ids[i, p:p + m] = torch.tensor(r.token_ids)
            completion[i, p:p + m] = 1.0
            logprobs[i, p:p + m] = torch.tensor(r.logprobs, dtype=torch.float64).float()
            cand_ids[i, p:p + m] = torch.tensor([c[:k] for c in r.candidate_ids])
            cand_lp[i, p:p + m] = torch.tensor([c[:k] for c in r.candidate_logprobs],
                                               dtype=torch.float64).float()
        return Rollout(token_ids=ids, attention_mask=attention, completion_mask=completion,
                       sampler_logprobs=logprobs, sampler_logprobs_processed=logprobs.clone(),
                       candidate_ids=cand_ids, candidate_logprobs=cand_lp,
                       sampler=self.label, mode="measured",
                       meta={"prompt_width": p, **meta})


def _top(pairs: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """Candidates sorted by log-prob (descending; ties by id), duplicates dropped."""
    seen: dict[int, float] = {}
    for tok, lp in pairs:
        seen.setdefault(tok, lp)
    ordered = sorted(seen.items(), key=lambda x: (-x[1], x[0]))
    return [t for t, _ in ordered], [lp for _, lp in ordered]


def _field(obj: Any, key: str, kind: type, label: str, what: str) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get(key), kind):
        raise RemoteError(f"sampler {label} answered {what} without a valid {key!r} field; is it "
                          f"the engine the client expects? (check --sampler and the engine)")
    return obj[key]


class VllmClient(SamplerClient):
    """vLLM's OpenAI-compatible server (`vllm serve`), through `POST /v1/completions`.

    model: the served model name (None: the first one `GET /v1/models` lists). logprobs_mode:
    the server's `--logprobs-mode` (it does not report it; vLLM's default is raw_logprobs).
    """

    engine = "vllm"
    engine_name = "vLLM"
    _MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}

    def __init__(self, base_url: str, model: str | None = None, *,
                 logprobs_mode: str = "raw_logprobs", **kwargs):
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        super().__init__(base, **kwargs)
        if logprobs_mode not in self._MODES:
            raise RemoteError(f"vLLM --logprobs-mode {logprobs_mode} returns logits, not "
                              f"log-probs; serve with --logprobs-mode raw_logprobs (or "
                              f"processed_logprobs)")
        self.logprobs_mode = logprobs_mode
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            body = self._http("GET", "/v1/models", what="GET /v1/models")
            data = _field(body, "data", list, self.label, "GET /v1/models")
            names = [m.get("id") for m in data if isinstance(m, dict) and m.get("id")]
            if not names:
                raise RemoteError(f"sampler {self.label} serves no model (GET /v1/models is "
                                  f"empty); start it with the checkpoint to probe")
            with self._lock:
                self._model = self._model or str(names[0])
        return self._model

    def _describe(self) -> dict:
        return {"model": self.model}

    def logprob_mode(self, temperature: float) -> tuple[str, str]:
        return (self._MODES[self.logprobs_mode],
                f"assumed from --logprobs-mode {self.logprobs_mode} (vLLM's default is "
                f"raw_logprobs; the server does not report it)")

    def tokenize(self, text: str) -> ServerTokens:
        body = self._http("POST", "/tokenize", {"model": self.model, "prompt": text,
                                                "add_special_tokens": False},
                          what="POST /tokenize")
        tokens = _field(body, "tokens", list, self.label, "POST /tokenize")
        return ServerTokens([int(t) for t in tokens], False)

    def _complete(self, index, prompt, *, max_new_tokens, temperature, top_p, top_k, seed,
                  candidates, ignore_eos):
        what = f"prompt {index}"
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens,
                "temperature": temperature, "top_p": top_p, "top_k": top_k or -1,
                "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "ignore_eos": ignore_eos, "seed": seed, "n": 1,
                "stream": False,
                "echo": False, "logprobs": candidates, "return_tokens_as_token_ids": True,
                "return_token_ids": True}
        answer = self._http("POST", "/v1/completions", body, what=what)
        choices = _field(answer, "choices", list, self.label, what)
        if len(choices) != 1 or not isinstance(choices[0], dict):
            raise RemoteError(f"sampler {self.label} returned {len(choices)} choices for "
                              f"{what}, 1 asked; check the server")
        choice = choices[0]
        lp = choice.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("token_logprobs"), list):
            raise RemoteError(f"sampler {self.label} returned no log-probs for {what} though "
                              f"logprobs={candidates} was asked; is --sampler a vLLM OpenAI "
                              f"server, not a proxy that drops them?")
        tokens = lp.get("tokens") or []
        ids = [self._token_id(t, what) for t in tokens]
        if isinstance(choice.get("token_ids"), list):
            if ids and [int(t) for t in choice["token_ids"]] != ids:
                raise RemoteError(f"sampler {self.label} returned token_ids that differ from its "
                                  f"log-prob tokens for {what}; check the server version")
            ids = ids or [int(t) for t in choice["token_ids"]]
        values = [None if v is None else float(v) for v in lp["token_logprobs"]]
        cand_ids, cand_lps = [], []
        for step, top in enumerate(lp.get("top_logprobs") or []):
            if not isinstance(top, dict):
                raise RemoteError(f"sampler {self.label} returned no top log-probs at generated "
                                  f"token {step} of {what}; serve with log-probs enabled")
            c_ids, c_lps = _top([(self._token_id(k, what), float(v)) for k, v in top.items()])
            cand_ids.append(c_ids)
            cand_lps.append(c_lps)
        return _Completion(ids, values, cand_ids, cand_lps, choice.get("finish_reason"))

    def _token_id(self, token: Any, what: str) -> int:
        if isinstance(token, str) and token.startswith("token_id:"):
            try:
                return int(token[len("token_id:"):])
            except ValueError:
                pass
        raise RemoteError(f"sampler {self.label} returned token text {str(token)[:20]!r} instead "
                          f"of 'token_id:N' for {what}; this vLLM ignores "
                          f"return_tokens_as_token_ids (upgrade vLLM)")


class SglangClient(SamplerClient):
    """SGLang's native server (`python -m sglang.launch_server`), through `POST /generate`.

    original_logprob: the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB (raw log-probs at any
    temperature); otherwise SGLang reports log_softmax(logits / T). send_seed: send
    `sampling_seed` (servers older than that field reject it; it only takes effect under
    --enable-deterministic-inference).
    """

    engine = "sglang"
    engine_name = "SGLang"
    # SGLang 0.5.23 does not check prompt ids against the vocabulary: an id >= vocab_size makes
    # the scheduler raise (IndexError in the embedding) and the server exit (seen on a real
    # server; the check exists only for token_ids_logprob, sgl-project/sglang@v0.5.23:
    # python/sglang/srt/managers/tokenizer_manager.py)
    _crash_hint = (" (SGLang exits on a prompt id outside its vocabulary: is --model the "
                   "served model's tokenizer?)")

    def __init__(self, base_url: str, *, original_logprob: bool = False, send_seed: bool = True,
                 **kwargs):
        super().__init__(base_url, **kwargs)
        self.original_logprob = bool(original_logprob)
        self.send_seed = bool(send_seed)

    def logprob_mode(self, temperature: float) -> tuple[str, str]:
        if self.original_logprob:
            return "raw", "SGLANG_RETURN_ORIGINAL_LOGPROB set on the server (as told)"
        if temperature in (0.0, 1.0):
            return "raw", (f"SGLang reports log_softmax(logits / T), which at temperature "
                           f"{temperature:g} is the raw distribution")
        return "temperature-scaled", (f"SGLang reports log_softmax(logits / {temperature:g}) — "
                                      f"after temperature, before top-k/top-p; serve with "
                                      f"SGLANG_RETURN_ORIGINAL_LOGPROB=1 for raw")

    def tokenize(self, text: str) -> ServerTokens:
        body = self._http("POST", "/tokenize", {"prompt": text, "add_special_tokens": False},
                          what="POST /tokenize", missing_ok=True)
        if body is not None:
            tokens = _field(body, "tokens", list, self.label, "POST /tokenize")
            return ServerTokens([int(t) for t in tokens], False)
        # no /tokenize (older SGLang): the prompt's ids come back as input-token log-probs
        what = "POST /generate (text, for the tokenizer check)"
        answer = self._http("POST", "/generate", {
            "text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": False},
            what=what)
        answer = answer[0] if isinstance(answer, list) and answer else answer
        meta = _field(answer, "meta_info", dict, self.label, what)
        entries = _field(meta, "input_token_logprobs", list, self.label, what)
        return ServerTokens([int(e[1]) for e in entries], True)

    def _complete(self, index, prompt, *, max_new_tokens, temperature, top_p, top_k, seed,
                  candidates, ignore_eos):
        what = f"prompt {index}"
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                    "top_p": top_p, "top_k": top_k or -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "ignore_eos": ignore_eos}
        if self.send_seed:
            sampling["sampling_seed"] = seed
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
                "logprob_start_len": -1, "top_logprobs_num": candidates,
                "return_text_in_logprobs": False, "stream": False}
        answer = self._http("POST", "/generate", body, what=what)
        if isinstance(answer, list):
            if len(answer) != 1:
                raise RemoteError(f"sampler {self.label} returned {len(answer)} answers for "
                                  f"{what}, 1 asked; check the server")
            answer = answer[0]
        meta = _field(answer, "meta_info", dict, self.label, what)
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            message = finish.get("message") if isinstance(finish, dict) else ""
            raise RemoteError(f"sampler {self.label} aborted {what}: {message}; check the "
                              f"server's log")
        out = meta.get("output_token_logprobs")
        if not isinstance(out, list):
            raise RemoteError(f"sampler {self.label} returned no log-probs for {what} though "
                              f"return_logprob was asked; is --sampler an SGLang server, not a "
                              f"proxy that drops them?")
        try:
            ids = [int(e[1]) for e in out]
            values = [None if e[0] is None else float(e[0]) for e in out]
        except (TypeError, IndexError, ValueError):
            raise RemoteError(f"sampler {self.label} returned output_token_logprobs that are not"
                              f" [logprob, token_id, text] triples for {what}; check the SGLang "
                              f"version") from None
        output_ids = answer.get("output_ids")
        if isinstance(output_ids, list):
            output_ids = [int(t) for t in output_ids]
            if ids and output_ids[:len(ids)] != ids[:len(output_ids)]:
                raise RemoteError(f"sampler {self.label} returned output_ids that differ from "
                                  f"its log-prob token ids for {what}; check the server")
            if len(output_ids) > len(ids):
                ids = output_ids  # more tokens than log-probs: _finish says so
        elif isinstance(meta.get("completion_tokens"), int):
            missing = meta["completion_tokens"] - len(ids)
            ids = ids + [self.pad_id] * max(missing, 0)  # ditto: _finish counts them
        cand_ids, cand_lps = [], []
        for step, top in enumerate(meta.get("output_top_logprobs") or []):
            if not isinstance(top, list):
                raise RemoteError(f"sampler {self.label} returned no top log-probs at generated "
                                  f"token {step} of {what}; check top_logprobs_num support")
            c_ids, c_lps = _top([(int(e[1]), float(e[0])) for e in top])
            cand_ids.append(c_ids)
            cand_lps.append(c_lps)
        return _Completion(ids, values, cand_ids, cand_lps, kind)
