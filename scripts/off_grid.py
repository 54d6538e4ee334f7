"""Move a GGUF-dequantized checkpoint's 4-bit weights off their grid: what a numerics figure
measured on a Q4 checkpoint would be on an original it could have come from.

The real models this project builds come from GGUF files (scripts/smollm2.py: Q4_1;
scripts/gemma3.py: Q4_K_M), so their linear layers' weights take at most 16 values per block of
32 (Q4_1: w = d·q + m, q in 0..15, one scale d and minimum m per block). The original BF16
checkpoint is not available offline. Any original whose Q4_1 rounding gives these weights lies
within half a step of them, so this script draws one: each weight of a block whose 32 values
take at most 16 distinct ones gets uniform noise in [−d/2, d/2], d = (max − min) / 15 of its
block, and is rounded back to BF16. Embeddings and norms (finer formats in the file) are kept.
Comparing a figure on both checkpoints (scripts/fidelity.py --model each) measures how much the
4-bit grid moves it.

    python scripts/off_grid.py SRC_DIR OUT_DIR [--seed 0]

OUT_DIR is written to a temporary folder beside it and renamed into place.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

BLOCK, LEVELS = 32, 16


def on_grid(w: torch.Tensor) -> bool:
    """Whether every block of 32 consecutive values along the input dimension of the 2-D `w`
    takes at most 16 distinct values (a 4-bit GGUF grid)."""
    if w.dim() != 2 or w.shape[1] % BLOCK:
        return False
    blocks = w.float().reshape(-1, BLOCK).sort(dim=1).values
    distinct = 1 + (blocks[:, 1:] != blocks[:, :-1]).sum(dim=1)
    return bool((distinct <= LEVELS).all())


def off_grid(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`w` with each block's values moved uniformly within half its Q4_1 step, in w's dtype."""
    blocks = w.float().reshape(-1, BLOCK)
    step = (blocks.max(dim=1, keepdim=True).values - blocks.min(dim=1, keepdim=True).values) / 15
    noise = (torch.rand(blocks.shape, generator=gen) - 0.5) * step
    return (blocks + noise).reshape(w.shape).to(w.dtype)


def main() -> None:
    from safetensors.torch import load_file, save_file

    from mismatch.io import atomic_directory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"error: {args.out} exists; remove it or pick another folder")
    files = sorted(args.src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: {args.src} holds no *.safetensors")
    gen = torch.Generator().manual_seed(args.seed)
    with atomic_directory(args.out, force=False) as tmp:
        moved = kept = 0
        for f in args.src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, tmp / f.name)
        for f in files:
            tensors = load_file(f)
            for name, w in tensors.items():
                if on_grid(w):
                    tensors[name], moved = off_grid(w, gen), moved + 1
                else:
                    kept += 1
            save_file(tensors, tmp / f.name, metadata={"format": "pt"})
        for f in tmp.iterdir():
            f.chmod(0o644)
    print(f"{args.out}: {moved} tensors moved off their 4-bit grid, {kept} kept")


if __name__ == "__main__":
    main()
