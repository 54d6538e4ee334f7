"""QTensor: a tensor in a codec's real storage (codes, block scales, a global scale), and the
nibble packing of FP4 codes (two per byte, the even element in the low nibble, as modelopt and
the serving kernels store them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QTensor", "pack_nibbles", "unpack_nibbles"]


@dataclass(frozen=True)
class QTensor:
    """A tensor in a codec's real storage.

    codes: uint8. FP4 codecs pack two codes per byte, the even element in the low nibble:
        [..., K/2]. FP8 codecs hold one byte per element: [..., K]. Cast codecs hold the cast
        tensor itself (bf16/fp16) [..., K].
    scales: per-block scales, or None. FP8: float32 with one entry per tensor / row / block /
        group. MXFP4: uint8 E8M0 [..., K/32]. NVFP4: float8_e4m3fn [..., K/16].
    global_scale: NVFP4's float32 per-tensor scale (0-dim, or [E, 1, 1] for stacked experts);
        None otherwise.
    """

    codec: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of the storage (codes + scales + global scale)."""
        total = self.codes.numel() * self.codes.element_size()
        for t in (self.scales, self.global_scale):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes < 16 → [..., K/2] uint8, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 → [..., K] uint8 codes (inverse of pack_nibbles)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
