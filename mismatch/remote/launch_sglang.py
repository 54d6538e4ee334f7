"""Starting a real SGLang server on this CPU (127.0.0.1), for the engine tests; `mismatch qualify
--sampler URL` itself connects to a server you started and launches nothing.

    with sglang_server(model_dir) as url:   # url = "http://127.0.0.1:PORT"
        ...                                  # POST {url}/generate, {url}/tokenize, ...
    sglang_available(venv) -> bool           # is SGLang installed in that venv?
    default_sglang_venv() -> Path            # $MISMATCH_SGLANG_VENV, else .venv-sglang in the repo

SGLang lives in its own virtual environment (`scripts/setup_sglang_cpu.sh`: sglang 0.5.23 with
--no-deps on torch 2.13.0+cpu, transformers 5.19.0, a patched torchvision and a pure-torch
`sgl_kernel`; see the script for why), so the server is always a subprocess:
`VENV/bin/python -m sglang.launch_server`. Serve a dense model: the kernel shim has no MoE,
quantized, speculative or multimodal path (the embedded model is a MoE; the engine test builds
a dense one from it).

Flags, and why:
  --device cpu --host 127.0.0.1   this CPU; never listen beyond loopback
  --attention-backend torch_native  the only attention without SGLang's CPU kernels (no AMX)
  --disable-overlap-schedule, --cuda-graph-backend-decode/-prefill disabled   no CUDA here
  --max-total-tokens, --context-length, --max-running-requests   the KV cache is sized from
                                  these, not from free memory
  --dtype bfloat16                the trainer's dtype
  --random-seed                   the server's seed (per-request seeds need SGLang's
                                  --enable-deterministic-inference, not used here)
Environment: SGLANG_USE_CPU_ENGINE=1 and SGLANG_CPU_OMP_THREADS_BIND=0 (the CPU engine),
Hugging Face offline. Readiness is `GET /health` = 200: SGLang answers 503 until its warm-up
request is done (~45 s on 2 cores), and /v1/models answers before that.

Known behaviour of the real server (sglang 0.5.23, seen on this CPU): a prompt that holds a token
id outside the vocabulary (negative or >= vocab_size), or a `top_logprobs_num` above the
vocabulary size, is not rejected: the scheduler raises (IndexError in the embedding / "selected
index k out of range" in topk) and the whole server exits. A prompt longer than the context
length gets HTTP 400 instead.

The server's stdout and stderr go to a log file (kept, its path in every error); on exit the
whole process group (launcher, tokenizer manager, scheduler, detokenizer) is stopped and reaped,
as for vLLM (launch.py, `serve`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from .launch import (EngineLaunchError, free_port, port_free, serve, server_env,
                     engine_venv, venv_passes)

__all__ = ["default_sglang_venv", "sglang_available", "sglang_command", "sglang_server"]

SGLANG_VENV_ENV = "MISMATCH_SGLANG_VENV"
"""Environment variable naming the SGLang virtual environment."""


def default_sglang_venv() -> Path:
    """$MISMATCH_SGLANG_VENV, else `.venv-sglang` (launch.engine_venv)."""
    return engine_venv(SGLANG_VENV_ENV, ".venv-sglang")


def _python(venv: str | Path | None) -> Path:
    return Path(default_sglang_venv() if venv is None else venv).expanduser() / "bin" / "python"


def sglang_available(venv: str | Path | None = None) -> bool:
    """Whether `venv` (None: `default_sglang_venv()`) has SGLang's server module and the
    `sgl_kernel` shim. Cheap (finds the files, imports nothing heavy); a broken install still
    fails later, at `sglang_server`, with the log's last line."""
    probe = ("import importlib.util as u, pathlib, sys; s = u.find_spec('sglang'); "
             "k = u.find_spec('sgl_kernel'); ok = s is not None and k is not None and "
             "s.origin is not None and (pathlib.Path(s.origin).parent / 'launch_server.py')"
             ".is_file(); sys.exit(0 if ok else 1)")
    return venv_passes(_python(venv), probe)


def sglang_command(model_dir: str | Path, *, venv: str | Path | None = None, port: int,
                   context_length: int = 1024, max_total_tokens: int = 8192,
                   max_running_requests: int = 4, dtype: str = "bfloat16", seed: int = 0,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The argv that `sglang_server` runs (see the module doc for each flag)."""
    if context_length < 1 or max_total_tokens < context_length or max_running_requests < 1:
        raise ValueError(f"need context_length >= 1, max_total_tokens >= context_length and "
                         f"max_running_requests >= 1; got {context_length}, {max_total_tokens}, "
                         f"{max_running_requests}")
    return [str(_python(venv)), "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--attention-backend", "torch_native",
            "--disable-overlap-schedule", "--cuda-graph-backend-decode", "disabled",
            "--cuda-graph-backend-prefill", "disabled",
            "--max-total-tokens", str(max_total_tokens), "--context-length", str(context_length),
            "--max-running-requests", str(max_running_requests), "--random-seed", str(seed),
            *extra_args]


@contextlib.contextmanager
def sglang_server(model_dir: str | Path, *, venv: str | Path | None = None,
                  port: int | None = None, context_length: int = 1024,
                  max_total_tokens: int = 8192, max_running_requests: int = 4,
                  dtype: str = "bfloat16", seed: int = 0, timeout_s: float = 240.0,
                  stop_timeout_s: float = 20.0, log_path: str | Path | None = None,
                  extra_args: Sequence[str] = (),
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """Serve the dense checkpoint `model_dir` with SGLang on this CPU, on 127.0.0.1; yields the
    base URL ("http://127.0.0.1:PORT") once `GET /health` answers 200.

    port: None picks a free one. timeout_s: start-up limit (~50 s on 2 cores for a tiny model).
    Raises EngineLaunchError (one line, with the log's last meaningful line and its path) when
    SGLang is missing, the port is taken, the server exits early or is not ready in time."""
    from ..zoo import check_model_dir

    model = check_model_dir(model_dir, tokenizer=True, quantized=True)
    python = _python(venv)
    venv_dir = python.parent.parent
    if not sglang_available(venv_dir):
        raise EngineLaunchError(f"SGLang is not installed in {venv_dir}; run "
                                f"scripts/setup_sglang_cpu.sh {venv_dir}")
    if port is None:
        port = free_port()
    elif not port_free(port):
        raise EngineLaunchError(f"port {port} on 127.0.0.1 is already in use; pass another "
                                f"port or port=None to pick a free one")
    cmd = sglang_command(model, venv=venv_dir, port=port, context_length=context_length,
                         max_total_tokens=max_total_tokens,
                         max_running_requests=max_running_requests, dtype=dtype, seed=seed,
                         extra_args=extra_args)
    environ = server_env(venv_dir, {"SGLANG_USE_CPU_ENGINE": "1",
                                    "SGLANG_CPU_OMP_THREADS_BIND": "0", **(env or {})})
    with serve(cmd, port=port, name="SGLang", log_path=log_path, env=environ, cwd=None,
               timeout_s=timeout_s, stop_timeout_s=stop_timeout_s,
               ready_path="/health") as url:
        yield url
