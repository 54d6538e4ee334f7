"""Calibration data for post-training quantization: token windows and the forward loop.

Max calibration only needs activations of the right magnitude in every quantized layer, not a
data set: `calibration_batches` cuts seeded windows out of a small built-in text (prose, code,
math, JSON tool calls, chat) when the model directory has a tokenizer, and otherwise draws
seeded uniform token ids within the vocabulary. Either way the summary line says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from .errors import QuantizeError

__all__ = ["CALIBRATION_TEXTS", "calibration_batches", "forward_loop"]

CALIBRATION_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog while the farmer counts his sheep twice.",
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n",
    "Question: A train leaves at 9:40 and arrives at 13:05. How long is the trip? "
    "Answer: 3 h 25 min.",
    '{"name": "search", "arguments": {"query": "boiling point of water at 2000 m", "top_k": 3}}',
    "<think>The user wants the sum of the first 100 odd numbers; that is 100^2 = 10000.</think>",
    "In 1905 Einstein published four papers: the photoelectric effect, Brownian motion, special "
    "relativity and the equivalence of mass and energy.",
    "SELECT customer_id, SUM(amount) FROM orders WHERE created_at > '2024-01-01' GROUP BY 1;",
    "Dear team, the deployment is postponed to Thursday because the migration failed on staging.",
    "Gradient descent updates the parameters against the gradient: theta <- theta - lr * grad.",
    "La vie est un mystere qu'il faut vivre, et non un probleme a resoudre.",
    "1 2 3 5 8 13 21 34 55 89 144 233 377 610 987 1597 2584 4181 6765 10946",
    "User: Can you book a table for two at 7pm?\nAssistant: Sure, which restaurant do you prefer?",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 6 * 7); return 0; }",
    "The mitochondria is the membrane-bound organelle that produces most of the cell's ATP.",
    "Theorem. Every bounded monotone sequence of real numbers converges. Proof: completeness.",
    "ERROR 2024-05-01T12:00:03Z worker-7 timeout after 30s while reading shard 0041 of 0128",
)
"""Built-in calibration prose, code, math, JSON and chat, used when the model has a tokenizer."""


def calibration_batches(tokenizer: Any, *, vocab_size: int, samples: int, seq_len: int, seed: int,
                        source: Path) -> tuple[list[torch.Tensor], str]:
    """`samples` tensors of token ids [1, seq_len] int64, and one line saying where they came from.

    tokenizer: a Hugging Face tokenizer, or None for random ids in [0, vocab_size).
    """
    gen = torch.Generator().manual_seed(seed)
    if tokenizer is None:
        ids = torch.randint(0, vocab_size, (samples, seq_len), generator=gen)
        return list(ids.split(1)), (f"random token ids (no tokenizer in the model dir): "
                                    f"{samples} x {seq_len}, seed {seed}")
    stream = torch.tensor(tokenizer("\n\n".join(CALIBRATION_TEXTS))["input_ids"], dtype=torch.long)
    if stream.numel() < 2:
        raise QuantizeError(f"the tokenizer in {source} encodes the calibration text to "
                            f"{stream.numel()} token(s)")
    if int(stream.max()) >= vocab_size:
        raise QuantizeError(f"the tokenizer in {source} produces token id {int(stream.max())}, "
                            f"beyond the model's vocab_size {vocab_size}")
    stream = stream.repeat(seq_len // stream.numel() + 2)  # long enough for any window
    starts = torch.randint(0, stream.numel() - seq_len, (samples,), generator=gen)
    batches = [stream[s:s + seq_len].unsqueeze(0) for s in starts.tolist()]
    return batches, (f"tokenizer: {samples} windows of {seq_len} tokens from "
                     f"{len(CALIBRATION_TEXTS)} built-in texts, seed {seed}")


def forward_loop(batches: list[torch.Tensor], *, progress: bool) -> Callable[[Any], None]:
    """modelopt's `forward_loop(model)`: run every batch, with a progress bar on a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    def loop(model: Any) -> None:
        columns = ("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn())
        console = Console(stderr=True)
        with Progress(*columns, console=console, transient=True,
                      disable=not (progress and console.is_terminal)) as bar:
            task = bar.add_task("calibrating", total=len(batches))
            with torch.no_grad():
                for ids in batches:
                    model(input_ids=ids, use_cache=False)
                    bar.advance(task)

    return loop
