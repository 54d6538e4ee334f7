"""Shared by the peak-memory benchmarks (bench_exact_kl.py, bench_scorer_head.py): each variant
runs in a fresh worker process of the calling script, so its peak resident set is its own."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The median seconds of `repeats` calls of fn, and the last call's result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_workers(script: str, variants: tuple[str, ...], args: list[str]) -> list[dict]:
    """Run `script --worker VARIANT ARGS` per variant; each prints one JSON line last."""
    rows = []
    name = script.rsplit("/", 1)[-1]
    for variant in variants:
        res = subprocess.run([sys.executable, script, "--worker", variant, *args],
                             capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{name}: the {variant} worker failed (exit {res.returncode}; out of "
                     f"memory?): {res.stderr.strip().splitlines()[-1:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return rows
