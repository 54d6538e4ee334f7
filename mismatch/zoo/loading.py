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

__all__ = ["default_model_dir", "check_model_dir", "load_model", "load_tokenizer"]

_DATA_DIR = Path(__file__).resolve().parent / "data"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    """The directory of the embedded model (package data; made by `mismatch zoo build`)."""
    return _DATA_DIR


def check_model_dir(path: str | Path | None = None, *, weights: bool = True,
                    tokenizer: bool = True) -> Path:
    """The resolved model directory, or a `ZooError` naming what is missing and what to do."""
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
    return where


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
