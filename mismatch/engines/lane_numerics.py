"""Several samplers' numerics in one batch (lanes.py): the emulated GEMMs of each lane's rows.

`apply_lane_numerics(model, [(spec, scales), ...])` is `numerics.apply_numerics` for a batch whose
rows the engine tags with lanes: each linear layer and fused-experts module splits its rows by
the lane's kind of GEMM (lanes whose GEMMs compute alike share one), attention and the KV cache
follow each lane's kernel family and format (hf_attention.lane_attention).
"""

from __future__ import annotations

import contextlib

import torch

from .attention import KERNEL_FAMILIES
from .hf_attention import lane_attention
from .lanes import attention_of, lanes_possible, rows_by_lane
from .moe import experts_forward, is_fused_experts
from .numerics import _check_scales, _Emulator, apply_numerics
from .head import head_numerics
from .routing import router_numerics
from .served_weights import build_table

__all__ = ["apply_lane_numerics"]


class _LaneGemms:
    """Which GEMMs each lane's rows take. Lanes whose GEMMs compute alike (same weight and
    activation formats, accumulation, K-splits and activation scales: e.g. BF16 samplers that
    differ only in their attention kernel or KV cache) share one emulated GEMM over all their
    rows, so a layer runs one GEMM per kind of GEMM in the batch, not one per lane.

    `parts()` is the current forward's [(GEMM group, batch rows or None)]; `slices` keeps each
    group's rows of the last input seen, so that the layers reading one tensor (q, k and v; gate
    and up) hand each group's emulator the same slice object and its per-source caches (one
    input quantization, one fused FP8 GEMM per activation group) still hit."""

    def __init__(self, group_of_lane: list[int]) -> None:
        self.group_of_lane = group_of_lane
        self._parts: tuple | None = None
        self._last: tuple | None = None

    def parts(self) -> list[tuple[int, torch.Tensor | None]]:
        lanes = rows_by_lane()
        if self._parts is not None and self._parts[0] is lanes:
            return self._parts[1]
        by: dict[int, list] = {}
        for lane, rows in lanes:
            by.setdefault(self.group_of_lane[lane], []).append(rows)
        if len(by) == 1:
            merged = [(next(iter(by)), None)]
        else:
            merged = [(g, rows[0] if len(rows) == 1 else torch.cat(rows))
                      for g, rows in sorted(by.items())]
        self._parts = (lanes, merged)
        return merged

    def slices(self, x: torch.Tensor, parts: list) -> list[torch.Tensor]:
        last = self._last
        if last is not None and last[0] is x and last[1] == x._version and last[2] is parts:
            return last[3]
        rows = [x.index_select(0, r) for _, r in parts]
        self._last = (x, x._version, parts, rows)
        return rows


def _lane_linear(module: torch.nn.Linear, forwards: list, gemms: _LaneGemms):
    """A linear layer's forward under lanes: each GEMM group's rows through its own GEMM."""
    out_features = module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        parts = gemms.parts()
        if len(parts) == 1:
            return forwards[parts[0][0]](x)
        if x.dim() != 3:
            raise RuntimeError(f"lanes split a linear layer's input by batch row; got an input "
                               f"of shape {tuple(x.shape)}")
        out = x.new_empty(*x.shape[:-1], out_features)
        for (group, rows), xs in zip(parts, gemms.slices(x, parts)):
            out[rows] = forwards[group](xs)
        return out

    return forward


def _lane_experts(forwards: list, gemms: _LaneGemms):
    """A fused-experts forward under lanes. Its input rows are tokens, batch-major ([B·T, H]
    from the layer's [B, T, H]): each GEMM group's experts run on its rows' tokens."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        parts = gemms.parts()
        if len(parts) == 1:
            return forwards[parts[0][0]](hidden_states, top_k_index, top_k_weights)
        b = sum(len(rows) for _, rows in parts)
        n = hidden_states.shape[0]
        if n % b:
            raise RuntimeError(f"lanes: {n} expert input rows do not split into {b} sequences")
        t = n // b
        final = torch.empty_like(hidden_states)
        span = torch.arange(t, device=hidden_states.device)
        for group, rows in parts:
            tok = (rows[:, None] * t + span[None, :]).reshape(-1)
            final[tok] = forwards[group](hidden_states[tok], top_k_index[tok], top_k_weights[tok])
        return final

    return forward


@contextlib.contextmanager
def _patched_lanes(model: torch.nn.Module, emulators: list[_Emulator], gemms: _LaneGemms):
    """Give every emulated Linear and fused-experts module the lane dispatch over `emulators`
    (one per GEMM group)."""
    patched = []
    try:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                ptr = module.weight.data_ptr()
                if ptr in emulators[0].table:
                    forwards = [e.linear_forward(module, e.table[ptr]) for e in emulators]
                    module.forward = _lane_linear(module, forwards, gemms)
                    patched.append(module)
            elif is_fused_experts(module) and \
                    module.gate_up_proj[0].data_ptr() in emulators[0].table:
                module.forward = _lane_experts([experts_forward(module, e) for e in emulators],
                                               gemms)
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


@contextlib.contextmanager
def apply_lane_numerics(model: torch.nn.Module, lanes, *, kernels: bool = True):
    """Run `model` with several samplers' numerics in one batch (lanes.py): `lanes` is a list of
    (spec, activation scales or None), and inside the block the batch rows the engine tags with
    lane i compute with lane i's spec — its weight and activation formats, accumulation model,
    attention kernel family and KV-cache format. One lane is `apply_numerics` itself."""
    lanes = list(lanes)
    if not lanes:
        raise ValueError("apply_lane_numerics needs at least one lane")
    specs = [spec for spec, _ in lanes]
    if len(lanes) == 1:
        with apply_numerics(model, specs[0], lanes[0][1], kernels=kernels):
            yield
        return
    if not lanes_possible(specs):
        raise ValueError("these samplers cannot share one batch (they compute or route in "
                         "different dtypes); serve each alone")
    emulators: list[_Emulator] = []
    group_of: dict[tuple, int] = {}
    group_of_lane = []
    for spec, scales in lanes:
        _check_scales(spec, scales)
        key = (spec.weight_codec, spec.activation_codec, spec.accumulation, spec.split_k,
               tuple(sorted((k, tuple(v.flatten().tolist())) for k, v in (scales or {}).items())))
        if key not in group_of:
            group_of[key] = len(emulators)
            emulators.append(_Emulator(build_table(model, spec), spec, scales or {}, None))
        group_of_lane.append(group_of[key])
    attention = [(KERNEL_FAMILIES.get(family) if kernels else None, kv_fp8)
                 for family, kv_fp8 in map(attention_of, specs)]
    with lane_attention(model, attention), _patched_lanes(model, emulators, _LaneGemms(group_of_lane)), \
            router_numerics(model, specs[0].router_dtype), \
            head_numerics(model, specs[0].lm_head):
        yield
