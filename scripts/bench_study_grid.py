"""Benchmark: what a `mismatch study` grid step costs before and after two changes, side by side.

    python scripts/bench_study_grid.py [--model DIR] [--repeats 3] [--report reports/benchmarks.md]

1. FP8 KV cache, rounded at write. Each L2 sampler group samples two zoo units (16 episodes, the
   grid's share of one group) twice in the same process, alternating: with the engine's cache
   rounding each position once as it is written (this tree), and with the cache holding
   unrounded keys/values that attention rounds whole at every decode step (the path before;
   obtained by switching the cache's rounding off, so attention takes its fallback). The
   episodes must be identical bit for bit; the table gives the median seconds.
2. Pinned runs. Two trainer processes step the same sampled 16 × 8 zoo batch at the same time,
   as two grid runs do: unpinned, each trainer on two threads (what a lockstep trainer takes on
   a two-CPU machine), against pinned to one CPU each with one thread; one trainer alone on one
   CPU for the floor. The first step of each worker is left out.

These machines are noisy: compare the ratios of one run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("h200-fp8", "b200-nvfp4", "a100-bf16")


def _cfg(fleet: str):
    from mismatch.train.config import preset_config

    return preset_config(fleet, correction="sc+mis", prompts_per_step=16, samples_per_prompt=8,
                         tasks="zoo", eval_tasks=0, staleness=8)


def _load(model_dir: str | None):
    from mismatch.zoo import load_model, load_tokenizer

    return load_model(model_dir, dtype="bfloat16").eval(), load_tokenizer()


def kv_store(model_dir: str | None, repeats: int) -> list[tuple[str, float, float, bool]]:
    """(group, seconds rounded at write, seconds rounded whole, identical) per group."""
    import torch

    import mismatch.engines.kv_cache as kv_cache
    from mismatch.train.fleet import fleet
    from mismatch.train.unit_sampling import sample_units

    torch.set_num_threads(1)
    model, tok = _load(model_dir)
    cfg = _cfg("mixed")
    at_write = kv_cache.kv_store_rounding
    rows = []
    for group in [g for g in fleet("mixed") if g.name in GROUPS]:
        times: dict[bool, list[float]] = {True: [], False: []}
        eps: dict[bool, list] = {}
        for _ in range(repeats):
            for write in (True, False):
                kv_cache.kv_store_rounding = at_write if write else (lambda: None)
                t0 = time.perf_counter()
                with torch.no_grad():
                    got = sample_units(model, tok, cfg, group, [0, 1], 0)
                times[write].append(time.perf_counter() - t0)
                eps[write] = [(e.token_ids, e.sampler_logprobs, e.candidate_logprobs.tolist())
                              for e in got]
        kv_cache.kv_store_rounding = at_write
        rows.append((group.name, statistics.median(times[True]),
                     statistics.median(times[False]), eps[True] == eps[False]))
    return rows


def sample_batch(model_dir: str | None, path: Path) -> None:
    import torch

    from mismatch.train.batch import Unit
    from mismatch.train.fleet import fleet
    from mismatch.train.unit_sampling import sample_units

    torch.set_num_threads(1)
    model, tok = _load(model_dir)
    cfg = _cfg("homogeneous")
    group = fleet("homogeneous")[0]
    with torch.no_grad():
        eps = sample_units(model, tok, cfg, group, list(range(16)), 0)
    units = [Unit(index=u, group=group.name, version=0, episodes=eps[u * 8:(u + 1) * 8],
                  seconds=0.0) for u in range(16)]
    path.write_bytes(pickle.dumps(units))


def worker(spec: dict) -> None:
    """A trainer stepping the pickled batch once per line read from stdin."""
    if spec["cpus"] is not None:
        os.sched_setaffinity(0, spec["cpus"])
    import torch

    from mismatch.train.batch import build_batch
    from mismatch.train.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    model, tok = _load(spec["model"])
    units = pickle.loads(Path(spec["units"]).read_bytes())
    trainer = Trainer(model, _cfg("homogeneous"))
    trainer.threads = spec["threads"]
    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        trainer.step(build_batch(units, 8, tok.pad_token_id))
        print(json.dumps(time.perf_counter() - t0), flush=True)


def _together(specs: list[dict], repeats: int) -> list[float]:
    """Start the workers, then step them all at once `repeats` + 1 times; median seconds each."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for s in specs]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            sys.exit("bench_study_grid: a trainer worker failed to start")
    seconds: list[list[float]] = [[] for _ in procs]
    for _ in range(repeats + 1):
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            seconds[i].append(json.loads(p.stdout.readline()))
    for p in procs:
        p.stdin.close()
        p.wait()
    return [statistics.median(s[1:]) for s in seconds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="policy directory (default: the embedded one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", type=Path, default=None, help="append the table to this file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("bench_study_grid: needs two CPUs (two runs side by side)")
    lines = [f"# torch CPU, {len(cpus)} CPUs, load average at start "
             f"{os.getloadavg()[0]:.1f}; model {args.model or 'embedded'}; "
             f"median of {args.repeats}",
             "sampling 2 zoo units (16 episodes)   at write s  whole cache s  speed-up  identical"]
    for name, new, old, same in kv_store(args.model, args.repeats):
        lines.append(f"{name:<36}{new:>11.2f}{old:>15.2f}{old / new:>9.2f}x  {same}")
    with tempfile.TemporaryDirectory() as tmp:
        units = Path(tmp) / "units.pkl"
        sample_batch(args.model, units)
        base = {"model": args.model, "units": str(units)}
        alone = _together([dict(base, cpus=[cpus[0]], threads=1)], args.repeats)[0]
        unpinned = _together([dict(base, cpus=None, threads=2)] * 2, args.repeats)
        pinned = _together([dict(base, cpus=[c], threads=1) for c in cpus[:2]], args.repeats)
    lines += ["trainer step, 16x8 zoo batch, sc+mis        s   vs alone",
              f"one trainer alone, 1 CPU, 1 thread    {alone:>8.2f}   1.00x"]
    for label, got in (("two at once, unpinned, 2 threads each", unpinned),
                       ("two at once, pinned, 1 CPU each      ", pinned)):
        m = statistics.mean(got)
        lines.append(f"{label} {m:>8.2f}   {m / alone:.2f}x")
    lines.append(f"unpinned / pinned: {statistics.mean(unpinned) / statistics.mean(pinned):.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.report:
        stamp = datetime.date.today().isoformat()
        with open(args.report, "a") as f:
            f.write(f"\n<!-- bench_study_grid.py, {stamp} -->\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
