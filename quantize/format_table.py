"""The element formats as data: `FloatFormat`, the table `FORMATS` (E2M1, E4M3, E5M2) and their
constants. No torch: the codec table (codec_table.py), the serving precisions and the command
line read it without loading torch. The arithmetic on these formats (rounding, codes, decoding)
is formats.py's, which re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mismatch.registry import add_once

if TYPE_CHECKING:
    import torch

__all__ = ["FloatFormat", "FORMATS", "E2M1", "E4M3", "E5M2", "E2M1_MAX", "E4M3_MAX", "E5M2_MAX",
           "E8M0_BIAS", "E8M0_NAN", "get_format", "Overflow", "Ties", "SignRule"]

Overflow = Literal["saturate", "inf"]
Ties = Literal["even", "toward_zero"]
SignRule = Literal["ieee", "negative", "nonpositive"]


@dataclass(frozen=True, kw_only=True)
class FloatFormat:
    """A binary floating-point element format (at most 8 bits wide)."""

    name: str
    """Short name used in tables and error messages."""
    ebits: int
    """Exponent bits."""
    mbits: int
    """Explicit mantissa bits."""
    bias: int
    """Exponent bias; the smallest normal exponent is 1 - bias."""
    max_finite: float
    """Largest finite magnitude (E4M3FN: 448, not the IEEE-style 240, since it gives up inf)."""
    overflow: Overflow
    """What a finite value beyond `max_finite` becomes after rounding."""
    inf_code: int | None = None
    """Code of +inf (sign bit clear), or None when the format has no infinity."""
    nan_code: int | None = None
    """Canonical code of NaN (sign bit clear), or None when the format has no NaN."""
    torch_dtype_name: str | None = field(default=None, compare=False)
    """Name of the torch dtype with the same bits, where one exists (`torch_dtype`)."""

    def __post_init__(self) -> None:
        if not (1 <= self.ebits and 0 <= self.mbits and self.ebits + self.mbits <= 7):
            raise ValueError(f"{self.name}: need 1 <= ebits and ebits + mbits <= 7, got "
                             f"ebits={self.ebits}, mbits={self.mbits}")
        if self.overflow == "inf" and self.inf_code is None:
            raise ValueError(f"{self.name}: overflow='inf' needs an inf_code")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with the same bits, where one exists (used for fast casts)."""
        if self.torch_dtype_name is None:
            return None
        import torch

        return getattr(torch, self.torch_dtype_name)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def n_codes(self) -> int:
        return 1 << self.bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)


E2M1_MAX = 6.0  # largest FP4 E2M1 magnitude: 1.5 * 2^2
E4M3_MAX = 448.0  # largest FP8 E4M3FN magnitude: 1.75 * 2^8 (S.1111.110; S.1111.111 is NaN)
E5M2_MAX = 57344.0  # largest finite FP8 E5M2 magnitude: 1.75 * 2^15
E8M0_BIAS = 127  # E8M0 byte b encodes 2^(b - 127)
E8M0_NAN = 0xFF  # the one NaN code of E8M0

E2M1 = FloatFormat(name="e2m1", ebits=2, mbits=1, bias=1, max_finite=E2M1_MAX,
                   overflow="saturate", torch_dtype_name=None)
E4M3 = FloatFormat(name="e4m3", ebits=4, mbits=3, bias=7, max_finite=E4M3_MAX,
                   overflow="saturate", nan_code=0x7F, torch_dtype_name="float8_e4m3fn")
E5M2 = FloatFormat(name="e5m2", ebits=5, mbits=2, bias=15, max_finite=E5M2_MAX,
                   overflow="inf", inf_code=0x7C, nan_code=0x7F, torch_dtype_name="float8_e5m2")

FORMATS: dict[str, FloatFormat] = {}


def _register(fmt: FloatFormat) -> None:
    add_once(FORMATS, fmt.name, fmt, "element format")


for _fmt in (E2M1, E4M3, E5M2):
    _register(_fmt)


def get_format(name: str) -> FloatFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown element format {name!r}; valid: {', '.join(FORMATS)}") from None
