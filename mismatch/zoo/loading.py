"""Loading a model and tokenizer from a local directory: the embedded one or any HF checkpoint.

`path=None` means the embedded model shipped in package data (`default_model_dir()`). Any other
path must be a local directory as `save_pretrained` writes it; it is checked before
`transformers` sees it, so a typo never turns into a hub download attempt or a long traceback:
a missing directory or file is a `ZooError` (a ValueError) with one line saying what to do.
Loading is always offline (`local_files_only=True`); weights must be safetensors (a pickled
`pytorch_model.bin` can run code when loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ZooError

__all__ = ["default_model_dir", "check_model_dir", "load_model",
           "load_tokenizer"]

_DATA_DIR = Path(__file__).resolve().parent / "data"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    """The directory of the embedded model (package data; made by `mismatch zoo build`)."""
    return _DATA_DIR


def check_model_dir(path: str | Path | None = None, *, weights: bool = True,
                    tokenizer: bool = True, quantized: bool = False) -> Path:
    """The resolved model directory, or a `ZooError` naming what is missing and what to do.
    With `weights`, the safetensors files must be whole, and a quantized checkpoint is refused
    unless `quantized` (a server may load one; the trainer side cannot)."""
    embedded = path is None
    where = default_model_dir() if embedded else Path(path).expanduser()
    fix = ("run `mismatch zoo build` to build the embedded model" if embedded else
           "pass a local directory written by save_pretrained (config.json, model.safetensors, "
           "tokenizer.json)")
    if not where.is_dir():
        raise ZooError(f"model directory {where} does not exist; {fix}")
    missing = []
    if weights and not (where / "config.json").is_file():
        missing.append("config.json")
    if weights and not any((where / name).is_file() for name in _WEIGHT_FILES):
        missing.append("model.safetensors")
    if tokenizer and not any((where / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer.json")
    if missing:
        raise ZooError(f"model directory {where} lacks {', '.join(missing)}; {fix}")
    if weights:
        _check_weights(where)
        if not quantized:
            _refuse_quantized(where)
    return where


def _check_weights(where: Path) -> None:
    """Every safetensors file's header parses and covers the file (a truncated or overwritten
    file fails here in one line, not deep inside transformers)."""
    import json

    from safetensors import safe_open

    files = sorted(where.glob("*.safetensors"))
    index = where / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ZooError(f"{index} is not a safetensors index ({type(exc).__name__}); "
                           "rewrite the checkpoint with save_pretrained") from None
        absent = sorted(s for s in shards if not (where / s).is_file())
        if absent:
            raise ZooError(f"{index} names {absent[0]}, which is missing; copy the whole "
                           "checkpoint")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors' own error type; one line whatever it is
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ZooError(f"{file} is corrupt or truncated ({detail}); rebuild or copy the "
                           "checkpoint again") from None


def _refuse_quantized(where: Path) -> None:
    """A quantized checkpoint (modelopt's export) is a sampler's weights, not a model both
    sides can load: say what to run instead."""
    import json

    try:
        config = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ZooError(f"{where / 'config.json'} is not JSON ({type(exc).__name__}); rewrite "
                       "it with save_pretrained") from None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not quant and not (where / "hf_quant_config.json").is_file():
        return
    from mismatch.quantize.checkpoint_formats import QUANTIZE_INFO

    info = {}
    if (where / QUANTIZE_INFO).is_file():
        try:
            info = json.loads((where / QUANTIZE_INFO).read_text())
        except ValueError:
            info = {}
    fmt = info.get("format") or (quant or {}).get("quant_algo") or \
        (quant or {}).get("quant_method", "quantized")
    source = info.get("source_model")
    model = f"--model {source}" if source else "--model <the BF16 checkpoint it came from>"
    raise ZooError(f"{where} is a {fmt} checkpoint (a sampler's weights); probe the format "
                   f"against the BF16 model it came from: {model} --dtype {fmt} (the probe "
                   "quantizes with the same codecs), or serve it and run `mismatch qualify "
                   "--sampler URL`")


def _torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ZooError(f"dtype {dtype!r} is not a torch floating-point dtype; use e.g. "
                       "torch.bfloat16, 'float32'")
    return resolved


def load_model(path: str | Path | None = None, dtype: Any = "bfloat16"):
    """A causal LM from `path` (None: the embedded model), in `dtype`, in eval mode, on CPU.

    `dtype` is a torch dtype or its name (default BF16, the dtype the trainer side scores in).
    """
    from transformers import AutoModelForCausalLM

    where = check_model_dir(path, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=_torch_dtype(dtype),
                                                 local_files_only=True)
    return model.eval()


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer (with its chat template) from `path` (None: the embedded model's)."""
    from transformers import AutoTokenizer

    where = check_model_dir(path, weights=False)
    return AutoTokenizer.from_pretrained(where, local_files_only=True)
