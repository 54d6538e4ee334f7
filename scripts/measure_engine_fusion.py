"""How much vLLM-style engine fusion changes an FP8 modelopt export of a tiny random Qwen3.

    python scripts/measure_engine_fusion.py
"""
from pathlib import Path
import sys, tempfile

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import build_tiny_model
from mismatch.quantize.checkpoint import QuantizeConfig, quantize_checkpoint
from mismatch.quantize.loader import load_quantized
d = Path(tempfile.mkdtemp())
src = build_tiny_model(d / "src", kind="dense")
quantize_checkpoint(QuantizeConfig(model=src, format="fp8", out=d / "q", calib_samples=2, calib_seq_len=16, progress=False))
raw, fused = load_quantized(d / "q"), load_quantized(d / "q", engine_fusion=True)
changed = total = 0
for name, parts in fused.shards.items():
    a = torch.cat([raw.weights[p].codes for p, _ in parts]); b = fused.weights[name].codes
    changed += int((a != b).sum()); total += a.numel()
print(f"engine fusion changed {changed} of {total} FP8 codes in fused layers ({changed/total:.1%})")
