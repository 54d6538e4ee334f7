"""The build record of a zoo model: `build_info.json` (machine-readable) and `model_card.md`.

`build_info.json` holds everything needed to rebuild and to check a rebuild: the command and
seed, the full build config, library versions, parameter counts, the weights' size and SHA-256
(the same seed on the same machine gives the same hash), and the held-out figures of the shipped
BF16 weights (metrics.py, solve.py). `model_card.md` is written from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ZooError

__all__ = ["BUILD_INFO", "MODEL_CARD", "write_card", "read_build_info", "summary_lines"]

BUILD_INFO = "build_info.json"
MODEL_CARD = "model_card.md"


def write_card(out_dir: Path, info: dict[str, Any]) -> None:
    """Write build_info.json and model_card.md into `out_dir`."""
    out_dir = Path(out_dir)
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    (out_dir / MODEL_CARD).write_text(_card_text(info))


def read_build_info(model_dir: Path) -> dict[str, Any]:
    """The build record of a zoo model directory (ZooError when there is none)."""
    path = Path(model_dir) / BUILD_INFO
    if not path.is_file():
        raise ZooError(f"{path} does not exist: {path.parent} is not a zoo build; "
                       "run `mismatch zoo build` to make one")
    return json.loads(path.read_text())


def summary_lines(info: dict[str, Any]) -> list[str]:
    """The headline figures, one per line (what `mismatch zoo info` prints)."""
    held, model = info["heldout"], info["model"]
    lines = [
        f"model            {model['architecture']}, {model['parameters']:,} parameters "
        f"({model['active_parameters']:,} active per token), {model['dtype']}",
        f"layout           {model['layers']} layers, {model['experts']} experts top-"
        f"{model['experts_per_token']}, {model['heads']}x{model['head_dim']} heads "
        f"({model['kv_heads']} KV), hidden {model['hidden_size']}, vocab {model['vocab_size']} "
        f"({info['tokenizer']['tokens']} tokens)",
        f"weights          {info['weights']['bytes']:,} bytes, "
        f"sha256 {info['weights']['sha256'][:16]}…",
        f"built by         {info['command']}  ({info['training']['wall_seconds']:.0f} s, "
        f"{info['training']['threads']} thread)",
    ]
    for subset in ("assistant", "all"):
        f = held[subset]
        lines.append(f"held-out {subset:<9} ppl {f['perplexity']:.3f}  mean top-1 p "
                     f"{f['mean_top1_prob']:.3f}  top-1 acc {f['top1_accuracy']:.3f}  "
                     f"entropy {f['mean_entropy']:.3f} nats  ({f['tokens']:,} tokens)")
    if info.get("greedy"):
        g = info["greedy"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in g["by_kind"].items())
        lines.append(f"greedy solve     {g['solve_rate']:.3f} of {g['episodes']} held-out "
                     f"episodes ({kinds})")
    return lines


def _card_text(info: dict[str, Any]) -> str:
    held, model, train = info["heldout"], info["model"], info["training"]
    rows = "\n".join(
        f"| {subset} | {held[subset]['tokens']:,} | {held[subset]['perplexity']:.3f} | "
        f"{held[subset]['mean_top1_prob']:.3f} | {held[subset]['top1_accuracy']:.3f} | "
        f"{held[subset]['mean_entropy']:.3f} |" for subset in ("assistant", "all"))
    greedy = ""
    if info.get("greedy"):
        g = info["greedy"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in g["by_kind"].items())
        greedy = (f"\nGreedy episodes on {g['episodes']} held-out tasks (BF16, multi-turn with "
                  f"the real tool): solve rate **{g['solve_rate']:.3f}** ({kinds}); endings "
                  f"{g['end_reasons']}; {g['mean_turns']:.2f} assistant turns on average.\n")
    return f"""# mismatch zoo: tiny Qwen3-MoE tool-use policy

The embedded default model of `mismatch`: a {model['parameters']:,}-parameter
`{model['architecture']}` ({model['layers']} layers, {model['experts']} experts \
top-{model['experts_per_token']},
{model['heads']} query heads × {model['head_dim']} and {model['kv_heads']} KV heads, hidden {model['hidden_size']},
vocabulary {model['vocab_size']} of which {info['tokenizer']['tokens']} are tokens), with its own byte-level
BPE tokenizer and a Qwen3-style chat template (tool calls, `<think>` blocks). It was trained from
scratch in FP32 for {train['steps']} steps on synthetic multi-turn calculator tool-use transcripts
(`mismatch/zoo/tasks.py`) and is stored in {model['dtype']} ({info['weights']['bytes']:,} bytes).

It exists so that every probe, monitor and RL test of this project runs on a CPU without a
download. It is a numerics test article, not a useful assistant.

## Build

```bash
{info['command']}
```

Seed {info['seed']}; {train['wall_seconds']:.0f} s of training on {train['threads']} CPU thread
(torch {info['versions']['torch']}, transformers {info['versions']['transformers']}).
The same seed on the same machine gives the same weights bit for bit
(sha256 `{info['weights']['sha256']}`). Final training loss {train['final_loss']:.4f}.

## Held-out figures (the shipped {model['dtype']} weights)

Teacher-forced on {held['transcripts']} held-out gold transcripts (task seeds ≥ 10⁹, never
trained on). "assistant" = tokens the policy generates; "all" = every token including the
system prompt, questions and tool results.

| tokens | count | perplexity | mean top-1 prob | top-1 accuracy | entropy (nats) |
|---|---|---|---|---|---|
{rows}
{greedy}
## Intended use and limits

Measuring sampler–trainer numerics (precision, kernels, routing, retokenization) on a model whose
next-token distributions are peaked like a real model's, and small RL experiments on the same
task family. It knows nothing outside the synthetic transcripts.
"""
