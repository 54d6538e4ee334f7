"""The fused scorer head (torch twin) vs the naive `log_softmax` path: peak memory and time.

Both variants compute, from BF16 hidden states [T, H] and a BF16 lm_head weight [V, H], the
per-token log-prob of the label, the entropy, the top-1 id and the log-probs at K candidate ids:

    naive   logits = (hidden @ Wᵀ).float(); lp = log_softmax(logits); gathers; entropy from
            p = lp.exp() with one in-place multiply (so it holds two [T, V] FP32 tensors at its
            peak, not the three a plain `-(lp.exp() * lp).sum(-1)` would)
    fused   mismatch.kernels.scorer_head_torch: the same GEMM in [256, 8192] tiles with an online
            log-sum-exp, never more than a few tiles in FP32

Each variant runs in its own fresh process, so the process's peak resident set size
(getrusage ru_maxrss, the kernel's high-water mark of pages actually touched) is its own; the
figure is that peak minus the current RSS (VmRSS) measured after the inputs were built, i.e. the
extra memory the computation itself needed. Inputs are filled in slices so that building them
leaves no transient high-water mark above that RSS (the script prints the gap to show it). Times are the median of --repeats calls.

    python scripts/bench_scorer_head.py [--tokens 8192] [--vocab 152064] [--hidden 128]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

from _peak_memory import run_workers, timed  # scripts/: beside this file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_kib() -> int:
    """Current resident set size (VmRSS of /proc/self/status), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (this benchmark needs Linux)")


def _worker(variant: str, tokens: int, vocab: int, hidden: int, k: int, repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from mismatch.kernels import scorer_head_torch

    g = torch.Generator().manual_seed(0)
    h = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    w = torch.empty(vocab, hidden, dtype=torch.bfloat16)
    for x, scale in ((h, 1.0), (w, hidden ** -0.5)):  # filled in slices: no big FP32 temporary
        for r0 in range(0, x.shape[0], 1024):
            rows = x[r0:r0 + 1024]
            rows.copy_(torch.randn(rows.shape, generator=g) * scale)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    cand = torch.randint(0, vocab, (tokens, k), generator=g)
    # the peak is compared with the resident set *now*; the high-water mark so far is printed
    # too, so a reader can see that building the inputs left no transient peak above it
    base = _rss_kib()
    base_hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def naive():
        lp = torch.log_softmax(F.linear(h, w).float(), dim=-1)  # (T, V) FP32
        p = lp.exp()
        entropy = -(p.mul_(lp)).sum(-1)
        del p
        return lp.gather(-1, labels[:, None])[:, 0], entropy, lp.argmax(-1), lp.gather(-1, cand)

    def fused():
        out = scorer_head_torch(labels, hidden=h, weight=w, candidate_ids=cand)
        return out.logprobs, out.entropy, out.top1, out.candidate_logprobs

    seconds, out = timed(naive if variant == "naive" else fused, repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save([o.clone() for o in out], f"/tmp/bench_scorer_head_{variant}.pt")
    print(json.dumps({"variant": variant, "seconds": seconds,
                      "extra_peak_mib": (peak - base) / 1024,
                      "hwm_above_rss_at_start_mib": (base_hwm - base) / 1024,
                      "inputs_mib": (tokens + vocab) * hidden * 2 / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", choices=["naive", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.tokens, args.vocab, args.hidden, args.candidates, args.repeats)
        return
    rows = run_workers(__file__, ("naive", "fused"),
                       ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden",
                        str(args.hidden), "--candidates", str(args.candidates), "--repeats",
                        str(args.repeats)])
    import torch

    a = torch.load("/tmp/bench_scorer_head_naive.pt")
    b = torch.load("/tmp/bench_scorer_head_fused.pt")
    naive, fused = rows
    import platform

    print(f"# scorer head over T={args.tokens}, V={args.vocab}, H={args.hidden}, "
          f"K={args.candidates}; BF16 inputs {naive['inputs_mib']:.0f} MiB; torch "
          f"{torch.__version__}, {platform.machine()}; median of {args.repeats}")
    print(f"{'variant':<10}{'seconds':>10}{'extra peak MiB':>16}{'  (start-up HWM above RSS, MiB)'}")
    for r in rows:
        print(f"{r['variant']:<10}{r['seconds']:>10.2f}{r['extra_peak_mib']:>16.1f}"
              f"{r['hwm_above_rss_at_start_mib']:>12.1f}")
    print(f"fused/naive: extra peak memory {fused['extra_peak_mib'] / naive['extra_peak_mib']:.4f}x"
          f", time {fused['seconds'] / naive['seconds']:.2f}x")
    print(f"agreement: max |Δ log-prob| {float((a[0] - b[0]).abs().max()):.2e}, max |Δ entropy| "
          f"{float((a[1] - b[1]).abs().max()):.2e}, top-1 equal {bool(torch.equal(a[2], b[2]))}, "
          f"max |Δ candidate log-prob| {float((a[3] - b[3]).abs().max()):.2e}")


if __name__ == "__main__":
    main()
