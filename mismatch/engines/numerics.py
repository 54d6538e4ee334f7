"""Apply a NumericsSpec to a Hugging Face model, reversibly: formats, GEMMs, KV cache, attention.

`apply_numerics(model, spec, calibration)` is a context manager. Inside it:

- every linear layer of the decoder (attention projections, dense MLPs, and each expert slice of
  fused 3-D MoE expert weights) runs as the target kernel does: weights decoded from the real
  storage of `spec.weight_codec` (quantize/), activations quantized with `spec.activation_codec`
  at a static per-tensor scale calibrated beforehand (modelopt's `input_scale`; fused q/k/v and
  experts of one layer share it, as serving engines take the max), products exact and summed in
  FP32 (or by `spec.accumulation`'s model), output rounded once to the compute dtype — the
  shape of a GPU GEMM, whatever CPU kernel torch would have picked. Activation fake-quant and
  the accumulation-model GEMM go through mismatch.kernels: quantize/'s exact torch code on CPU,
  the bit-identical Triton kernels on CUDA tensors. Routers, embeddings and
  lm_head stay in the compute dtype, as modelopt excludes them.
- attention runs through `attention.tiled_attention` with the spec's kernel family (or torch
  SDPA for the reference), with the KV cache stored in FP8 when `spec.kv_codec` says so.

Each decoder `nn.Linear` and each fused-experts module gets an instance-level `forward` for the
duration of the block (the class's forward is back in `finally`); nothing else in the model is
touched or slowed down. Fused experts quantize their activations once per GEMM stage for all
experts, as fused-MoE kernels do (moe.py).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mismatch.quantize import QTensor, decode, encode
from mismatch.quantize.accumulate import KSlices, resolve
from mismatch.quantize.loader import requantize_fp8

from ..kernels import accumulate_gemm, fake_quant
from ..profiles import NumericsSpec
from .attention import KERNEL_FAMILIES, KernelFamily, quantize_kv, tiled_attention
from .moe import experts_forward, is_fused_experts
from .routing import router_numerics

__all__ = ["apply_numerics", "calibrate", "quantizable_weights", "eager_experts", "fp8_kv_cache",
           "ATTN_IMPL"]

ATTN_IMPL = "mismatch_emulated"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Activation global scale: amax maps to the format's largest code times its block-scale range.
_ACT_SCALE_DIVISOR = {"fp8-act": 448.0, "nvfp4-act": 6.0 * 448.0}
# Codecs with dynamic per-group scales (no static input scale) and their group length along K.
# A K that is not a multiple is zero-padded (zeros change no group's amax): real block-scaled
# kernels need K % 128 == 0, so on a small model one group covers the whole row.
_DYNAMIC_GROUPS = {"fp8-group128": 128}
# Weight codecs with 2-D blocks: weights are zero-padded to whole blocks, then cropped.
_WEIGHT_BLOCKS = {"fp8-block128": 128}


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


def _act_group(group: str) -> str:
    """Activation scales are shared by q/k/v (same input) and across the experts of a layer."""
    parts = group.split(".")
    if len(parts) >= 2 and parts[-2].isdigit():  # <experts>.<e>.<gate_up|down>
        return ".".join(parts[:-2] + [parts[-1]])
    return group


@dataclass
class _Linear:
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


class _Emulator:
    """The GEMMs of one NumericsSpec (or, with `amax` given, a calibration recorder)."""

    def __init__(self, table: dict[int, _Linear], spec: NumericsSpec,
                 act_scales: dict[str, torch.Tensor], amax: dict[str, torch.Tensor] | None):
        self.table, self.spec, self.act_scales, self.amax = table, spec, act_scales, amax
        self._last: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}
        # the last fused FP8 GEMM per activation group: (source, its _version, group slices,
        # unscaled output [M, ΣN]); q, k and v (gate and up) read their columns of one GEMM
        self._last_gemm: dict[str, tuple[torch.Tensor, int, KSlices, torch.Tensor]] = {}
        self._acc = resolve(spec.accumulation)

    def quantized_input(self, x2: torch.Tensor, entry: _Linear,
                        source: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] activations → [N, K] FP32 values the GEMM sees (fake-quantized if W*A*); for
        an FP8 GEMM under an accumulation model, the E4M3 element values (float8_e4m3fn, no
        scale: the GEMM scales its output).

        q, k and v read the same tensor with one scale: like a fused QKV GEMM, the input is
        quantized once (the last input per activation group is remembered by identity)."""
        if self.amax is not None:  # calibration: record the input range, quantize nothing
            if x2.numel():
                a = x2.detach().abs().amax().float()
                prev = self.amax.get(entry.act_key)
                self.amax[entry.act_key] = a if prev is None else torch.maximum(prev, a)
            return x2.float()
        if entry.group_slices is not None:
            return self._elements(x2, entry)
        codec = self.spec.activation_codec
        if codec is None or x2.shape[0] == 0:
            return x2.float()
        source = x2 if source is None else source
        last = self._last.get(entry.act_key)
        if last is not None and last[0] is source and last[1] == source._version:
            return last[2]
        if codec in _DYNAMIC_GROUPS:  # dynamic per-group scales; K padded to whole groups
            k = x2.shape[-1]
            xq = fake_quant(F.pad(x2.float(), (0, -k % _DYNAMIC_GROUPS[codec])), codec,
                            validate=False)[:, :k]
        else:
            xq = fake_quant(x2.float(), codec, global_scale=self.act_scales[entry.act_key],
                            validate=False)
        self._last[entry.act_key] = (source, source._version, xq)
        return xq

    def _elements(self, x2: torch.Tensor, entry: _Linear) -> torch.Tensor:
        """[N, K] activations → [N, K] float8_e4m3fn: the codes of the static per-tensor FP8
        quantization (encode's own), viewed as E4M3 (exact, no decoding pass)."""
        q = encode(x2, self.spec.activation_codec,
                   global_scale=self.act_scales[entry.act_key], validate=False)
        return q.codes.view(torch.float8_e4m3fn)

    def _fp8_gemm(self, x2: torch.Tensor, entry: _Linear, elems: torch.Tensor | None,
                  source: torch.Tensor | None) -> torch.Tensor:
        """The accumulation-model GEMM of `entry`'s fusion group on the input's E4M3 elements
        → [N, ΣN] FP32, unscaled. With a `source`, the output is remembered for the group's
        other members (each output element is its own dot product: the columns of the fused
        GEMM are those of the separate GEMMs, bit for bit)."""
        last = self._last_gemm.get(entry.act_key)
        if source is not None and last is not None and last[0] is source and \
                last[1] == source._version and last[2] is entry.group_slices:
            return last[3]
        if elems is None:
            elems = self._elements(x2, entry)
        y = accumulate_gemm(elems, entry.group_slices, self._acc)
        if source is not None:
            self._last_gemm[entry.act_key] = (source, source._version, entry.group_slices, y)
        return y

    def gemm(self, x2: torch.Tensor, entry: _Linear, xq: torch.Tensor | None = None,
             source: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] activations → [N, N_out] FP32: exact products, FP32 sums (or the spec's
        accumulation model for FP8 W8A8). `xq`: the already-quantized input, if any (as
        `quantized_input` returns it)."""
        if entry.group_slices is not None and self.amax is None:
            lo, hi = entry.cols
            y = self._fp8_gemm(x2, entry, xq, source)[:, lo:hi]
            a_scale = self.act_scales[entry.act_key].float()
            return y * (a_scale * entry.weight_scale)
        if xq is None:
            xq = self.quantized_input(x2, entry, source)
        splits = self.spec.split_k
        k = xq.shape[-1]
        if splits <= 1 or k < 2 * splits:
            return torch.matmul(xq, entry.weight.t())
        step = -(-k // splits)  # FP32 partials over K slices, summed in slice order at the end
        out = torch.matmul(xq[:, :step], entry.weight[:, :step].t())
        for k0 in range(step, k, step):
            out = out + torch.matmul(xq[:, k0:k0 + step], entry.weight[:, k0:k0 + step].t())
        return out

    def batched(self) -> bool:
        """Whether activations can be quantized once per MoE stage: always here (static
        per-tensor scales and per-row groups quantize each row alone, so the rows of the whole
        stage give each expert the values of its own rows, E4M3 elements included)."""
        return True

    def linear_forward(self, module: torch.nn.Linear, entry: _Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, x.shape[-1])
            y = self.gemm(x2, entry, source=x)
            if module.bias is not None:
                y = y + module.bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

        return forward


_SCALED_MM_ALIGN = 16  # torch._scaled_mm needs M, K and N multiples of 16 (cuBLASLt FP8)


class _NativeFP8(_Emulator):
    """Measured FP8 W8A8 on a GPU with FP8 tensor cores: each linear layer (and each expert)
    runs torch._scaled_mm on the served FP8 weight and the activation quantized with its static
    per-tensor scale (vLLM's `scaled_fp8_quant` order), with fast accumulation on Hopper as
    per-tensor serving kernels use it. Rows are zero-padded to a multiple of 16; a layer whose
    K or N is not a multiple of 16 keeps the emulated GEMM."""

    def __init__(self, *args, fast_accum: bool):
        super().__init__(*args)
        self.fast_accum = fast_accum

    def batched(self) -> bool:
        return False  # each GEMM quantizes its own input for _scaled_mm

    def gemm(self, x2, entry, xq=None, source=None):
        w = entry.weight_fp8
        if w is None or x2.shape[0] == 0 or w.shape[0] % _SCALED_MM_ALIGN or \
                w.shape[1] % _SCALED_MM_ALIGN:
            return super().gemm(x2, entry, xq, source)
        scale = self.act_scales[entry.act_key].to(x2.device, torch.float32)
        a = (x2.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        m = a.shape[0]
        pad = -m % _SCALED_MM_ALIGN
        if pad:
            a = torch.cat([a, torch.zeros(pad, a.shape[1], dtype=a.dtype, device=a.device)])
        y = torch._scaled_mm(a, w.t(), scale_a=scale.reshape(()),
                             scale_b=entry.weight_scale.to(x2.device, torch.float32).reshape(()),
                             out_dtype=torch.bfloat16, use_fast_accum=self.fast_accum)
        return y[:m].float()


@contextlib.contextmanager
def _patched(model: torch.nn.Module, emulator: _Emulator):
    """Give every emulated Linear and fused-experts module its emulated forward."""
    patched = []
    try:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                entry = emulator.table.get(module.weight.data_ptr())
                if entry is not None:
                    module.forward = emulator.linear_forward(module, entry)
                    patched.append(module)
            elif is_fused_experts(module) and module.gate_up_proj[0].data_ptr() in emulator.table:
                module.forward = experts_forward(module, emulator)
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def _serve_weights(group: str, members: list[tuple[str, torch.Tensor]],
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
    if codec in ("nvfp4", "w4a16-nvfp4"):
        amax = torch.stack([w.abs().amax().float() for w in weights]).max()
        shared = torch.where(amax > 0, amax / (6.0 * 448.0), torch.ones_like(amax))
        return [encode(w, codec, global_scale=shared) for w in weights]
    if codec in _WEIGHT_BLOCKS:
        n = _WEIGHT_BLOCKS[codec]
        return [encode(F.pad(w, (0, -w.shape[1] % n, 0, -w.shape[0] % n)), codec)
                for w in weights]
    return [encode(w, codec) for w in weights]


_TABLES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _fingerprint(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter is replaced or written in place."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _build_table(model: torch.nn.Module, spec: NumericsSpec,
                 native_fp8: bool = False) -> dict[int, _Linear]:
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
                  native_fp8: bool = False) -> dict[int, _Linear]:
    table: dict[int, _Linear] = {}
    fp8_acc = spec.activation_codec == "fp8-act" and spec.accumulation != "fp32"
    for group, members in quantizable_weights(model).items():
        act_key = _act_group(group)
        if spec.weight_codec is None:
            for _, w in members:
                table[w.data_ptr()] = _Linear(weight=w.detach().float(), act_key=act_key)
            continue
        served = _serve_weights(group, members, spec.weight_codec)
        if fp8_acc and spec.weight_codec == "fp8":
            # one [K, ΣN] operand per fusion group, E4M3 values exactly in bfloat16
            elems = torch.cat([q.codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
                               for q in served])
            slices = KSlices.of(elems.t(), resolve(spec.accumulation).mma_k)
            bounds = torch.tensor([0] + [q.codes.shape[0] for q in served]).cumsum(0).tolist()
        for i, ((_, w), q) in enumerate(zip(members, served)):
            entry = _Linear(weight=decode(q)[:w.shape[0], :w.shape[1]], act_key=act_key)
            if fp8_acc and spec.weight_codec == "fp8":
                entry.group_slices, entry.cols = slices, (bounds[i], bounds[i + 1])
                entry.weight_scale = q.scales
            if native_fp8 and spec.weight_codec == "fp8":
                entry.weight_fp8 = q.codes.view(torch.float8_e4m3fn)
                entry.weight_scale = q.scales
            table[w.data_ptr()] = entry
    return table


# ------------------------------------------------------------------------------------ attention

_ACTIVE: list[tuple[KernelFamily | None, bool]] = []


def _emulated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        **kwargs):
    family, kv_fp8 = _ACTIVE[-1] if _ACTIVE else (None, False)
    if kv_fp8:
        key, value = quantize_kv(key), quantize_kv(value)
    tq, tk = query.shape[2], key.shape[2]
    if attention_mask is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        allowed = allowed[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask == 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if family is None:
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
    else:  # grouped-query attention without copying K/V per query head
        out = tiled_attention(query, key, value, allowed, scale, family)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _emulated_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


@contextlib.contextmanager
def eager_experts(model: torch.nn.Module):
    """Run fused MoE experts through transformers' eager per-expert loop rather than a grouped
    GEMM. Qwen3-MoE-layout experts get the emulator's own forward anyway (moe.py); this keeps
    any other layout on one and the same expert kernel on every side of a comparison."""
    config = model.config
    previous = getattr(config, "_experts_implementation", None)
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = previous


@contextlib.contextmanager
def _attention(model: torch.nn.Module, family: KernelFamily | None, kv_fp8: bool):
    _register_attention()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPL
    _ACTIVE.append((family, kv_fp8))
    try:
        with eager_experts(model):
            yield
    finally:
        _ACTIVE.pop()
        config._attn_implementation = previous


# ------------------------------------------------------------------------------------ public


@contextlib.contextmanager
def fp8_kv_cache(model: torch.nn.Module):
    """Only the KV cache in FP8 (per-tensor, scale 1.0, as engines default), attention by torch
    SDPA and the model's own GEMMs: a measured BF16/FP16 sampler with an FP8 KV cache."""
    with _attention(model, None, True):
        yield


@torch.no_grad()
def calibrate(model: torch.nn.Module, spec: NumericsSpec, batches) -> dict[str, torch.Tensor]:
    """Static activation scales for `spec.activation_codec`: run `batches` (an iterable of
    (input_ids, attention_mask)) through the model as it is, record each linear input's amax,
    and divide by the codec's range. Returns {activation group: float32 scale}."""
    if spec.activation_codec is None:
        return {}
    amax: dict[str, torch.Tensor] = {}
    emulator = _Emulator(_build_table(model, spec), spec, {}, amax)
    with eager_experts(model), _patched(model, emulator):
        for input_ids, attention_mask in batches:
            model(input_ids=input_ids, attention_mask=attention_mask)
    divisor = _ACT_SCALE_DIVISOR.get(spec.activation_codec, 1.0)
    return {k: torch.where(v > 0, v / divisor, torch.ones_like(v)) for k, v in amax.items()}


@contextlib.contextmanager
def apply_numerics(model: torch.nn.Module, spec: NumericsSpec, act_scales=None, *,
                   kernels: bool = True, native_fp8: bool = False):
    """Run `model` with `spec`'s numerics inside the block. kernels=False keeps the reference
    attention (torch SDPA) and emulates formats only (the "precision" configuration). MoE routers
    compute their logits in `spec.router_dtype` (routing.py). native_fp8 (measured mode, a CUDA
    model on a GPU with FP8 tensor cores, an FP8 W8A8 spec): the GEMMs are torch._scaled_mm's."""
    if spec.activation_codec is not None and not act_scales:
        raise ValueError(f"{spec.label}: activation quantization needs calibrated scales; "
                         f"call calibrate() first")
    if native_fp8:
        if spec.activation_codec != "fp8-act" or spec.weight_codec != "fp8":
            raise ValueError(f"{spec.label}: native FP8 GEMMs need an FP8 W8A8 spec")
        device = next(model.parameters()).device
        scales = {k: v.to(device) for k, v in (act_scales or {}).items()}
        emulator: _Emulator = _NativeFP8(_build_table(model, spec, True), spec, scales, None,
                                         fast_accum=spec.accumulation != "fp32")
    else:
        emulator = _Emulator(_build_table(model, spec), spec, act_scales or {}, None)
    family = KERNEL_FAMILIES.get(spec.attention) if kernels else None
    with _attention(model, family, spec.kv_codec is not None), _patched(model, emulator), \
            router_numerics(model, spec.router_dtype):
        yield
