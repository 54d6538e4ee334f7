"""The rollout engine's KV cache: per-layer slot tensors written in place (engine.py uses it).

Per layer one [slots, kv_heads, capacity, head_dim] key and value tensor in the compute dtype.
Before each forward the engine plans which slots the batch's rows are, where their new positions
start and how many there are; `update` (transformers' Cache hook, called by every attention
layer) writes the new keys/values at those positions and hands attention the first `tk`
positions of the batch's slots. No per-step concatenation; `grow` reallocates (one copy) when a
longer context is needed.

Under an FP8 KV cache (hf_attention: the active block's `kv_store_rounding`) each new position
is rounded once as it is written, as a serving engine's FP8 cache stores it (under lanes, only
the positions of rows whose lane has an FP8 cache), and what `update`
returns is marked as rounded so that attention does not round the whole cache again. The block
in force when the cache is made is the one it serves: an update under another raises. Where
every row of that block attends with one tiled kernel (which reads K and V in FP32), the store
holds the compute dtype's values widened to FP32 once, as they are written, instead of at every
attention call (a decode step widened the whole cache, every layer); a lane block whose rows
attend in several calls keeps the compute dtype (hf_attention.stores_widened). Where every row
attends with a tiled kernel and the batch's slots are contiguous, attention gets a view of the
store, not a compact copy. The values are the same bits either way: widening BF16/FP16 to FP32
is exact, and an FP8 rounding of the widened values is the rounding of the narrow ones.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .hf_attention import kv_store_rounding, mark_rounded, reads_widened, stores_widened

__all__ = ["SlotCache"]


class SlotCache(Cache):
    """Per-layer [slots, kv_heads, capacity, head_dim] keys and values, written in place.

    Before each forward the engine calls `plan` with the batch's slots, their start positions and
    new-token counts; `update` then writes each row's new keys/values at its positions and
    returns the first `tk` positions of the batch's slots for attention."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(layers=[])
        shape = (slots, kv_heads, capacity, head_dim)
        self.dtype = dtype  # the values' dtype (the compute dtype)
        self._widened = stores_widened()  # stored widened to FP32 for a tiled kernel's reads
        store = torch.float32 if self._widened else dtype
        self.keys = [torch.zeros(shape, dtype=store, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=store, device=device) for _ in range(layers)]
        self._plan: tuple | None = None
        self._rounding = kv_store_rounding()  # how every position of this cache is stored

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def grow(self, capacity: int) -> None:
        """Reallocate to `capacity` positions, keeping what is cached."""
        old = self.capacity
        if capacity <= old:
            return
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                bigger = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
                bigger[:, :, :old] = t
                store[i] = bigger

    def plan(self, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
             width: int, tk: int) -> None:
        """rows [B] slots, starts [B] first new position, counts [B] new tokens (≤ width, the
        padded query length); attention will read positions [0, tk) of each row's slot."""
        j = torch.arange(width, device=rows.device)
        valid = j[None, :] < counts[:, None]  # [B, width]
        b_idx, j_idx = valid.nonzero(as_tuple=True)
        n = rows.shape[0]
        lo = int(rows[0])
        contiguous = bool((rows == torch.arange(lo, lo + n, device=rows.device)).all())
        self._plan = (rows, b_idx, j_idx, rows[b_idx], starts[b_idx] + j_idx, tk,
                      (lo, lo + n) if contiguous else None)

    def planned_positions(self) -> tuple[torch.Tensor, ...]:
        """(b_idx, j_idx, slot_idx, pos_idx) [n] each: the batch row, query offset, slot and
        position of every new token of the planned forward."""
        assert self._plan is not None, "plan() first"
        return self._plan[1:5]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        rows, b_idx, j_idx, slot_idx, pos_idx, tk, span = self._plan
        rounding = kv_store_rounding()
        if rounding is not self._rounding:
            raise RuntimeError("this KV cache was made under another KV cache format than the "
                               "one active now; use one engine per apply_numerics block")
        widened = reads_widened()  # a tiled kernel reads K and V in FP32, from any layout
        out = []
        for store, new in ((self.keys, key_states), (self.values, value_states)):
            cache = store[layer_idx]
            written = new.transpose(1, 2)[b_idx, j_idx].to(self.dtype).to(cache.dtype)
            cache[slot_idx, :, pos_idx] = (written if rounding is None
                                            else rounding(written, b_idx))
            if span is not None:  # the batch's slots in a row: a view, or one compact copy
                view = cache[span[0]:span[1], :, :tk]  # (attention streams it many times)
                out.append(view if widened else view.to(self.dtype).contiguous())
            else:
                picked = cache[:, :, :tk].index_select(0, rows)
                out.append(picked if widened else picked.to(self.dtype))
        if rounding is not None:
            mark_rounded(*out)
        return out[0], out[1]

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
        """Copy positions [0, n) of slots `src` [R] into slots `dst` [R] (a shared prefill:
        the KV as stored, FP8 rounding included)."""
        for store in (self.keys, self.values):
            for cache in store:
                cache[dst, :, :n] = cache[src, :, :n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._plan is None else self._plan[5]
