"""`mismatch study`: the reference study's grid (fleet × staleness × correction arm × seed) on the
embedded model, run as separate `mismatch train` processes, then aggregated into one report.

The grid:

- fleets: L0 = `homogeneous` (B200 BF16, BF16 KV cache: kernels only), L1 = `precision` (B200
  NVFP4 W4A16, FP8 KV cache: + precision), L2 = `mixed` (the study's eight groups: + accelerator);
- forced staleness K (`--staleness`: step s trains on episodes of version max(0, s − K)),
  reproducible given the seed;
- arms: grpo, mis, sc, sc+mis, grpo+topp (the `topp` arm: top-p sampling with mask replay, no
  other correction), sc+mis+topp;
- seeds.

Each cell is one run directory `OUT/<fleet>-k<K>-<arm>-s<seed>` (a `+` in the arm name becomes
`_`). Runs go as subprocesses, `jobs` at a time, each on one torch thread. Resumable: a run
whose `final/` exists and whose log reached its steps is never rerun; a run with a checkpoint
restarts from it (`--resume`); a run killed before its first checkpoint starts again from
scratch. `OUT/study.json` records the grid so that `--report-only` can rebuild the report.

The report (`aggregate`): per fleet and arm, over seeds, the reward curve (mean and min–max),
KL and format-error share over steps; a table of final and peak accuracy (reward of the
training batches, a 5-step moving average; 95% t-intervals over seeds), the monitor's first
critical alert, the step at which the reward halved, and the lead time between them; the
L2/L0 KL ratio at the first step (where sampler and trainer hold the same weights, so only the
numerics differ) and over the whole run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["FLEETS", "ARMS", "StudyConfig", "STUDY_PRESETS", "Cell", "cells", "run_grid",
           "aggregate", "run_state"]

FLEETS = {"L0": "homogeneous", "L1": "precision", "L2": "mixed"}
"""Study fleet name → train.fleet preset."""
ARMS = {"grpo": "grpo", "mis": "mis", "sc": "sc", "sc+mis": "sc+mis", "grpo+topp": "topp",
        "sc+mis+topp": "sc+mis+topp"}
"""Study arm name → train.loss arm."""


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """The grid and the settings every run shares."""

    fleets: tuple[str, ...] = ("L0", "L1", "L2")
    staleness: tuple[int, ...] = (4,)
    arms: tuple[str, ...] = tuple(ARMS)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 32
    lr: float = 3e-4
    tasks: str = "arith"
    prompts: int = 4
    samples: int = 8
    max_turns: int = 4
    max_new_tokens: int = 64
    candidates: int = 128
    checkpoint_every: int = 10

    def __post_init__(self) -> None:
        for f in self.fleets:
            if f not in FLEETS:
                raise ValueError(f"unknown fleet {f!r}; fleets: {', '.join(FLEETS)}")
        for a in self.arms:
            if a not in ARMS:
                raise ValueError(f"unknown arm {a!r}; arms: {', '.join(ARMS)}")
        if not (self.fleets and self.arms and self.seeds and self.staleness):
            raise ValueError("the grid needs at least one fleet, arm, seed and staleness")
        if any(k < 0 for k in self.staleness):
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def train_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--lr", repr(self.lr), "--tasks", self.tasks,
                "--prompts", str(self.prompts), "--samples", str(self.samples),
                "--checkpoint-every", str(self.checkpoint_every), "--eval-tasks", "0",
                "--threads", "1", "--sampler-processes", "0"]  # `jobs` runs share the cores


STUDY_PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    # CI: one uncorrected and one corrected arm on the mixed fleet, a few small steps
    "ci": {"fleets": ("L2",), "arms": ("grpo", "sc+mis"), "seeds": (0,), "staleness": (2,),
           "steps": 3, "prompts": 2, "samples": 4, "checkpoint_every": 2},
}


@dataclass(frozen=True)
class Cell:
    fleet: str
    staleness: int
    arm: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.fleet}-k{self.staleness}-{self.arm.replace('+', '_')}-s{self.seed}"


def cells(cfg: StudyConfig) -> list[Cell]:
    return [Cell(f, k, a, s) for f in cfg.fleets for k in cfg.staleness for a in cfg.arms
            for s in cfg.seeds]


def _steps_logged(run: Path) -> int:
    from .trainer import read_metrics

    recs = read_metrics(run / "metrics.jsonl")
    return recs[-1]["step"] if recs else 0


def run_state(run: Path, steps: int) -> str:
    """done | resume (a checkpoint to continue from) | fresh (nothing, or nothing worth keeping)"""
    from .trainer import latest_checkpoint

    if (run / "final").is_dir() and _steps_logged(run) >= steps:
        return "done"
    if latest_checkpoint(run) is not None:
        return "resume"
    return "fresh"


def _command(cfg: StudyConfig, cell: Cell, run: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "mismatch.cli", "train", "--out", str(run),
           "--preset", FLEETS[cell.fleet], "--correction", ARMS[cell.arm],
           "--staleness", str(cell.staleness), "--seed", str(cell.seed), "--quiet",
           *cfg.train_args()]
    return cmd + (["--resume"] if resume else [])


@dataclass
class GridResult:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Finished before this invocation (never rerun)."""
    resumed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """run name → the last line of its log."""
    seconds: float = 0.0


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _death_signal() -> Callable[[], None] | None:
    """A Popen preexec_fn (Linux) that makes the child get SIGKILL when the study process dies,
    so a killed study leaves no orphan run writing into its directory (None elsewhere). libc is
    loaded here, before any fork."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _lock(out: Path):
    """Hold OUT/.lock for this process (one study per directory at a time)."""
    import fcntl

    handle = open(out / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ValueError(f"another `mismatch study` is running in {out}; wait for it or use "
                         "another --out") from None
    return handle


def run_grid(cfg: StudyConfig, out: Path, *, jobs: int = 2,
             progress: Callable[[dict[str, Any]], None] | None = None,
             poll_seconds: float = 1.0, command: str = "") -> GridResult:
    """Run every cell not yet done, `jobs` processes at a time (`command`, the invocation, is
    saved in OUT/study.json for the report). `progress` gets
    {"steps": steps logged over all runs, "total": …, "running": [names], "done": n, "failed": n}
    after every poll."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        return _run_grid(cfg, out, jobs, progress, poll_seconds, command)
    finally:
        lock.close()


def _run_grid(cfg: StudyConfig, out: Path, jobs: int, progress, poll_seconds: float,
              command: str) -> GridResult:
    meta = out / "study.json"
    if meta.exists():
        saved = json.loads(meta.read_text())
        mine = json.loads(json.dumps(asdict(cfg)))
        shared = [k for k in ("steps", "lr", "tasks", "prompts", "samples", "max_turns",
                              "max_new_tokens", "candidates") if saved.get(k) != mine.get(k)]
        if shared:
            k = shared[0]
            raise ValueError(f"{out} holds a study with {k}={saved.get(k)!r}, not "
                             f"{mine.get(k)!r}; use the same settings or another --out")
    _write_json(meta, dict(asdict(cfg), command=command))
    result = GridResult()
    todo: list[tuple[Cell, bool]] = []
    for cell in cells(cfg):
        run = out / cell.name
        state = run_state(run, cfg.steps)
        if state == "done":
            result.skipped.append(cell.name)
            continue
        if state == "fresh" and run.exists():
            shutil.rmtree(run)  # killed before its first checkpoint: nothing to keep
        todo.append((cell, state == "resume"))
    # seed by seed (a partial study holds whole seeds), the slowest fleet first in each
    rank = {f: i for i, f in enumerate(sorted(cfg.fleets, reverse=True))}
    todo.sort(key=lambda x: (cfg.seeds.index(x[0].seed), rank[x[0].fleet]))
    total = len(cells(cfg)) * cfg.steps
    running: dict[str, tuple[subprocess.Popen, Path, Any]] = {}
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    death = _death_signal()
    logged = {c.name: _steps_logged(out / c.name) for c in cells(cfg)}

    def report() -> None:
        if progress is None:
            return
        for name in running:
            logged[name] = _steps_logged(out / name)
        progress({"steps": sum(logged.values()), "total": total, "running": sorted(running),
                  "done": len(result.done) + len(result.skipped), "runs": len(cells(cfg)),
                  "failed": len(result.failed)})

    try:
        queue = list(todo)
        while queue or running:
            while queue and len(running) < max(1, jobs):
                cell, resume = queue.pop(0)
                run = out / cell.name
                run.mkdir(parents=True, exist_ok=True)
                log = open(run / "train.log", "ab")
                proc = subprocess.Popen(_command(cfg, cell, run, resume), stdout=log,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True,
                                        preexec_fn=death)
                running[cell.name] = (proc, run, log)
                if resume:
                    result.resumed.append(cell.name)
            time.sleep(poll_seconds)
            for name, (proc, run, log) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                log.close()
                del running[name]
                logged[name] = _steps_logged(run)
                if code == 0:
                    result.done.append(name)
                else:
                    lines = (run / "train.log").read_text(errors="replace")
                    last = [x for x in lines.splitlines() if x.strip()]
                    result.failed[name] = last[-1] if last else f"exit {code}"
            report()
    finally:
        for name, (proc, _, log) in running.items():  # interrupted: stop the children too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    result.seconds = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------------------------
# aggregation

_WINDOW = 5
"""Steps of the trailing moving average that accuracy, halving and the end values use."""


def _trailing(xs: list[float], w: int = _WINDOW) -> list[float]:
    out = []
    for i in range(len(xs)):
        part = [x for x in xs[max(0, i - w + 1):i + 1] if x is not None and math.isfinite(x)]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def _ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (nan with fewer than two values)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, float("nan")
    from scipy import stats

    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return mean, float(stats.t.ppf(0.975, len(vals) - 1)) * sd / math.sqrt(len(vals))


def summarize_run(run: Path) -> dict[str, Any] | None:
    """One run's curves and the figures the study compares (None if it logged nothing)."""
    from .trainer import read_metrics

    recs = read_metrics(run / "metrics.jsonl")
    if not recs:
        return None
    alerts = read_metrics(run / "alerts.jsonl")
    reward = [r["reward"] for r in recs]
    kl = [r["kl"] for r in recs]
    fmt = [r["format_error_rate"] for r in recs]
    acc = _trailing(reward)
    base = sum(reward[:3]) / len(reward[:3])
    halved = next((recs[i]["step"] for i, a in enumerate(acc)
                   if i >= _WINDOW - 1 and a <= 0.5 * base), None)
    critical = [a for a in alerts if a.get("severity") == "critical"]
    first_critical = min((a["step"] for a in critical), default=None)
    early_kl = sorted(kl[:_WINDOW])[len(kl[:_WINDOW]) // 2]
    end = slice(-_WINDOW, None)
    return {
        "steps": [r["step"] for r in recs], "reward": reward, "kl": kl,
        "format_error_rate": fmt, "accuracy": acc,
        "base": base, "final": sum(reward[end]) / len(reward[end]),
        "peak": max(a for a in acc[_WINDOW - 1:] or acc),
        "kl_first": kl[0], "kl_early": early_kl, "kl_end": sum(kl[end]) / len(kl[end]),
        "kl_max": max(_trailing(kl)),
        "kl_growth": (max(_trailing(kl)) / early_kl) if early_kl > 0 else float("nan"),
        "format_end": sum(fmt[end]) / len(fmt[end]), "format_max": max(_trailing(fmt)),
        "halved_step": halved, "first_critical": first_critical,
        "critical_alerts": len(critical), "alert_signals": sorted({a["signal"] for a in critical}),
        "group_kl_first": recs[0].get("group_kl", {}),
        "mis_masked_end": sum(r.get("mis_masked_fraction", 0.0) for r in recs[end]) / len(
            recs[end]),
    }


def _fmt_ci(mean: float, half: float, digits: int = 2) -> str:
    if not math.isfinite(mean):
        return "–"
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if math.isfinite(half) else f"{mean:.{digits}f}"


def _steps_list(values: list[int | None]) -> str:
    return ", ".join("–" if v is None else str(v) for v in values)


def aggregate(cfg: StudyConfig, out: Path, report: Path, *, command: str = "",
              elapsed: float | None = None, notes: str | None = None) -> Path:
    """Write `report` (markdown) and its plots (`<stem>-reward.png`, `-kl.png`, `-format.png`)
    beside it, atomically. Cells without a run are listed as missing."""
    out, report = Path(out), Path(report)
    runs: dict[Cell, dict[str, Any]] = {}
    for cell in cells(cfg):
        s = summarize_run(out / cell.name)
        if s is not None:
            runs[cell] = s
    if not runs:
        raise ValueError(f"{out} holds no study run with a logged step; run `mismatch study` "
                         "first")
    report.parent.mkdir(parents=True, exist_ok=True)
    stem = report.stem
    figures = _plots(cfg, runs, report.parent, stem)
    text = _markdown(cfg, runs, figures, command=command, elapsed=elapsed)
    if notes:
        text += "\n" + notes.strip() + "\n"
    tmp = report.with_name(f".{report.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, report)
    return report


def _cell_runs(runs: dict[Cell, dict], fleet: str, k: int, arm: str) -> list[dict]:
    return [runs[c] for c in sorted(runs, key=lambda c: c.seed)
            if (c.fleet, c.staleness, c.arm) == (fleet, k, arm)]


_COLORS = {"grpo": "tab:red", "mis": "tab:orange", "sc": "tab:purple", "sc+mis": "tab:blue",
           "grpo+topp": "tab:brown", "sc+mis+topp": "tab:green"}


def _plots(cfg: StudyConfig, runs: dict[Cell, dict], folder: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mismatch.report import save_figure

    panels = [(f, k) for f in cfg.fleets for k in cfg.staleness]
    names = []
    files = {"accuracy": "reward", "kl": "kl", "format_error_rate": "format"}
    for key, title, log in (("accuracy", f"reward ({_WINDOW}-step moving average)", False),
                            ("kl", "sampler–trainer KL (k3, per token)", True),
                            ("format_error_rate", "episodes ending on format errors", False)):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6),
                                 squeeze=False, sharey=True)
        for ax, (fleet, k) in zip(axes[0], panels):
            for arm in cfg.arms:
                rs = _cell_runs(runs, fleet, k, arm)
                if not rs:
                    continue
                n = min(len(r["steps"]) for r in rs)
                steps = rs[0]["steps"][:n]
                series = [r[key][:n] if key != "format_error_rate"
                          else _trailing(r[key])[:n] for r in rs]
                mean = [sum(v) / len(v) for v in zip(*series)]
                lo = [min(v) for v in zip(*series)]
                hi = [max(v) for v in zip(*series)]
                ax.plot(steps, mean, color=_COLORS.get(arm), lw=1.6, label=arm)
                ax.fill_between(steps, lo, hi, color=_COLORS.get(arm), alpha=0.12, lw=0)
            ax.set_title(f"{fleet} ({FLEETS[fleet]}), staleness {k}", fontsize=9)
            ax.set_xlabel("optimizer step")
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(title, fontsize=9)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"{title}: mean over seeds, band = min–max (emulated samplers)",
                     fontsize=10)
        final = folder / f"{stem}-{files[key]}.png"
        tmp = folder / f".{final.stem}.tmp-{os.getpid()}.png"  # renamed only when whole
        save_figure(fig, tmp)
        os.replace(tmp, final)
        names.append(final.name)
    return names


def _verdicts(cfg: StudyConfig, runs: dict[Cell, dict]) -> list[str]:
    """The study's claims, each answered from the runs (numbers, not adjectives)."""
    lines = []

    def tally(fleet: str, k: int, arm: str) -> tuple[int, int, list]:
        rs = _cell_runs(runs, fleet, k, arm)
        return sum(r["halved_step"] is not None for r in rs), len(rs), [r["halved_step"]
                                                                      for r in rs]

    for k in cfg.staleness:
        lines.append(f"Staleness {k}:")
        if "grpo" in cfg.arms:
            parts = []
            for f in cfg.fleets:
                n, total, at = tally(f, k, "grpo")
                if total:
                    parts.append(f"{f} {n}/{total} (halved at step {_steps_list(at)})")
            lines.append("- Does uncorrected GRPO collapse (5-step mean reward at or below half "
                         "its first 3 steps)? " + "; ".join(parts) + ".")
            if {"L0", "L2"} <= set(cfg.fleets):
                h0 = [x for x in tally("L0", k, "grpo")[2] if x is not None]
                h2 = [x for x in tally("L2", k, "grpo")[2] if x is not None]
                if h0 and h2:
                    ans = (f"median halving step L2 {sorted(h2)[len(h2) // 2]} vs L0 "
                           f"{sorted(h0)[len(h0) // 2]}")
                else:
                    ans = (f"runs collapsed: L2 {len(h2)}, L0 {len(h0)}; no pair of medians to "
                           "compare")
                lines.append(f"- Earlier on L2 than on L0? {ans}.")
        singles = ("mis", "sc", "grpo+topp")
        for arm in singles + ("sc+mis", "sc+mis+topp"):
            if arm not in cfg.arms:
                continue
            parts = []
            for f in cfg.fleets:
                n, total, at = tally(f, k, arm)
                rs = _cell_runs(runs, f, k, arm)
                if not rs:
                    continue
                fin = _ci95([r["final"] for r in rs])
                parts.append(f"{f} {n}/{total} collapsed (halved at step {_steps_list(at)}), "
                             f"final {_fmt_ci(*fin)}")
            ask = ("alone: collapse delayed rather than avoided?" if arm in singles
                   else "stable to the end?")
            lines.append(f"- {arm} {ask} " + "; ".join(parts) + ".")
        signs = []
        for c, r in runs.items():
            if c.staleness != k or r["halved_step"] is None:
                continue
            signs.append((r["kl_growth"] >= 3, r["format_max"] >= 0.5))
        if signs:
            lines.append(f"- The collapse signature, over the {len(signs)} collapsed runs: reward "
                         f"halved in all (by definition); KL grew ≥ 3× in "
                         f"{sum(a for a, _ in signs)}; most episodes (≥ 50%, 5-step mean) "
                         f"ended on format errors in {sum(b for _, b in signs)}.")
    if {"L0", "L2"} <= set(cfg.fleets):
        # top-p arms never sample the tail, where most of the mismatch lives: their KL is
        # another quantity, so the ratio is given per sampling mode
        for mode, pick in (("full-distribution arms", lambda a: not ARMS[a].endswith("topp")),
                           ("top-p arms", lambda a: ARMS[a].endswith("topp"))):
            first = {f: [r["kl_first"] for c, r in runs.items() if c.fleet == f and pick(c.arm)]
                     for f in ("L0", "L2")}
            if first["L0"] and first["L2"]:
                m0 = sum(first["L0"]) / len(first["L0"])
                m2 = sum(first["L2"]) / len(first["L2"])
                lines.append(f"- L2/L0 sampler–trainer KL at step 1 (same weights: numerics "
                             f"only), {mode}: {m2:.2e} / {m0:.2e} = {m2 / m0:.1f}× (the study: "
                             "4.7×).")
    return lines


def _markdown(cfg: StudyConfig, runs: dict[Cell, dict], figures: list[str], *, command: str,
              elapsed: float | None) -> str:
    missing = [c.name for c in cells(cfg) if c not in runs]
    short = [c.name for c, r in runs.items() if r["steps"][-1] < cfg.steps]
    out = ["# The study on the CPU testbed: which corrections keep mixed-sampler RL stable", ""]
    out += ["Sampler numerics are **emulated** (bit-exact formats and kernel habits on CPU); the "
            "trainer computes in BF16 on an FP32 master. Embedded model (Qwen3-MoE "
            "architecture, 2.0M parameters), multi-turn calculator task "
            f"(`{cfg.tasks}`; an episode ends on a submit, {cfg.max_turns} turns, or three "
            "replies in a row without a tool call).", ""]
    if command:
        out += ["Regenerate:", "", "```bash", command, "```", ""]
    out += [f"Grid: fleets {', '.join(f'{f} ({FLEETS[f]})' for f in cfg.fleets)}; forced "
            f"staleness {', '.join(map(str, cfg.staleness))}; arms {', '.join(cfg.arms)}; seeds "
            f"{', '.join(map(str, cfg.seeds))}. Each run: {cfg.steps} steps of {cfg.prompts} "
            f"prompts × {cfg.samples} episodes, AdamW lr {cfg.lr:g}, temperature 1 (top-p arms: "
            "p = 0.97 after top-k 64), SC over the samplers' top-128 candidates."]
    if elapsed is not None:
        out += ["", f"Wall time of the runs in this invocation: {elapsed / 60:.1f} min."]
    if missing or short:
        out += ["", f"**Incomplete**: {len(missing)} run(s) missing "
                f"({', '.join(missing[:6])}{'…' if len(missing) > 6 else ''}), {len(short)} "
                f"short of {cfg.steps} steps."]
    out += ["", "## The study's claims, answered by these runs", ""] + _verdicts(cfg, runs)
    out += ["", "## Curves", ""] + [f"![{f}]({f})" for f in figures]
    out += ["", "## Accuracy and the collapse signature per cell", "",
            f"Accuracy = reward of the training batches (1 for a correct submit), {_WINDOW}-step "
            "trailing mean; final = mean of the last "
            f"{_WINDOW} steps; peak = the highest {_WINDOW}-step mean; ± = 95% t-interval over "
            "seeds. Collapsed = the 5-step mean fell to half the first 3 steps' reward. KL growth "
            f"= highest {_WINDOW}-step KL mean / median KL of the first {_WINDOW} steps.", "",
            "| fleet | K | arm | runs | first 3 steps | final | peak | collapsed | halved at | "
            "first critical alert | KL step 1 | KL growth | format errors (end / max) | "
            "MIS-masked (end) |", "|" + "---|" * 14]
    for f in cfg.fleets:
        for k in cfg.staleness:
            for arm in cfg.arms:
                rs = _cell_runs(runs, f, k, arm)
                if not rs:
                    continue
                col = sum(r["halved_step"] is not None for r in rs)
                mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
                out.append(
                    f"| {f} | {k} | {arm} | {len(rs)} | {mean('base'):.2f} | "
                    f"{_fmt_ci(*_ci95([r['final'] for r in rs]))} | "
                    f"{_fmt_ci(*_ci95([r['peak'] for r in rs]))} | {col}/{len(rs)} | "
                    f"{_steps_list([r['halved_step'] for r in rs])} | "
                    f"{_steps_list([r['first_critical'] for r in rs])} | "
                    f"{mean('kl_first'):.1e} | {mean('kl_growth'):.1f}× | "
                    f"{mean('format_end'):.2f} / {mean('format_max'):.2f} | "
                    f"{mean('mis_masked_end'):.3f} |")
    out += ["", "## The monitor on these runs", "",
            "Lead time = the step at which the reward halved − the step of the monitor's first "
            "critical alert (positive: the alert came first). The monitor ran live inside every "
            "run with its default rules (probes.monitor.MonitorConfig: baseline over steps 4–13, "
            "judged from step 14).", ""]
    collapsed = [(c, r) for c, r in runs.items() if r["halved_step"] is not None]
    stable = [(c, r) for c, r in runs.items() if r["halved_step"] is None]
    if collapsed:
        out += ["| run | reward halved at | first critical alert | lead (steps) | signals |",
                "|---|---|---|---|---|"]
        for c, r in sorted(collapsed, key=lambda x: x[0].name):
            a = r["first_critical"]
            lead = "no alert" if a is None else str(r["halved_step"] - a)
            out.append(f"| {c.name} | {r['halved_step']} | {a if a is not None else '–'} | "
                       f"{lead} | {', '.join(r['alert_signals']) or '–'} |")
        leads = [r["halved_step"] - r["first_critical"] for _, r in collapsed
                 if r["first_critical"] is not None]
        out += ["", f"Collapsed runs: {len(collapsed)}; alerted before the reward halved: "
                f"{sum(x > 0 for x in leads)}; at the same step: {sum(x == 0 for x in leads)}; "
                f"after: {sum(x < 0 for x in leads)}; never: {len(collapsed) - len(leads)}."
                + (f" Median lead {sorted(leads)[len(leads) // 2]} steps." if leads else "")]
    alarmed = [(c, r) for c, r in stable if r["critical_alerts"]]
    out += ["", f"Runs whose reward never halved: {len(stable)}; with a critical alert: "
            f"{len(alarmed)}" + (" (" + ", ".join(
                f"{c.name} at step {r['first_critical']} on {', '.join(r['alert_signals'])}"
                for c, r in sorted(alarmed, key=lambda x: x[0].name)) + ")" if alarmed else "")
            + "."]
    l2 = [r for c, r in runs.items() if c.fleet == "L2" and r["group_kl_first"]]
    if l2:
        groups = sorted({g for r in l2 for g in r["group_kl_first"]})
        out += ["", "## KL per sampler group of L2 at step 1 (same weights: numerics only)", "",
                "| group | mean KL (k3) over runs |", "|---|---|"]
        for g in groups:
            vals = [r["group_kl_first"][g] for r in l2 if g in r["group_kl_first"]]
            out.append(f"| {g} | {sum(vals) / len(vals):.2e} |")
    return "\n".join(out) + "\n"
