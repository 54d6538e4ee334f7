"""Number formats, block codecs, the GEMM accumulation model, and modelopt checkpoints.

Imports nothing else of this project. See formats.py (element formats), codecs.py (block-scaled
storage), accumulate.py (low-precision GEMM accumulation), checkpoint.py / loader.py (modelopt).
"""

from .codecs import CODECS, CodecSpec, QTensor, decode, encode, fake_quant, get_codec
from .errors import QuantizeError
from .formats import FORMATS, FloatFormat, get_format

__all__ = ["CODECS", "CodecSpec", "QTensor", "decode", "encode", "fake_quant", "get_codec",
           "QuantizeError", "FORMATS", "FloatFormat", "get_format"]
