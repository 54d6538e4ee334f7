"""Decode throughput of a model on one GPU × serving format: a roofline of one decode step.

`mismatch plan` needs, per sampler group, the sampled tokens per second one GPU delivers on the
run's model. An RL sampler spends almost all its time decoding (prompts are short next to the
rollouts, and prefill runs at compute speed), so the figure is decode throughput at the batch
the GPU's memory allows. One decode step at batch b (b sequences each emitting one token) costs

    bytes = weights touched · bytes per weight  +  b · context · KV bytes per token
            (+ 2 · b · recurrent-state bytes for linear-attention layers: read and written)
    flops = 2 · active params · b
    step  = max(bytes / (bandwidth · efficiency), flops / (peak(format) · compute_efficiency))

and the group's throughput is b / step at the b that maximises it (the largest b that fits,
unless compute saturates first: then the smallest b that reaches the compute roof). What each
term reads from the project's own tables:

- The format's numerics come from `mismatch.profiles.resolve(gpu, dtype, kv_cache)`: an A100
  serves an FP8 checkpoint through a Marlin W8A16 kernel, so its weights move 1 byte each but
  its GEMMs run at the BF16 peak; an H100 serves NVFP4 as W4A16 (FP4 bytes, BF16 math). A pair no
  kernel serves is a PlanInputError carrying the profile's message.
- Bytes per weight come from the weight codec (mismatch.quantize.codecs): the element's bits plus
  its block scales — NVFP4 0.5 + 1/16 (an E4M3 byte per 16 elements; the one FP32 per tensor is
  negligible), MXFP4 0.5 + 1/32 (an E8M0 byte per 32), FP8 per tensor 1, BF16/FP16 2. The
  embedding table and the LM head stay in the compute dtype (modelopt's and the official FP8
  checkpoints' default exclusions); the head is read whole every step, the embedding only in the
  b rows gathered.
- Mixture-of-experts layers: a step touches only the experts its b tokens route to. With each
  token choosing k of E experts, an expert escapes one token with probability 1 − k/E, so the
  expected number of distinct experts touched per layer is E · (1 − (1 − k/E)^b) (exact when
  tokens route independently and uniformly). Uniform routing is the worst case: for selection
  probabilities p_e with Σ p_e = k, Σ (1 − (1 − p_e)^b) is concave in p and peaks at p_e = k/E, so
  skewed real routing touches fewer experts and moves fewer bytes than this.
- FLOPs count 2 per active parameter (attention, linear attention, shared experts, routers, the
  top-k experts, the LM head, one embedding row). Attention's QK and PV products are left out:
  at decode they do a few FLOPs per KV byte read (the GQA group size), far below any GPU's ridge
  point, so the KV read they come with already bounds them.
- The batch is capped by memory: memory_utilization · memory (vLLM's default
  gpu_memory_utilization, 0.9) minus the resident weights (every expert), divided by one
  sequence's KV at `context` (plus its recurrent state), and by `max_batch` (256 by default:
  vLLM's max_num_seqs before its V1 engine).

Efficiencies. Decode kernels do not reach datasheet peaks: well-tuned decode sustains roughly
60–80% of peak memory bandwidth ("model bandwidth utilization", Databricks, LLM Inference
Performance Engineering: Best Practices, 2023), so `efficiency` defaults to 0.7; grouped MoE and
low-precision GEMMs at decode batch sizes reach about half of dense peak, so
`compute_efficiency` defaults to 0.5. Both are the model's free parameters, the same for every
GPU and format: the ratio between two memory-bound groups — what a plan's mix depends on — does
not depend on `efficiency` at all.

Replicas of more than one GPU. Rather than refuse a model one GPU cannot hold, the model is
served tensor-parallel: a replica of n GPUs (n in 1, 2, 4, 8) holds and reads 1/n of the weights
and KV on each GPU, so its step time is the single-GPU formula with n times the bandwidth and
peak, and tokens/s per GPU is the replica's tokens/s divided by n. The replica size chosen is
the one with the most tokens/s per GPU, the fewest GPUs on ties. At a given batch per replica
tokens/s per GPU does not depend on n here, so a larger replica wins only where memory limits
the batch (more GPUs hold more KV) or a latency bound is set (`max_step_ms`: more GPUs step
faster); `max_batch` counts sequences per replica, as an engine's max_num_seqs does. The
all-reduces are not charged (NVLink GPUs hide most of them at decode batch sizes; over PCIe,
RTX PRO 6000 replicas are optimistic). A model more than `max_gpus` (8) GPUs cannot hold is a
PlanInputError: give tokens_per_s for that group.

`context` is the mean KV length per sequence over its decode (a prompt of P tokens and a
response of R average P + R/2), 4096 by default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mismatch.plan import PlanInputError
from mismatch.plan.hardware import hardware
from mismatch.plan.model_shape import ModelShape, distinct_experts
from mismatch.profiles import NumericsSpec, ProfileError, resolve
from mismatch.quantize.codecs import get_codec
from mismatch.quantize.precisions import PRECISIONS

__all__ = ["ModelShape", "Estimate", "decode_throughput", "distinct_experts",
           "weight_bytes_per_element", "kv_bytes_per_element", "compute_format",
           "DEFAULT_CONTEXT", "BANDWIDTH_EFFICIENCY", "COMPUTE_EFFICIENCY", "MEMORY_UTILIZATION",
           "MAX_BATCH", "TP_SIZES"]

DEFAULT_CONTEXT = 4096
BANDWIDTH_EFFICIENCY = 0.7
COMPUTE_EFFICIENCY = 0.5
MEMORY_UTILIZATION = 0.9
MAX_BATCH = 256
TP_SIZES = (1, 2, 4, 8)
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def weight_bytes_per_element(spec: NumericsSpec) -> float:
    """Bytes one weight occupies in `spec`'s serving format, block scales included."""
    return _codec_bytes(spec.weight_codec, spec.compute_dtype)


def kv_bytes_per_element(spec: NumericsSpec) -> float:
    """Bytes one KV-cache element occupies (FP8: 1; otherwise the compute dtype)."""
    return _codec_bytes(spec.kv_codec, spec.compute_dtype)


def _codec_bytes(codec: str | None, compute_dtype: str) -> float:
    if codec is None:
        return float(_DTYPE_BYTES[compute_dtype])
    c = get_codec(codec)
    if c.scheme == "cast":
        assert c.cast_dtype is not None
        return torch.finfo(c.cast_dtype).bits / 8
    assert c.element is not None
    element = c.element.bits / 8
    if c.scheme in ("nvfp4", "mx"):
        return element + 1 / c.block  # one 8-bit scale (E4M3 / E8M0) per block
    if c.granularity == "block":
        return element + 4 / (c.block * c.block_rows)  # one FP32 scale per block
    return element  # per tensor (or per row: one FP32 per K elements, negligible)


def compute_format(spec: NumericsSpec) -> str:
    """The tensor-core format `spec`'s GEMMs run in: the low format for W*A* kernels, else the
    compute dtype (weight-only kernels dequantize to it)."""
    if spec.activation_codec is None:
        return spec.compute_dtype
    tc = PRECISIONS[spec.dtype].tensor_cores
    return {"nvfp4": "fp4", "mxfp4": "fp4"}.get(str(tc), str(tc))


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The roofline's answer for one group."""

    gpu: str
    dtype: str
    kv_cache: str
    kernel_path: str
    tokens_per_s: float
    """Sampled tokens per second per GPU."""
    batch: int
    """Sequences decoding together in one replica."""
    gpus: int
    """GPUs per replica (tensor parallel; 1 when the model fits one GPU)."""
    bound: str
    """"memory" or "compute": which roof sets the step time."""
    step_ms: float
    weight_bytes: float
    """Weight bytes one step reads (the whole replica)."""
    kv_bytes: float
    """KV-cache (and recurrent-state) bytes one step reads and writes."""
    flops: float
    """FLOPs of one step."""
    resident_weight_bytes: float
    memory_batch: int
    """Sequences the replica's memory holds at `context`."""
    batch_limit: str
    """What stops a larger batch: "memory", "max_batch", "compute" (the compute roof is
    reached), "latency" (max_step_ms) or "given" (a fixed batch)."""
    weight_bytes_per_element: float
    kv_bytes_per_element: float
    compute_format: str
    peak_tflops: float
    """Dense peak of `compute_format` per GPU."""
    bandwidth_tbs: float
    context: int
    efficiency: float
    compute_efficiency: float

    def to_json(self) -> dict:
        return asdict(self)


def _check(name: str, value: Any, lo: float, hi: float | None = None, integer: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and value > lo and (hi is None or value <= hi) and (not integer or
                                                                 float(value).is_integer())
    if not ok:
        rng = f"in ({lo:g}, {hi:g}]" if hi is not None else f"> {lo:g}"
        raise PlanInputError(f"{name} must be {'an integer ' if integer else ''}{rng}, got "
                             f"{value!r}")


def decode_throughput(shape: ModelShape, gpu: str, dtype: str, kv_cache: str | None = None, *,
                      context: int = DEFAULT_CONTEXT, efficiency: float = BANDWIDTH_EFFICIENCY,
                      compute_efficiency: float = COMPUTE_EFFICIENCY,
                      memory_utilization: float = MEMORY_UTILIZATION, max_batch: int = MAX_BATCH,
                      batch: int | None = None, max_step_ms: float | None = None,
                      gpus: int | None = None, max_gpus: int = TP_SIZES[-1]) -> Estimate:
    """Decode tokens/s per GPU of `shape` on `gpu` serving `dtype` with a `kv_cache` KV cache.

    The roofline of the module docstring at the best batch (the largest that fits memory and
    `max_batch`, or the smallest that reaches the compute roof) and the best replica size.
    `batch` fixes the batch per replica; `gpus` fixes the replica size; `max_step_ms` keeps only
    batches whose step takes at most that long (a per-sequence rate of 1000 / max_step_ms
    tokens/s, the "interactivity" serving benchmarks hold fixed). Bad GPU/format names, pairs
    no kernel serves, bad numbers and models more than `max_gpus` GPUs cannot hold are
    PlanInputErrors with one-line messages."""
    if not isinstance(shape, ModelShape):
        raise PlanInputError(f"shape must be a ModelShape, got {type(shape).__name__}")
    try:
        spec = resolve(gpu, dtype, kv_cache)
    except ProfileError as exc:
        raise PlanInputError(str(exc)) from None
    _check("context", context, 0, integer=True)
    _check("efficiency", efficiency, 0, 1)
    _check("compute_efficiency", compute_efficiency, 0, 1)
    _check("memory_utilization", memory_utilization, 0, 1)
    _check("max_batch", max_batch, 0, integer=True)
    _check("max_gpus", max_gpus, 0, integer=True)
    if batch is not None:
        _check("batch", batch, 0, integer=True)
    if max_step_ms is not None:
        _check("max_step_ms", max_step_ms, 0)
    if gpus is not None:
        _check("gpus", gpus, 0, integer=True)
    context, max_batch = int(context), int(max_batch)
    hw = hardware(spec.gpu)
    per_weight = weight_bytes_per_element(spec)
    per_kv = kv_bytes_per_element(spec)
    head = float(_DTYPE_BYTES[spec.compute_dtype])
    fmt = compute_format(spec)
    peak = hw.tflops(fmt) * 1e12
    resident = shape.resident_weight_bytes(per_weight, head)
    kv_seq = context * shape.kv_elements_per_token * per_kv
    per_seq = kv_seq + shape.state_bytes
    need = 1 if batch is None else int(batch)

    sizes = [t for t in TP_SIZES if t <= max_gpus] if gpus is None else [int(gpus)]
    active = shape.active_params

    def step(b: int, n: int) -> tuple[float, float, float, float, float]:
        wbytes = shape.step_weight_bytes(b, per_weight, head)
        kvbytes = b * kv_seq + 2 * b * shape.state_bytes
        flops = 2.0 * active * b
        t_mem = (wbytes + kvbytes) / (n * hw.bandwidth_bytes_per_s * efficiency)
        t_comp = flops / (n * peak * compute_efficiency)
        return max(t_mem, t_comp), t_mem, wbytes, kvbytes, flops

    best: tuple | None = None
    slowest = math.inf
    for n in sizes:
        fits = int((n * hw.memory_bytes * memory_utilization - resident) // per_seq)
        if fits < need:
            continue
        top = min(fits, max_batch) if batch is None else need
        rows = []
        for b in (range(need, need + 1) if batch is not None else range(1, top + 1)):
            t, t_mem, wbytes, kvbytes, flops = step(b, n)
            slowest = min(slowest, t)
            if max_step_ms is not None and t * 1e3 > max_step_ms:
                continue
            rows.append((b / t / n, b, t, t_mem, wbytes, kvbytes, flops))
        if not rows:
            continue
        peak_rate = max(r[0] for r in rows)
        row = next(r for r in rows if r[0] >= peak_rate * (1 - 1e-9))
        if best is None or row[0] > best[0][0] * (1 + 1e-9):
            best = (row, n, fits, top)
    if best is None:
        if slowest < math.inf:
            raise PlanInputError(
                f"no batch of {shape.name} on {spec.gpu} {spec.dtype} steps within "
                f"max_step_ms={max_step_ms:g} (the fastest step takes {slowest * 1e3:.3g} ms)")
        raise PlanInputError(
            f"{shape.name} in {spec.dtype} ({resident / 1e9:.0f} GB of weights) does not fit "
            f"{max(sizes)} x {spec.gpu} ({hw.memory_gb.value:g} GB each) with {need} "
            f"sequence(s) of {context} tokens; give tokens_per_s for this group")
    (rate, b, t, t_mem, wbytes, kvbytes, flops), n, fits, top = best
    if batch is not None:
        limit = "given"
    elif max_step_ms is not None and b < top and step(b + 1, n)[0] * 1e3 > max_step_ms:
        limit = "latency"
    elif b < top:
        limit = "compute"
    else:
        limit = "memory" if fits <= max_batch else "max_batch"
    return Estimate(
        gpu=spec.gpu, dtype=spec.dtype, kv_cache=spec.kv_cache, kernel_path=spec.kernel_path,
        tokens_per_s=rate, batch=b, gpus=n,
        bound="compute" if t > t_mem else "memory", step_ms=t * 1e3, weight_bytes=wbytes,
        kv_bytes=kvbytes, flops=flops, resident_weight_bytes=resident, memory_batch=fits,
        batch_limit=limit, weight_bytes_per_element=per_weight, kv_bytes_per_element=per_kv,
        compute_format=fmt, peak_tflops=peak / 1e12, bandwidth_tbs=hw.bandwidth_tbs.value,
        context=context, efficiency=float(efficiency), compute_efficiency=float(compute_efficiency))
