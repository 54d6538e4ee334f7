"""OpenMP's wait policy under load: the 16 x 8 homogeneous `--sync` step with GNU OpenMP's
default wait (threads spin a while at each barrier), OMP_WAIT_POLICY=PASSIVE (threads sleep;
what `mismatch` sets unless the environment chooses) and GOMP_SPINCOUNT=10000 (a short spin),
quiet and with one CPU-bound competitor per core, interleaved (these machines are noisy: only
ratios measured together mean much).

    python scripts/bench_omp_waits.py [--reps 2] [--conditions quiet,loaded]

Each run is `python -m mismatch.cli train --preset homogeneous --sync --steps 4 --prompts 16
--samples 8 --tasks arith --eval-tasks 0 --correction grpo --threads 1 -q` in a fresh process
(the policy is read once, when torch loads OpenMP); the figures are the medians of steps 2-4.
The first line is the CPU's model and vector extensions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_metrics import cpu_line  # noqa: E402

# "GNU default": an empty OMP_WAIT_POLICY, which `mismatch` leaves alone (the user chose) and GNU
# OpenMP rejects as invalid (one line on stderr) and then treats as unset: its default spin.
VARIANTS = {"GNU default": {"OMP_WAIT_POLICY": ""}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "spin 10k": {"GOMP_SPINCOUNT": "10000"}}
CMD = [sys.executable, "-m", "mismatch.cli", "train", "--preset", "homogeneous", "--sync",
       "--steps", "4", "--prompts", "16", "--samples", "8", "--tasks", "arith", "--eval-tasks",
       "0", "--correction", "grpo", "--threads", "1", "-q"]


def run(extra: dict[str, str]) -> tuple[float, float]:
    """(step, train) seconds, medians of the steps after the first."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(CMD + ["--out", f"{out}/run"], env={**env, **extra}, check=True,
                       capture_output=True)
        recs = [json.loads(x) for x in Path(out, "run", "metrics.jsonl").read_text().splitlines()]
    later = [r for r in recs if "step_seconds" in r][1:]
    return (statistics.median(r["step_seconds"] for r in later),
            statistics.median(r["train_seconds"] for r in later))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--conditions", default="quiet,loaded")
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    print(f"# load average at start {os.getloadavg()[0]:.1f}", flush=True)
    steps: dict[tuple[str, str], list[float]] = {}
    for cond in args.conditions.split(","):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(len(os.sched_getaffinity(0)))] if cond == "loaded" else []
        try:
            for rep in range(args.reps):
                for name, extra in VARIANTS.items():
                    step, train = run(extra)
                    steps.setdefault((cond, name), []).append(step)
                    print(f"{cond:7} rep {rep} {name:11} step {step:6.2f} s  train {train:6.2f} s",
                          flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"{'median step s':20}" + "".join(f"{n:>11}" for n in VARIANTS))
    for cond in args.conditions.split(","):
        print(f"{cond:20}" + "".join(f"{statistics.median(steps[(cond, n)]):11.2f}"
                                     for n in VARIANTS))


if __name__ == "__main__":
    main()
