"""Benchmark: the trainer's half of a step against the bare floor, before and after, side by side.

    python scripts/bench_train_step.py [--before REV|DIR] [--arms grpo sc+mis+topp]
                                        [--repeats 3] [--out FILE]

One 16 × 8 step of `mismatch train --preset homogeneous --sync --tasks arith` is sampled once
(train.rollout.run_episodes, the homogeneous B200-BF16 group, full-distribution sampling, 128
candidates per token) and every variant trains on those same episodes, each in its own worker
process:

- floor: forward + backward + AdamW of the same [B, T] tokens through the embedded model, no
  attention mask, a plain cross-entropy over the sampled tokens: FP32; FP32 weights under BF16
  autocast; BF16 weights (the numerics the trainer computes its loss in, on its master's BF16
  cast); nothing of the trainer (no master copy, no candidates, no metrics).
- before / after: what `_run` times as `train_seconds` — build_batch, Trainer.step (the arm's
  loss on the BF16 cast, AdamW on the FP32 master, the step's metrics), Trainer.published() —
  of the `--before` checkout (default: the merge base of HEAD and main, exported with
  `git archive`; or a directory holding a checkout) and of this one, each imported through
  PYTHONPATH. "after lockstep" is the trainer as a `--sync` run builds it (Trainer.threads: it
  takes the idle sampler's thread while it steps); "after" runs on the process's one thread.

The workers of a table section (the floors; one arm's trainers) are started together and
stepped in turn, so that a change of load on the shared machine hits them alike; the first step
of each (allocator and kernel warm-up) is left out, the table gives the median of `--repeats`
steps. These machines are shared and noisy: compare the ratios.
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
PROMPTS, SAMPLES, TASKS = 16, 8, ("arith",)
FLOORS = ("fp32", "bf16-autocast", "bf16")


def _config(arm: str):
    from mismatch.train.config import preset_config

    return preset_config("homogeneous", correction=arm, sync=True, prompts_per_step=PROMPTS,
                         samples_per_prompt=SAMPLES, tasks=",".join(TASKS), eval_tasks=0)


def sample_units(path: Path) -> dict:
    """Sample one step's units with this checkout and pickle them to `path`."""
    import torch

    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.train.fleet import fleet
    from mismatch.train.rollout import run_episodes
    from mismatch.train.batch import Unit, task_of

    torch.set_num_threads(1)
    cfg = _config("grpo")
    model, tok = load_model(dtype="bfloat16").eval(), load_tokenizer()
    group = fleet("homogeneous")[0]
    tasks = [task_of(u, cfg.seed, cfg.task_kinds) for u in range(PROMPTS) for _ in range(SAMPLES)]
    t0 = time.perf_counter()
    with torch.no_grad():
        eps = run_episodes(model, tok, tasks, group, version=0,
                           max_turns=cfg.rollout.max_turns,
                           max_new_tokens=cfg.rollout.max_new_tokens,
                           top_k_candidates=cfg.rollout.candidates,
                           seed=1)
    seconds = time.perf_counter() - t0
    units = [Unit(index=u, group=group.name, version=0,
                  episodes=eps[u * SAMPLES:(u + 1) * SAMPLES], seconds=seconds / PROMPTS)
             for u in range(PROMPTS)]
    path.write_bytes(pickle.dumps(units))
    lengths = [len(ep.token_ids) for ep in eps]
    return {"sample_s": seconds, "rows": len(eps), "longest": max(lengths),
            "mean_length": sum(lengths) / len(lengths),
            "sampled": sum(sum(ep.sampled_mask) for ep in eps)}


def _floor(units, dtype: str):
    """One step of the floor: a callable that returns its timings."""
    import torch
    import torch.nn.functional as F

    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.train.batch import build_batch

    tok = load_tokenizer()
    batch = build_batch(units, 0, tok.pad_token_id)
    model = load_model(dtype="bfloat16" if dtype == "bf16" else "float32").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    target = torch.where(batch.mask[:, 1:], batch.ids[:, 1:], -100)

    def step() -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16-autocast"):
            logits = model(input_ids=batch.ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}

    return step


def memory() -> dict:
    """The process's resident memory and (glibc) the heap bytes in use, in MiB."""
    import ctypes

    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024
    try:
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd "
                                                       "usmblks fsmblks uordblks fordblks "
                                                       "keepcost").split()]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
        info = libc.mallinfo2()
        out["in_use_mib"] = (info.uordblks + info.hblkhd) / 2 ** 20
    except (OSError, AttributeError):  # not glibc
        pass
    return out


def _trainer(units, arm: str, lockstep: bool):
    """One step of the trainer as `_run` times it: a callable that returns its timings."""
    import torch

    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.train.batch import build_batch
    from mismatch.train.trainer import Trainer

    tok = load_tokenizer()
    trainer = Trainer(load_model(dtype="bfloat16"), _config(arm))
    if not lockstep and hasattr(trainer, "threads"):
        trainer.threads = None  # the process's threads, as the pipelined modes run

    def step() -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = build_batch(units, 0, tok.pad_token_id)
        t1 = time.perf_counter()
        trainer.step(batch)
        t2 = time.perf_counter()
        trainer.published()
        t3 = time.perf_counter()
        return {"seconds": t3 - t0, "cpu": time.process_time() - c0, "build": t1 - t0,
                "step": t2 - t1, "publish": t3 - t2,
                "step_threads": getattr(trainer, "threads", None) or torch.get_num_threads(),
                **memory()}

    return step


def worker(spec: dict) -> None:
    """Load, report the package imported, then run one step per line read from stdin (one
    JSON line of timings each)."""
    import torch

    from mismatch import train

    torch.set_num_threads(spec["threads"])
    units = pickle.loads(Path(spec["units"]).read_bytes())
    step = (_floor(units, spec["dtype"]) if spec["kind"] == "floor"
            else _trainer(units, spec["arm"], spec["lockstep"]))
    print(json.dumps({"package": str(Path(train.__file__).resolve().parents[1])}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(step()), flush=True)


class _Worker:
    """A worker process importing the packages under `root`."""

    def __init__(self, spec: dict, root: Path) -> None:
        self.spec, self.root, self.steps = spec, root, []
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                     env=dict(os.environ, PYTHONPATH=str(root)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines()[-15:]
            sys.exit(f"bench_train_step: worker {self.spec} failed:\n" + "\n".join(err))
        return json.loads(line)

    def ready(self) -> None:
        package = self._read()["package"]
        if Path(package) != self.root:
            sys.exit(f"bench_train_step: the worker imported {package}, not {self.root}")

    def step(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.steps.append(self._read())

    def close(self) -> dict:
        self.proc.stdin.close()
        self.proc.wait()
        kept = self.steps[1:]  # the first step warms up
        return {k: statistics.median(s[k] for s in kept) for k in kept[0]}


def _measure(specs: list[tuple[dict, Path]], repeats: int) -> list[dict]:
    """Start the workers together, then step them in turn for `repeats` + 1 rounds."""
    workers = [_Worker(spec, root) for spec, root in specs]
    for w in workers:
        w.ready()
    for _ in range(repeats + 1):
        for w in workers:
            w.step()
    return [w.close() for w in workers]


def _export(before: str, into: Path) -> Path:
    """The directory of the 'before' packages: `before` itself, or its git revision exported."""
    if Path(before).is_dir():
        return Path(before).resolve()
    rev = before
    if rev == "merge-base":
        rev = subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"],
                             capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True,
                             check=True).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _table(rows: list[tuple[str, int, dict]], info: dict, args) -> str:
    import torch

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    floors = {(name.split(" ", 1)[1], threads): r["seconds"]
              for name, threads, r in rows if name.startswith("floor")}
    lines = [f"# {PROMPTS} prompts x {SAMPLES} samples ({','.join(TASKS)}), homogeneous "
             f"B200-BF16 sampler: {info['rows']} rows, longest {info['longest']}, mean "
             f"{info['mean_length']:.0f} tokens, {info['sampled']} sampled; K = 128",
             f"# torch {torch.__version__}, {os.cpu_count()} CPUs; median of {args.repeats} "
             f"interleaved steps after 1 warm-up; after = {rev}, before = {args.before}",
             "# seconds: wall (cpu: the process's CPU seconds); build, step: build_batch and "
             "Trainer.step inside it; ratios of wall seconds at the same threads",
             f"{'variant':26s} {'threads':>7s} {'seconds':>8s} {'cpu':>6s} {'build':>6s} "
             f"{'step':>6s} {'/fp32':>7s} {'/bf16-ac':>8s} {'/bf16':>7s} {'/before':>8s}"]
    befores: dict[tuple[str, int], float] = {}
    for name, threads, r in rows:
        t, used = r["seconds"], int(r.get("step_threads", threads))
        arm, _, label = name.partition(" ")
        if label == "before":
            befores[arm, used] = t
        ref = befores.get((arm, used)) if label.startswith("after") else None
        parts = (f"{r['build']:6.2f} {r['step']:6.2f}" if "build" in r else " " * 13)
        lines.append(f"{name:26s} {used:7d} {t:8.2f} {r['cpu']:6.2f} {parts} "
                     + " ".join(f"{t / floors[f, used]:{w - 1}.2f}x"
                                for f, w in zip(FLOORS, (7, 8, 7)))
                     + (f" {t / ref:7.2f}x" if ref else ""))
    return "\n".join(line.rstrip() for line in lines)


def write_table(text: str, out: Path | None, script: str) -> None:
    """Print a benchmark's table and, with `out`, write it there with the command that made it."""
    print(text)
    if out:
        command = " ".join([f"python scripts/{script}", *sys.argv[1:]])
        out.write_text(f"Command: `{command}`, {datetime.date.today()}\n\n```\n{text}\n```\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="merge-base",
                    help="git revision or checkout directory of the 'before' trainer "
                         "(default: merge-base, of HEAD and main)")
    ap.add_argument("--arms", nargs="+", default=["grpo", "sc+mis+topp"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    if args.worker:
        import logging
        import warnings

        logging.disable(logging.WARNING)
        warnings.filterwarnings("ignore")
        worker(json.loads(args.worker))
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        before = _export(args.before, tmp / "before")
        units = tmp / "units.pkl"
        res = subprocess.run([sys.executable, "-c",
                              "import json, sys; from pathlib import Path;"
                              "from bench_train_step import sample_units;"
                              "print(json.dumps(sample_units(Path(sys.argv[1]))))", str(units)],
                             env=dict(os.environ,
                                      PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'scripts'}"),
                             capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit("bench_train_step: sampling failed:\n" + res.stderr[-2000:])
        info = json.loads(res.stdout.strip().splitlines()[-1])
        base = {"units": str(units)}
        rows: list[tuple[str, int, dict]] = []
        specs = [(dict(base, kind="floor", dtype=dtype, threads=threads), ROOT)
                 for dtype in FLOORS for threads in (1, 2)]
        for (spec, _), r in zip(specs, _measure(specs, args.repeats)):
            rows.append((f"floor {spec['dtype']}", spec["threads"], r))
        for arm in args.arms:
            variants = (("before", before, 1, True), ("before", before, 2, True),
                        ("after", ROOT, 1, False), ("after lockstep", ROOT, 1, True))
            specs = [(dict(base, kind="trainer", arm=arm, threads=threads, lockstep=lockstep),
                      root) for _, root, threads, lockstep in variants]
            for (label, _, threads, _), r in zip(variants, _measure(specs, args.repeats)):
                rows.append((f"{arm} {label}", threads, r))
    write_table(_table(rows, info, args), args.out, "bench_train_step.py")


if __name__ == "__main__":
    main()
