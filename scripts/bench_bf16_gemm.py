"""Benchmark: BF16 GEMMs native vs as FP32 GEMMs of BF16 values (mismatch.kernels.bf16_gemm),
side by side in one process, interleaved (these machines are noisy: compare the ratios).

    python scripts/bench_bf16_gemm.py [--repeats 3] [--out FILE]

Four sections, each variant under `MISMATCH_BF16_GEMM=native` and `=fp32` in turn, one thread:

- GEMMs at the embedded model's shapes (and 1024³): GFLOP/s of torch's BF16 GEMM, of the
  rerouted one (cast up, FP32 GEMM, round) and of a plain FP32 GEMM;
- attention: forward + backward of the trainer's causal SDPA at a 16 × 8 step's shape;
- the trainer's step: `Trainer.step` (grpo) on one sampled 16 × 8 step of `mismatch train
  --preset homogeneous --sync --tasks arith` (scripts/bench_train_step.py samples it);
- decode: 128 held-out prompts × up to 64 new tokens through the engine, the embedded model
  unemulated (its BF16 kernels) and as the emulated B200 BF16 sampler.

The first line names the CPU and its BF16-relevant extensions and the policy `auto` picks here.
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python scripts/bench_bf16_gemm.py` measures a
CPU without fast BF16 on one that has it (the first line then says oneDNN is capped).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_metrics import cpu_line  # noqa: E402

POLICIES = ("native", "fp32")
SHAPES = [(128, 256, 256), (512, 64, 512), (2048, 128, 768), (1024, 1024, 1024)]


def _rate(fn, seconds: float = 0.3) -> float:
    from mismatch.kernels.bf16_gemm import calls_per_second

    return calls_per_second(fn, seconds)


def gemms() -> list[str]:
    from mismatch.kernels.bf16_gemm import bf16_gemms

    out = [f"{'GEMM [M,K]x[K,N]':<22}{'bf16 native':>13}{'bf16 via fp32':>15}{'fp32':>9}"
           f"{'speed-up':>10}   (GFLOP/s, one thread)"]
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
        af, bf = a.float(), b.float()
        flops = 2 * m * k * n / 1e9
        res = {}
        for policy in POLICIES:
            def f(policy=policy):
                with bf16_gemms(policy):
                    a @ b
            res[policy] = _rate(f) * flops
        res["plain fp32"] = _rate(lambda: af @ bf) * flops
        out.append(f"{f'[{m},{k}]x[{k},{n}]':<22}{res['native']:>13.1f}"
                   f"{res['fp32']:>15.1f}{res['plain fp32']:>9.1f}"
                   f"{res['fp32'] / res['native']:>9.2f}x")
    return out


ATTENTION = (128, 4, 2, 294, 32)
"""The trainer's attention in a 16 × 8 step: [B, heads, KV heads, T, head dim]."""


def attention(repeats: int) -> list[str]:
    """Forward + backward of the trainer's causal SDPA (CPU flash attention, GQA): torch's BF16
    kernel vs the FP32 kernel on BF16 values (the reroute), seconds per call."""
    import torch.nn.functional as F

    from mismatch.kernels.bf16_gemm import bf16_gemms

    b, h, kv, t, d = ATTENTION
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=g).bfloat16() for n in (h, kv, kv))
    grad = torch.randn(b, h, t, d, generator=g).bfloat16()

    def run() -> float:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        t0 = time.perf_counter()
        with bf16_gemms():
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                           enable_gqa=True).backward(grad)
        return time.perf_counter() - t0

    med = _median_by_policy(run, repeats)
    return [f"attention fwd+bwd [{b},{h}({kv} kv),{t},{d}] causal: native "
            f"{med['native']:.3f} s, via fp32 {med['fp32']:.3f} s, speed-up "
            f"{med['native'] / med['fp32']:.2f}x"]


def _median_by_policy(run, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for p in POLICIES:  # warm-up
        os.environ["MISMATCH_BF16_GEMM"] = p
        run()
    for _ in range(repeats):
        for p in POLICIES:
            os.environ["MISMATCH_BF16_GEMM"] = p
            times[p].append(run())
    return {p: statistics.median(v) for p, v in times.items()}


def trainer_step(repeats: int) -> list[str]:
    import pickle

    import bench_train_step as bts
    from mismatch.train.batch import build_batch
    from mismatch.train.trainer import Trainer
    from mismatch.zoo import load_model, load_tokenizer

    with tempfile.TemporaryDirectory() as d:
        info = bts.sample_units(Path(d) / "units.pkl")
        units = pickle.loads((Path(d) / "units.pkl").read_bytes())
    tok = load_tokenizer()
    trainer = Trainer(load_model(dtype="bfloat16"), bts._config("grpo"))
    trainer.threads = None
    batch = build_batch(units, 0, tok.pad_token_id)

    def run() -> float:
        t0 = time.perf_counter()
        trainer.step(batch)
        return time.perf_counter() - t0

    med = _median_by_policy(run, repeats)
    return [f"trainer step (grpo, {info['rows']} rows, longest {info['longest']}, "
            f"{info['sampled']} sampled tokens): native {med['native']:.2f} s, via fp32 "
            f"{med['fp32']:.2f} s, speed-up {med['native'] / med['fp32']:.2f}x"]


def decode(repeats: int) -> list[str]:
    from mismatch.engines.numerics import apply_numerics, calibrate
    from mismatch.engines.logits import SamplingParams
    from mismatch.engines.generation import generate
    from mismatch.profiles import resolve
    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.zoo.prompts import load_prompts

    tok = load_tokenizer()
    model = load_model()
    prompts = load_prompts(tok, None, 128)
    params = SamplingParams(max_new_tokens=64, seed=0)
    eos = {tok.eos_token_id}
    spec = resolve("b200", "bf16")
    scales = calibrate(model, spec, [(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
                                     for p in prompts[:8]])
    out = []
    for name in ("unemulated", "emulated b200 bf16"):
        tokens = []

        def run(name=name) -> float:
            t0 = time.perf_counter()
            if name == "unemulated":
                r = generate(model, prompts, params, pad_id=0, eos_ids=eos, label=name)
            else:
                with apply_numerics(model, spec, scales):
                    r = generate(model, prompts, params, pad_id=0, eos_ids=eos, label=name)
            tokens.append(r.n_tokens)
            return time.perf_counter() - t0

        med = _median_by_policy(run, repeats)
        out.append(f"decode 128 prompts, {name} ({tokens[-1]} tokens): native "
                   f"{med['native']:.2f} s, via fp32 {med['fp32']:.2f} s, speed-up "
                   f"{med['native'] / med['fp32']:.2f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sections", nargs="+", default=["gemm", "attention", "trainer", "decode"],
                    choices=["gemm", "attention", "trainer", "decode"])
    ap.add_argument("--out", type=Path, help="also write the lines to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from mismatch.cli.common import quiet_libraries
    from mismatch.kernels.bf16_gemm import bf16_gemm_policy

    quiet_libraries()
    saved = os.environ.pop("MISMATCH_BF16_GEMM", None)
    lines = [f"# {cpu_line()}; torch {torch.__version__}, 1 thread; `auto` picks "
             f"{bf16_gemm_policy()} here; median of {args.repeats} interleaved runs"]
    print(lines[0], flush=True)
    for section, fn in (("gemm", gemms), ("attention", lambda: attention(args.repeats)),
                        ("trainer", lambda: trainer_step(args.repeats)),
                        ("decode", lambda: decode(args.repeats))):
        if section in args.sections:
            for line in fn():
                print(line, flush=True)
                lines.append(line)
    if saved is not None:
        os.environ["MISMATCH_BF16_GEMM"] = saved
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
