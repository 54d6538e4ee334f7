"""The trainer's CPU attention: torch's BF16 flash attention forward, its backward in FP32.

SDPA on CPU runs causal or masked attention of BF16 tensors with torch's flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`). Its BF16 backward computes the score and
gradient blocks with BF16 GEMMs and rounds the softmax probabilities to BF16; on the trainer's
shape (127 rows × 4 heads, 113 queries against 230 keys, head dim 32, two threads, AMD EPYC with
AVX-512-BF16) it takes 91–113 ms a layer, a third of the whole training step, against 55 ms for
the same kernel's FP32 instantiation on the BF16 values.

`fp32_attention_backward()` is a context manager under which each call of
`F.scaled_dot_product_attention` that autograd records, on BF16 CPU tensors, runs

- forward: the flash kernel exactly as SDPA calls it (the same op on the same arguments — a
  boolean mask becomes the additive −inf/0 mask in the query's dtype, as SDPA converts it), so
  the outputs, hence the logits and every log-prob and KL computed from them, are the same bits;
- backward: the flash kernel's FP32 backward on the BF16 values of the output gradient, q, k, v
  and the saved output, with the forward's FP32 log-sum-exp; each gradient rounded once to BF16.

That backward is what the FP32 kernel on BF16 values computes where BF16 GEMMs are slow
(`mismatch.kernels.bf16_gemm`, "Attention"), and closer to float64 than the BF16 kernel's
(tests/test_flash_backward.py: relative error 1.7e-3 against 2.5–3.3e-3 at the trainer's shape;
one BF16 rounding is 2⁻⁹ ≈ 2e-3). What moves: the gradients by BF16 rounding, so a run's
trajectory from its second step on; a step's loss, log-probs and KL do not.

A call outside autograd (no_grad, the sampler, the scorer), in another dtype or device, with
dropout, a mask of another kind, or where SDPA would not take the flash kernel (flash disabled,
head dims that differ, a last dimension not contiguous) goes to SDPA unchanged. A
`TorchFunctionMode`: a few microseconds per torch call in the forward, nothing in the backward
(autograd's engine does not see it); per thread, as torch's mode stacks are.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .bf16_gemm import _FLASH, _FLASH_BACKWARD, _fp32_attention

__all__ = ["fp32_attention_backward", "flash_attention_fp32_backward"]

_BF16 = torch.bfloat16


class _FlashFP32Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal: bool, scale):
        out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, mask = ctx.saved_tensors
        # the FP32 kernel on the BF16 values, each gradient rounded once (bf16_gemm's reroute)
        gq, gk, gv = _fp32_attention(_FLASH_BACKWARD, (grad_out, q, k, v, out, lse, 0.0,
                                                       ctx.causal),
                                     {"attn_mask": mask, "scale": ctx.scale}, masked=True)
        return gq, gk, gv, None, None, None


def _takes_flash(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> bool:
    """Whether SDPA would run these BF16 CPU tensors through the flash kernel, and the call is
    one this module reroutes (module docstring)."""
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dtype == _BF16 and t.device.type == "cpu"
               and t.dim() == 4 and t.stride(-1) == 1 for t in ts):
        return False
    if dropout_p or not torch.backends.cuda.flash_sdp_enabled():
        return False
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or min(q.shape[2], k.shape[2]) == 0:
        return False
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        return False
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        return False
    if mask is not None:
        if is_causal or not isinstance(mask, torch.Tensor) or mask.dim() != 4 \
                or mask.dtype not in (torch.bool, _BF16) or mask.device.type != "cpu" \
                or mask.shape[-2:] != (q.shape[2], k.shape[2]):
            return False
    return True


def flash_attention_fp32_backward(query, key, value, attn_mask=None, dropout_p=0.0,
                                  is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` with this module's backward where it applies (module
    docstring), else SDPA itself."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            and _takes_flash(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool:  # as SDPA converts a boolean mask
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, float("-inf"))
    return _FlashFP32Backward.apply(query, key, value, mask, bool(is_causal), scale)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:  # (the mode is off while it handles a call)
            return flash_attention_fp32_backward(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_attention_backward() -> Iterator[None]:
    """Inside, SDPA calls autograd records run as `flash_attention_fp32_backward` (this
    thread only)."""
    with _Mode():
        yield
