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
  lm_head stay in the compute dtype, as modelopt excludes them (the head in FP32 where
  `spec.lm_head` says so: head.py).
- attention runs through `attention.tiled_attention` with the spec's kernel family (or torch
  SDPA for the reference), with the KV cache stored in FP8 when `spec.kv_codec` says so.

Each decoder `nn.Linear` and each fused-experts module gets an instance-level `forward` for the
duration of the block (the class's forward is back in `finally`); nothing else in the model is
touched or slowed down. Fused experts quantize their activations once per GEMM stage for all
experts, as fused-MoE kernels do (moe.py). The served weights come from served_weights.py, the
attention hook from hf_attention.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mismatch.quantize import encode, get_codec
from mismatch.quantize.accumulate import KSlices, resolve
from mismatch.quantize.formats import E4M3_MAX, div_scalar

from ..kernels import accumulate_gemm, fake_quant
from ..kernels.gemm import accumulate_gemm_grouped
from ..kernels.bf16_gemm import bf16_module_gemms
from ..profiles import NumericsSpec
from .attention import KERNEL_FAMILIES
from .head import head_numerics
from .hf_attention import eager_experts, emulated_attention
from .moe import experts_forward, is_fused_experts
from .routing import router_numerics
from .served_weights import ServedLinear, build_table

__all__ = ["apply_numerics", "calibrate"]


class _Emulator:
    """The GEMMs of one NumericsSpec (or, with `amax` given, a calibration recorder)."""

    def __init__(self, table: dict[int, ServedLinear], spec: NumericsSpec,
                 act_scales: dict[str, torch.Tensor], amax: dict[str, torch.Tensor] | None):
        self.table, self.spec, self.act_scales, self.amax = table, spec, act_scales, amax
        self._last: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}
        # the last fused FP8 GEMM per activation group: (source, its _version, group slices,
        # unscaled output [M, ΣN]); q, k and v (gate and up) read their columns of one GEMM
        self._last_gemm: dict[str, tuple[torch.Tensor, int, KSlices, torch.Tensor]] = {}
        self._acc = resolve(spec.accumulation)

    def quantized_input(self, x2: torch.Tensor, entry: ServedLinear,
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
        group = get_codec(codec)
        if group.granularity == "group":  # dynamic per-group scales; K padded to whole groups
            # zeros change no group's amax: real block-scaled kernels need K % 128 == 0, so on a
            # small model one group covers the whole row
            k = x2.shape[-1]
            xq = fake_quant(F.pad(x2.float(), (0, -k % group.block)), codec,
                            validate=False)[:, :k]
        else:
            xq = fake_quant(x2.float(), codec, global_scale=self.act_scales[entry.act_key],
                            validate=False)
        self._last[entry.act_key] = (source, source._version, xq)
        return xq

    def _elements(self, x2: torch.Tensor, entry: ServedLinear) -> torch.Tensor:
        """[N, K] activations → [N, K] float8_e4m3fn: the codes of the static per-tensor FP8
        quantization (encode's own), viewed as E4M3 (exact, no decoding pass)."""
        q = encode(x2, self.spec.activation_codec,
                   global_scale=self.act_scales[entry.act_key], validate=False)
        return q.codes.view(torch.float8_e4m3fn)

    def _fp8_gemm(self, x2: torch.Tensor, entry: ServedLinear, elems: torch.Tensor | None,
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

    def gemm(self, x2: torch.Tensor, entry: ServedLinear, xq: torch.Tensor | None = None,
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

    def expert_gemms(self, entries: list[ServedLinear], xs: list[torch.Tensor] | None,
                     xqs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """A fused MoE stage's GEMMs, one per expert hit: `gemm(xs[i], entries[i], xqs[i])`
        each (xs None where xqs is given: `gemm` given the quantized input reads only that).
        FP8 under an accumulation model on CPU runs them as one grouped accumulation-model GEMM
        (kernels.accumulate_gemm_grouped: the same bits, one call instead of one per expert)."""
        if xqs is None or len(entries) < 2 or self.amax is not None or \
                xqs[0].device.type != "cpu" or not all(
                    e.group_slices is not None and e.cols == (0, e.group_slices.values.shape[2])
                    for e in entries):
            return [self.gemm(x, e, None if xqs is None else q)
                    for x, e, q in zip(xs if xs is not None else xqs, entries,
                                       xqs or [None] * len(xs))]
        scales = [self.act_scales[e.act_key].float() * e.weight_scale for e in entries]
        return accumulate_gemm_grouped(xqs, [e.group_slices for e in entries], self._acc, scales)

    def batched(self) -> bool:
        """Whether activations can be quantized once per MoE stage: always here (static
        per-tensor scales and per-row groups quantize each row alone, so the rows of the whole
        stage give each expert the values of its own rows, E4M3 elements included)."""
        return True

    def linear_forward(self, module: torch.nn.Linear, entry: ServedLinear):
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
        a = (x2.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
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


def _check_scales(spec: NumericsSpec, act_scales) -> None:
    if spec.activation_codec is not None and not act_scales:
        raise ValueError(f"{spec.label}: activation quantization needs calibrated scales; "
                         f"call calibrate() first")


# ------------------------------------------------------------------------------------ public


@torch.no_grad()
def calibrate(model: torch.nn.Module, spec: NumericsSpec, batches) -> dict[str, torch.Tensor]:
    """Static activation scales for `spec.activation_codec`: run `batches` (an iterable of
    (input_ids, attention_mask)) through the model as it is, record each linear input's amax,
    and divide by the codec's range. Returns {activation group: float32 scale}."""
    if spec.activation_codec is None:
        return {}
    amax: dict[str, torch.Tensor] = {}
    emulator = _Emulator(build_table(model, spec), spec, {}, amax)
    with eager_experts(model), _patched(model, emulator), bf16_module_gemms(model):
        for input_ids, attention_mask in batches:
            model(input_ids=input_ids, attention_mask=attention_mask)
    # a per-tensor scale maps amax to the codec's range; block-scaled codecs ignore it
    divisor = get_codec(spec.activation_codec).scale_divisor or 1.0
    return {k: torch.where(v > 0, div_scalar(v, divisor), torch.ones_like(v))
            for k, v in amax.items()}


@contextlib.contextmanager
def apply_numerics(model: torch.nn.Module, spec: NumericsSpec, act_scales=None, *,
                   kernels: bool = True, native_fp8: bool = False):
    """Run `model` with `spec`'s numerics inside the block. kernels=False keeps the reference
    attention (torch SDPA) and emulates formats only (the "precision" configuration). MoE routers
    compute their logits in `spec.router_dtype` (routing.py). native_fp8 (measured mode, a CUDA
    model on a GPU with FP8 tensor cores, an FP8 W8A8 spec): the GEMMs are torch._scaled_mm's."""
    _check_scales(spec, act_scales)
    if native_fp8:
        if spec.activation_codec != "fp8-act" or spec.weight_codec != "fp8":
            raise ValueError(f"{spec.label}: native FP8 GEMMs need an FP8 W8A8 spec")
        device = next(model.parameters()).device
        scales = {k: v.to(device) for k, v in (act_scales or {}).items()}
        emulator: _Emulator = _NativeFP8(build_table(model, spec, True), spec, scales, None,
                                         fast_accum=spec.accumulation != "fp32")
    else:
        emulator = _Emulator(build_table(model, spec), spec, act_scales or {}, None)
    family = KERNEL_FAMILIES.get(spec.attention) if kernels else None
    with emulated_attention(model, family, spec.kv_codec is not None), _patched(model, emulator), \
            router_numerics(model, spec.router_dtype), head_numerics(model, spec.lm_head):
        yield
