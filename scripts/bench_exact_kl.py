"""Chunked exact KL vs the naive log_softmax version: time and peak memory, side by side.

Each variant runs in its own fresh process (so peak RSS is its own), on the same seeded BF16
logits of shape [T, V] for both sides; the figure is the peak resident memory above what the
inputs alone take, and the median wall time of --repeats calls.

    python scripts/bench_exact_kl.py [--tokens 4096] [--vocab 152064] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource

from _peak_memory import run_workers, timed  # scripts/: beside this file


def _worker(variant: str, tokens: int, vocab: int, repeats: int) -> None:
    import torch

    from mismatch.metrics import exact_kl

    g = torch.Generator().manual_seed(0)
    ls = torch.empty(tokens, vocab, dtype=torch.bfloat16)
    lt = torch.empty(tokens, vocab, dtype=torch.bfloat16)
    for r0 in range(0, tokens, 8):  # fill in small chunks: the fill must not set the peak
        x = torch.randn(min(8, tokens - r0), vocab, generator=g) * 4
        ls[r0:r0 + 8] = x.bfloat16()
        lt[r0:r0 + 8] = (x + torch.randn(x.shape, generator=g) * 0.05).bfloat16()
        del x
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def naive():
        lp_s = torch.log_softmax(ls.float(), dim=-1)
        lp_t = torch.log_softmax(lt.float(), dim=-1)
        return (lp_s.exp() * (lp_s - lp_t)).sum(-1)

    seconds, out = timed(naive if variant == "naive" else (lambda: exact_kl(ls, lt)), repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": variant, "seconds": seconds,
                      "extra_peak_mib": (peak - base) / 1024, "inputs_mib":
                      2 * tokens * vocab * 2 / 2**20, "mean_kl": float(out.double().mean())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.tokens, args.vocab, args.repeats)
        return
    rows = run_workers(__file__, ("naive", "chunked"),
                       ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--repeats",
                        str(args.repeats)])
    naive, chunked = rows
    print(f"# exact KL over [T={args.tokens}, V={args.vocab}] BF16 logits, both sides; "
          f"inputs {naive['inputs_mib']:.0f} MiB; median of {args.repeats}")
    print(f"{'variant':<10}{'seconds':>10}{'extra peak MiB':>16}{'mean KL':>14}")
    for r in rows:
        print(f"{r['variant']:<10}{r['seconds']:>10.2f}{r['extra_peak_mib']:>16.0f}"
              f"{r['mean_kl']:>14.6e}")
    print(f"chunked/naive: time {chunked['seconds'] / naive['seconds']:.2f}x, extra peak memory "
          f"{chunked['extra_peak_mib'] / max(naive['extra_peak_mib'], 1e-9):.3f}x")


if __name__ == "__main__":
    main()
