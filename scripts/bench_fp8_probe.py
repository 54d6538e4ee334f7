"""The probe's wall time on Hopper FP8 (fast accumulation, emulated) against A100 BF16, and the
accumulation GEMM's plain reference against its fast path, side by side in one run.

Probe: `mismatch probe --gpu a100 --dtype bf16` and `--gpu h100 --dtype fp8`, each in its own
process (`--threads N`, default 1: these machines are shared, and one intra-op thread is what
keeps small ops from waiting on a busy second core), on the SmolLM2-135M-Instruct checkpoint
(scripts/smollm2.py builds it) and on the embedded default model. Wall and CPU seconds of each
process; the figure the goal speaks of is h100-fp8 / a100-bf16. With `--baseline-tree DIR` (an
exported older commit of this repository) the same probes run on that code as well, and their
results.json summaries are compared with this tree's: the speed-up must not change a number.

GEMMs: `accumulate_matmul_reference` (the model written plainly; the emulator's GEMM before the
fast path) against `accumulate_matmul` on prepared weight slices, on the FP8 GEMMs of one
SmolLM2 layer (fused q/k/v, o, fused gate/up, down) at decode (M = 8 rows) and prefill
(M = 256) sizes, with an FP32 `torch.matmul` of the same size (what the A100 BF16 emulation
runs) as the yardstick; minimum of --gemm-repeats timings; both outputs compared bit for bit.

    python scripts/bench_fp8_probe.py [--model DIR] [--n-prompts 8] [--max-new-tokens 32]
        [--threads 1] [--repeats 1] [--baseline-tree DIR] [--report reports/benchmarks.md]

A baseline tree: `git archive <commit> | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROBES = [("a100", "bf16"), ("h100", "fp8")]
# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536 — one layer's FP8
# GEMMs as the emulator runs them (q/k/v and gate/up fused), as (name, K, N)
GEMMS = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
ROWS = {"decode": 8, "prefill": 256}


def run_probe(tree: Path, gpu: str, dtype: str, model: str | None, args) -> dict:
    """--repeats probes, each in a fresh process on the code of `tree`: the least wall and CPU
    seconds, and the summary (which must be the same every time)."""
    runs = [_run_probe_once(tree, gpu, dtype, model, args) for _ in range(args.repeats)]
    if any(r["summary"] != runs[0]["summary"] for r in runs):
        raise SystemExit(f"probe {gpu} {dtype} on {tree}: repeated runs disagree")
    return {"wall": min(r["wall"] for r in runs), "cpu": min(r["cpu"] for r in runs),
            "summary": runs[0]["summary"]}


def _run_probe_once(tree: Path, gpu: str, dtype: str, model: str | None, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "mismatch.cli", "probe", "--gpu", gpu, "--dtype", dtype,
               "--n-prompts", str(args.n_prompts), "--max-new-tokens", str(args.max_new_tokens),
               "--threads", str(args.threads), "--out", out, "--json"]
        if model:
            cmd += ["--model", model]
        env = dict(os.environ, PYTHONPATH=str(tree))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            raise SystemExit(f"probe {gpu} {dtype} on {tree} failed: {' '.join(tail)}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"wall": wall, "cpu": cpu, "summary": json.loads(proc.stdout)}


def probe_table(args) -> list[str]:
    trees = [("this tree", ROOT)]
    if args.baseline_tree:
        trees.append(("baseline", Path(args.baseline_tree).resolve()))
    models = [("SmolLM2-135M", args.model)] + ([] if args.skip_embedded else [("embedded", None)])
    lines = [f"{'model':<14} {'code':<10} {'gpu-dtype':<10} {'wall s':>8} {'cpu s':>8}  "
             f"{'h100-fp8 / a100-bf16 (wall, cpu)':>32}"]
    for model_name, model in models:
        results = {}
        for tree_name, tree in trees:
            for gpu, dtype in PROBES:
                r = results[tree_name, gpu] = run_probe(tree, gpu, dtype, model, args)
                ratio = ""
                if gpu == "h100":
                    base = results[tree_name, "a100"]
                    ratio = f"{r['wall'] / base['wall']:.2f}x, {r['cpu'] / base['cpu']:.2f}x"
                lines.append(f"{model_name:<14} {tree_name:<10} {gpu + '-' + dtype:<10} "
                             f"{r['wall']:8.1f} {r['cpu']:8.1f}  {ratio:>32}")
                print(lines[-1], flush=True)
        if args.baseline_tree:
            for gpu, dtype in PROBES:
                same = results["this tree", gpu]["summary"] == results["baseline", gpu]["summary"]
                speed = results["baseline", gpu]["wall"] / results["this tree", gpu]["wall"]
                lines.append(f"{model_name:<14} {gpu}-{dtype}: baseline / this tree wall "
                             f"{speed:.2f}x; results.json summaries identical: {same}")
                print(lines[-1], flush=True)
    return lines


def _best_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and the widening buffer's first allocation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def gemm_table(args) -> list[str]:
    from mismatch.quantize.accumulate import KSlices, accumulate_matmul, accumulate_matmul_reference

    acc = "hopper-fp8-fast"
    g = torch.Generator().manual_seed(0)
    lines = [f"{'GEMM':<16} {'M':>4} {'K':>5} {'N':>5} {'fp32 ms':>8} {'old ms':>8} "
             f"{'new ms':>8} {'old/new':>8} {'old/fp32':>9} {'new/fp32':>9}  bits equal"]
    sums = {"fp32": 0.0, "old": 0.0, "new": 0.0}
    for phase, m in ROWS.items():
        for name, k, n in GEMMS:
            a = (torch.randn(m, k, generator=g) * 8).to(torch.float8_e4m3fn)
            w = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)  # [N, K] storage
            a32, w32 = a.float(), w.float()
            prepared = KSlices.of(w.t(), 32)
            ms = {"fp32": _best_ms(lambda: torch.matmul(a32, w32.t()), args.gemm_repeats),
                  "old": _best_ms(lambda: accumulate_matmul_reference(a32, w32.t(), acc),
                                  args.gemm_repeats),
                  "new": _best_ms(lambda: accumulate_matmul(a, prepared, acc), args.gemm_repeats)}
            same = torch.equal(accumulate_matmul_reference(a32, w32.t(), acc).view(torch.int32),
                               accumulate_matmul(a, prepared, acc).view(torch.int32))
            for key in sums:
                sums[key] += ms[key]
            lines.append(f"{phase + ' ' + name:<16} {m:>4} {k:>5} {n:>5} {ms['fp32']:8.2f} "
                         f"{ms['old']:8.2f} {ms['new']:8.2f} {ms['old'] / ms['new']:7.1f}x "
                         f"{ms['old'] / ms['fp32']:8.1f}x {ms['new'] / ms['fp32']:8.1f}x  {same}")
            print(lines[-1], flush=True)
    lines.append(f"{'all of the above':<28} {sums['fp32']:8.2f} {sums['old']:8.2f} "
                 f"{sums['new']:8.2f} {sums['old'] / sums['new']:7.1f}x "
                 f"{sums['old'] / sums['fp32']:8.1f}x {sums['new'] / sums['fp32']:8.1f}x")
    print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="SmolLM2 checkpoint folder (default: built by scripts/smollm2.py "
                             "into ~/.cache/mismatch/smollm2-135m-instruct)")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each probe; the least wall and CPU time is reported")
    parser.add_argument("--baseline-tree", default=None,
                        help="an exported older commit to time (and compare results) as well")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--skip-probe", action="store_true")
    parser.add_argument("--gemm-repeats", type=int, default=7)
    parser.add_argument("--report", default=None, help="append a markdown section to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None and not args.skip_probe:
        sys.path.insert(0, str(ROOT / "scripts"))
        from smollm2 import MissingPackage, build

        try:
            args.model = str(build(Path.home() / ".cache" / "mismatch" / "smollm2-135m-instruct"))
        except MissingPackage as e:
            raise SystemExit(f"error: {e}") from None
    started = datetime.date.today().isoformat()
    header = (f"# torch {torch.__version__}, {args.threads} thread(s), "
              f"{os.cpu_count()} CPUs; probe: --n-prompts {args.n_prompts} "
              f"--max-new-tokens {args.max_new_tokens} --threads {args.threads}, least of "
              f"{args.repeats} run(s); GEMMs: least of {args.gemm_repeats}")
    print(header, flush=True)
    gemm = gemm_table(args)
    probe = [] if args.skip_probe else probe_table(args)
    if args.report:
        command = "python scripts/bench_fp8_probe.py " + " ".join(sys.argv[1:])
        block = "\n".join([header, *probe, "", *gemm])
        with open(args.report, "a") as f:
            f.write(f"\n## Hopper FP8 probe vs A100 BF16; accumulation GEMM old vs new\n\n"
                    f"Command: `{command}` (measured {started}).\n\n```\n{block}\n```\n")


if __name__ == "__main__":
    main()
