"""Seeded synthetic training runs with a known truth, to measure the collapse monitor on.

The traces: 200 steps each. Healthy runs have a noisy sampler–trainer KL (log-AR(1) noise, 10–30%
per step, drifting ×0.75–1.4 over the run), a learning reward with batch noise, a few percent of
episodes ending on format errors (binomial over 256–1024 episodes), slowly falling entropy.
A collapse at a known onset step follows the study's signature: the KL rises log-linearly to 3×
within 3–10 steps and on to 3.5–10×; the share of episodes ending on format errors rises to
50–80% over 4–12 steps from 0–3 steps after onset; the reward falls by 70–95% over 10–30 steps
from 2–8 steps after onset; entropy and length move either way. A "slow" collapse stretches each
ramp 2.5× (KL at 3× after 7.5–25 steps), outside what the tests require. A spike run is a
healthy run with one step whose KL (and masked share) is 3–10× its neighbours.

`scripts/bench_monitor.py --report` runs hundreds of them through the default monitor
(reports/monitor.md); tests/test_monitor.py pins the detection properties on a few seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .rules import MonitorConfig
from .state import CollapseMonitor

__all__ = ["KINDS", "Trace", "judge", "run_monitor", "synthetic_trace"]

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
