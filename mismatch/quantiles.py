"""torch.quantile's values, bit for bit, from numpy's selection instead of torch's sort.

torch.quantile sorts with torch.sort (a stable sort carrying indices: ~20× numpy's on CPU); only
the order statistics at floor and ceil of q·(n − 1) matter, and they are the same whatever finds
them. `_quantiles_np` finds them with numpy (a selection for one rank and its successor, one sort
for more) and interpolates as torch.quantile does: ranks q·(n − 1) in the output dtype, weights
rank − floor(rank), `lerp` (pytorch/pytorch@v2.5.0 aten/src/ATen/native/Sorting.cpp,
quantile_compute). `mismatch.metrics.masked_quantiles` (and the losses' ratio quantiles) call it
on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

__all__: list[str] = []

_NAN = float("nan")


def _order_stats(a: np.ndarray, ranks: list[int]) -> dict[int, float]:
    """{k: the k-th smallest value of the 1-D ndarray `a`} for the 0-based ranks asked; `a` is
    reordered in place. One rank (and its successor) by a selection, np.partition's introselect
    in O(n), the successor being the least value above it; more ranks by one sort."""
    ks = sorted(set(ranks))
    if ks[-1] - ks[0] <= 1:
        k = ks[0]
        a.partition(k)
        found = {k: a[k]}
        if len(ks) == 2:
            found[k + 1] = a[k + 1:].min()
        return found
    a.sort()
    return {k: a[k] for k in ks}


def _quantiles_np(a: np.ndarray, q: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.quantile(torch.from_numpy(a), q) bit for bit: a 1-D ndarray of finite values
    (reordered in place). The ranks, weights and `lerp` are torch.quantile's own, in `dtype`."""
    n = a.size
    if n == 0:
        return torch.full((len(q),), _NAN, dtype=dtype)
    ranks = torch.tensor(q, dtype=dtype) * (n - 1)
    below, above = ranks.long(), ranks.ceil().long()
    at = _order_stats(a, below.tolist() + above.tolist())
    lo = torch.tensor([at[k] for k in below.tolist()], dtype=dtype)
    hi = torch.tensor([at[k] for k in above.tolist()], dtype=dtype)
    return torch.lerp(lo, hi, ranks - below)
