"""Clients that use a live inference server as the sampler: token ids in, ids and log-probs out.

A client sends each prompt as token ids (never text), one HTTP request per prompt, at most
`max_concurrency` at a time, and lays the answers out exactly as the emulated sampler does
(`mismatch.engines.generation.generate`): prompts left-padded to a common width, the completion
after them, padded after EOS / the last token, `sampler_logprobs` at the completion positions,
the top-K candidates of each step, `prompt_width`. The trainer side then re-scores the
same tokens locally (`mismatch.engines.scorer.score`) and the same metrics apply.

Only the standard library speaks HTTP here (urllib.request, json, concurrent.futures).

The engines' clients and the schemas they implement: vllm_client.py (VllmClient),
sglang_client.py (SglangClient).

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

__all__ = ["ParsedCompletion", "RemoteError", "SamplerClient", "ServerTokens", "ranked_candidates",
           "required_field"]


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
class ParsedCompletion:
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
                  ignore_eos: bool) -> ParsedCompletion:
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
        from ..engines.logits import SamplingParams

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
        results: list[ParsedCompletion | None] = [None] * len(prompts)
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

    def _finish(self, index: int, c: ParsedCompletion, max_new_tokens: int, candidates: int, *,
                cut_at_eos: bool = True) -> ParsedCompletion:
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
            c = ParsedCompletion(c.token_ids[:cut], c.logprobs[:cut], c.candidate_ids[:cut],
                            c.candidate_logprobs[:cut], "stop")
        return c

    def _rollout(self, prompts: list[list[int]], results: list[ParsedCompletion], k: int,
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
                       prompt_width=p, meta=meta)


def ranked_candidates(pairs: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """Candidates sorted by log-prob (descending; ties by id), duplicates dropped."""
    seen: dict[int, float] = {}
    for tok, lp in pairs:
        seen.setdefault(tok, lp)
    ordered = sorted(seen.items(), key=lambda x: (-x[1], x[0]))
    return [t for t, _ in ordered], [lp for _, lp in ordered]


def required_field(obj: Any, key: str, kind: type, label: str, what: str) -> Any:
    """`obj[key]` when `obj` is a dict holding a `kind` there; otherwise a RemoteError naming the
    sampler (`label`), the request (`what`) and the missing field."""
    if not isinstance(obj, dict) or not isinstance(obj.get(key), kind):
        raise RemoteError(f"sampler {label} answered {what} without a valid {key!r} field; is it "
                          f"the engine the client expects? (check --sampler and the engine)")
    return obj[key]
