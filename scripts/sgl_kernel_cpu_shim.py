"""A pure-torch stand-in for SGLang's CPU kernel package `sgl_kernel`, installed into the SGLang
venv by scripts/setup_sglang_cpu.sh (this file becomes sgl_kernel/__init__.py there).

SGLang's real CPU kernels are built from its repository's sglang/kernels/aot and published on
no index reachable here. On a CPU without AMX the server computes with native torch (attention:
torch_native), but with `--device cpu` some of its modules import names from `sgl_kernel` at
import time, and the plain (non-speculative) generate path calls exactly one of them:
`assign_req_to_token_pool_cpu`, defined below. Every other name resolves to a function that raises
RuntimeError when called (MoE, quantized, speculative and multimodal paths need the real
package: serve a dense model).
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+mismatch-cpu-shim"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int | None = None) -> None:
    """For each request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i] - start[i] entries of out_cache_loc (the semantics of assign_req_to_token_pool in
    sglang/srt/mem_cache/allocation.py, sgl-project/sglang@v0.5.23)."""
    pos = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                               end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def _missing(name: str):
    def unsupported(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} is not in the pure-torch CPU shim "
                                  f"(scripts/sgl_kernel_cpu_shim.py): serve a dense model, "
                                  f"without speculative decoding or quantization")
    unsupported.__name__ = name
    return unsupported


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
