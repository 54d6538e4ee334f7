"""Ahead-of-time builds of every Triton kernel variant for named CUDA architectures, without a
GPU: Triton's compiler lowers to PTX and runs its bundled ptxas to a cubin for a `GPUTarget`
(Triton docs, `triton.compile`). This is how a machine without a GPU checks that the kernels
build for sm80 / sm90 / sm100 / sm120, and what the device self-test reports as "builds".

Run with TRITON_INTERPRET unset: under the interpreter `triton.jit` returns interpreted
functions, which have nothing to compile.

    python -m mismatch.kernels.aot 80 90 100 120 [--only fake_quant]
"""

from __future__ import annotations

import sys
import time

__all__ = ["build_all"]

_HEAD_SIG = [("lab_ptr", "*i64"), ("h_ptr", "*{dt}"), ("w_ptr", "*{dt}"), ("x_ptr", "*{dt}"),
             ("cid_ptr", "*i64"), ("slp_ptr", "*fp32"), ("lp_ptr", "*fp32"),
             ("ent_ptr", "*fp32"), ("top_ptr", "*i64"), ("cand_ptr", "*fp32"),
             ("kl_ptr", "*fp32"), ("N", "i32"), ("V", "i32"), ("H", "i32"), ("K", "i32"),
             ("stride_h", "i32"), ("stride_w", "i32"), ("stride_x", "i32"),
             ("stride_c", "i32")]
_FQ_SIG = {"x_ptr": "*fp32", "out_ptr": "*fp32", "scale_ptr": "*fp32", "M": "i32", "B": "i32"}
_GEMM_SIG = {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "M": "i32", "N": "i32",
             "K": "i32", "sam": "i32", "sak": "i32", "sbk": "i32", "sbn": "i32"}


def _variants():
    """(label, kernel, signature, constexprs, options) of every variant the launchers use."""
    from mismatch.quantize.accumulate import ACCUMULATIONS

    from . import _tl_fake_quant as fq, _tl_gemm as gm, _tl_scorer_head as sh
    from .fake_quant import KERNEL_CODECS
    from .scorer_head import default_blocks

    for dt in ("fp32", "fp16", "bf16"):
        for from_logits in (False, True):
            sig = {n: t.format(dt=dt) for n, t in _HEAD_SIG}
            rows, vocab, hid = default_blocks(from_logits, cuda=True)
            consts = {"FROM_LOGITS": from_logits, "HAS_CAND": True, "HAS_KL": True,
                      "BLOCK_N": rows, "BLOCK_V": vocab, "BLOCK_H": max(hid, 16), "BLOCK_K": 8}
            yield (f"scorer_head {dt} {'logits' if from_logits else 'hidden'}", sh._head_kernel,
                   {**sig, **{k: "constexpr" for k in consts}}, consts,
                   {"enable_fp_fusion": True})
    for codec, (mode, group) in KERNEL_CODECS.items():
        consts = {"MODE": mode, "BLOCK_M": 64 if group else 1, "BLOCK_B": group or 4096}
        yield (f"fake_quant {codec}", fq._fake_quant_kernel,
               {**_FQ_SIG, **{k: "constexpr" for k in consts}}, consts,
               {"enable_fp_fusion": False})
    for acc in ACCUMULATIONS.values():
        mbits = acc.acc_mbits
        consts = {"KEEP_MASK": ~((1 << (52 - mbits)) - 1) if mbits else 0,
                  "TRUNCATE": mbits is not None,
                  "PROMOTE_SLICES": (acc.promote_every or 0) // acc.mma_k, "MMA_K": acc.mma_k,
                  "BLOCK_M": 16, "BLOCK_N": 16}
        yield (f"accumulate_gemm {acc.name}", gm._acc_gemm_kernel,
               {**_GEMM_SIG, **{k: "constexpr" for k in consts}}, consts,
               {"enable_fp_fusion": False})


def build_all(capabilities: list[int], only: str = "") -> list[tuple[str, int, str, float]]:
    """Build every variant (whose label contains `only`) for each compute capability (80, 90,
    100, 120, ...); returns (variant, capability, "ok" or the first line of the error, seconds)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for cap in capabilities:
        for label, fn, sig, consts, opts in _variants():
            if only not in label:
                continue
            t0 = time.perf_counter()
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                               target=GPUTarget("cuda", cap, 32), options=opts)
                status = "ok"
            except Exception as exc:  # a build failure is the result being reported
                status = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            rows.append((label, cap, status, time.perf_counter() - t0))
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    only = args.pop(args.index("--only") + 1) if "--only" in args else ""
    caps = [int(c) for c in args if c != "--only"] or [80, 90, 100, 120]
    failed = 0
    for label, cap, status, secs in build_all(caps, only):
        failed += status != "ok"
        print(f"sm{cap:<4}{label:<38}{status} ({secs:.1f} s)")
    sys.exit(1 if failed else 0)
