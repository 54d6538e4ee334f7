"""`mismatch qualify --sampler URL --engine vllm|sglang`: qualify a live inference server;
`mismatch qualify --launch vllm|sglang --model DIR`: start that server on 127.0.0.1 first
(mismatch.remote.launch: each engine in its own virtual environment), qualify it, stop it.

The server samples (token ids in, sampled ids, their log-probs and top-k candidates out, over
HTTP); the trainer side re-scores the same tokens locally from `--model` (BF16 teacher-forced
forward, reference kernels) and the policy's checks run on the result. Every run starts with the
canary (canary.py): tokenizer agreement and one log-prob per generated token, before any minutes
are spent. Measurable against a live server: every whole-sampler figure except the exact KL
(the server reports top-k candidates, not its full distribution) and the decode→re-encode round
trip of its samples; routing flips and the emulated sources are not (they are `n/a`).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from mismatch.app.probe import completion_slice
from mismatch.probes.errors import ProbeError
from mismatch.zoo.prompts import eos_ids, load_prompts
from mismatch.app.qualify import Launched, Policy, Throughput, Verdict, verdict_result
from mismatch.remote.canary import run_canary
from mismatch.remote.engines import LIVE_ENGINES
from mismatch.remote.sglang_client import SglangClient
from mismatch.remote.vllm_client import VllmClient
from mismatch.runtime import default_threads, torch_threads

__all__ = ["ENGINES", "qualify_remote", "qualify_launched", "launched_server"]

ENGINES = dict(zip(LIVE_ENGINES, (VllmClient, SglangClient), strict=True))
_REQUESTS_PER_ROUND = 64  # prompts sent per generate() call: progress, and bounded memory


def qualify_remote(*, url: str, engine: str | None, model: Path | None, policy: Policy,
                   n_prompts: int = 256, max_new_tokens: int = 48, seed: int = 0,
                   concurrency: int = 8, timeout: float = 60.0, gpu: str | None = None,
                   dtype: str | None = None,
                   progress: Callable[[str, int, int], None] | None = None) -> Verdict:
    """Sample from the server at `url`, re-score locally, check `policy`; the verdict."""
    from mismatch.engines.numerics import apply_numerics
    from mismatch.engines.scorer import score
    from mismatch.probes.round_trip import round_trip
    from mismatch.probes.tally import Tally
    from mismatch.profiles import trainer_spec
    from mismatch.zoo import load_model, load_tokenizer

    if engine is None or engine.lower() not in ENGINES:
        raise ProbeError(f"--engine must be one of {', '.join(ENGINES)} with --sampler, got "
                         f"{engine!r}")
    if n_prompts < 1 or max_new_tokens < 1:
        raise ProbeError("--n-prompts and --max-new-tokens must be >= 1")
    tokenizer = load_tokenizer(model)
    trainer_model = load_model(model, dtype=torch.bfloat16)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(tokenizer, trainer_model)
    client = ENGINES[engine.lower()](url, timeout=timeout, max_concurrency=concurrency,
                                     pad_id=pad_id, eos_ids=eos)
    canary = run_canary(client, tokenizer)
    prompts = load_prompts(tokenizer, None, n_prompts)
    trainer = trainer_spec("bf16")
    tally = Tally()
    changed = sequences = 0
    with torch_threads(default_threads(trainer_model)):  # the re-scoring runs here
        for r0 in range(0, len(prompts), _REQUESTS_PER_ROUND):
            batch = prompts[r0:r0 + _REQUESTS_PER_ROUND]
            rollout = client.generate(batch, max_new_tokens=max_new_tokens, temperature=1.0,
                                      top_p=1.0, top_k=0, seed=seed + r0, candidates=8)
            with apply_numerics(trainer_model, trainer, kernels=False):
                scores = score(trainer_model, rollout, with_routing=False)
            mask = completion_slice(rollout.completion_mask, rollout, max_new_tokens)
            tally.add(completion_slice(scores.logprobs, rollout, max_new_tokens),
                      completion_slice(rollout.sampler_logprobs, rollout, max_new_tokens), mask)
            completion = completion_slice(rollout.token_ids, rollout, max_new_tokens)
            for row, m in zip(completion.tolist(), mask.bool().tolist()):
                ids = [t for t, keep in zip(row, m) if keep]
                if ids:
                    sequences += 1
                    changed += int(round_trip(tokenizer, ids).changed)
            if progress:
                progress("sampling on the server and re-scoring",
                         min(r0 + len(batch), len(prompts)), len(prompts))
        total = tally.summary(seed)
    if not math.isfinite(total.kl_k3):
        raise ProbeError("the server's log-probs gave a non-finite KL; check that it reports "
                         "log-probs of the sampled tokens (not logits)")
    mode, source = client.logprob_mode(1.0)
    summary = {
        "mode": "measured", "sampler": client.label, "engine": engine.lower(),
        "gpu": gpu, "dtype": dtype, "model": str(model) if model else "embedded",
        "trainer_dtype": "bf16", "prompts": len(prompts), "tokens": tally.tokens,
        "logprob_mode": mode, "logprob_mode_source": source, "canary": canary,
        "total": total.to_json(),
        "sources": {"retokenization": {
            "changed_sequence_fraction": changed / max(sequences, 1), "sequences": sequences,
            "applies": True,
            "notes": ["Decode→re-encode of the server's sampled ids with --model's tokenizer."]}},
    }
    label = client.label + (f" ({gpu} {dtype})" if gpu and dtype else "")
    return verdict_result(policy, summary, mode="measured", sampler=label,
                          throughput=Throughput.from_json(client.throughput))


def launched_server(engine: str, model: Path | None
                    ) -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`start(seed=, log_path=)`: a context manager serving `model` with `engine` on 127.0.0.1
    (yields its URL; stops it on exit) — vLLM's CPU build on the embedded model by default,
    SGLang on a dense `model`. Checked here, before anything starts: the engine's name, its
    virtual environment, and a model SGLang can serve."""
    if engine == "vllm":
        from mismatch.remote.launch import default_vllm_venv, vllm_available, vllm_server

        venv = default_vllm_venv()
        if not vllm_available(venv):
            raise ProbeError(f"vLLM is not installed in {venv}; run scripts/setup_vllm_cpu.sh "
                             f"{venv} (or point MISMATCH_VLLM_VENV at its venv)")
        return lambda **kw: vllm_server(model, venv=venv, **kw)
    if engine == "sglang":
        if model is None:
            raise ProbeError("--launch sglang needs --model DIR with a dense checkpoint: SGLang's "
                             "CPU build has no MoE kernels and the embedded model is a Qwen3-MoE")
        from mismatch.remote.launch_sglang import (default_sglang_venv, sglang_available,
                                                   sglang_server)

        venv = default_sglang_venv()
        if not sglang_available(venv):
            raise ProbeError(f"SGLang is not installed in {venv}; run "
                             f"scripts/setup_sglang_cpu.sh {venv} (or point "
                             f"MISMATCH_SGLANG_VENV at its venv)")
        return lambda **kw: sglang_server(model, venv=venv, **kw)
    raise ProbeError(f"--launch must be one of {', '.join(ENGINES)}, got {engine!r}")


def qualify_launched(*, engine: str, model: Path | None, policy: Policy, seed: int = 0,
                     progress: Callable[[str, int, int], None] | None = None,
                     **options) -> Verdict:
    """Start `engine` serving `model` on 127.0.0.1, qualify it as qualify_remote does (`options`:
    its n_prompts, max_new_tokens, concurrency, timeout, gpu, dtype), stop it. The verdict
    records the launch (`launched`: engine, model, the server's log). A server that does not
    start is a ProbeError naming its log's last line."""
    from mismatch.remote.launch import EngineLaunchError

    engine = engine.lower()
    start = launched_server(engine, model)
    fd, name = tempfile.mkstemp(prefix=f"mismatch-qualify-{engine}-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    stage = f"starting {engine} on 127.0.0.1 (log: {log_path})"
    if progress:
        progress(stage, 0, 1)
    try:
        with start(seed=seed, log_path=log_path) as url:
            if progress:
                progress(stage, 1, 1)
            result = qualify_remote(url=url, engine=engine, model=model, policy=policy,
                                    seed=seed, progress=progress, **options)
    except EngineLaunchError as exc:
        raise ProbeError(str(exc)) from None
    return replace(result, launched=Launched(engine=engine,
                                             model=str(model) if model else "embedded",
                                             log=str(log_path)))
