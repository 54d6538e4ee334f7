"""Live inference servers (vLLM, SGLang) as the sampler: token ids in, ids and log-probs out.

    VllmClient(url, model=None)   vLLM's OpenAI-compatible /v1/completions
    SglangClient(url)             SGLang's native /generate
    client.generate(prompts, ...) → a Rollout laid out as the emulated sampler's (mode "measured")
    run_canary(client, tokenizer) the checks every remote run starts with
    RemoteError                   every failure: one line, what happened and what to do
    LIVE_ENGINES                  the engines' names (engines.py, no imports)
"""

from __future__ import annotations

import importlib
from typing import Any

from .engines import LIVE_ENGINES

# each name from its module, loaded on first use: the command line reads LIVE_ENGINES without
# the clients' network stack
_EXPORTS = {"CANARY_TEXT": "canary", "run_canary": "canary", "RemoteError": "clients",
            "SamplerClient": "clients", "ServerTokens": "clients",
            "SglangClient": "sglang_client", "VllmClient": "vllm_client"}

__all__ = ["CANARY_TEXT", "LIVE_ENGINES", "RemoteError", "SamplerClient", "ServerTokens",
           "SglangClient", "VllmClient", "run_canary"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
