"""The rollout engine and the training step, against the code before it and against the floors,
side by side in one run (these machines are noisy: only ratios measured together mean much).

1. Step time of `mismatch train --sync --prompts 16 --samples 8 --steps 3 --tasks arith` on the
   `homogeneous` and `mixed` presets: this tree (its defaults: sampler processes, one per core)
   against a baseline tree (an older commit checked out with `git worktree add`), each run in its
   own process; the figure is the median step_seconds of the steps after the first. Goal: ≥ 4×
   faster on homogeneous, ≥ 5× on mixed.
2. The floor of that step, measured here: a bare batched decode of the step's sampled tokens
   (the model's own forward over a static slot cache, batch = the step's episodes, greedy,
   nothing recorded) plus a bare forward + backward + AdamW over the step's token batch (BF16
   compute, FP32 master). Goal: step ≤ 1.5× the floor.
3. Engine tokens/s against the bare decode loop of the same model on the same prompts (static
   cache, no emulation, no bookkeeping): the engine unemulated (goal ≥ 50% of the loop), and
   emulated B200 BF16 against emulated B200 NVFP4 (goal: NVFP4 ≤ 1.3× BF16's time).
4. Asynchronous vs `--sync` steps per minute, both with sampler processes (goal ≥ 1.0×).
5. Under load (`load`): the homogeneous step of both trees again with one CPU-bound competing
   process per core running; the speed-up under load against the quiet one (goal ≥ 75%).
6. What a mixed half costs (`mixcost`, this tree only): each of the two halves the lockstep
   step gives its sampler processes, sampled in this process on one thread as it is, with every
   group's GEMMs as BF16's (no weight or activation format, FP32 accumulation), with every
   group's attention and KV cache as the homogeneous fleet's, and as the homogeneous fleet
   itself; rounds interleaved, medians. The differences say which numerics the mixed step pays
   for (changed numerics sample other tokens: the tokens are printed beside the seconds).

    python scripts/bench_rollouts.py [--baseline-tree DIR] [--steps 3] [--report FILE]
        [--sections steps,decode,async,load,mixcost]

The first line is the CPU's model and vector extensions (whether it has fast BF16). Section
`steps` also gives the mixed / homogeneous step ratio of each tree (goal ≤ 1.3×: a mixed fleet's
groups share one engine batch, mismatch.engines.lanes).

Every figure is printed in one table and, with --report, appended to that file with the command
and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tree import tree_command  # noqa: E402
from bench_metrics import cpu_line  # noqa: E402

SECTIONS = ("steps", "decode", "async", "load", "mixcost")
TRAIN = ["--prompts", "16", "--samples", "8", "--tasks", "arith", "--eval-tasks",
         "0", "--correction", "grpo", "--threads", "1", "-q"]


def train_steps(tree: Path, preset: str, steps: int, extra: list[str]) -> dict:
    """One `mismatch train` run on the code of `tree`: its per-step records and wall time, and
    medians of the steps after the first."""
    with tempfile.TemporaryDirectory() as out:
        cmd, env = tree_command(tree, "mismatch.cli", ["train", "--preset", preset, "--steps",
                                                        str(steps), "--out", out, *TRAIN, *extra])
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"train on {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
        recs = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
    later = recs[1:] or recs
    return {"recs": recs, "wall": wall,
            "step": statistics.median(r["step_seconds"] for r in later),
            "train": statistics.median(r["train_seconds"] for r in later),
            "tokens": statistics.median(r["sampled_tokens"] for r in later)}


def _prompts(tok, n: int) -> list[list[int]]:
    from mismatch.engines.episodes import render_chat
    from mismatch.zoo.tasks import generate_tasks

    return [render_chat(tok, t.prompt_messages(), generation=True)
            for t in generate_tasks("heldout", n)]


@torch.no_grad()
def bare_decode(model, prompts: list[list[int]], steps: int) -> float:
    """Seconds of a bare batched decode loop: prefill (right-padded), then `steps` greedy
    tokens for every row over a static slot cache; nothing recorded."""
    from mismatch.engines.kv_cache import SlotCache

    cfg = model.config
    b = len(prompts)
    width = max(len(p) for p in prompts)
    cache = SlotCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, cfg.head_dim,
                      width + steps, next(model.parameters()).dtype, torch.device("cpu"))
    rows = torch.arange(b)
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    t0 = time.perf_counter()
    pos = torch.arange(width)[None].expand(b, width)
    cache.plan(rows, torch.zeros(b, dtype=torch.long), lens, width, width)
    mask = (torch.arange(width)[None, None, :] <= pos[:, :, None])[:, None]
    h = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True).last_hidden_state
    token = model.lm_head(h[rows, lens - 1]).argmax(-1)
    for j in range(steps):
        at = lens + j
        tk = int(at.max()) + 1
        cache.plan(rows, at, torch.ones(b, dtype=torch.long), 1, tk)
        mask = (torch.arange(tk)[None, :] <= at[:, None])[:, None, None]
        h = model.model(input_ids=token[:, None], attention_mask=mask, position_ids=at[:, None],
                        past_key_values=cache, use_cache=True).last_hidden_state
        token = model.lm_head(h[:, -1]).argmax(-1)
    return time.perf_counter() - t0


def engine_run(model, prompts, steps: int, spec=None) -> tuple[float, int]:
    """Seconds and generated tokens of the engine on `prompts` (`steps` tokens each at most,
    temperature 1, 128 candidates), under `spec`'s numerics when given."""
    import contextlib

    from mismatch.engines.engine import Engine
    from mismatch.engines.requests import Request
    from mismatch.engines.numerics import apply_numerics, calibrate
    from mismatch.engines.logits import SamplingParams

    ctx = contextlib.nullcontext()
    if spec is not None:
        scales = None
        if spec.activation_codec:
            scales = calibrate(model, spec, [(torch.tensor([p]), torch.ones(1, len(p),
                                                                           dtype=torch.long))
                                             for p in prompts[:8]])
        ctx = apply_numerics(model, spec, scales)
    params = SamplingParams(max_new_tokens=steps, candidates=128)
    with ctx:
        engine = Engine(model, pad_id=0, eos_ids=set(), slots=len(prompts))
        t0 = time.perf_counter()
        out = engine.run([Request(prompt=p, params=params, seed=i)
                          for i, p in enumerate(prompts)])
        dt = time.perf_counter() - t0
    return dt, sum(len(c.tokens) for c in out)


def bare_train(model, batch: int, length: int, repeats: int = 2) -> float:
    """Seconds of forward + backward + AdamW over [batch, length] tokens: BF16 compute model,
    FP32 master weights (the trainer's layout), least of `repeats`."""
    import copy

    compute = copy.deepcopy(model).to(torch.bfloat16).train()
    master = [p.detach().float().clone().requires_grad_(True) for p in compute.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-5)
    ids = torch.randint(5, model.config.vocab_size - 1, (batch, length))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = compute(input_ids=ids).logits.float()
        lp = torch.log_softmax(out[:, :-1], -1).gather(-1, ids[:, 1:, None])
        (-lp.mean()).backward()
        for m, p in zip(master, compute.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(master, compute.parameters()):
                p.copy_(m)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a checkout of the code to compare with (git worktree add DIR REV); "
                         "sections steps and load need it")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--report", type=Path, default=None)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    args = ap.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not sections or any(x not in SECTIONS for x in sections):
        raise SystemExit(f"bench_rollouts: --sections takes some of {', '.join(SECTIONS)}; "
                         f"got {args.sections!r}")
    if args.baseline_tree is None and {"steps", "load"} & set(sections):
        raise SystemExit("bench_rollouts: sections steps and load compare with an older "
                         "checkout; pass --baseline-tree DIR (git worktree add DIR REV)")
    torch.set_num_threads(1)
    from mismatch.runtime import tune_allocator

    tune_allocator()
    from mismatch.kernels import native

    lib = native.library()
    kernels = ("off (the torch code)" if lib is None else
               f"on, {os.environ.get(native.MARCH_ENV) or 'native'} build, vectors of "
               f"{lib.mismatch_native_vector_width()} doubles")
    lines = [f"# {cpu_line()}",
             f"# torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
             f"{os.getloadavg()[0]:.1f}; train: {' '.join(TRAIN)} --steps {args.steps}",
             f"# this tree's native CPU kernels: {kernels}"]

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    for line in lines:
        print(line, flush=True)

    from mismatch.zoo import load_model, load_tokenizer

    model, tok = load_model(dtype="bfloat16"), load_tokenizer()
    step_runs, old_runs = {}, {}
    if "steps" in sections:
        say(f"{'step (median of steps 2..)':34} {'baseline s':>11} {'this tree s':>12} "
            f"{'speed-up':>9} {'floor s':>8} {'step/floor':>11}")
    for preset in ("homogeneous", "mixed") if "steps" in sections else ():
        old = train_steps(args.baseline_tree, preset, args.steps, ["--sync"])
        new = train_steps(ROOT, preset, args.steps, ["--sync"])
        step_runs[preset], old_runs[preset] = new, old
        episodes = 16 * 8
        per_row = max(1, round(new["tokens"] / episodes))
        decode_s = bare_decode(model, _prompts(tok, episodes), per_row)
        length = max(len(p) for p in _prompts(tok, 8)) + int(new["tokens"] / episodes) + 48
        floor = decode_s + bare_train(model, episodes, length)
        say(f"{'sync 16x8 ' + preset:34} {old['step']:11.2f} {new['step']:12.2f} "
            f"{old['step'] / new['step']:8.2f}x {floor:8.2f} {new['step'] / floor:10.2f}x")
        say(f"{'  of which training (train_seconds)':34} {old['train']:11.2f} "
            f"{new['train']:12.2f} {old['train'] / new['train']:8.2f}x")

    if "steps" in sections:
        say(f"{'mixed / homogeneous step':34} "
            f"{old_runs['mixed']['step'] / old_runs['homogeneous']['step']:10.2f}x "
            f"{step_runs['mixed']['step'] / step_runs['homogeneous']['step']:11.2f}x")
    if "decode" in sections:
        decode_section(model, tok, say)
    if "async" in sections:
        sync = step_runs.get("homogeneous") or train_steps(ROOT, "homogeneous", args.steps,
                                                           ["--sync"])
        async_section(sync, args.steps, say)
    if "load" in sections:
        load_section(args.baseline_tree, old_runs.get("homogeneous"),
                     step_runs.get("homogeneous"), args.steps, say)
    if "mixcost" in sections:
        mixcost_section(model, tok, say)
    if args.report:
        stamp = datetime.date.today().isoformat()
        cmd = "python scripts/bench_rollouts.py " + " ".join(sys.argv[1:])
        block = (f"\n## Rollout engine and training step ({stamp})\n\nCommand: `{cmd}`\n\n```\n"
                 + "\n".join(lines) + "\n```\n")
        with open(args.report, "a") as fh:
            fh.write(block)


def decode_section(model, tok, say) -> None:
    prompts = _prompts(tok, 128)
    loop = bare_decode(model, prompts, 64)
    loop_tokens = 128 * 64
    say("")
    say(f"{'decode, 128 prompts x 64 tokens':34} {'seconds':>11} {'tokens/s':>12} "
        f"{'vs loop':>9}")
    say(f"{'bare loop (no emulation)':34} {loop:11.2f} {loop_tokens / loop:12.0f} {1.0:8.2f}x")
    from mismatch.profiles import resolve

    results = {}
    for label, spec in (("engine, no emulation", None), ("engine, emulated b200 bf16",
                                                         resolve("b200", "bf16")),
                        ("engine, emulated b200 nvfp4", resolve("b200", "nvfp4"))):
        dt, n = engine_run(model, prompts, 64, spec)
        results[label] = dt
        say(f"{label:34} {dt:11.2f} {n / dt:12.0f} {(n / dt) / (loop_tokens / loop):8.2f}x")
    say(f"{'nvfp4 / bf16 (emulated) time':34} "
        f"{results['engine, emulated b200 nvfp4'] / results['engine, emulated b200 bf16']:11.2f}x")


def mixcost_section(model, tok, say, rounds: int = 3) -> None:
    """Section 6 (module docstring): the study's mixed step, its units claimed in order."""
    import dataclasses

    from mismatch.train.config import preset_config
    from mismatch.train.fleet import fleet
    from mismatch.train.pipeline import _halves
    from mismatch.train.unit_sampling import sample_units

    def config(preset):
        return preset_config(preset, prompts_per_step=16, samples_per_prompt=8, tasks="arith")

    cfg = config("mixed")
    groups = fleet(cfg.fleet)
    homog = fleet(config("homogeneous").fleet)[0]
    base = homog.spec

    def variant(group, what: str):
        spec = group.spec
        if what == "homogeneous fleet":
            return homog
        if what == "GEMMs as BF16":
            spec = dataclasses.replace(spec, weight_codec=None, activation_codec=None,
                                       accumulation="fp32", split_k=base.split_k)
        elif what == "attention as homogeneous":
            spec = dataclasses.replace(spec, attention=base.attention, kv_codec=base.kv_codec,
                                       kv_cache=base.kv_cache)
        return dataclasses.replace(group, spec=spec)

    whats = ["as is", "GEMMs as BF16", "attention as homogeneous", "homogeneous fleet"]
    say("")
    say(f"{'mixed half, in-process, 1 thread':34} {'seconds':>11} {'tokens':>12} "
        f"{'vs as is':>9}")
    halves = _halves([(u, groups[u % len(groups)]) for u in range(cfg.prompts_per_step)])
    for i, half in enumerate(halves):
        units = [u for u, _ in half]
        took: dict[str, list[float]] = {w: [] for w in whats}
        tokens: dict[str, int] = {}
        for r in range(rounds):
            for what in whats if r % 2 else whats[::-1]:
                gs = [variant(g, what) for _, g in half]
                scales: dict = {}
                sample_units(model, tok, cfg, gs, units, 0, scales=scales)  # calibrated, warm
                t0 = time.perf_counter()
                eps = sample_units(model, tok, cfg, gs, units, 0, scales=scales)
                took[what].append(time.perf_counter() - t0)
                tokens[what] = sum(sum(e.sampled_mask) for e in eps)
        kinds = ", ".join(dict.fromkeys(g.name for _, g in half))
        say(f"half {i}: {kinds}")
        first = statistics.median(took["as is"])
        for what in whats:
            sec = statistics.median(took[what])
            say(f"{'  ' + what:34} {sec:11.2f} {tokens[what]:12d} {sec - first:+8.2f}s")


def _competitors(n: int) -> list[subprocess.Popen]:
    """`n` CPU-bound processes (a busy loop each), for as long as the caller keeps them."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def load_section(baseline: Path, quiet_old: dict | None, quiet_new: dict | None, steps: int,
                 say) -> None:
    """The homogeneous `--sync` step of both trees with one competitor per core, beside the
    quiet figures (measured here when the steps section did not run)."""
    if quiet_old is None or quiet_new is None:
        quiet_old = train_steps(baseline, "homogeneous", steps, ["--sync"])
        quiet_new = train_steps(ROOT, "homogeneous", steps, ["--sync"])
    cores = len(os.sched_getaffinity(0))
    procs = _competitors(cores)
    try:
        old = train_steps(baseline, "homogeneous", steps, ["--sync"])
        new = train_steps(ROOT, "homogeneous", steps, ["--sync"])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    quiet = quiet_old["step"] / quiet_new["step"]
    loaded = old["step"] / new["step"]
    say("")
    say(f"{'sync 16x8 homogeneous':34} {'baseline s':>11} {'this tree s':>12} {'speed-up':>9}")
    say(f"{'  quiet':34} {quiet_old['step']:11.2f} {quiet_new['step']:12.2f} {quiet:8.2f}x")
    say(f"{f'  {cores} CPU-bound competitors':34} {old['step']:11.2f} {new['step']:12.2f} "
        f"{loaded:8.2f}x")
    say(f"{'speed-up under load / quiet':34} {loaded / quiet:11.0%}")


def async_section(sync: dict, steps: int, say) -> None:
    """Steps a minute of the homogeneous 16 x 8 step, `--sync` and asynchronous. An asynchronous
    run's steps alternate long and short (a step whose units were sampled ahead is short), so
    besides the median step it gives the rate over all steps after the first (their mean)."""
    say("")
    asyn = train_steps(ROOT, "homogeneous", steps + 1, [])

    def mean_step(run: dict) -> float:
        later = run["recs"][1:] or run["recs"]
        return statistics.fmean(r["step_seconds"] for r in later)

    say(f"{'homogeneous 16x8, processes':34} {'steps/min':>11} {'(mean)':>8}")
    sync_rate, sync_mean = 60.0 / sync["step"], 60.0 / mean_step(sync)
    asyn_rate, asyn_mean = 60.0 / asyn["step"], 60.0 / mean_step(asyn)
    say(f"{'--sync':34} {sync_rate:11.2f} {sync_mean:8.2f}")
    say(f"{'asynchronous':34} {asyn_rate:11.2f} {asyn_mean:8.2f}   async/sync "
        f"{asyn_rate / sync_rate:.2f}x (mean {asyn_mean / sync_mean:.2f}x)")


if __name__ == "__main__":
    main()
