"""GPU kernels and their pure-torch twins.

Each kernel comes as a pair: `<name>_torch` is the reference and the CPU path, `<name>_triton`
the Triton kernel (CUDA, or Triton's CPU interpreter when TRITON_INTERPRET=1). The dispatchers
(`scorer_head`, `fake_quant`, `accumulate_gemm`) pick Triton for CUDA tensors when Triton is
installed and the twin otherwise, so this package imports and runs without Triton.

- scorer_head.py  from hidden states (or logits) to per-token log-prob of the label, entropy,
                  top-1, log-probs at K candidate ids and the exact KL against the sampler's
                  candidate distribution, in vocabulary tiles (no [T, V] FP32 tensor)
- fake_quant.py   FP8 / MXFP4 / NVFP4 activation fake-quant, bit-exact to quantize.codecs
- gemm.py         a GEMM with the accumulation model of quantize.accumulate, bit-exact
- native.py       C kernels for the CPU (compiled once per machine, ctypes): the accumulation
                  GEMM for E4M3 inputs and NVFP4 activation fake-quant, bit-exact to the torch
                  code; MISMATCH_NATIVE=off skips them
"""

from .fake_quant import KERNEL_CODECS, fake_quant, fake_quant_torch, fake_quant_triton
from .gemm import accumulate_gemm, accumulate_gemm_torch, accumulate_gemm_triton
from .runtime import KernelError, triton_available, use_triton
from .scorer_head import HeadOutput, scorer_head, scorer_head_torch, scorer_head_triton

__all__ = ["KERNEL_CODECS", "fake_quant", "fake_quant_torch", "fake_quant_triton",
           "accumulate_gemm", "accumulate_gemm_torch", "accumulate_gemm_triton", "KernelError",
           "triton_available", "use_triton", "HeadOutput", "scorer_head", "scorer_head_torch",
           "scorer_head_triton"]
