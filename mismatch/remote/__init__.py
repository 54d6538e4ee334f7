"""Live inference servers (vLLM, SGLang) as the sampler: token ids in, ids and log-probs out.

    VllmClient(url, model=None)   vLLM's OpenAI-compatible /v1/completions
    SglangClient(url)             SGLang's native /generate
    client.generate(prompts, ...) → a Rollout laid out as the emulated sampler's (mode "measured")
    run_canary(client, tokenizer) the checks every remote run starts with
    RemoteError                   every failure: one line, what happened and what to do
"""

from .canary import CANARY_TEXT, run_canary
from .clients import RemoteError, SamplerClient, ServerTokens
from .sglang_client import SglangClient
from .vllm_client import VllmClient

__all__ = ["CANARY_TEXT", "RemoteError", "SamplerClient", "ServerTokens", "SglangClient",
           "VllmClient", "run_canary"]
