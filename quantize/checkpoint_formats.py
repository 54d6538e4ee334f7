"""modelopt checkpoint formats: for each precision a checkpoint can hold, the modelopt recipe that
writes it, the `quant_algo` its hf_quant_config.json names, and the codec of its weight storage
(the precision's `checkpoint_codec`, precisions.py), byte-exact with modelopt's export.
checkpoint.py writes them; loader.py reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch.registry import add_once

from .codec_table import get_codec
from .errors import QuantizeError
from .precisions import PRECISIONS

__all__ = ["CheckpointFormat", "CHECKPOINT_FORMATS", "KV_CACHE_FORMATS", "QUANTIZE_INFO",
           "format_for_quant_algo"]

QUANTIZE_INFO = "mismatch_quantize.json"
"""Written beside a `mismatch quantize` checkpoint: its format, KV cache and the BF16 model it
came from (so a reader can name the model to compare it with)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointFormat:
    """One checkpoint format: the modelopt recipe that writes it; its weight codec is its
    precision's (precisions.py)."""

    name: str
    """Name on the command line: a precision with a checkpoint codec."""
    modelopt_config: str
    """Attribute of `modelopt.torch.quantization` holding the recipe."""
    quant_algo: str
    """`quant_algo` in hf_quant_config.json, upper-cased (modelopt writes MXFP4 in lower case)."""

    @property
    def codec(self) -> str:
        """Codec of the weight storage, byte-exact with modelopt's export (its precision's)."""
        return PRECISIONS[self.name].checkpoint_codec  # type: ignore[return-value]  # _register

    @property
    def block(self) -> int:
        """Elements along the input dimension that share one weight scale (0: per tensor)."""
        return get_codec(self.codec).block


CHECKPOINT_FORMATS: dict[str, CheckpointFormat] = {}


def _register(fmt: CheckpointFormat) -> None:
    if fmt.name not in PRECISIONS or PRECISIONS[fmt.name].checkpoint_codec is None:
        raise ValueError(f"checkpoint format {fmt.name!r}: no precision with a checkpoint codec")
    add_once(CHECKPOINT_FORMATS, fmt.name, fmt, "checkpoint format")


for _fmt in (
    CheckpointFormat(name="fp8", modelopt_config="FP8_DEFAULT_CFG", quant_algo="FP8"),
    CheckpointFormat(name="nvfp4", modelopt_config="NVFP4_DEFAULT_CFG", quant_algo="NVFP4"),
    CheckpointFormat(name="w4a16-nvfp4", modelopt_config="W4A16_NVFP4_CFG",
                     quant_algo="W4A16_NVFP4"),
    CheckpointFormat(name="mxfp4", modelopt_config="MXFP4_DEFAULT_CFG", quant_algo="MXFP4"),
):
    _register(_fmt)

KV_CACHE_FORMATS: dict[str, str] = {"fp8": "FP8_KV_CFG"}
"""KV-cache format name → modelopt recipe appended to the weight recipe."""


def format_for_quant_algo(quant_algo: str) -> CheckpointFormat:
    """The checkpoint format of an hf_quant_config.json `quant_algo` (case-insensitive)."""
    for fmt in CHECKPOINT_FORMATS.values():
        if fmt.quant_algo == str(quant_algo).upper():
            return fmt
    valid = ", ".join(f.quant_algo for f in CHECKPOINT_FORMATS.values())
    raise QuantizeError(f"unsupported quant_algo {quant_algo!r}; supported: {valid}")
