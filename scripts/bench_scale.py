"""Throughput of `mismatch train --backend ray` against the local backend, side by side in one run,
and the sizes that drive a large fleet's plan (reports/scale.md).

    python scripts/bench_scale.py [--steps 6] [--out /tmp/bench-scale]

Every variant trains the same config (the mixed fleet, asynchronous, 4 prompts × 8 samples per
step, sc+mis+topp) from the same seed, one after the other on this machine:

- local, 1 sampler thread (the default) and 2 sampler threads (one process, torch threads 1);
- ray, one sampler actor per group (8) plus a trainer actor, or plus two FSDP2 trainer rank
  actors, on a local Ray with the machine's CPUs (started once, before the timed runs; the wall
  time includes the actors' start-up, the throughput does not).

Throughput = sampled tokens consumed over the seconds of steps 2..N (step 1 holds start-up).
Then, on the same Ray: the bytes of one published weight version and of one trajectory as Ray
serializes them, and the object-store transfer rate of a weight version to an actor.
"""

from __future__ import annotations

import argparse
import logging
import pickle
import shutil
import statistics
import time
from pathlib import Path


def _throughput(recs: list[dict]) -> tuple[float, float, float]:
    steady = recs[1:] or recs
    tokens = sum(r["sampled_tokens"] for r in steady)
    secs = sum(r["step_seconds"] for r in steady)
    idle = statistics.fmean(r["trainer_idle_share"] for r in steady)
    return tokens / secs, secs / len(steady), idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-scale"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    import ray
    import torch

    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.train.config import preset_config
    from mismatch.train.loop import run
    from mismatch.train.ray_backend import RayBackend
    from mismatch.train.ray_session import start_ray
    from mismatch.train.rundir import read_metrics

    model, tok = load_model(dtype="bfloat16"), load_tokenizer()
    cfg = dict(steps=args.steps, eval_tasks=0, checkpoint_every=100, tasks="arith,table")
    shutil.rmtree(args.out, ignore_errors=True)
    t0 = time.perf_counter()
    session = start_ray()
    ray_start = time.perf_counter() - t0
    rows = []
    variants = [("local, 1 sampler thread", "local", 1, 1),
                ("local, 2 sampler threads", "local", 2, 1),
                ("ray, 8 sampler actors + trainer actor", "ray", 1, 1),
                ("ray, 8 sampler actors + 2 FSDP2 trainer ranks", "ray", 1, 2)]
    for label, backend, workers, ranks in variants:
        out = args.out / backend / f"{workers}-{ranks}"
        c = preset_config("mixed", workers=workers, **cfg)
        engine = RayBackend(trainer_ranks=ranks) if backend == "ray" else None
        t0 = time.perf_counter()
        run(c, out, model=model, tokenizer=tok, log_alerts=False, backend=engine)
        wall = time.perf_counter() - t0
        tps, step_s, idle = _throughput(read_metrics(out / "metrics.jsonl"))
        rows.append((label, wall, tps, step_s, idle))
        print(f"{label:40s} wall {wall:6.1f} s  {tps:7.1f} tok/s  {step_s:5.2f} s/step  "
              f"trainer idle {idle:.0%}", flush=True)

    # sizes on the wire
    weights = {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()}
    w_bytes = sum(p.numel() * p.element_size() for p in weights.values())
    ref = ray.put(weights)

    @ray.remote(num_cpus=0)
    class Reader:
        def read(self, box):
            t = time.perf_counter()
            got = ray.get(box[0])
            return time.perf_counter() - t, sum(p.numel() for p in got.values())

    reader = Reader.remote()
    ray.get(reader.read.remote([ref]))  # warm
    secs = [ray.get(reader.read.remote([ref]))[0] for _ in range(5)]
    fetch = statistics.median(secs)
    ray_run = args.out / "ray" / "1-1"
    from mismatch.train.batch import Unit  # noqa: F401  (pickled units name it)
    from mismatch.train.rollout import Trajectory  # noqa: F401

    recs = read_metrics(ray_run / "metrics.jsonl")
    tokens_per_episode = statistics.fmean(r["sampled_tokens"] / r["n_episodes"] for r in recs)
    sample = _one_unit(model, tok)
    unit_bytes = len(pickle.dumps(sample))
    per_episode = unit_bytes / len(sample.episodes)
    per_sampled_token = per_episode / max(1, sum(sum(e.sampled_mask) for e in sample.episodes)
                                          / len(sample.episodes))
    session.close()

    base = rows[0][2]
    print()
    print("| backend | wall (s) | tokens/s, steps 2..N | × local 1 thread | s/step "
          "| trainer idle |")
    print("|---|---|---|---|---|---|")
    for label, wall, tps, step_s, idle in rows:
        print(f"| {label} | {wall:.1f} | {tps:.1f} | {tps / base:.2f}× | {step_s:.2f} | "
              f"{idle:.0%} |")
    print()
    print(f"local Ray start-up: {ray_start:.1f} s")
    print(f"one weight version (BF16 state dict, {sum(p.numel() for p in weights.values()):,} "
          f"parameters): {w_bytes / 2**20:.2f} MiB; object-store fetch by an actor: "
          f"{fetch * 1e3:.1f} ms ({w_bytes / fetch / 2**30:.2f} GiB/s)")
    print(f"one trajectory as Ray pickles it: {per_episode / 1024:.1f} KiB "
          f"({per_sampled_token:.0f} B per sampled token, 128 candidates per token; "
          f"mean {tokens_per_episode:.0f} sampled tokens per episode in the ray run)")


def _one_unit(model, tok):
    """One unit (8 episodes) sampled locally, as a sampler actor returns it."""
    from mismatch.train.fleet import fleet
    from mismatch.train.config import preset_config
    from mismatch.train.unit_sampling import sample_units, split_units

    cfg = preset_config("mixed", tasks="arith,table")
    group = fleet("mixed")[0]
    eps = sample_units(model.eval(), tok, cfg, group, [0], 0)
    return split_units(eps, [(0, group)], 0, 0.0, cfg.samples_per_prompt)[0]


if __name__ == "__main__":
    main()
