"""Where a kernel runs: Triton on CUDA tensors when Triton is installed, the torch twin otherwise.

Triton is imported lazily and only here, so the package works without it. Triton's interpreter
(`TRITON_INTERPRET=1`, read when `triton` is first imported; Triton docs, "Debugging Triton")
runs the same kernels on CPU tensors with numpy; it is how the tests check kernels on a machine
without a GPU. It is wrong for BF16 (numpy has no bfloat16), so callers pass FP32 or FP16 there.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["KernelError", "triton_available", "interpreting", "use_triton", "require_triton",
           "BACKENDS"]

BACKENDS = ("auto", "torch", "triton")


class KernelError(ValueError):
    """Bad input to a kernel, or a backend that cannot run here; the message says what to do."""


@functools.cache
def triton_available() -> bool:
    """Whether `import triton` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(*tensors: torch.Tensor) -> None:
    """Raise a one-line KernelError unless Triton can run on these tensors."""
    if not triton_available():
        raise KernelError("the Triton kernels need the `triton` package (pip install "
                          "'mismatch[gpu]'); use backend='torch' for the torch twin")
    if not interpreting() and not all(t.is_cuda for t in tensors):
        raise KernelError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for the "
                          "CPU interpreter); use backend='torch' for the torch twin")


def use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """Resolve a backend name: 'auto' is Triton for CUDA tensors when Triton is installed."""
    if backend not in BACKENDS:
        raise KernelError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    if backend == "triton":
        require_triton(*tensors)
        return True
    return triton_available() and all(t.is_cuda for t in tensors)
