"""Number formats, block codecs, the GEMM accumulation model, and modelopt checkpoints.

Imports nothing else of this project. See formats.py (element formats), codecs.py (block-scaled
storage; schemes.py their arithmetic, qtensor.py the storage layout), precisions.py (what a
serving precision stores and quantizes, in codecs), accumulate.py (low-precision GEMM
accumulation), checkpoint_formats.py / checkpoint.py / loader.py (modelopt checkpoints).
"""

from .codecs import CODECS, CodecSpec, decode, encode, fake_quant, get_codec
from .errors import QuantizeError
from .formats import FORMATS, FloatFormat, get_format
from .qtensor import QTensor

__all__ = ["CODECS", "CodecSpec", "QTensor", "decode", "encode", "fake_quant", "get_codec",
           "QuantizeError", "FORMATS", "FloatFormat", "get_format"]
