"""The weights a served checkpoint computes with, per linear layer: grouped as serving engines fuse
them, encoded in the spec's weight codec by modelopt's export rules and vLLM's loading rules, and
decoded once into the FP32 values the emulated GEMMs read.

`quantizable_weights` finds the decoder's linear weights and their fusion groups (q/k/v, a dense
MLP's gate/up, each expert's slices); `serve_weights` encodes one group as a server holds it;
`build_table` gives each weight its `ServedLinear` (decoded weight, activation-scale group and,
for FP8 W8A8 under an accumulation model, the group's E4M3 elements as MMA slices), cached per
model until a parameter changes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mismatch.quantize import QTensor, decode, encode, get_codec
from mismatch.quantize.accumulate import KSlices, resolve
from mismatch.quantize.formats import div_scalar
from mismatch.quantize.loader import requantize_fp8

from ..profiles import NumericsSpec

__all__ = ["ServedLinear", "quantizable_weights", "act_group", "serve_weights", "build_table"]


def quantizable_weights(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Groups of weights that share a global scale: {group: [(name, weight [N, K]), ...]}.

    q/k/v of one attention share; gate/up of a dense MLP share; each expert's fused gate_up and
    down slices form their own groups. lm_head, embeddings and MoE routers are excluded.
    """
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, module in model.named_modules():
        if ".layers." not in f".{name}." and not name.startswith("layers."):
            continue
        if isinstance(module, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            parent = name.rsplit(".", 1)[0]
            if leaf in ("q_proj", "k_proj", "v_proj"):
                key = f"{parent}.qkv"
            elif leaf in ("gate_proj", "up_proj"):
                key = f"{parent}.gate_up"
            elif leaf == "gate":  # a router kept as nn.Linear in some versions
                continue
            else:
                key = name
            groups.setdefault(key, []).append((name, module.weight))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and \
                isinstance(getattr(module, "gate_up_proj"), torch.nn.Parameter):
            for e in range(module.gate_up_proj.shape[0]):
                groups[f"{name}.{e}.gate_up"] = [(f"{name}.{e}.gate_up_proj",
                                                  module.gate_up_proj[e])]
                groups[f"{name}.{e}.down"] = [(f"{name}.{e}.down_proj", module.down_proj[e])]
    return groups


def act_group(group: str) -> str:
    """Activation scales are shared by q/k/v (same input) and across the experts of a layer."""
    parts = group.split(".")
    if len(parts) >= 2 and parts[-2].isdigit():  # <experts>.<e>.<gate_up|down>
        return ".".join(parts[:-2] + [parts[-1]])
    return group


@dataclass
class ServedLinear:
    """One quantized linear weight, ready to run."""

    weight: torch.Tensor  # [N, K] float32, decoded
    act_key: str
    # FP8 W8A8 under an accumulation model: the E4M3 element values of the whole fusion group
    # (q/k/v, gate/up: one input, one GEMM, as serving engines fuse them) as [K, ΣN] MMA slices,
    # shared by the group's entries; this weight's output columns are `cols` of the group's
    group_slices: KSlices | None = None
    cols: tuple[int, int] = (0, 0)
    weight_scale: torch.Tensor | None = None
    weight_fp8: torch.Tensor | None = None  # [N, K] float8_e4m3fn storage (measured FP8 GEMMs)


def serve_weights(group: str, members: list[tuple[str, torch.Tensor]],
                  codec: str) -> list[QTensor]:
    """The storage a server computes with for one fusion group, in modelopt's export rules and
    vLLM's loading rules (quantize/loader.py documents both):

    FP8: modelopt gives each linear its own per-tensor scale; the engine fuses q/k/v and gate/up
    into one GEMM with the max scale, requantizing shards whose scale differs (and, for MoE
    gate/up, always). NVFP4 / W4A16: modelopt already shares the max amax across q/k/v and
    gate/up, so the fused global scale is that value. MXFP4: no per-tensor scale.
    """
    weights = [w.detach() for _, w in members]
    if codec == "fp8":
        qts = [encode(w, "fp8") for w in weights]
        scales = torch.stack([q.scales for q in qts])
        expert_gate_up = ".experts." in group and group.endswith(".gate_up")
        if expert_gate_up or (len(qts) > 1 and not bool((scales == scales[0]).all())):
            top = scales.max()
            qts = [QTensor("fp8", q.shape, requantize_fp8(q, top), scales=top) for q in qts]
        return qts
    spec = get_codec(codec)
    if spec.scheme == "nvfp4":  # the fused global scale: the group's amax / (6 · 448)
        amax = torch.stack([w.abs().amax().float() for w in weights]).max()
        shared = torch.where(amax > 0, div_scalar(amax, spec.scale_divisor), torch.ones_like(amax))
        return [encode(w, codec, global_scale=shared) for w in weights]
    if spec.block_rows > 1:  # 2-D blocks: zero-pad to whole blocks (decode crops them again)
        rows, cols = spec.block_rows, spec.block
        return [encode(F.pad(w, (0, -w.shape[1] % cols, 0, -w.shape[0] % rows)), codec)
                for w in weights]
    return [encode(w, codec) for w in weights]


_TABLES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _fingerprint(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter is replaced or written in place."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def build_table(model: torch.nn.Module, spec: NumericsSpec,
                native_fp8: bool = False) -> dict[int, ServedLinear]:
    """The emulated weights of `spec`, cached per model until its parameters change."""
    per_model = _TABLES.setdefault(model, {})
    key = (spec.weight_codec, spec.activation_codec, spec.accumulation, native_fp8)
    fingerprint = _fingerprint(model)
    hit = per_model.get(key)
    if hit is not None and hit[0] == fingerprint:
        return hit[1]
    table = _encode_table(model, spec, native_fp8)
    per_model[key] = (fingerprint, table)
    return table


def _encode_table(model: torch.nn.Module, spec: NumericsSpec,
                  native_fp8: bool = False) -> dict[int, ServedLinear]:
    table: dict[int, ServedLinear] = {}
    fp8_acc = spec.activation_codec == "fp8-act" and spec.accumulation != "fp32"
    for group, members in quantizable_weights(model).items():
        act_key = act_group(group)
        if spec.weight_codec is None:
            for _, w in members:
                table[w.data_ptr()] = ServedLinear(weight=w.detach().float(), act_key=act_key)
            continue
        served = serve_weights(group, members, spec.weight_codec)
        if fp8_acc and spec.weight_codec == "fp8":
            # one [K, ΣN] operand per fusion group, E4M3 values exactly in bfloat16
            elems = torch.cat([q.codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
                               for q in served])
            slices = KSlices.of(elems.t(), resolve(spec.accumulation).mma_k)
            bounds = torch.tensor([0] + [q.codes.shape[0] for q in served]).cumsum(0).tolist()
        for i, ((_, w), q) in enumerate(zip(members, served)):
            entry = ServedLinear(weight=decode(q)[:w.shape[0], :w.shape[1]], act_key=act_key)
            if fp8_acc and spec.weight_codec == "fp8":
                entry.group_slices, entry.cols = slices, (bounds[i], bounds[i + 1])
                entry.weight_scale = q.scales
            if native_fp8 and spec.weight_codec == "fp8":
                entry.weight_fp8 = q.codes.view(torch.float8_e4m3fn)
                entry.weight_scale = q.scales
            table[w.data_ptr()] = entry
    return table
