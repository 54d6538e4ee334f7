"""Benchmark: training throughput and the trainer's idle share, asynchronous against --sync,
side by side in one process (these machines are noisy: compare ratios, not absolutes).

    python scripts/bench_train_async.py [--steps 12] [--workers 1 2] [--out reports/...md]

Each configuration trains `--steps` steps of the `mixed` preset (4 prompts × 8 episodes, the
sc+mis+topp arm) from the embedded model, async then sync, with the same workers and threads.
The first step (start-up: models copied, first calibration) is left out of the rates.
Amdahl's bound for a pipeline of one sampling stage S and one training stage T sharing nothing is
(S + T) / max(S, T); the table prints it from the sync run's measured S and T.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _one(steps: int, workers: int, threads: int, sync: bool, model, tok) -> dict:
    from mismatch.train.config import preset_config
    from mismatch.train.loop import run
    from mismatch.train.rundir import read_metrics

    cfg = preset_config("mixed", steps=steps, workers=workers, threads=threads, sync=sync,
                        eval_tasks=0, checkpoint_every=steps)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        run(cfg, Path(d) / "run", model=model, tokenizer=tok, log_alerts=False)
        total = time.perf_counter() - t0
        recs = read_metrics(Path(d) / "run" / "metrics.jsonl")[1:]
    wall = sum(r["step_seconds"] for r in recs)
    wait = sum(r["trainer_wait_seconds"] for r in recs)
    train = sum(r["train_seconds"] for r in recs)
    return {"steps_per_min": 60 * len(recs) / wall, "idle": wait / wall,
            "sample_s": wait / len(recs), "train_s": train / len(recs),
            "tokens_per_s": sum(r["sampled_tokens"] for r in recs) / wall,
            "staleness": sum(r["staleness_mean"] for r in recs) / len(recs), "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()

    from mismatch.cli.common import quiet_libraries

    quiet_libraries()
    from mismatch.zoo import load_model, load_tokenizer

    model, tok = load_model(dtype="bfloat16"), load_tokenizer()
    rows = []
    for w in args.workers:
        a = _one(args.steps, w, args.threads, False, model, tok)
        s = _one(args.steps, w, args.threads, True, model, tok)
        bound = (s["sample_s"] + s["train_s"]) / max(s["sample_s"], s["train_s"])
        rows.append((w, a, s, bound))
        print(f"workers={w}: async {a['steps_per_min']:.2f} steps/min (idle {a['idle']:.0%}), "
              f"sync {s['steps_per_min']:.2f} (idle {s['idle']:.0%}), ratio "
              f"{a['steps_per_min'] / s['steps_per_min']:.2f}x, bound {bound:.2f}x", flush=True)
    lines = [f"`python {' '.join(shlex.quote(x) for x in sys.argv)}` — {args.steps} steps "
             f"each (first left out), torch threads {args.threads}, mixed preset "
             "(4 prompts × 8 episodes, sc+mis+topp)", "",
             "| sampler workers | async steps/min | sync steps/min | async / sync | "
             "trainer idle, async | trainer idle, sync | sync: sample s + train s per step | "
             "Amdahl bound | async staleness (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for w, a, s, bound in rows:
        lines.append(f"| {w} | {a['steps_per_min']:.2f} | {s['steps_per_min']:.2f} | "
                     f"**{a['steps_per_min'] / s['steps_per_min']:.2f}×** | {a['idle']:.0%} | "
                     f"{s['idle']:.0%} | {s['sample_s']:.1f} + {s['train_s']:.1f} | "
                     f"{bound:.2f}× | {a['staleness']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
