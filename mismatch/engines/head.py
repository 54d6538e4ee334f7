"""The LM head's precision: in the compute dtype (what a BF16 model does) or in FP32.

A BF16 model's `lm_head` multiplies BF16 hidden states by BF16 weights and rounds the logits to
BF16: a logit of 20 carries an error of up to 2^-8 · 16 / 2 = 0.03 nats before the softmax.
Keeping the head in FP32 (the final hidden state and the head's weights upcast, the logits left
in FP32) is the mitigation MiniMax-M1 applied to its RL trainer and sampler (MiniMax 2025,
"MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv:2506.13585:
training and inference probabilities aligned once the LM head ran in FP32), and the row "BF16
with an FP32 LM head" of Fast-LLM's log-prob accuracy comparison (ServiceNow/Fast-LLM pull
request 525).

`head_numerics(model, "fp32")` gives the model's output embedding an instance-level forward for
the duration of the block; "compute" patches nothing. The scorer (scorer.py), the engine and the
trainer's scoring (train/scoring.py) all call the head module, so all see it. Under autograd the
upcast weight is computed in the graph on every call (the head's weight gets its gradient);
without, once per block (weights do not change inside one).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["HEAD_DTYPES", "head_numerics"]

HEAD_DTYPES = ("compute", "fp32")
"""The LM head's precisions: the model's compute dtype, or FP32 inputs, weights and logits."""


@contextlib.contextmanager
def head_numerics(model: torch.nn.Module, dtype: str = "compute"):
    """Inside the block, the model's LM head computes in `dtype` (HEAD_DTYPES)."""
    if dtype not in HEAD_DTYPES:
        raise ValueError(f"LM head dtype must be one of {', '.join(HEAD_DTYPES)}, got {dtype!r}")
    head = model.get_output_embeddings() if dtype == "fp32" else None
    if head is None:
        yield
        return
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"an FP32 LM head needs a linear output layer, the model has "
                         f"{type(head).__name__}")
    previous = head.__dict__.get("forward")
    weight32: list[torch.Tensor] = []  # the upcast weight, made on the first call without grad

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if head.bias is None else head.bias.float()
        if torch.is_grad_enabled() and head.weight.requires_grad:
            # training: the upcast is part of the graph, so the head's weight gets its gradient
            return F.linear(x.float(), head.weight.float(), bias)
        if not weight32:
            weight32.append(head.weight.detach().float())
        return F.linear(x.float(), weight32[0], bias)

    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
