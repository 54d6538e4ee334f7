"""Building the embedded model: tokenizer, training, evaluation, package data — reproducibly.

    1. render `tokenizer_corpus` training transcripts with the chat template; train the BPE
    2. seed torch, build the tiny Qwen3-MoE (model.py) in FP32, train it (supervised.py)
    3. save it in BF16 (safetensors) with the tokenizer, reload it the way users do (loading.py)
    4. held-out figures of the reloaded BF16 weights (metrics.py, solve.py); build_info + card

Everything runs on one CPU thread (`mismatch.runtime.torch_threads(1)`, restored afterwards): with the seed that fixes
the initialization and the batch stream, a build is bitwise reproducible on the same machine.

Output is written to a temporary sibling of `out` (`mismatch.io.atomic_directory`) and renamed
into place at the end, so `out` is never half-written; a directory that is in the way must be a previous build
(it has build_info.json) or empty, so a mistyped `--out` cannot replace unrelated files.
"""

from __future__ import annotations

import hashlib
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..io import atomic_directory
from ..runtime import torch_threads
from .card import BUILD_INFO, write_card
from .chat_template import render
from .errors import ZooError
from .model import ModelSpec, hf_config
from .tasks import TOOLS, generate_tasks, make_task, task_seeds
from .tokenizer import TokenizerSpec, save_tokenizer, train_tokenizer
from .supervised import TrainConfig

__all__ = ["BuildConfig", "build", "build_command"]


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """Everything a build depends on (with the machine and library versions)."""

    seed: int = 0
    """Seeds torch (initialization) and the training batch stream."""
    tokenizer_corpus: int = 4000
    """Training transcripts the BPE is trained on (task seeds 0..n-1)."""
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    """BPE settings."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """Architecture sizes."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer and schedule."""
    heldout_transcripts: int = 128
    """Held-out gold transcripts for the teacher-forced figures."""
    greedy_episodes: int = 64
    """Held-out greedy episodes for the solve rate (0 skips them)."""
    max_new_tokens: int = 96
    """Longest assistant turn in greedy episodes."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"BuildConfig.seed must be >= 0, got {self.seed}")
        if self.tokenizer_corpus < 1 or self.heldout_transcripts < 1:
            raise ValueError("BuildConfig: tokenizer_corpus and heldout_transcripts must be >= 1")
        if self.greedy_episodes < 0 or self.max_new_tokens < 1:
            raise ValueError("BuildConfig: greedy_episodes >= 0 and max_new_tokens >= 1 required")


def build_command(config: BuildConfig, out: Path | None = None) -> str:
    """The CLI command that reproduces a build with `config`'s seed and step count."""
    where = f" --out {out}" if out is not None else ""
    return f"mismatch zoo build --seed {config.seed} --steps {config.train.steps}{where}"


def _check_out(out: Path) -> None:
    from mismatch.io import check_writable_dir

    try:  # before training: not under a file, not the working directory, writable
        check_writable_dir(out)
    except ValueError as exc:
        raise ZooError(str(exc)) from None
    if out.is_dir() and any(out.iterdir()) and not (out / BUILD_INFO).is_file():
        raise ZooError(f"--out {out} is not empty and holds no previous build ({BUILD_INFO}); "
                       "pass a new or empty directory")


def _train_and_save(config: BuildConfig, tmp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from .data import train_batches
    from .supervised import train

    started = time.perf_counter()
    corpus = [render(make_task(s).gold_messages(), tools=TOOLS)
              for s in task_seeds("train", config.tokenizer_corpus)]
    save_tokenizer(train_tokenizer(corpus, config.tokenizer), tmp, config.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    log(f"tokenizer: {len(tokenizer)} tokens from {len(corpus)} transcripts")

    hf = hf_config(config.model, n_tokens=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(config.seed)
    model = Qwen3MoeForCausalLM(hf).float()
    batches = train_batches(tokenizer, seed=config.seed, batch_size=config.train.batch_size,
                            steps=config.train.steps, max_tokens=config.train.max_tokens)
    train_started = time.perf_counter()
    losses = train(model, batches, config.train, log)
    train_seconds = time.perf_counter() - train_started

    model.to(torch.bfloat16).save_pretrained(tmp)
    weights = tmp / "model.safetensors"
    weights.chmod(0o644)  # safetensors writes 0600; package data must be readable by all
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.model.experts_per_token // config.model.num_experts
    return {
        "tokenizer": {"tokens": len(tokenizer), "corpus_transcripts": len(corpus)},
        "model": {"architecture": "Qwen3MoeForCausalLM", "parameters": total,
                  "active_parameters": active, "dtype": "bfloat16", "vocab_size": hf.vocab_size,
                  "layers": hf.num_hidden_layers, "experts": hf.num_experts,
                  "experts_per_token": hf.num_experts_per_tok, "heads": hf.num_attention_heads,
                  "kv_heads": hf.num_key_value_heads, "head_dim": hf.head_dim,
                  "hidden_size": hf.hidden_size},
        "weights": {"file": weights.name, "bytes": weights.stat().st_size,
                    "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()},
        "training": {"steps": config.train.steps, "threads": 1,
                     "wall_seconds": round(train_seconds, 1),
                     "total_seconds": round(time.perf_counter() - started, 1),
                     "first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:])},
    }


def _evaluate(config: BuildConfig, tmp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    from .data import encode_tasks
    from .loading import load_model, load_tokenizer
    from .metrics import heldout_figures
    from .solve import greedy_solve

    model, tokenizer = load_model(tmp), load_tokenizer(tmp)  # the shipped BF16 weights
    heldout = generate_tasks("heldout", config.heldout_transcripts)
    figures = heldout_figures(model, encode_tasks(tokenizer, heldout, config.train.max_tokens))
    result: dict[str, Any] = {"heldout": {"transcripts": len(heldout), "dtype": "bfloat16",
                                          **{k: v.as_dict() for k, v in figures.items()}}}
    log(f"held-out assistant tokens: ppl {figures['assistant'].perplexity:.3f}, "
        f"mean top-1 p {figures['assistant'].mean_top1_prob:.3f}")
    if config.greedy_episodes:
        solved = greedy_solve(model, tokenizer, generate_tasks("heldout", config.greedy_episodes),
                              max_new_tokens=config.max_new_tokens)
        result["greedy"] = solved.as_dict()
        log(f"greedy held-out solve rate {solved.solve_rate:.3f} ({solved.by_kind})")
    return result


def build(config: BuildConfig, out: Path | str | None = None, *,
          log: Callable[[str], None] = lambda _: None,
          command: str | None = None) -> dict[str, Any]:
    """Build the model into `out` (None: the embedded model's package data); returns build_info."""
    import tokenizers
    import torch
    import transformers

    from .loading import default_model_dir

    target = Path(out).expanduser().resolve() if out is not None else default_model_dir()
    _check_out(target)
    with atomic_directory(target, force=True) as tmp:
        with torch_threads(1):
            info = _train_and_save(config, tmp, log)
            info.update(_evaluate(config, tmp, log))
        info.update({
            "command": command or build_command(config, None if out is None else target),
            "seed": config.seed, "config": asdict(config),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__},
        })
        write_card(tmp, info)
    log(f"wrote {target}")
    return info
