"""The sampler GPUs as a throughput model needs them, and what an hour of each costs.

One `GpuHardware` row per GPU profile of mismatch.profiles (`a100, h100, h200, b200, b300,
rtx-pro-6000`): memory, memory bandwidth, and peak DENSE tensor-core throughput per compute
format, each figure with the public source it comes from. NVIDIA's datasheets quote the low
precisions "with sparsity" (2:4 structured sparsity doubles the rate); a decode step multiplies
dense weights, so every figure here is the dense one — the sparse figure halved where the sheet
gives only that, and the source string says so. Memory is in GB of 10^9 bytes as the vendor
prints it (an "80GB" H100 actually exposes about 85.9 × 10^9 bytes, so the batch limit this gives
is a little conservative).

    gpu           memory  bandwidth  dense TFLOPS bf16 / fp8 / fp4   product the figures are of
    a100          80 GB   2.039 TB/s   312 /    -  /     -           A100 80GB SXM4
    h100          80 GB   3.35 TB/s    989 / 1979  /     -           H100 SXM5
    h200          141 GB  4.8 TB/s     989 / 1979  /     -           H200 SXM
    b200          180 GB  8.0 TB/s    2250 / 4500  /  9000           B200 in HGX B200
    b300          288 GB  8.0 TB/s    2250 / 4500  / 13500           B300 in HGX B300
    rtx-pro-6000  96 GB   1.792 TB/s   504 / 1008  /  2015           RTX PRO 6000 Blackwell

FP16 runs at the BF16 rate on all six (FP32 accumulation on the RTX PRO 6000, the professional
part, unlike GeForce). Which format a GEMM actually runs in on a GPU (an A100 serves FP8 weights
through a BF16 Marlin kernel) is mismatch.profiles' business, not this table's.

Prices: Modal's published on-demand rates (https://modal.com/pricing), as published 2026-12, in
USD per GPU-hour. Modal bills serverless GPU time per second, so the rate is what a serverless
sampler group pays for each GPU-second it runs. B300 is not on Modal's list: its price is None,
and `default_price` asks for one rather than inventing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch.plan import PlanInputError
from mismatch.profiles import GPUS

__all__ = ["Sourced", "GpuHardware", "HARDWARE", "hardware", "GpuPrice", "PRICES",
           "PRICE_SOURCE", "PRICE_DATE", "default_price", "COMPUTE_FORMATS"]

COMPUTE_FORMATS = ("bf16", "fp16", "fp8", "fp4")
"""Tensor-core operand formats a GEMM can run in (NVFP4 and MXFP4 both run at the FP4 rate)."""


@dataclass(frozen=True)
class Sourced:
    """A figure and where it comes from."""

    value: float
    source: str


@dataclass(frozen=True, kw_only=True)
class GpuHardware:
    """One GPU's memory, bandwidth and dense peak per compute format."""

    name: str
    """GPU profile name (mismatch.profiles.GPUS)."""
    product: str
    """The exact product the figures are of (form factor and memory size matter)."""
    memory_gb: Sourced
    """Device memory, GB (10^9 bytes, as the vendor prints it)."""
    bandwidth_tbs: Sourced
    """Peak memory bandwidth, TB/s (10^12 bytes/s)."""
    dense_tflops: tuple[tuple[str, Sourced], ...]
    """(format, peak dense tensor TFLOPS) for "bf16", "fp8" and, on Blackwell, "fp4"."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb.value * 1e9

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_tbs.value * 1e12

    def tflops(self, fmt: str) -> float:
        """Peak dense TFLOPS of a GEMM in `fmt` ("bf16", "fp16", "fp8", "fp4"); FP16 runs at
        the BF16 rate. A format the GPU has no tensor cores for is a PlanInputError."""
        key = "bf16" if fmt == "fp16" else fmt
        for f, figure in self.dense_tflops:
            if f == key:
                return figure.value
        have = ", ".join(f for f, _ in self.dense_tflops)
        raise PlanInputError(f"{self.name} has no {fmt} tensor cores (it has: {have})")

    def flops_source(self, fmt: str) -> str:
        key = "bf16" if fmt == "fp16" else fmt
        return dict(self.dense_tflops)[key].source


_A100 = ("NVIDIA A100 Tensor Core GPU datasheet "
         "(nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), A100 80GB SXM column")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/), "
         "H100 SXM column")
_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h200/), "
         "H200 SXM column")
_HGX = "NVIDIA HGX platform specifications (https://www.nvidia.com/en-us/data-center/hgx/)"
_RTX = ("NVIDIA RTX PRO 6000 Blackwell Server Edition datasheet "
        "(https://www.nvidia.com/en-us/data-center/rtx-pro-6000-blackwell-server-edition/)")
_RTX_WP = "NVIDIA RTX Blackwell GPU architecture whitepaper, RTX PRO 6000 Blackwell column"
_SPARSE = "; the sheet quotes it with 2:4 sparsity ({sparse}), halved here for dense"


def _dense(sparse: float, source: str) -> Sourced:
    return Sourced(sparse / 2, source + _SPARSE.format(sparse=f"{sparse:g} TFLOPS"))


HARDWARE: dict[str, GpuHardware] = {}

for _h in (
    GpuHardware(
        name="a100", product="A100 80GB SXM4",
        memory_gb=Sourced(80, _A100 + ": 80GB HBM2e"),
        bandwidth_tbs=Sourced(2.039, _A100 + ": 2,039 GB/s"),
        dense_tflops=(("bf16", Sourced(312, _A100 + ": BF16 Tensor Core 312 TFLOPS dense "
                                               "(624 with sparsity); no FP8/FP4 tensor cores")),)),
    GpuHardware(
        name="h100", product="H100 SXM5 80GB",
        memory_gb=Sourced(80, _H100 + ": 80GB HBM3"),
        bandwidth_tbs=Sourced(3.35, _H100 + ": 3.35TB/s"),
        dense_tflops=(("bf16", _dense(1979, _H100 + ": BF16 Tensor Core")),
                      ("fp8", _dense(3958, _H100 + ": FP8 Tensor Core")))),
    GpuHardware(
        name="h200", product="H200 SXM 141GB",
        memory_gb=Sourced(141, _H200 + ": 141GB HBM3e"),
        bandwidth_tbs=Sourced(4.8, _H200 + ": 4.8TB/s"),
        dense_tflops=(("bf16", _dense(1979, _H200 + ": BF16 Tensor Core")),
                      ("fp8", _dense(3958, _H200 + ": FP8 Tensor Core")))),
    GpuHardware(
        name="b200", product="B200 (HGX B200, 8 GPUs)",
        memory_gb=Sourced(180, _HGX + ": HGX B200 total memory 1.4TB over 8 GPUs, i.e. "
                                  "180GB HBM3e each (as DGX B200's 1,440GB)"),
        bandwidth_tbs=Sourced(8.0, _HGX + ": HGX B200 64TB/s HBM3e over 8 GPUs, 8TB/s each"),
        dense_tflops=(("bf16", Sourced(2250, _HGX + ": HGX B200 FP16/BF16 36 PFLOPS with "
                                               "sparsity over 8 GPUs, halved for dense")),
                      ("fp8", Sourced(4500, _HGX + ": HGX B200 FP8 72 PFLOPS with sparsity "
                                              "over 8 GPUs, halved for dense")),
                      ("fp4", Sourced(9000, _HGX + ": HGX B200 FP4 72 PFLOPS dense "
                                              "(144 with sparsity) over 8 GPUs")))),
    GpuHardware(
        name="b300", product="B300 (HGX B300, 8 GPUs)",
        memory_gb=Sourced(288, _HGX + ": HGX B300 2.3TB over 8 GPUs, 288GB HBM3e each"),
        bandwidth_tbs=Sourced(8.0, _HGX + ": HGX B300 up to 8TB/s HBM3e per GPU (same stacks' "
                                       "speed as B200; assumption where a sheet gives only the "
                                       "node total)"),
        dense_tflops=(("bf16", Sourced(2250, _HGX + ": HGX B300 FP16/BF16 36 PFLOPS with "
                                               "sparsity over 8 GPUs, halved for dense")),
                      ("fp8", Sourced(4500, _HGX + ": HGX B300 FP8 72 PFLOPS with sparsity "
                                              "over 8 GPUs, halved for dense")),
                      ("fp4", Sourced(13500, _HGX + ": HGX B300 FP4 108 PFLOPS dense (144 with "
                                               "sparsity) over 8 GPUs; Blackwell Ultra raises "
                                               "dense FP4 only")))),
    GpuHardware(
        name="rtx-pro-6000", product="RTX PRO 6000 Blackwell Server Edition",
        memory_gb=Sourced(96, _RTX + ": 96GB GDDR7 with ECC"),
        bandwidth_tbs=Sourced(1.792, _RTX_WP + ": 512-bit GDDR7 at 28Gbps, 1,792 GB/s; "
                                     "assumed the same on the Server Edition board"),
        dense_tflops=(("bf16", _dense(1007.6, _RTX_WP + ": peak FP16/BF16 Tensor TFLOPS with "
                                             "FP32 accumulate")),
                      ("fp8", _dense(2015.2, _RTX_WP + ": peak FP8 Tensor TFLOPS with FP32 "
                                            "accumulate")),
                      ("fp4", _dense(4031, _RTX_WP + ": peak FP4 Tensor TFLOPS (the datasheet's "
                                        "'4 PFLOPS FP4 AI performance')")))),
):
    HARDWARE[_h.name] = _h


def _key(gpu: str, table: dict) -> str:
    key = str(gpu).lower().replace("_", "-")
    if key not in table:
        raise PlanInputError(f"unknown gpu {gpu!r}; known: {', '.join(table)}")
    return key


def hardware(gpu: str) -> GpuHardware:
    """The hardware row of `gpu` (a PlanInputError listing the known GPUs otherwise)."""
    return HARDWARE[_key(gpu, HARDWARE)]


PRICE_SOURCE = "https://modal.com/pricing"
PRICE_DATE = "2026-12"
"""The month Modal's list was read ("as published 2026-12"); prices change, so plans say which."""


@dataclass(frozen=True, kw_only=True)
class GpuPrice:
    """One GPU's on-demand price in the default table."""

    gpu: str
    per_hour: float | None
    """USD per GPU-hour; None where the source does not list the GPU."""
    listed_as: str
    """The product name on the source's list."""


PRICES: dict[str, GpuPrice] = {p.gpu: p for p in (
    GpuPrice(gpu="a100", per_hour=2.50, listed_as="A100 80 GB"),
    GpuPrice(gpu="h100", per_hour=3.95, listed_as="H100"),
    GpuPrice(gpu="h200", per_hour=4.54, listed_as="H200"),
    GpuPrice(gpu="b200", per_hour=6.25, listed_as="B200"),
    GpuPrice(gpu="b300", per_hour=None, listed_as="(not listed)"),
    GpuPrice(gpu="rtx-pro-6000", per_hour=3.03, listed_as="RTX PRO 6000"),
)}

assert set(HARDWARE) == set(GPUS) == set(PRICES), "hardware/price tables must cover every profile"


def default_price(gpu: str) -> float:
    """USD per GPU-hour of `gpu` in the default table (Modal, as published 2026-12).

    A GPU the table has no price for (b300) or an unknown GPU is a PlanInputError whose one-line
    message says what to do."""
    p = PRICES[_key(gpu, PRICES)]
    if p.per_hour is None:
        raise PlanInputError(f"{p.gpu} has no published price in the default table (Modal does "
                             f"not list it); give price_per_hour for the group")
    return p.per_hour
