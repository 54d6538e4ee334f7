"""The vLLM client: `SamplerClient` (clients.py) over vLLM's OpenAI-compatible server.

Schema implemented (read from vLLM's sources):

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
"""

from __future__ import annotations

from typing import Any

from .clients import RemoteError, SamplerClient, ServerTokens, ParsedCompletion, required_field, ranked_candidates

__all__ = ["VllmClient"]


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
            data = required_field(body, "data", list, self.label, "GET /v1/models")
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
        tokens = required_field(body, "tokens", list, self.label, "POST /tokenize")
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
        choices = required_field(answer, "choices", list, self.label, what)
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
            c_ids, c_lps = ranked_candidates([(self._token_id(k, what), float(v)) for k, v in top.items()])
            cand_ids.append(c_ids)
            cand_lps.append(c_lps)
        return ParsedCompletion(ids, values, cand_ids, cand_lps, choice.get("finish_reason"))

    def _token_id(self, token: Any, what: str) -> int:
        if isinstance(token, str) and token.startswith("token_id:"):
            try:
                return int(token[len("token_id:"):])
            except ValueError:
                pass
        raise RemoteError(f"sampler {self.label} returned token text {str(token)[:20]!r} instead "
                          f"of 'token_id:N' for {what}; this vLLM ignores "
                          f"return_tokens_as_token_ids (upgrade vLLM)")
