"""Benchmark: a training process's memory and step time with oneDNN's per-shape caches at their
defaults against capped by `mismatch.runtime.bound_kernel_caches`, side by side.

    python scripts/bench_kernel_caches.py [--steps 12] [--arm sc+mis] [--out FILE]

One 16 × 8 batch is sampled once (bench_train_step.sample_units); two trainer worker processes,
one per setting (the caches are sized at a process's first matrix product, so each setting
needs its own process), step it in turn, one thread each. The same batch every step is the
gentlest case: its shapes change only as the weights move the tokens each MoE expert receives;
a real run also changes the batch's length every step. Memory: resident (VmRSS) and glibc's
bytes in use (`mallinfo2`: what is allocated, not what the allocator keeps), after each step.

These machines are noisy: compare the ratios of one run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train_step import _Worker, sample_units, write_table  # noqa: E402

_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _start(spec: dict, shapes: int | None) -> _Worker:
    """A trainer worker whose environment caps the caches at `shapes` (None: the defaults)."""
    saved = {k: os.environ.pop(k, None) for k in _VARIABLES}
    try:
        if shapes is not None:
            os.environ.update({k: str(shapes) for k in _VARIABLES})
        return _Worker(spec, ROOT)  # the environment is copied when the process starts
    finally:
        for k in _VARIABLES:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]


def main() -> None:
    from mismatch.runtime import KERNEL_CACHE_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--arm", default="sc+mis")
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        units = Path(tmp) / "units.pkl"
        info = sample_units(units)
        spec = {"units": str(units), "kind": "trainer", "arm": args.arm, "threads": 1,
                "lockstep": False}
        settings = (("oneDNN defaults", None), (f"capped at {KERNEL_CACHE_SHAPES}",
                                                KERNEL_CACHE_SHAPES))
        workers = [_start(spec, shapes) for _, shapes in settings]
        for w in workers:
            w.ready()
        for _ in range(args.steps):
            for w in workers:
                w.step()
        for w in workers:
            w.close()
    import torch

    lines = [f"# {args.arm}, 16 prompts x 8 samples: {info['rows']} rows, longest "
             f"{info['longest']}, the same batch every step; torch {torch.__version__}, "
             f"1 thread, {os.cpu_count()} CPUs; step seconds: median after the first",
             "setting                 step s   in use MiB: step 1 -> last   resident MiB: step 1"
             " -> last   growth/step"]
    seconds = {}
    for (label, _), w in zip(settings, workers):
        s = w.steps
        seconds[label] = statistics.median(x["seconds"] for x in s[1:])
        growth = (s[-1]["in_use_mib"] - s[0]["in_use_mib"]) / max(1, len(s) - 1)
        lines.append(f"{label:<22} {seconds[label]:7.2f}   {s[0]['in_use_mib']:10.0f} -> "
                     f"{s[-1]['in_use_mib']:6.0f}         {s[0]['rss_mib']:10.0f} -> "
                     f"{s[-1]['rss_mib']:6.0f}      {growth:6.1f}")
    a, b = (seconds[label] for label, _ in settings)
    lines.append(f"step time, capped / defaults: {b / a:.2f}x")
    write_table("\n".join(lines), args.out, "bench_kernel_caches.py")


if __name__ == "__main__":
    main()
