"""The collapse monitor: its cost per training step, and how early and how falsely it alerts.

Cost (default): `CollapseMonitor.update` per step — a record of the native signals, and records
that carry raw episodes whose end reasons it computes (8: the episodes of an 8 x 128 batch; 1024:
a step of ~1M tokens) — against the step it watches: a training step of the embedded model
(forward + backward + AdamW on 8 x 128 tokens), and the per-token records of 1M tokens
(mismatch.metrics kl_estimators + ratio_stats on [1024, 1024] sampler and trainer log-probs).

    python scripts/bench_monitor.py [--repeats 5] [--threads 2]

Detection (`--report`): seeded synthetic traces (mismatch.probes.monitor.traces, the study's collapse shape)
run through the default monitor; writes the figures section of reports/monitor.md.

    python scripts/bench_monitor.py --report [--traces 200]

The traces are described in mismatch.probes.monitor.traces.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mismatch.io import atomic_write_text  # noqa: E402
from mismatch.probes.monitor import CollapseMonitor  # noqa: E402
from mismatch.probes.monitor.traces import KINDS, judge, run_monitor, synthetic_trace  # noqa: E402

# -- detection report ---------------------------------------------------------------------------


def _quantiles(xs: list[float], fmt: str = ".0f") -> str:
    """median (min, p90, max)"""
    if not xs:
        return "—"
    q = np.quantile(xs, [0.0, 0.5, 0.9, 1.0])
    return f"{q[1]:{fmt}} (min {q[0]:{fmt}}, p90 {q[2]:{fmt}}, max {q[3]:{fmt}})"


def detection_report(n: int) -> str:
    """The figures section of reports/monitor.md over n traces of each kind."""
    rows: dict[str, list[dict]] = {}
    healthy: dict[str, int] = {}
    for kind in KINDS:
        rows[kind] = []
        for seed in range(n):
            trace = synthetic_trace(kind, seed)
            alerts = run_monitor(trace)
            rows[kind].append(judge(trace, alerts))
            if kind in ("stable", "spike"):
                for a in alerts:
                    healthy[f"{a.signal} {a.severity}"] = healthy.get(f"{a.signal} {a.severity}",
                                                                      0) + 1
    lines = [f"Command: `python scripts/bench_monitor.py --report --traces {n}` (default "
             f"`MonitorConfig`, 200 steps per trace, seeds 0–{n - 1} of each kind).", "",
             "| traces | n | with a critical alert | with a warning | warnings / criticals per "
             "trace |", "|---|---|---|---|---|"]
    for kind in KINDS:
        r = rows[kind]
        lines.append(f"| {kind} | {len(r)} | {sum(x['criticals'] > 0 for x in r)} | "
                     f"{sum(x['warnings'] > 0 for x in r)} | "
                     f"{statistics.mean(x['warnings'] for x in r):.2f} / "
                     f"{statistics.mean(x['criticals'] for x in r):.2f} |")
    lines += ["", "| collapses | critical at or after onset | within 10 steps of onset | before "
              "the reward fell by half | both | a critical before onset |",
              "|---|---|---|---|---|---|"]
    for kind in ("collapse", "slow"):
        r = rows[kind]
        hit = [x for x in r if x["lead"] is not None]
        both = sum(x["lead"] is not None and x["lead"] <= 10 and x["before_half"] for x in r)
        lines.append(f"| {kind} | {len(hit)}/{len(r)} | {sum(x['lead'] <= 10 for x in hit)}"
                     f"/{len(r)} | {sum(x['before_half'] for x in r)}/{len(r)} | {both}/{len(r)} "
                     f"| {sum(x['false_before_onset'] > 0 for x in r)} |")
    lines += ["", "| collapses | steps from onset to the first critical: median (min, p90, max) "
              "| reward drop since onset at that step, % | signal of the first critical |",
              "|---|---|---|---|"]
    for kind in ("collapse", "slow"):
        hit = [x for x in rows[kind] if x["lead"] is not None]
        first: dict[str, int] = {}
        for x in hit:
            first[x["first_signal"]] = first.get(x["first_signal"], 0) + 1
        lines.append(f"| {kind} | {_quantiles([x['lead'] for x in hit])} | "
                     f"{_quantiles([100 * x['reward_drop'] for x in hit], '.1f')} | "
                     + ", ".join(f"{k} {v}" for k, v in sorted(first.items(),
                                                               key=lambda kv: -kv[1]))
                     + " |")
    worst = {"none": 0, "warning": 0, "critical": 0}
    near = {"none": 0, "warning": 0, "critical": 0}
    for x in rows["spike"]:
        worst["critical" if x["criticals"] else "warning" if x["warnings"] else "none"] += 1
        near[x["at_spike"]] += 1
    lines += ["", f"Spike traces (one step of 3–10× KL), worst alert anywhere in the trace: none "
              f"{worst['none']}, warning {worst['warning']}, critical {worst['critical']} of {n}; "
              f"worst alert from the spike's step to 3 steps after: none {near['none']}, warning "
              f"{near['warning']}, critical {near['critical']}.", "",
              "Alerts on the healthy traces (stable and spike) by signal: "
              + (", ".join(f"{k} {v}" for k, v in sorted(healthy.items())) or "none") + "."]
    return "\n".join(lines)


def write_report(path: Path, n: int) -> None:
    begin, end = "<!-- figures:begin -->", "<!-- figures:end -->"
    figures = detection_report(n)
    text = path.read_text() if path.exists() else f"# Collapse monitor\n\n{begin}\n{end}\n"
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} … {end} section to replace")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(path, f"{head}{begin}\n{figures}\n{end}{tail}")
    print(figures)
    print(f"wrote the figures section of {path}")


# -- cost ---------------------------------------------------------------------------------------


def _episodes(rng: np.random.Generator, n: int, turns: int) -> list[dict]:
    """n raw episodes of `turns` replies ({"tool_call": bool}), a fifth ending on format errors."""
    out = []
    for _ in range(n):
        calls = [bool(c) for c in rng.random(turns) > 0.05]
        if rng.random() < 0.2:
            calls[-3:] = [False, False, False]
        out.append({"replies": [{"tool_call": c} for c in calls],
                    "reward": float(rng.random() < 0.4)})
    return out


def _time(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_cost(repeats: int, threads: int) -> str:
    """Monitor update variants against a training step and against 1M tokens' records."""
    import torch

    torch.set_num_threads(threads)
    from mismatch.cli.common import quiet_libraries

    quiet_libraries()
    from mismatch.metrics import kl_estimators, ratio_stats
    from mismatch.zoo import load_model

    trace = synthetic_trace("stable", 0, steps=400)
    rng = np.random.default_rng(0)

    def with_episodes(n: int, form: str) -> list[dict]:
        out = []
        for i, r in enumerate(trace.records[:40]):
            episodes = _episodes(rng, n, 20)
            if form == "bools":
                episodes = [{"replies": [r["tool_call"] for r in e["replies"]],
                             "reward": e["reward"]} for e in episodes]
            elif form == "end_reason":
                episodes = [{"end_reason": "format_errors" if not e["replies"][-1]["tool_call"]
                             else "submit", "reward": e["reward"]} for e in episodes]
            out.append({"step": i, "kl": r["kl"], "reward": r["reward"], "episodes": episodes})
        return out

    variants = {
        "native signals only": trace.records,
        "+ 8 raw episodes x 20 replies (the 8x128 batch's)": with_episodes(8, "replies"),
        "+ 1024 raw episodes x 20 replies (~1M tokens)": with_episodes(1024, "replies"),
        "+ 1024 raw episodes x 20 bools (~1M tokens)": with_episodes(1024, "bools"),
        "+ 1024 episodes with end_reason (~1M tokens)": with_episodes(1024, "end_reason"),
    }

    def updates(records: list[dict]) -> float:
        def run() -> None:
            monitor = CollapseMonitor()
            for record in records:
                monitor.update(record)

        return _time(run, repeats) / len(records)

    monitor_cost = {name: updates(records) for name, records in variants.items()}

    model = load_model(dtype="bfloat16")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (8, 128), generator=gen)

    def train_step() -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # warm-up: allocations, AdamW state
    per_train = _time(train_step, repeats)

    trainer = torch.randn(1024, 1024, generator=gen) * 0.5 - 1.0  # [B, T] log π
    sampler = trainer + torch.randn(1024, 1024, generator=gen) * 0.05  # [B, T] log μ
    mask = torch.ones(1024, 1024)

    def token_records() -> None:
        kl_estimators(trainer, sampler, mask)
        ratio_stats(trainer, sampler, mask)

    token_records()
    per_tokens = _time(token_records, repeats)
    n_params = sum(p.numel() for p in model.parameters())
    width = 58
    train = f"train step: fwd+bwd+AdamW, 8x128 tokens, embedded model {n_params / 1e6:.1f}M"
    lines = [f"# CollapseMonitor.update per step vs the step it watches; torch {torch.__version__},"
             f" {threads} threads, median of {repeats}",
             f"{'yardstick':<{width}}{'ms':>10}",
             f"{train:<{width}}{per_train * 1e3:>10.1f}",
             f"{'per-token records of 1M tokens (kl_estimators + ratio_stats)':<{width}}"
             f"{per_tokens * 1e3:>10.1f}", "",
             f"{'monitor.update, per step':<{width}}{'ms':>10}{'/ train':>10}{'/ 1M tok':>10}"]
    for name, cost in monitor_cost.items():
        lines.append(f"{name:<{width}}{cost * 1e3:>10.4f}{cost / per_train:>10.2e}"
                     f"{cost / per_tokens:>10.2e}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true",
                        help="write the detection figures into reports/monitor.md")
    parser.add_argument("--traces", type=int, default=200, help="traces of each kind")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "monitor.md")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.report:
        write_report(args.out, args.traces)
    else:
        print(bench_cost(args.repeats, args.threads))


if __name__ == "__main__":
    main()
