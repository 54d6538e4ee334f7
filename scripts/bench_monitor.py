"""The collapse monitor: its cost per training step, and how early and how falsely it alerts.

Cost (default): `CollapseMonitor.update` per step — a record of the native signals, and records
that carry raw episodes whose end reasons it computes (8: the episodes of an 8 x 128 batch; 1024:
a step of ~1M tokens) — against the step it watches: a training step of the embedded model
(forward + backward + AdamW on 8 x 128 tokens), and the per-token records of 1M tokens
(mismatch.metrics kl_estimators + ratio_stats on [1024, 1024] sampler and trainer log-probs).

    python scripts/bench_monitor.py [--repeats 5] [--threads 2]

Detection (`--report`): seeded synthetic traces (`synthetic_trace`, the study's collapse shape)
run through the default monitor; writes the figures section of reports/monitor.md.

    python scripts/bench_monitor.py --report [--traces 200]

The traces: 200 steps each. Healthy runs have a noisy sampler–trainer KL (log-AR(1) noise, 10–30%
per step, drifting ×0.75–1.4 over the run), a learning reward with batch noise, a few percent of
episodes ending on format errors (binomial over 256–1024 episodes), slowly falling entropy.
A collapse at a known onset step follows the study's signature: the KL rises log-linearly to 3×
within 3–10 steps and on to 3.5–10×; the share of episodes ending on format errors rises to
50–80% over 4–12 steps from 0–3 steps after onset; the reward falls by 70–95% over 10–30 steps
from 2–8 steps after onset; entropy and length move either way. A "slow" collapse stretches each
ramp 2.5× (KL at 3× after 7.5–25 steps), outside what the tests require. A spike run is a
healthy run with one step whose KL (and masked share) is 3–10× its neighbours.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mismatch.probes.monitor import CollapseMonitor, MonitorConfig  # noqa: E402

KINDS = ("stable", "collapse", "slow", "spike")


@dataclass
class Trace:
    """One synthetic run: its records and, for collapses, where the truth lies."""

    kind: str
    seed: int
    records: list[dict]
    onset: int | None
    """Step the collapse starts (the KL ramp's first step); the spike's step for spikes."""
    reward_true: np.ndarray
    """The noiseless reward curve."""
    half_step: int | None
    """First step at or after onset whose noiseless reward is at most half its onset value."""


def _ar1(rng: np.random.Generator, n: int, phi: float, sigma: float) -> np.ndarray:
    """Stationary AR(1) noise with marginal standard deviation sigma."""
    out = np.empty(n)
    out[0] = rng.normal(0.0, sigma)
    shocks = rng.normal(0.0, sigma * math.sqrt(1 - phi * phi), n)
    for i in range(1, n):
        out[i] = phi * out[i - 1] + shocks[i]
    return out


def _ramp(t: np.ndarray, start: float, duration: float) -> np.ndarray:
    """0 before start, smoothstep to 1 over duration steps."""
    x = np.clip((t - start) / duration, 0.0, 1.0)
    return x * x * (3 - 2 * x)


def synthetic_trace(kind: str, seed: int, steps: int = 200) -> Trace:
    """A seeded synthetic training run of `kind` (stable, collapse, slow, spike)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rng = np.random.default_rng([KINDS.index(kind), seed])
    t = np.arange(steps, dtype=float)
    log_kl = (math.log(10 ** rng.uniform(-3.5, -2.5)) + math.log(rng.uniform(0.75, 1.4)) * t / steps
              + _ar1(rng, steps, 0.5, rng.uniform(0.1, 0.3)))
    f = np.full(steps, rng.uniform(0.0, 0.06))
    n_episodes = int(rng.integers(256, 1025))
    r0, gain, tau = rng.uniform(0.2, 0.5), rng.uniform(0.0, 0.25), rng.uniform(30, 120)
    reward = r0 + gain * (1 - np.exp(-t / tau))
    reward_sd = rng.uniform(0.015, 0.035)
    entropy = rng.uniform(0.3, 1.0) * (1 - rng.uniform(0.0, 0.3) * t / steps)
    length = rng.uniform(200, 2000) * (1 + rng.uniform(-0.2, 0.3) * t / steps)
    masked0 = rng.uniform(0.001, 0.008)
    onset = half = None
    if kind in ("collapse", "slow"):
        stretch = 2.5 if kind == "slow" else 1.0
        onset = int(rng.integers(30, steps - 80))
        peak = rng.uniform(3.5, 10.0)
        to_3x = rng.uniform(3, 10) * stretch
        log_kl += math.log(peak) * np.clip((t - onset) / (to_3x * math.log(peak) / math.log(3)),
                                           0.0, 1.0)
        f += (rng.uniform(0.5, 0.8) - f) * _ramp(t, onset + rng.uniform(0, 3) * stretch,
                                                 rng.uniform(4, 12) * stretch)
        reward *= 1 - rng.uniform(0.7, 0.95) * _ramp(t, onset + rng.uniform(2, 8) * stretch,
                                                     rng.uniform(10, 30) * stretch)
        entropy *= 1 + rng.uniform(-0.3, 0.5) * _ramp(t, onset, 20 * stretch)
        length *= 1 + rng.uniform(-0.5, 1.0) * _ramp(t, onset, 20 * stretch)
        below = np.nonzero((t >= onset) & (reward <= 0.5 * reward[onset]))[0]
        half = int(below[0]) if len(below) else None
    elif kind == "spike":
        onset = int(rng.integers(20, steps - 10))
        log_kl[onset] += math.log(rng.uniform(3.0, 10.0))
    kl = np.exp(log_kl)
    rel = kl / np.exp(np.median(log_kl[:20]))
    masked = np.clip(masked0 * rel * np.exp(rng.normal(0, 0.1, steps)), 0, 1)
    tail = 1 + rng.uniform(0.1, 0.4) * np.sqrt(rel) * np.exp(rng.normal(0, 0.05, steps))
    fmt = rng.binomial(n_episodes, np.clip(f, 0, 1)) / n_episodes
    obs_reward = np.clip(reward + rng.normal(0, reward_sd, steps), 0, 1)
    obs_entropy = entropy * np.exp(rng.normal(0, 0.03, steps))
    obs_length = length * np.exp(rng.normal(0, 0.05, steps))
    records = [{"step": i, "kl": float(kl[i]), "format_error_rate": float(fmt[i]),
                "reward": float(obs_reward[i]), "entropy": float(obs_entropy[i]),
                "response_length": float(obs_length[i]), "mis_masked_fraction": float(masked[i]),
                "sc_tail_ratio": float(tail[i])} for i in range(steps)]
    return Trace(kind=kind, seed=seed, records=records, onset=onset, reward_true=reward,
                 half_step=half)


def run_monitor(trace: Trace, config: MonitorConfig | None = None) -> list:
    """Every alert the monitor raises on the trace."""
    monitor = CollapseMonitor(config)
    for record in trace.records:
        monitor.update(record)
    return monitor.alerts


def judge(trace: Trace, alerts: list) -> dict:
    """What the alerts mean for this trace: first critical, lead, reward drop, false alarms."""
    critical = [a for a in alerts if a.severity == "critical"]
    out = {"warnings": sum(a.severity == "warning" for a in alerts), "criticals": len(critical),
           "first_critical": critical[0].step if critical else None,
           "critical_signals": sorted({a.signal for a in critical})}
    if trace.kind == "spike":  # alerts the spike itself could have caused
        near = {a.severity for a in alerts if trace.onset <= a.step <= trace.onset + 3}
        out["at_spike"] = "critical" if "critical" in near else "warning" if near else "none"
    if trace.kind in ("collapse", "slow"):
        onset = trace.onset
        early = [a for a in critical if a.step < onset]
        hit = next((a for a in critical if a.step >= onset), None)
        out["false_before_onset"] = len(early)
        out["lead"] = None if hit is None else hit.step - onset
        out["reward_drop"] = (None if hit is None else
                              1 - trace.reward_true[hit.step] / trace.reward_true[onset])
        out["before_half"] = hit is not None and (trace.half_step is None
                                                  or hit.step < trace.half_step)
        out["first_signal"] = None if hit is None else hit.signal
    return out


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
    path.write_text(f"{head}{begin}\n{figures}\n{end}{tail}")
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
    from mismatch.cli.main import quiet_libraries

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
