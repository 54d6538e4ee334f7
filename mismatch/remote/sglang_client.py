"""The SGLang client: `SamplerClient` (clients.py) over SGLang's native server.

Schema implemented:

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
"""

from __future__ import annotations

from .clients import RemoteError, SamplerClient, ServerTokens, ParsedCompletion, required_field, ranked_candidates

__all__ = ["SglangClient"]


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
            tokens = required_field(body, "tokens", list, self.label, "POST /tokenize")
            return ServerTokens([int(t) for t in tokens], False)
        # no /tokenize (older SGLang): the prompt's ids come back as input-token log-probs
        what = "POST /generate (text, for the tokenizer check)"
        answer = self._http("POST", "/generate", {
            "text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": False},
            what=what)
        answer = answer[0] if isinstance(answer, list) and answer else answer
        meta = required_field(answer, "meta_info", dict, self.label, what)
        entries = required_field(meta, "input_token_logprobs", list, self.label, what)
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
        meta = required_field(answer, "meta_info", dict, self.label, what)
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
            c_ids, c_lps = ranked_candidates([(int(e[1]), float(e[0])) for e in top])
            cand_ids.append(c_ids)
            cand_lps.append(c_lps)
        return ParsedCompletion(ids, values, cand_ids, cand_lps, kind)
