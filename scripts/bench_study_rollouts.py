"""Rollout cost of one study step, per fleet: each prompt's group generated on its own (one
batched generation per unit, as the asynchronous pipeline does) against all of a step's units
that share a sampler group generated together (what lockstep modes — sync, forced staleness,
hence the study — do). Same tasks, same weights, one torch thread, side by side in one process.

    python scripts/bench_study_rollouts.py [--prompts 4] [--samples 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from mismatch.zoo import load_model, load_tokenizer
from mismatch.train.fleet import Router, fleet
from mismatch.probes.base import TORCH_DTYPES
from mismatch.train.rollout import run_episodes
from mismatch.train.batch import task_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer()
    base = load_model(dtype="bfloat16")
    kinds = ("arith",)
    print(f"one step = {args.prompts} prompts × {args.samples} episodes (arith), full "
          f"distribution, 1 thread; best of {args.repeats}")
    print(f"{'fleet':<12} {'per unit (s)':>13} {'per group (s)':>14} {'speed-up':>9} "
          f"{'calls':>6}")
    for study, preset in (("L0", "homogeneous"), ("L1", "precision"), ("L2", "mixed")):
        groups = fleet(preset)
        router = Router(groups, seed=0)
        units = [(u, router.assign(u)) for u in range(args.prompts)]
        models = {}
        for _, g in units:
            dtype = TORCH_DTYPES[g.spec.compute_dtype]
            models.setdefault(dtype, base.to(dtype).eval())
        by_group = defaultdict(list)
        for u, g in units:
            by_group[g.name].append((u, g))

        def per_unit() -> None:
            for u, g in units:
                run_episodes(models[TORCH_DTYPES[g.spec.compute_dtype]], tok,
                             [task_of(u, 0, kinds)] * args.samples, g, version=0, seed=u)

        def per_group() -> None:
            for batch in by_group.values():
                g = batch[0][1]
                tasks = [task_of(u, 0, kinds) for u, _ in batch for _ in range(args.samples)]
                run_episodes(models[TORCH_DTYPES[g.spec.compute_dtype]], tok, tasks, g,
                             version=0, seed=batch[0][0])

        times = {}
        for name, fn in (("unit", per_unit), ("group", per_group)):
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            times[name] = best
        print(f"{study + ' ' + preset:<12} {times['unit']:>13.2f} {times['group']:>14.2f} "
              f"{times['unit'] / times['group']:>8.2f}× {len(by_group):>3}/{len(units)}",
              flush=True)


if __name__ == "__main__":
    main()
