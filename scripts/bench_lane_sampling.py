"""Sampling CPU time of one batch, homogeneous vs mixed fleet (lanes), on two trees, interleaved.

One batch of 8 units x 8 episodes (arith tasks) sampled in one thread, by the homogeneous fleet
(B200 BF16) and by the mixed fleet (one unit per group, all eight groups in one engine batch:
mismatch.engines.lanes), at a new weight version each time (so the quantized groups recalibrate,
as they do every training step). The figure is the sampling thread's CPU time (time.thread_time:
less moved by other processes than wall time), the median over versions after the first. Each
tree runs on its own code (scripts/_tree.py).

    python scripts/bench_lane_sampling.py --baseline-tree DIR [--tree DIR] [--reps 2]
        [--versions 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _tree import tree_command  # noqa: E402
from bench_metrics import cpu_line  # noqa: E402


def inner(versions: int) -> None:
    """In the tree's process: thread CPU seconds per version, per fleet, as JSON on stdout."""
    import torch

    torch.set_num_threads(1)
    try:  # as a sampler worker process runs (trees that have it)
        from mismatch.runtime import tune_allocator
        tune_allocator()
    except ImportError:
        pass
    from mismatch.train.config import TrainConfig
    from mismatch.train.fleet import fleet
    from mismatch.train.unit_sampling import sample_units
    from mismatch.zoo import load_model, load_tokenizer

    model, tok = load_model(dtype="bfloat16"), load_tokenizer()
    out = {}
    for preset in ("homogeneous", "mixed"):
        # flat fields (TrainConfig.flat where a config is made of components' configs)
        make = getattr(TrainConfig, "flat", TrainConfig)
        cfg = make(fleet=preset, samples_per_prompt=8, tasks="arith", eval_tasks=0)
        groups = fleet(preset)
        units = list(range(8))
        per_unit = [groups[u % len(groups)] for u in units]
        times = []
        for version in range(versions):
            t0 = time.thread_time()
            sample_units(model, tok, cfg, per_unit, units, version)
            times.append(time.thread_time() - t0)
        out[preset] = times
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--tree", type=Path, default=HERE.parent)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        return inner(args.versions)
    if args.baseline_tree is None:
        ap.error("--baseline-tree is required")
    print(cpu_line(), flush=True)
    print(f"# load average at start {os.getloadavg()[0]:.1f}", flush=True)
    trees = {"baseline": args.baseline_tree, "this tree": args.tree}
    res: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.reps):
        for name, tree in trees.items():
            cmd, env = tree_command(tree, "bench_lane_sampling",
                                    ["--inner", "--versions", str(args.versions)])
            env["PYTHONPATH"] += os.pathsep + str(HERE)
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True,
                                  check=True)
            out = json.loads(done.stdout.strip().splitlines()[-1])
            for preset, times in out.items():
                res.setdefault((name, preset), []).extend(times[1:])
            print(f"rep {rep} {name:9} " + "  ".join(
                f"{p} {statistics.median(t[1:]):.2f} s" for p, t in out.items()), flush=True)
    print(f"{'sampling CPU s (median)':24} {'homogeneous':>12} {'mixed':>8} {'mixed/homog':>12}")
    for name in trees:
        h = statistics.median(res[(name, "homogeneous")])
        m = statistics.median(res[(name, "mixed")])
        print(f"{name:24} {h:12.2f} {m:8.2f} {m / h:11.2f}x")


if __name__ == "__main__":
    main()
