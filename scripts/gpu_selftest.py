"""Device self-test of the GPU path: kernels against their torch twins, timed against the
hardware's floors, and `mismatch probe` measured vs emulated on the local GPU. One run of a few
minutes on a CUDA machine; it writes everything it prints to a markdown report.

    python scripts/gpu_selftest.py                      # CUDA: writes reports/gpu-<gpu>.md
    python scripts/gpu_selftest.py --smoke --report /tmp/smoke.md
                                                        # CPU: TRITON_INTERPRET=1, tiny shapes,
                                                        # emulated probe only (checks the script)

1. environment: torch / triton versions, the device, the profile it matches (name + capability);
   every kernel variant built ahead of time for the device's architecture (--smoke: sm90)
2. floors, measured here: device-to-device copy bandwidth, cuBLAS BF16 and FP64 matmul rates
3. every kernel vs its torch twin on seeded random inputs (Triton JIT-compiles on first call):
   scorer head (FP32 and BF16 hidden states, BF16 logits), each fake-quant codec (bit patterns),
   the accumulation-model GEMM for each preset (bit patterns)
4. timing: median ms of kernel and twin, the floor (bytes / bandwidth or FLOPs / matmul rate)
   and kernel / floor
5. `mismatch probe --gpu <local>` measured and with --emulate, for BF16 and, on FP8 GPUs, FP8:
   the KL figures side by side

Exit status: 0 when every check passed, 1 when one failed, 2 without CUDA (and no --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Out:
    """Print and keep every line for the report."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def _timer(device):
    import torch

    def run(fn, repeats: int) -> float:
        """Median milliseconds of fn() after one warm-up call."""
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def _floors(out: Out, device, timed, smoke: bool) -> dict:
    import torch

    n = (1 << 20) if smoke else (1 << 28)  # FP32 elements: 4 MiB / 1 GiB
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 5)
    bw = 2 * 4 * n / (ms * 1e-3)  # read + write
    s = 256 if smoke else 8192
    a = torch.randn(s, s, device=device, dtype=torch.bfloat16)
    ms_mm = timed(lambda: a @ a, 5)
    bf16 = 2 * s**3 / (ms_mm * 1e-3)
    rates = {}
    for dtype, size in ((torch.float32, 128 if smoke else 8192),
                        (torch.float64, 128 if smoke else 4096)):
        d = torch.randn(size, size, device=device, dtype=dtype)  # FP32: no TF32 (torch default)
        rates[dtype] = 2 * size**3 / (timed(lambda: d @ d, 3) * 1e-3)
    out(f"floors measured here: copy {bw / 1e9:.0f} GB/s; cuBLAS matmul BF16 "
        f"{bf16 / 1e12:.1f}, FP32 {rates[torch.float32] / 1e12:.1f}, FP64 "
        f"{rates[torch.float64] / 1e12:.2f} TFLOP/s")
    return {"bw": bw, "bf16": bf16, "fp32": rates[torch.float32], "fp64": rates[torch.float64]}


def _builds(out: Out, capability: int) -> bool:
    """Every kernel variant built ahead of time for this device's architecture, in a fresh
    process with an empty kernel cache (mismatch/kernels/aot.py)."""
    out(f"\n## builds (Triton -> PTX -> cubin for sm{capability}, empty cache)")
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        res = subprocess.run([sys.executable, "-m", "mismatch.kernels.aot", str(capability)],
                             capture_output=True, text=True, env=env, cwd=ROOT)
    for line in res.stdout.strip().splitlines():
        out(f"    {line}")
    if res.returncode != 0 and not res.stdout.strip():
        out(f"    FAILED: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
    return res.returncode == 0


def _bits_differ(a, b) -> int:
    import torch

    nan = torch.isnan(a) & torch.isnan(b)
    return int(((a.float().view(torch.int32) != b.float().view(torch.int32)) & ~nan).sum())


def _kernels(out: Out, device, timed, floors: dict, smoke: bool) -> bool:
    """Every kernel family; one that raises (a compiler without FP64 tl.dot, say) is a FAIL
    line with the error, and the others still run."""
    rows: list[tuple[str, str, float, float, float, str]] = []
    ok = True
    out("\n## kernels vs torch twins")
    for family in (_scorer_head, _fake_quant, _gemm):
        try:
            ok &= family(out, device, timed, floors, smoke, rows)
        except Exception as exc:  # report and go on: this is a diagnostic run
            ok = False
            out(f"{family.__name__[1:]}: FAIL ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})")
    out("\n## timing (median ms; floor = the work at the rates measured above)")
    out("| kernel | floor from | work | Triton ms | twin ms | floor ms | Triton / floor | "
        "twin / Triton |")
    out("|---|---|---|---:|---:|---:|---:|---:|")
    for name, kind, ms_k, ms_t, floor, work in rows:
        out(f"| {name} | {kind} | {work} | {ms_k:.3f} | {ms_t:.3f} | {floor:.3f} | "
            f"{ms_k / floor:.1f}x | {ms_t / ms_k:.2f}x |")
    return ok


def _scorer_head(out: Out, device, timed, floors: dict, smoke: bool, rows: list) -> bool:
    import torch
    import torch.nn.functional as F

    from mismatch.kernels import scorer_head_torch, scorer_head_triton

    ok = True
    g = torch.Generator(device=device).manual_seed(0)
    t, v, h, k = (48, 1000, 64, 8) if smoke else (4096, 152064, 2048, 8)
    for dtype in (torch.float32, torch.bfloat16):
        hid = torch.randn(t, h, device=device, generator=g).to(dtype)
        w = (torch.randn(v, h, device=device, generator=g) * h ** -0.5).to(dtype)
        lab = torch.randint(0, v, (t,), device=device, generator=g)
        cand = torch.randint(0, v, (t, k), device=device, generator=g)
        slp = torch.log_softmax(F.linear(hid, w).float(), -1).gather(-1, cand) + 0.01
        # the interpreter (--smoke) has no bfloat16: widen exactly and compare from logits
        args = dict(hidden=hid, weight=w) if (device.type == "cuda" or dtype == torch.float32) \
            else dict(logits=F.linear(hid, w).float())
        twin = scorer_head_torch(lab, candidate_ids=cand, sampler_candidate_logprobs=slp, **args)
        kern = scorer_head_triton(lab, candidate_ids=cand, sampler_candidate_logprobs=slp, **args)
        err = float((kern.logprobs - twin.logprobs).abs().max())
        err_e = float((kern.entropy - twin.entropy).abs().max())
        err_c = float((kern.candidate_logprobs - twin.candidate_logprobs).abs().max())
        top = float((kern.top1 == twin.top1).float().mean())
        # FP32: ~1e-6 relative; BF16 logits may differ by one BF16 rounding of the GEMM output
        # (cuBLAS and tl.dot sum H in other orders): allow two BF16 ulps of the largest logit
        scale = float(F.linear(hid[:64], w).float().abs().max())
        tol = 2e-5 * max(scale, 1.0) if dtype == torch.float32 else 2 * scale * 2.0**-7
        passed = max(err, err_c) <= tol and err_e <= tol and top >= 0.99
        ok &= passed
        out(f"scorer head [{t}x{h}]x[{v}x{h}] {str(dtype)[6:]}: max |Δ log-prob| {err:.2e}, "
            f"|Δ entropy| {err_e:.2e}, |Δ candidate| {err_c:.2e}, top-1 agree {top:.4f} "
            f"(tol {tol:.1e}) {'PASS' if passed else 'FAIL'}")
        ms_k = timed(lambda: scorer_head_triton(lab, candidate_ids=cand, **args), 3)
        ms_t = timed(lambda: scorer_head_torch(lab, candidate_ids=cand, **args), 3)
        flops = 2 * t * v * h
        nbytes = (v * h + t * h) * hid.element_size()
        rate = floors["bf16"] if dtype == torch.bfloat16 else floors["fp32"]
        floor = max(flops / rate, nbytes / floors["bw"]) * 1e3
        rows.append((f"scorer head {str(dtype)[6:]}", f"{str(dtype)[6:]} matmul", ms_k,
                     ms_t, floor, f"{flops / 1e9:.1f} GFLOP"))

    return ok


def _fake_quant(out: Out, device, timed, floors: dict, smoke: bool, rows: list) -> bool:
    import torch

    from mismatch.kernels import KERNEL_CODECS, fake_quant_torch, fake_quant_triton

    ok = True
    g = torch.Generator(device=device).manual_seed(1)
    r, c = (64, 256) if smoke else (8192, 8192)
    x = torch.randn(r, c, device=device, generator=g) * torch.logspace(
        -3, 3, c, device=device)
    for codec in KERNEL_CODECS:
        s = torch.tensor(0.05, device=device) if codec in ("fp8-act", "nvfp4-act") else None
        diff = _bits_differ(fake_quant_triton(x, codec, global_scale=s),
                            fake_quant_torch(x, codec, global_scale=s))
        ok &= diff == 0
        out(f"fake-quant {codec:<12} [{r}x{c}] FP32: {diff} of {x.numel()} elements differ in "
            f"bits {'PASS' if diff == 0 else 'FAIL'}")
        ms_k = timed(lambda: fake_quant_triton(x, codec, global_scale=s, validate=False), 5)
        ms_t = timed(lambda: fake_quant_torch(x, codec, global_scale=s, validate=False), 5)
        rows.append((f"fake-quant {codec}", "bandwidth", ms_k, ms_t,
                     8 * x.numel() / floors["bw"] * 1e3, f"{8 * x.numel() / 2**20:.0f} MiB"))

    return ok


def _gemm(out: Out, device, timed, floors: dict, smoke: bool, rows: list) -> bool:
    import torch

    from mismatch.kernels import accumulate_gemm_torch, accumulate_gemm_triton

    ok = True
    g = torch.Generator(device=device).manual_seed(2)
    m, kk, n = (16, 300, 16) if smoke else (1024, 4096, 1024)
    a = (torch.randn(m, kk, device=device, generator=g) * 8).to(torch.float8_e4m3fn).float()
    b = (torch.randn(kk, n, device=device, generator=g) * 8).to(torch.float8_e4m3fn).float()
    for acc in ("fp32", "hopper-fp8-fast", "hopper-fp8-promote128"):
        diff = _bits_differ(accumulate_gemm_triton(a, b, acc), accumulate_gemm_torch(a, b, acc))
        ok &= diff == 0
        out(f"accumulation GEMM {acc:<22} [{m}x{kk}]x[{kk}x{n}] FP8 grid: {diff} of {m * n} "
            f"outputs differ in bits {'PASS' if diff == 0 else 'FAIL'}")
        ms_k = timed(lambda: accumulate_gemm_triton(a, b, acc), 3)
        ms_t = timed(lambda: accumulate_gemm_torch(a, b, acc), 3)
        rows.append((f"GEMM {acc}", "FP64 matmul", ms_k, ms_t,
                     2 * m * n * kk / floors["fp64"] * 1e3, f"{2 * m * n * kk / 1e9:.1f} GFLOP"))
    return ok


def _probe(gpu: str, dtype: str, emulate: bool, n_prompts: int, max_new: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "mismatch.cli", "probe", "--gpu", gpu, "--dtype", dtype,
               "--n-prompts", str(n_prompts), "--max-new-tokens", str(max_new), "--json",
               "--out", str(Path(tmp) / "run")] + (["--emulate"] if emulate else [])
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1], "wall": wall}
    s = json.loads(res.stdout.strip().splitlines()[-1])
    s["wall"] = wall
    return s


def _probes(out: Out, local, smoke: bool, n_prompts: int) -> bool:
    from mismatch.profiles import GPUS, local_profile

    here = local_profile(local) if local else None
    gpu = here or "h100"
    out("\n## mismatch probe: measured vs emulated on this GPU")
    if here is None and not smoke:
        out(f"skipped: {local[0]} is not one of the profiled GPUs ({', '.join(GPUS)})")
        return True
    dtypes = ["bf16"] + (["fp8"] if "fp8" in GPUS[gpu].native else [])
    max_new = 8 if smoke else 48
    n = 8 if smoke else n_prompts
    out(f"`mismatch probe --gpu {gpu} --dtype D --n-prompts {n} --max-new-tokens {max_new}` "
        f"[--emulate]")
    out("| dtype | mode | tokens | KL k3 total | KL k3 precision | KL k3 accelerator | KL k1 "
        "total | mean abs Δlogp | wall s |")
    out("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for dtype in dtypes:
        for emulate in (False, True):
            if smoke and not emulate:
                out(f"| {dtype} | measured | n/a: no CUDA on this machine | | | | | | |")
                continue
            s = _probe(gpu, dtype, emulate, n, max_new)
            if "error" in s:
                ok = False
                out(f"| {dtype} | {'emulated' if emulate else 'measured'} | FAILED: {s['error']} "
                    f"| | | | | | {s['wall']:.0f} |")
                continue
            tot, src = s["total"], s["sources"]
            out(f"| {dtype} | {s['mode']} | {s['tokens']} | {tot['kl_k3']:.3e} | "
                f"{src['precision']['kl_k3']:.3e} | {src['accelerator']['kl_k3']:.3e} | "
                f"{tot['kl_k1']:.3e} | {tot['abs_logprob_diff_mean']:.3e} | {s['wall']:.0f} |")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny "
                        "shapes, emulated probe only: checks this script without a GPU")
    parser.add_argument("--report", type=Path, help="markdown report (default "
                        "reports/gpu-<gpu>.md)")
    parser.add_argument("--n-prompts", type=int, default=128, help="prompts per probe run")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    from mismatch.kernels import triton_available
    from mismatch.profiles import local_gpu, local_profile

    local = local_gpu()
    if local is None and not args.smoke:
        print("gpu_selftest: no CUDA device here; run it on a GPU machine, or --smoke to check "
              "the script on CPU", file=sys.stderr)
        sys.exit(2)
    if not triton_available():
        print("gpu_selftest: Triton is not installed (pip install 'mismatch[gpu]')",
              file=sys.stderr)
        sys.exit(2)
    import triton

    device = torch.device("cuda" if local else "cpu")
    out = Out()
    name = local[0] if local else "cpu (smoke: Triton interpreter)"
    tag = (local_profile(local) or name.replace(" ", "-").lower()) if local else "smoke"
    out(f"# GPU self-test: {name}")
    out()
    out(f"`python scripts/gpu_selftest.py{' --smoke' if args.smoke else ''}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
        f"triton {triton.__version__}, device {name}"
        + (f", compute capability {local[1][0]}.{local[1][1]}, profile "
           f"{local_profile(local) or 'none'}" if local else ""))
    timed = _timer(device)
    t0 = time.perf_counter()
    ok = _builds(out, 10 * local[1][0] + local[1][1] if local else 90)
    floors = _floors(out, device, timed, args.smoke)
    ok &= _kernels(out, device, timed, floors, args.smoke)
    ok &= _probes(out, local, args.smoke, args.n_prompts)
    out(f"\n{'ALL PASS' if ok else 'SOME CHECKS FAILED'} in {time.perf_counter() - t0:.0f} s")
    report = args.report or ROOT / "reports" / f"gpu-{tag}.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(out.lines) + "\n")
    print(f"wrote {report}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
