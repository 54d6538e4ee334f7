"""Number formats, block codecs, the GEMM accumulation model, and modelopt checkpoints.

Imports nothing else of this project. See formats.py (element formats; their table, without torch,
format_table.py), codecs.py (block-scaled storage; its table, without torch, codec_table.py;
schemes.py their arithmetic, qtensor.py the storage layout), precisions.py (what a serving
precision stores and quantizes, in codecs), accumulate.py (low-precision GEMM accumulation),
checkpoint_formats.py / checkpoint.py / loader.py (modelopt checkpoints).

Importing the package loads the tables only; the names that need torch (`encode`, `decode`,
`fake_quant`, `QTensor`) load their modules when first asked for, so the serving precisions and
the command line read the tables without loading torch.
"""

from __future__ import annotations

import importlib

from .codec_table import CODECS, CodecSpec, get_codec
from .errors import QuantizeError
from .format_table import FORMATS, FloatFormat, get_format

__all__ = ["CODECS", "CodecSpec", "QTensor", "decode", "encode", "fake_quant", "get_codec",
           "QuantizeError", "FORMATS", "FloatFormat", "get_format"]

_WITH_TORCH = {"decode": "codecs", "encode": "codecs", "fake_quant": "codecs",
               "QTensor": "qtensor"}
"""Exported name → the module (of this package) that defines it and imports torch."""


def __getattr__(name: str):
    if name in _WITH_TORCH:
        return getattr(importlib.import_module(f".{_WITH_TORCH[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
