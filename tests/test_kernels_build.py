"""The Triton kernels build for a real GPU target without a GPU: Triton's compiler lowers them to
PTX and its bundled ptxas assembles a cubin for sm90 (mismatch/kernels/aot.py). Run in a fresh
process with TRITON_INTERPRET unset (under the interpreter there is nothing to compile) and an
empty kernel cache, so every build is real. The full matrix (sm80/90/100/120, every variant)
takes minutes: `python -m mismatch.kernels.aot`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_build_for_sm90(tmp_path):
    triton = pytest.importorskip("triton", reason="Triton is not installed "
                                 "(pip install 'mismatch[gpu]')")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip(f"this Triton build has no NVIDIA backend ({triton.__version__})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(ROOT))
    for only in ("fake_quant", "accumulate_gemm", "scorer_head bf16 hidden",
                 "scorer_head fp32 logits"):
        res = subprocess.run([sys.executable, "-m", "mismatch.kernels.aot", "90", "--only", only],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count(" ok (") >= 1 and "Error" not in res.stdout, res.stdout
