"""Native CPU kernels: C files compiled once per machine and called through ctypes.

Where the torch twin of a kernel is a chain of small tensor operations, each paying torch's
fixed cost per call, a decode step of a small model is made of those fixed costs. The C
functions here compute the same values in one pass, bit for bit (tests/test_native_kernels.py
compares them with the torch code on every input they test, NaN included):

- `accumulate_grouped`: `quantize.accumulate.accumulate_matmul` (and its batched form) for
  E4M3 activations against E4M3 weights, several GEMMs of one shape in one call with no padded
  rows, each output optionally scaled: what the emulated Hopper FP8 sampler's linear layers and
  fused-MoE stages compute.
- `fake_nvfp4_act`: NVFP4 activation fake-quant in the serving kernels' order
  (`quantize.schemes._fake_nvfp4_act`, FP32 throughout): what the emulated Blackwell NVFP4
  sampler does to every linear layer's input.
- `ranked_topk`: `engines.logits.ranked_topk` (the k best of each row by value, then id),
  what the rollout engine records as every sampled position's candidates.

The build. The C files are compiled with the system's C compiler (`$CC`, else `cc`) at `-O3
-march=native`, each with its own FP contraction setting (`_SOURCES`: on only where fusing a
multiply-add into an FMA is exact), and linked into one library in
`$XDG_CACHE_HOME/mismatch/native/` (`~/.cache` by default) under a name that hashes the sources,
the compiler's version, the flags and the CPU's model and feature flags — a library built for one
CPU is never loaded on another. The library is written to a temporary name and renamed, so
processes building at once never see half a file; the build directory a killed build leaves
behind is removed by the next build (after ten minutes: a younger one may be another process's
build in progress). The first build takes about a second; every later process loads it.

`MISMATCH_NATIVE_MARCH=x86-64-v3` builds for another instruction set than this CPU's (here:
what an AVX2-only CPU builds; the benchmarks' AVX2 stand-in uses it).

The choice, once per process: `MISMATCH_NATIVE=auto` (the default) uses the native kernels when
the library builds and falls back to the torch code, with one warning, when it does not (no
compiler); `off` always runs the torch code; `on` raises a one-line error when the library
cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from mismatch.io import user_cache_dir

from .runtime import KernelError

__all__ = ["NATIVE_ENV", "NATIVE_MODES", "MARCH_ENV", "native_mode", "library", "available",
           "accumulate_grouped", "fake_nvfp4_act", "ranked_topk"]

NATIVE_ENV = "MISMATCH_NATIVE"
NATIVE_MODES = ("auto", "off", "on")
_HERE = Path(__file__).parent
# each C file and its FP contraction: on only where every product and sum it contracts is exact
_SOURCES = {"native_gemm.c": "-ffp-contract=fast", "native_quant.c": "-ffp-contract=off",
            "native_select.c": "-ffp-contract=off"}
_FLAGS = ("-O3", "-fPIC", "-std=gnu11")
_STALE_SECONDS = 600  # a build directory this old was left by a killed build, not a running one
MARCH_ENV = "MISMATCH_NATIVE_MARCH"
"""The instruction set to build for (gcc's -march; default `native`): `x86-64-v3` builds what an
AVX2-only CPU builds, which is how the benchmarks measure that case on an AVX-512 machine."""


def _march() -> str:
    return "-march=" + (os.environ.get(MARCH_ENV, "").strip() or "native")


def native_mode() -> str:
    """MISMATCH_NATIVE's value (auto | off | on); a one-line error for anything else."""
    mode = os.environ.get(NATIVE_ENV, "auto").strip().lower() or "auto"
    if mode not in NATIVE_MODES:
        raise KernelError(f"{NATIVE_ENV}={mode!r}: use one of {', '.join(NATIVE_MODES)}")
    return mode


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str, march: str) -> Path:
    """Compile the C files for this CPU (or find the library built before) → its path. `march`
    names another instruction set (the tests build the AVX2 variant on an AVX-512 machine)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    flags = (*_FLAGS, march)
    parts = [version, " ".join(flags), _cpu_identity()]
    for name, contract in sorted(_SOURCES.items()):
        parts += [name, contract, (_HERE / name).read_text()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    out = user_cache_dir("native") / f"mismatch_native_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(out.stem + ".*"):  # a build killed before its cleanup
        if stale.is_dir() and time.time() - stale.stat().st_mtime > _STALE_SECONDS:
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=out.stem + ".", dir=out.parent) as tmp:
        objects = []
        for name, contract in sorted(_SOURCES.items()):
            objects.append(str(Path(tmp) / (name + ".o")))
            _run([compiler, *flags, contract, "-c", "-o", objects[-1], str(_HERE / name)],
                 compiler)
        lib = str(Path(tmp) / out.name)
        _run([compiler, "-shared", "-o", lib, *objects, "-lm"], compiler)
        os.replace(lib, out)  # whole or not at all
    return out


def _run(cmd: list[str], compiler: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise KernelError(f"{compiler} failed to build the native kernels: {tail[0]}")


def _load(march: str | None = None) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelError("no C compiler found for the native kernels: install gcc (or set "
                          f"CC), or set {NATIVE_ENV}=off")
    try:
        lib = ctypes.CDLL(str(_build(compiler, march or _march())))
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelError(f"the native kernels could not be built or loaded ({err}); set "
                          f"{NATIVE_ENV}=off to run the torch code") from err
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.mismatch_native_init.restype = None
    lib.mismatch_native_init.argtypes = []
    lib.mismatch_native_vector_width.restype = ctypes.c_int
    lib.mismatch_native_vector_width.argtypes = []
    lib.mismatch_accumulate_grouped.restype = ctypes.c_int
    lib.mismatch_accumulate_grouped.argtypes = [i64, p, p, i64, p, i64, i64, i64, i64,
                                                ctypes.c_int, ctypes.c_uint64, i64, p, p]
    lib.mismatch_fake_nvfp4_act.restype = None
    lib.mismatch_fake_nvfp4_act.argtypes = [p, p, i64, ctypes.c_float]
    lib.mismatch_ranked_topk.restype = ctypes.c_int
    lib.mismatch_ranked_topk.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.mismatch_native_init()
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it is off or (in auto mode) cannot be built."""
    mode = native_mode()
    if mode == "off":
        return None
    try:
        return _load()
    except KernelError as err:
        if mode == "on":
            raise
        warnings.warn(f"{err}; running the torch code instead", RuntimeWarning, stacklevel=2)
        return None


def available() -> bool:
    """Whether the native kernels run in this process."""
    return library() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise KernelError(f"the native kernels are not available ({NATIVE_ENV}=off, or no C "
                          "compiler)")
    return lib


def fake_nvfp4_act(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 on the CPU, K a multiple of 16 → its NVFP4-activation fake-quant
    values (float32, x's shape) with the FP32 per-tensor `input_scale` (one element)."""
    lib = _lib()
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.ndim == 0 or x.shape[-1] % 16:
        raise KernelError(f"fake_nvfp4_act takes float32 CPU tensors whose last dimension is a "
                          f"multiple of 16, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if input_scale.numel() != 1:
        raise KernelError(f"fake_nvfp4_act takes one input scale, got shape "
                          f"{tuple(input_scale.shape)}")
    src = x.contiguous()
    out = torch.empty_like(src)
    if src.numel():
        lib.mismatch_fake_nvfp4_act(src.data_ptr(), out.data_ptr(), src.numel() // 16,
                                    float(input_scale.float().reshape(())))
    return out


def ranked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] float32 on the CPU → the k best (values [B, k], ids [B, k] int64) of each row,
    ranked by value descending, then id ascending, NaN first: `engines.logits.ranked_topk`."""
    lib = _lib()
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.ndim != 2 \
            or not 0 < x.shape[1] < 2**32:
        raise KernelError(f"ranked_topk takes a float32 CPU matrix with 1 to 2^32 - 1 columns, "
                          f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    k = min(int(k), x.shape[1])
    if k < 1:
        raise KernelError(f"ranked_topk: k must be at least 1, got {k}")
    src = x if x.stride(1) == 1 else x.contiguous()
    vals = torch.empty(src.shape[0], k, dtype=torch.float32)
    ids = torch.empty(src.shape[0], k, dtype=torch.int64)
    if lib.mismatch_ranked_topk(src.data_ptr(), src.shape[0], src.shape[1], src.stride(0), k,
                                vals.data_ptr(), ids.data_ptr()):
        raise MemoryError("ranked_topk: the native kernel could not allocate its buffer")
    return vals, ids


def accumulate_grouped(a: torch.Tensor, rows: list[int], bs: list[torch.Tensor],
                       acc_mbits: int | None, promote_slices: int, mk: int, k: int,
                       scales: torch.Tensor | None = None) -> torch.Tensor:
    """len(bs) accumulation-model GEMMs in one call: a [R, K] E4M3 elements (float8_e4m3fn or
    their uint8 codes), the first rows[0] rows against bs[0], the next rows[1] against bs[1]…;
    each b a bfloat16 matrix of E4M3 values with at least K rows and N columns, unit column
    stride. The register keeps `acc_mbits` explicit mantissa bits (None: FP32), promoted into the
    FP32 total every `promote_slices` slices of `mk` (0: never). scales: FP32 [G] multiplying
    group g's results (one rounding) → [R, N] float32."""
    lib = _lib()
    if a.ndim != 2 or a.shape[1] != k or len(rows) != len(bs) or sum(rows) != a.shape[0]:
        raise KernelError(f"accumulate_grouped: a {tuple(a.shape)} does not split into rows "
                          f"{rows} of K={k}")
    n = bs[0].shape[1]
    ldb = bs[0].stride(0)
    for b in bs:
        if b.dtype != torch.bfloat16 or b.device.type != "cpu" or b.shape[0] < k or \
                b.shape[1] != n or b.stride(1) != 1 or b.stride(0) != ldb:
            raise KernelError("accumulate_grouped: every b must be a CPU bfloat16 [>=K, N] "
                              "matrix with unit column stride and one row stride")
    codes = a.contiguous()
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8 or codes.device.type != "cpu":
        raise KernelError(f"accumulate_grouped: a must hold E4M3 elements on the CPU, got "
                          f"{a.dtype} on {a.device}")
    if scales is not None:
        scales = scales.to(torch.float32).contiguous()
        if scales.numel() != len(bs):
            raise KernelError(f"accumulate_grouped: {scales.numel()} scales for {len(bs)} groups")
    out = torch.empty(codes.shape[0], n, dtype=torch.float32)
    if out.numel() == 0:
        return out
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    row_off = (ctypes.c_int64 * len(offsets))(*offsets)
    addr = (ctypes.c_int64 * len(bs))(*(b.data_ptr() for b in bs))
    # mode 0: an FP32 register; 1: the float64 register's bits ANDed with `keep`
    mode, keep = (0, 0) if acc_mbits is None else (1, ~((1 << (52 - acc_mbits)) - 1) % 2**64)
    rc = lib.mismatch_accumulate_grouped(len(bs), row_off, codes.data_ptr(), codes.stride(0),
                                         addr, ldb, k, n, mk, mode, keep, promote_slices,
                                         out.data_ptr(),
                                         None if scales is None else scales.data_ptr())
    if rc:
        raise MemoryError("accumulate_grouped: the native kernel could not allocate its buffer")
    return out
