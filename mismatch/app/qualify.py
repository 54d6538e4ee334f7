"""`mismatch qualify`: a PASS/FAIL verdict for a sampler against a mismatch budget.

A policy (TOML, `policies/default.toml` ships with cited defaults) sets limits on figures of the
whole sampler against the trainer (`kl_k3`, `mis_masked_fraction`, ...), on source-specific
figures (`"routing.flip_rate_any_layer"`), and on each source's own headline
(`[sources.precision] kl_k3 = ...`). `qualify` runs the probes those figures need, checks each
figure against its limit, names the source that dominates the mismatch, and returns the verdict.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["DEFAULT_POLICY", "SOURCE_METRICS", "TOTAL_METRICS", "Check", "Launched", "Policy",
           "PolicyError", "Throughput", "Verdict", "dominant_source", "evaluate", "load_policy",
           "markdown", "needed_sources", "qualify_emulated", "verdict", "verdict_result",
           "write_outputs"]

DEFAULT_POLICY = Path(__file__).parent.parent / "policies" / "default.toml"  # mismatch/policies

TOTAL_METRICS = {
    "kl_k3": "KL(sampler ‖ trainer), k3 estimator, nats/token",
    "kl_exact": "KL(sampler ‖ trainer) over the full vocabulary, nats/token (emulated only)",
    "kl_k1": "KL, k1 estimator, nats/token",
    "mis_masked_fraction": "share of tokens whose π/μ leaves the MIS range [0.5, 5]",
    "token_multiplicative_error": "mean e^|Δ log p| per token",
    "abs_logprob_diff_mean": "mean |Δ log p|",
    "abs_logprob_diff_p99": "99th percentile of |Δ log p|",
    "abs_logprob_diff_max": "largest |Δ log p|",
    "logprob_diff_rms": "RMS of Δ log p, nats",
    "logprob_diff_sd": "standard deviation of Δ log p, nats",
    "logprob_rel_rms": "RMS of Δ log p relative to the RMS of the trainer's log p",
    "ratio_outside_10pct": "share of tokens whose π/μ leaves [0.9, 1.1]",
}
SOURCE_METRICS = {
    "routing.flip_rate_mean": "share of router decisions (per layer, mean) whose top-k set flips",
    "routing.flip_rate_any_layer": "share of positions with a flip in at least one MoE layer",
    "routing.routing_kl_share_fraction": "share of the KL that routing replay removes",
    "retokenization.changed_sequence_fraction": "share of sampled sequences a decode→re-encode "
                                                "round trip changes",
    "retokenization.changed_episode_fraction": "share of multi-turn episodes whose re-rendered "
                                               "context differs from token-in-token-out",
    "sampling.sampler_mass_outside": "sampler probability mass outside its top-p set",
    "sampling.outside_trainer_top_p_fraction": "share of sampled tokens outside the trainer's "
                                                "own top-p set",
    "sampling.processed_minus_raw_mean": "processed minus raw log-prob per token (nats)",
}
ATTRIBUTION = ("kernels", "precision", "accelerator", "routing")
"""Sources whose headline KL says which one dominates a whole-sampler figure."""


class PolicyError(ValueError):
    """A policy file that cannot be read or names an unknown figure."""


@dataclass(frozen=True)
class Policy:
    path: Path
    budgets: dict[str, float]
    sources: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Check:
    metric: str
    value: float | None
    budget: float
    passed: bool | None
    """None: the figure could not be measured in this mode (does not decide the verdict)."""
    source: str
    """The source the figure belongs to, or the one that dominates a whole-sampler figure."""
    note: str = ""

    def to_json(self) -> dict:
        return {"metric": self.metric, "value": self.value, "budget": self.budget,
                "passed": self.passed, "source": self.source, "note": self.note}


@dataclass(frozen=True)
class Throughput:
    """A live server's totals over every request (the client's `throughput`)."""

    requests: int
    retries: int
    completion_tokens: int
    seconds: float
    tokens_per_s: float
    """Completion tokens per second of wall clock."""

    def to_json(self) -> dict:
        return {"requests": self.requests, "retries": self.retries,
                "completion_tokens": self.completion_tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_json(cls, d: dict) -> Throughput:
        return cls(**d)


@dataclass(frozen=True)
class Launched:
    """The server `qualify --launch` started: its engine, model and log."""

    engine: str
    model: str
    log: str

    def to_json(self) -> dict:
        return {"engine": self.engine, "model": self.model, "log": self.log}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """A policy's verdict on a sampler, its checks, and the probe summary they read."""

    verdict: str
    """"pass" or "fail"."""
    mode: str
    """"emulated" or "measured"."""
    sampler: str
    """What was qualified."""
    policy: str
    """The policy's file (or the default's words)."""
    dominant_source: str
    """The attribution source whose headline KL is largest ("–": none measured)."""
    checks: list[Check]
    throughput: Throughput | None = None
    """A live server's totals (measured mode)."""
    summary: dict = field(default_factory=dict, repr=False)
    """The evidence: the probe summary's results.json body (not part of verdict.json)."""
    launched: Launched | None = None
    """The server qualify started (--launch)."""

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict:
        """verdict.json, and what `--json` prints: everything but the summary."""
        out = {"verdict": self.verdict, "mode": self.mode, "sampler": self.sampler,
               "policy": self.policy, "dominant_source": self.dominant_source,
               "checks": [c.to_json() for c in self.checks],
               "throughput": self.throughput.to_json() if self.throughput is not None else None}
        launched = {"launched": self.launched.to_json()} if self.launched is not None else {}
        return out | launched


def _toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the project's machines run 3.11
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy {path} is not valid TOML ({exc}); fix the file or omit "
                          f"--policy for the default") from None


def _limit(path: Path, where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise PolicyError(f"policy {path}: {where} must be a finite number >= 0, got {value!r}")
    return float(value)


def load_policy(path: Path | None = None) -> Policy:
    """Read and validate a policy (None: the shipped default)."""
    path = Path(path) if path is not None else DEFAULT_POLICY
    if not path.is_file():
        raise PolicyError(f"policy file {path} does not exist; pass a TOML file to --policy or "
                          f"omit it for the default ({DEFAULT_POLICY.name})")
    data = _toml(path)
    unknown = sorted(set(data) - {"budgets", "sources"})
    if unknown:
        raise PolicyError(f"policy {path}: unknown table [{unknown[0]}]; use [budgets] and "
                          f"[sources.<name>]")
    budgets = {}
    for key, value in (data.get("budgets") or {}).items():
        if key not in TOTAL_METRICS and key not in SOURCE_METRICS:
            raise PolicyError(f"policy {path}: unknown figure {key!r} in [budgets]; known: "
                              f"{', '.join(list(TOTAL_METRICS) + list(SOURCE_METRICS))}")
        budgets[key] = _limit(path, key, value)
    from mismatch.probes import SOURCES

    sources: dict[str, dict[str, float]] = {}
    for name, table in (data.get("sources") or {}).items():
        if name not in SOURCES:
            raise PolicyError(f"policy {path}: unknown source [sources.{name}]; sources: "
                              f"{', '.join(SOURCES)}")
        if not isinstance(table, dict):
            raise PolicyError(f"policy {path}: [sources.{name}] must be a table of limits")
        for key, value in table.items():
            if key not in TOTAL_METRICS:
                raise PolicyError(f"policy {path}: unknown figure {key!r} in [sources.{name}]; "
                                  f"known: {', '.join(TOTAL_METRICS)}")
        sources[name] = {k: _limit(path, f"sources.{name}.{k}", v) for k, v in table.items()}
    if not budgets and not sources:
        raise PolicyError(f"policy {path} sets no limits; add a [budgets] table")
    return Policy(path=path, budgets=budgets, sources=sources)


def needed_sources(policy: Policy) -> tuple[str, ...]:
    """The source probes the policy's figures need, plus the attribution sources, in registry
    order."""
    from mismatch.probes import SOURCES

    want = set(ATTRIBUTION) | set(policy.sources)
    want |= {key.split(".", 1)[0] for key in policy.budgets if "." in key}
    return tuple(n for n in SOURCES if n in want)


def _figures(summary):
    from mismatch.probes.summary import Figures

    return Figures.of(summary)


def dominant_source(summary) -> str:
    """The attribution source whose own headline KL is largest ("–" when none was measured);
    `summary`: a ProbeSummary or a results.json body."""
    best, name = -1.0, "–"
    sources = _figures(summary).sources
    for source in ATTRIBUTION:
        value = _value(sources.get(source), "kl_exact", finite=False)
        value = _value(sources.get(source), "kl_k3", finite=False) if value is None else value
        if isinstance(value, (int, float)) and math.isfinite(value) and value > best:
            best, name = value, source
    return name


def _value(block, key: str, finite: bool = True):
    """Figure `key` of a source's result or a summary (KLSummary / SourceResult): a finite
    number, else None (with finite=False: any number as it is)."""
    v = block.figure(key) if block is not None else None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    return v if not finite else float(v) if math.isfinite(v) else None


def evaluate(policy: Policy, summary) -> list[Check]:
    """Every limit of the policy checked against a probe summary (a ProbeSummary or a
    results.json body)."""
    from mismatch.probes.base import SourceResult

    figures = _figures(summary)
    top = dominant_source(figures)
    checks = []
    for key, budget in policy.budgets.items():
        if "." in key:
            source, figure = key.split(".", 1)
            block = figures.sources.get(source)
            value = _value(block, figure)
            note = "" if value is not None else (
                "does not apply (dense model)"
                if isinstance(block, SourceResult) and not block.applies else
                "not measured in this mode")
        else:
            source, value = top, _value(figures.total, key)
            note = "" if value is not None else "not measured in this mode"
        checks.append(Check(metric=key, value=value, budget=budget,
                            passed=None if value is None else value <= budget,
                            source=source, note=note))
    for source, limits in policy.sources.items():
        block = figures.sources.get(source)
        for key, budget in limits.items():
            value = _value(block, key)
            checks.append(Check(metric=f"{source}: {key}", value=value, budget=budget,
                                passed=None if value is None else value <= budget,
                                source=source,
                                note="" if value is not None else "not measured in this mode"))
    return checks


def verdict(checks: list[Check]) -> str:
    """"fail" if any measured check failed, else "pass"."""
    return "fail" if any(c.passed is False for c in checks) else "pass"


def markdown(result: Verdict, command: str) -> str:
    """The qualification report."""
    v = result.verdict.upper()
    s = result.summary
    label = result.mode.upper()
    out = [f"# Qualify: {result.sampler} — {v} ({label})", "",
           f"Command: `{command}`", "",
           f"- policy: `{result.policy}`",
           f"- mode: **{result.mode}** — " + (
               "a live inference server sampled; the trainer side re-scored locally"
               if result.mode == "measured" else
               "the sampler's formats and kernels emulated on this machine's CPU"),
           f"- model: {s.get('model')}; prompts: {s.get('prompts')}; completion tokens: "
           f"{s.get('tokens')}",
           f"- dominant source: **{result.dominant_source}**" + (
               " (a live server gives no per-source attribution: qualify the same GPU × "
               "precision emulated, `--gpu G --dtype D`, to see which source dominates)"
               if result.dominant_source == "–" else ""), ""]
    if result.throughput is not None:
        t = result.throughput
        out.insert(-1, f"- server throughput: {t.tokens_per_s:.1f} completion tokens/s over "
                       f"{t.requests} requests ({t.retries} retries)")
    out += ["| check | value | budget | result | source | note |", "|---|---:|---:|:-:|---|---|"]
    for c in result.checks:
        value = "–" if c.value is None else f"{c.value:.4g}"
        res = {True: "pass", False: "**FAIL**", None: "n/a"}[c.passed]
        out.append(f"| {c.metric} | {value} | {c.budget:.4g} | {res} | {c.source} | "
                   f"{c.note} |")
    return "\n".join(out) + "\n"


SERVER_LOG = "server.log"
"""Where `qualify --launch` keeps the log of the server it started, in the output folder."""


def kept_launch(result: Verdict, out: Path) -> tuple[Verdict, Path | None]:
    """A launched server's verdict as written to `out`: its `launched.log` names the copy in the
    output folder (out/server.log), with the log where the server wrote it; (result, None) when
    nothing was launched, or when its log is no longer there (removed while the probe ran: the
    verdict then names the path the server wrote, and no copy is made)."""
    if result.launched is None:
        return result, None
    source = Path(result.launched.log)
    if not source.is_file():
        return result, None
    kept = replace(result.launched, log=str(Path(out).resolve() / SERVER_LOG))
    return replace(result, launched=kept), source


def write_outputs(out: Path, result: Verdict, command: str,
                  server_log: Path | None = None) -> Path:
    """verdict.json (the verdict and checks), results.json (the probe summary), report.md and,
    for a launched server, its log (`server_log` copied to server.log), written together or not
    at all."""
    import json
    import shutil

    from mismatch.io import atomic_directory, mark_output

    with atomic_directory(out) as tmp:
        mark_output(tmp, "qualify")
        if server_log is not None:
            shutil.copyfile(server_log, tmp / SERVER_LOG)
        (tmp / "verdict.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
        (tmp / "results.json").write_text(json.dumps(result.summary, indent=2) + "\n")
        (tmp / "report.md").write_text(markdown(result, command))
    return Path(out)


def qualify_emulated(cfg, policy: Policy, progress=None) -> Verdict:
    """Run the probes `policy` needs for an emulated sampler; the verdict and its evidence."""
    from mismatch.app.sources import probe_sources

    run = probe_sources(replace(cfg, sources=needed_sources(policy)), progress)
    return verdict_result(policy, run.summary, mode="emulated",
                   sampler=f"{cfg.gpu} {cfg.dtype}" + (f", kv {cfg.kv_cache}"
                                                       if cfg.kv_cache else ""))


def verdict_result(policy: Policy, summary: dict, *, mode: str, sampler: str,
                   throughput: Throughput | None = None) -> Verdict:
    """The verdict of `policy` on a probe `summary` (a results.json body), with its checks and
    evidence (what write_outputs writes and the CLI prints); `sampler` names what was
    qualified."""
    checks = evaluate(policy, summary)
    return Verdict(verdict=verdict(checks), mode=mode, sampler=sampler,
                   policy=("default (mismatch/policies/default.toml)"
                           if policy.path == DEFAULT_POLICY else str(policy.path)),
                   dominant_source=dominant_source(summary), checks=checks,
                   throughput=throughput, summary=summary)
