"""Read modelopt checkpoints back into codec storage (`QTensor`), optionally fused like a server.

`load_quantized(path)` reads config.json, hf_quant_config.json and every *.safetensors file of a
checkpoint written by modelopt (or `quantize_checkpoint`), and returns a `QuantizedCheckpoint`:
- `weights`: one `QTensor` per quantized linear, keyed by module name
  (`model.layers.0.self_attn.q_proj`), in the codec that wrote it (CHECKPOINT_FORMATS);
- `input_scales`: static activation scales (FP8, NVFP4), by module name;
- `kv_scales`: FP8 KV-cache scales keyed `<attention>.k_scale` / `.v_scale` — modelopt stores
  them on the projections (`self_attn.k_proj.k_scale`); engines remap them to the attention
  module the same way (vLLM `maybe_remap_kv_scale_name`); a missing one means 1.0 there;
- `tensors`: everything else (norms, embeddings, lm_head, routers) exactly as stored.

Engine fusion (`engine_fusion=True`). vLLM and SGLang run q/k/v as one `qkv_proj` GEMM and
gate/up as one `gate_up_proj` (per expert for MoE: `w13`), and a fused layer has one per-tensor
scale, so they rewrite the shards after loading. What a server computes with is therefore not
always the stored bytes. Read in vLLM (vllm/model_executor/layers/quantization/modelopt.py and
utils/w8a8_utils.py, fp8_utils.py), not copied:
- FP8 linear (`ModelOptFp8LinearMethod.process_weights_after_loading`): if the shards' weight
  scales differ, `requantize_with_max_scale` dequantizes each shard with its own scale via
  `per_tensor_dequantize` (FP8 → FP16, times the FP32 0-dim scale tensor: a 0-dim tensor does
  not promote, so the product is FP16) and requantizes it with `scaled_fp8_quant` against the
  max scale (FP32 x · (1/max), clamp ±448, RNE cast: codec "fp8-act"). Input scale: the max.
- FP8 MoE (`process_fp8_weight_tensor_strategy_moe`): the same per expert for w1/w3, done even
  when the two scales are equal.
- NVFP4 / W4A16 linear: codes and block scales stay; `weight_global_scale` is the max of the
  shards' `weight_scale_2`, `input_global_scale` the max of their `input_scale`. NVFP4 MoE keeps
  the w1 (gate) shard's `weight_scale_2` (`w13_weight_scale_2[:, 0]`, with a warning if w3's
  differs). modelopt's export already unifies these, so for its checkpoints this is exact.
- MoE input scales: engines keep one per layer (the max over experts); modelopt writes the same
  value for every expert, so the per-expert max kept here is that value.
- MXFP4: no per-tensor scale, so fusing is concatenation. (vLLM's modelopt loader, as read,
  accepts FP8 / NVFP4 / W4A16_NVFP4 but not modelopt's "mxfp4" quant_algo.)
FP16 in the FP8 requantization is the numerics detail that matters: on a CUDA tensor the FP32
scale is cast to FP16 by the elementwise kernel before the multiply (CPU torch keeps it FP32 for
a 0-dim operand); we follow the GPU, where vLLM runs: fp16(fp16(q) · fp16(scale)).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from .checkpoint_formats import CheckpointFormat, format_for_quant_algo
from .codecs import decode, encode
from .errors import QuantizeError
from .qtensor import QTensor

__all__ = ["QuantizedCheckpoint", "load_quantized", "fuse_like_engine", "requantize_fp8",
           "read_config", "iter_tensors", "safetensors_files", "FUSED_SHARDS"]

FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Fused module name → the checkpoint modules a serving engine concatenates into it (in order)."""

_KV_SCALE = re.compile(r"^(.*)\.[kv]_proj\.([kv]_scale)$")


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a QuantizeError that says what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise QuantizeError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantizeError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise QuantizeError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def read_config(path: Path) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint directory, checked to look like one."""
    path = Path(path)
    if not path.exists():
        raise QuantizeError(f"model path {path} does not exist")
    if not path.is_dir():
        raise QuantizeError(f"model path {path} is not a directory; a Hugging Face checkpoint "
                            f"is a directory with config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise QuantizeError(f"{path} has no config.json: not a Hugging Face checkpoint")
    config = load_json(path / "config.json")
    if "model_type" not in config:
        raise QuantizeError(f"{path / 'config.json'} has no model_type: not a transformers config")
    return config


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"{path} has no *.safetensors weights (only safetensors "
                            f"checkpoints are supported)")
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every *.safetensors file under `path`."""
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(path):
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise QuantizeError(f"{file} is not a readable safetensors file: {exc}") from None


def safetensors_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A quantized checkpoint as codec storage; see the module docstring."""

    path: Path
    format: CheckpointFormat
    config: dict[str, Any]
    """config.json."""
    quant_config: dict[str, Any]
    """The "quantization" object of hf_quant_config.json."""
    weights: dict[str, QTensor]
    """Module name → weight storage [out, in] (fused names such as `qkv_proj` under fusion)."""
    input_scales: dict[str, torch.Tensor]
    """Module name → static activation scale, 0-dim float32."""
    kv_scales: dict[str, torch.Tensor]
    """`<attention module>.k_scale` / `.v_scale` → 0-dim float32."""
    tensors: dict[str, torch.Tensor]
    """Every other stored tensor, unchanged."""
    shards: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    """Fused module → ((checkpoint module, rows), ...) in concatenation order."""

    def decode(self, module: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] of one (possibly fused) module as the kernels see it."""
        return decode(self.weights[module], dtype)

    def decoded_weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """`<module>.weight` → decoded weight, under the checkpoint's (unfused) names."""
        out: dict[str, torch.Tensor] = {}
        for module, qt in self.weights.items():
            values = decode(qt, dtype)
            if module not in self.shards:
                out[f"{module}.weight"] = values
                continue
            names, rows = zip(*self.shards[module])
            for name, part in zip(names, values.split(list(rows), dim=0)):
                out[f"{name}.weight"] = part.contiguous()
        return out

    def state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Decoded weights plus the unquantized tensors, floats cast to `dtype` (HF names)."""
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in self.tensors.items()}
        sd.update(self.decoded_weights(dtype))
        return sd


def load_quantized(path: str | Path, *, engine_fusion: bool = False) -> QuantizedCheckpoint:
    """Read a modelopt checkpoint; with `engine_fusion`, rewrite fused shards as vLLM does."""
    path = Path(path)
    config = read_config(path)
    if not (path / "hf_quant_config.json").is_file():
        raise QuantizeError(f"{path} has no hf_quant_config.json: not a modelopt-quantized "
                            f"checkpoint (write one with `mismatch quantize`)")
    quant = load_json(path / "hf_quant_config.json").get("quantization")
    if not isinstance(quant, dict) or "quant_algo" not in quant:
        raise QuantizeError(f"{path / 'hf_quant_config.json'} has no quantization.quant_algo")
    fmt = format_for_quant_algo(quant["quant_algo"])
    stored = dict(iter_tensors(path))
    modules = sorted(k[: -len(".weight_scale")] for k in stored if k.endswith(".weight_scale"))
    weights, input_scales, kv_scales = {}, {}, {}
    for module in modules:
        weights[module] = _qtensor(stored, module, fmt)
        stored.pop(f"{module}.weight")
        for suffix in ("weight_scale", "weight_scale_2"):
            stored.pop(f"{module}.{suffix}", None)
        if f"{module}.input_scale" in stored:
            input_scales[module] = stored.pop(f"{module}.input_scale").float()
    for key in [k for k in stored if _KV_SCALE.match(k)]:
        attention, which = _KV_SCALE.match(key).groups()
        kv_scales[f"{attention}.{which}"] = stored.pop(key).float()
    ckpt = QuantizedCheckpoint(path=path, format=fmt, config=config, quant_config=quant,
                               weights=weights, input_scales=input_scales, kv_scales=kv_scales,
                               tensors=stored)
    return fuse_like_engine(ckpt) if engine_fusion else ckpt


def _need(stored: dict[str, torch.Tensor], key: str, dtype: torch.dtype) -> torch.Tensor:
    if key not in stored:
        raise QuantizeError(f"checkpoint has no tensor {key}")
    t = stored[key]
    if t.dtype != dtype:
        raise QuantizeError(f"{key} has dtype {t.dtype}, expected {dtype}")
    return t


def _qtensor(stored: dict[str, torch.Tensor], module: str, fmt: CheckpointFormat) -> QTensor:
    """The stored weight of one module as a QTensor of the format's codec."""
    if fmt.block == 0:  # FP8, one scale per tensor
        w = _need(stored, f"{module}.weight", torch.float8_e4m3fn)
        scale = _need(stored, f"{module}.weight_scale", torch.float32)
        if scale.numel() != 1:
            raise QuantizeError(f"{module}.weight_scale has shape {list(scale.shape)}; only "
                                f"per-tensor FP8 (quant_algo FP8) is supported")
        return QTensor(fmt.codec, tuple(w.shape), w.view(torch.uint8), scales=scale.reshape(()))
    w = _need(stored, f"{module}.weight", torch.uint8)
    nvfp4 = fmt.block == 16
    scale = _need(stored, f"{module}.weight_scale", torch.float8_e4m3fn if nvfp4 else torch.uint8)
    shape = (*w.shape[:-1], w.shape[-1] * 2)
    expected = (*shape[:-1], shape[-1] // fmt.block)
    if tuple(scale.shape) != expected:
        raise QuantizeError(f"{module}.weight_scale has shape {list(scale.shape)}; a weight of "
                            f"{list(shape)} with blocks of {fmt.block} needs {list(expected)}")
    global_scale = None
    if nvfp4:
        global_scale = _need(stored, f"{module}.weight_scale_2", torch.float32).reshape(())
    return QTensor(fmt.codec, shape, w, scales=scale, global_scale=global_scale)


def _fusion_groups(modules: list[str]) -> dict[str, list[str]]:
    """Fused name → its shard modules, for every complete group among `modules`."""
    present, groups = set(modules), {}
    for fused, parts in FUSED_SHARDS.items():
        for module in modules:
            prefix, _, leaf = module.rpartition(".")
            if leaf == parts[0] and all(f"{prefix}.{p}" in present for p in parts):
                groups[f"{prefix}.{fused}"] = [f"{prefix}.{p}" for p in parts]
    return groups


def fuse_like_engine(ckpt: QuantizedCheckpoint) -> QuantizedCheckpoint:
    """The checkpoint with q/k/v and gate/up fused and rescaled the way vLLM serves them."""
    weights, input_scales = dict(ckpt.weights), dict(ckpt.input_scales)
    shards: dict[str, tuple[tuple[str, int], ...]] = {}
    for fused, parts in _fusion_groups(list(ckpt.weights)).items():
        qts = [weights.pop(p) for p in parts]
        expert = ".experts." in fused
        weights[fused] = _fuse(qts, ckpt.format, expert=expert)
        shards[fused] = tuple((p, qt.shape[0]) for p, qt in zip(parts, qts))
        scales = [input_scales.pop(p) for p in parts if p in input_scales]
        if scales:
            input_scales[fused] = torch.stack(scales).max()
    return QuantizedCheckpoint(path=ckpt.path, format=ckpt.format, config=ckpt.config,
                               quant_config=ckpt.quant_config, weights=weights,
                               input_scales=input_scales, kv_scales=ckpt.kv_scales,
                               tensors=ckpt.tensors, shards=shards)


def _fuse(qts: list[QTensor], fmt: CheckpointFormat, *, expert: bool) -> QTensor:
    rows = sum(qt.shape[0] for qt in qts)
    shape = (rows, *qts[0].shape[1:])
    codes = torch.cat([qt.codes for qt in qts])
    if fmt.block == 0:
        scales = torch.stack([qt.scales for qt in qts])
        max_scale = scales.max()
        if expert or not bool((scales == scales[0]).all()):
            codes = torch.cat([requantize_fp8(qt, max_scale) for qt in qts])
        return QTensor(fmt.codec, shape, codes, scales=max_scale)
    scales = torch.cat([qt.scales for qt in qts])
    if qts[0].global_scale is None:  # MXFP4
        return QTensor(fmt.codec, shape, codes, scales=scales)
    gs = qts[0].global_scale if expert else torch.stack([qt.global_scale for qt in qts]).max()
    return QTensor(fmt.codec, shape, codes, scales=scales, global_scale=gs)


def requantize_fp8(qt: QTensor, new_scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes [N, K] of one shard requantized to `new_scale`, in vLLM's order (see above).

    dequantize: fp16(fp16(code value) · fp16(scale)) — FP16 product, exact in FP32, rounded once;
    quantize:   E4M3(clamp(fp32(dq) · fp32(1/new_scale), ±448)), RNE ("fp8-act").
    """
    values = qt.codes.view(torch.float8_e4m3fn).to(torch.float16)  # exact: E4M3 ⊂ FP16
    dq = (values.float() * qt.scales.to(torch.float16).float()).to(torch.float16)
    return encode(dq, "fp8-act", global_scale=new_scale.float()).codes
