"""Encode+decode throughput of the codecs on a 4096x4096 BF16 matrix, side by side in one run.

Yardstick: a plain `x.to(torch.float8_e4m3fn).to(torch.bfloat16)` round trip (no scales).
Each codec runs encode → decode(bf16); the figure is the median of --repeats timings, as
elements per second and as a ratio to the yardstick measured in the same run (these machines
are noisy; only the ratio is meant to be compared across runs).

    python scripts/bench_quantize.py [--size 4096] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mismatch.quantize import decode, encode

CODECS = ["fp8", "fp8-channel", "fp8-block128", "mxfp4", "mxfp4-rceil", "mxfp4-modelopt",
          "nvfp4", "nvfp4-act"]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.size, args.size, generator=g).to(torch.bfloat16)
    n = x.numel()

    def yardstick():
        return x.to(torch.float8_e4m3fn).to(torch.bfloat16)

    base = _median_seconds(yardstick, args.repeats)
    print(f"# {args.size}x{args.size} bf16, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'codec':<16}{'ms':>10}{'Melem/s':>10}{'vs yardstick':>14}")
    print(f"{'yardstick':<16}{base * 1e3:>10.1f}{n / base / 1e6:>10.1f}{1.0:>14.3f}")
    for name in CODECS:
        sec = _median_seconds(lambda: decode(encode(x, name, validate=False), torch.bfloat16),
                              args.repeats)
        print(f"{name:<16}{sec * 1e3:>10.1f}{n / sec / 1e6:>10.1f}{base / sec:>14.3f}")


if __name__ == "__main__":
    main()
