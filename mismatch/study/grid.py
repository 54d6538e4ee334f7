"""`mismatch study`: the reference study's grid (fleet × staleness × correction arm × seed) on a
zoo policy, run as separate `mismatch train` processes, then aggregated into one report
(mismatch/study/aggregate.py).

The grid:

- fleets: L0 = `homogeneous` (B200 BF16, BF16 KV cache: kernels only), L1 = `precision` (B200
  NVFP4 W4A16, FP8 KV cache: + precision), L2 = `mixed` (the study's eight groups: + accelerator);
- forced staleness K (`--staleness`: step s trains on episodes of version max(0, s − K)),
  reproducible given the seed;
- arms: grpo, mis, sc, sc+mis, grpo+topp (the `topp` arm: top-p sampling with mask replay, no
  other correction), sc+mis+topp;
- seeds;
- on-policy controls (`sync_arms` on `sync_fleets`, `--sync`): the same arms without staleness.

Each cell is one run directory `OUT/<fleet>-k<K>-<arm>-s<seed>` (`-sync-` for a control; a `+`
in the arm name becomes `_`). Every run starts from the same policy: the embedded model, or
(`policy_steps`) a zoo policy trained less, built once into `OUT/policy-<N>`. Runs go as
subprocesses, `jobs` at a time, each pinned to cores of its own (mismatch.runtime.core_slots).
Resumable: a run whose `final/` exists and whose log reached its steps is never rerun, nor is
one adopted from an export of its finished logs (`adopt`, mismatch/study/logs.py); a run
with a checkpoint restarts from it (`--resume`); a run killed before its first checkpoint starts
again from scratch.
`OUT/study.json` records the grid so that `--report-only` can rebuild the report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from mismatch.io import atomic_write_text
from mismatch.registry import table_of
from mismatch.runtime import child_setup, core_slots, parent_death_signal

from .logs import ADOPTED, adopt_logs, export_logs, steps_logged

__all__ = ["STUDY_FLEETS", "fleet_of", "fleet_label", "STUDY_ARMS", "StudyConfig",
           "STUDY_PRESETS", "Cell", "cells", "run_grid",
           "run_state", "run_order", "build_policy", "export_logs"]

STUDY_FLEETS = {"L0": "homogeneous", "L1": "precision", "L2": "mixed"}
"""Study fleet name → train.fleet preset. A study fleet may also be a fleet file (a path ending
in .toml, as `mismatch plan` writes): its runs train with `--fleet FILE` and are named by the
file's stem."""


def fleet_of(name: str) -> str:
    """What `mismatch train` trains a study fleet on: its preset (L0–L2), or the fleet file's
    absolute path. Raises ValueError with one line for anything else (`StudyConfig` also parses
    each fleet file once, when the grid is made)."""
    if name in STUDY_FLEETS:
        return STUDY_FLEETS[name]
    from mismatch.train.fleet import is_fleet_file

    if not is_fleet_file(name):
        raise ValueError(f"unknown fleet {name!r}; fleets: {', '.join(STUDY_FLEETS)} or a fleet "
                         f"file ending in .toml (`mismatch plan` writes one)")
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"fleet file {name} does not exist; `mismatch plan ... --out DIR` "
                         f"writes DIR/fleet.toml")
    return str(path)


def fleet_label(name: str) -> str:
    """A study fleet's name in run folders and tables: L0–L2, or a fleet file's stem."""
    return name if name in STUDY_FLEETS else Path(name).stem


STUDY_ARMS = {"grpo": "grpo", "mis": "mis", "sc": "sc", "sc+mis": "sc+mis", "grpo+topp": "topp",
        "sc+mis+topp": "sc+mis+topp"}
"""Study arm name → train.loss arm."""


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """The grid and the settings every run shares."""

    fleets: tuple[str, ...] = ("L0", "L1", "L2")
    staleness: tuple[int, ...] = (4,)
    arms: tuple[str, ...] = tuple(STUDY_ARMS)
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
    sync_arms: tuple[str, ...] = ()
    """Arms also run on-policy (`--sync`: staleness 0) as controls, on `sync_fleets`."""
    sync_fleets: tuple[str, ...] = ("L0",)
    policy_steps: int = 0
    """Start every run from a zoo policy trained this many steps (`mismatch zoo build --steps
    N --seed 0`, built once into OUT/policy-<N>); 0: the embedded model."""
    eval_tasks: int = 0
    """Held-out tasks (× 4 episodes, temperature 1) evaluated before the first step, midway and
    after the last (0: none)."""

    def __post_init__(self) -> None:
        for f in dict.fromkeys((*self.fleets, *self.sync_fleets)):
            if f not in STUDY_FLEETS:
                from mismatch.train.fleet import fleet_file

                fleet_file(fleet_of(f))  # parses, or one line on what is wrong
        labels = [fleet_label(f) for f in dict.fromkeys((*self.fleets, *self.sync_fleets))]
        if len(set(labels)) != len(labels):
            raise ValueError(f"two fleets share a name ({', '.join(labels)}): rename a fleet "
                             f"file so each run folder is its own")
        for a in (*self.arms, *self.sync_arms):
            if a not in STUDY_ARMS:
                raise ValueError(f"unknown arm {a!r}; arms: {', '.join(STUDY_ARMS)}")
        if not (self.fleets and self.arms and self.seeds and self.staleness):
            raise ValueError("the grid needs at least one fleet, arm, seed and staleness")
        if any(k < 0 for k in self.staleness):
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.policy_steps < 0 or self.eval_tasks < 0:
            raise ValueError(f"policy-steps and eval-tasks must be >= 0, got "
                             f"{self.policy_steps}, {self.eval_tasks}")

    @property
    def policy_name(self) -> str | None:
        """The study's starting policy's folder in OUT (None: the embedded model)."""
        return f"policy-{self.policy_steps}" if self.policy_steps else None

    def train_args(self) -> list[str]:
        midway = (self.steps + 1) // 2 if self.eval_tasks and self.steps > 1 else 0
        return ["--steps", str(self.steps), "--lr", repr(self.lr), "--tasks", self.tasks,
                "--prompts", str(self.prompts), "--samples", str(self.samples),
                "--checkpoint-every", str(self.checkpoint_every),
                "--eval-tasks", str(self.eval_tasks), "--eval-every", str(midway),
                "--threads", "1", "--sampler-processes", "0"]  # each run on the cores of its slot


def full() -> StudyConfig:
    """L0 and L2 × 5 arms × 3 seeds, staleness 8, 150 steps of 16 × 8, lr 1e-4, sync controls.

    The study's regime at this scale: a policy with headroom (held-out reward ~0.45 at
    temperature 1; `mismatch zoo build --steps 800`), lr 1e-4, 16 prompts × 8 episodes, 150
    steps, forced staleness 8, on-policy controls; held-out reward before, midway, after."""
    return StudyConfig(fleets=("L0", "L2"), staleness=(8,),
                       arms=("grpo", "mis", "sc", "sc+mis", "sc+mis+topp"), steps=150, lr=1e-4,
                       tasks="zoo", prompts=16, samples=8, sync_arms=("grpo", "sc+mis"),
                       policy_steps=800, eval_tasks=64)


def edge() -> StudyConfig:
    """The first grid: 3 fleets × 6 arms, 32 steps of 4 × 8, lr 3e-4, staleness 4.

    reports/study-edge.md: the embedded policy at its ceiling (StudyConfig's defaults)."""
    return StudyConfig()


def ci() -> StudyConfig:
    """Three short runs on L2 for CI: grpo, sc+mis and a sync grpo control."""
    return StudyConfig(fleets=("L2",), arms=("grpo", "sc+mis"), seeds=(0,), staleness=(2,),
                       steps=3, prompts=2, samples=4, checkpoint_every=2, sync_arms=("grpo",),
                       sync_fleets=("L2",), eval_tasks=2)


def _registry(*presets: Callable[[], StudyConfig]) -> dict[str, Callable[[], StudyConfig]]:
    return table_of(presets, lambda fn: fn.__name__, "study preset")


STUDY_PRESETS: dict[str, Callable[[], StudyConfig]] = _registry(full, edge, ci)
"""`mismatch study --preset` name → the function returning its grid."""


@dataclass(frozen=True)
class Cell:
    fleet: str
    staleness: int | None
    """Forced staleness K; None: an on-policy control (`--sync`)."""
    arm: str
    seed: int

    @property
    def name(self) -> str:
        lag = "sync" if self.staleness is None else f"k{self.staleness}"
        return f"{fleet_label(self.fleet)}-{lag}-{self.arm.replace('+', '_')}-s{self.seed}"


def cells(cfg: StudyConfig) -> list[Cell]:
    """The grid's cells, then its on-policy controls."""
    return ([Cell(f, k, a, s) for f in cfg.fleets for k in cfg.staleness for a in cfg.arms
             for s in cfg.seeds]
            + [Cell(f, None, a, s) for f in cfg.sync_fleets for a in cfg.sync_arms
               for s in cfg.seeds])


def run_order(cfg: StudyConfig, cell: Cell) -> tuple:
    """The sort key of the order cells run in: the central comparison (uncorrected vs SC+MIS)
    over the first two seeds first, so that a sitting that ends mid-grid leaves the central
    claim with a spread over seeds; then seed by seed every cell (the central pair, the other
    arms, the on-policy controls), so that every claim has an answer before the intervals
    tighten; the fastest fleet first in each (the presets L0 < L1 < L2, then fleet files)."""
    fleets = sorted({*cfg.fleets, *cfg.sync_fleets},
                    key=lambda f: (f not in STUDY_FLEETS, fleet_label(f)))
    rank = {f: i for i, f in enumerate(fleets)}
    seed = cfg.seeds.index(cell.seed)
    kind = 0 if cell.arm in ("grpo", "sc+mis") and cell.staleness is not None else (
        2 if cell.staleness is None else 1)
    return (0 if kind == 0 and seed < 2 else 1 + seed), kind, seed, rank[cell.fleet]


def run_state(run: Path, steps: int) -> str:
    """done | resume (a checkpoint to continue from) | fresh (nothing, or nothing worth keeping)"""
    from mismatch.train.rundir import latest_checkpoint

    finished = (run / "final").is_dir() or (run / ADOPTED).is_file()  # adopted: logs.py
    if finished and steps_logged(run) >= steps:
        return "done"
    if latest_checkpoint(run) is not None:
        return "resume"
    return "fresh"


def _command(cfg: StudyConfig, cell: Cell, run: Path, resume: bool) -> list[str]:
    lag = ["--sync"] if cell.staleness is None else ["--staleness", str(cell.staleness)]
    policy = ["--model", str(run.parent / cfg.policy_name)] if cfg.policy_name else []
    fleet = (["--preset", STUDY_FLEETS[cell.fleet]] if cell.fleet in STUDY_FLEETS
             else ["--preset", "mixed", "--fleet", fleet_of(cell.fleet)])
    cmd = [sys.executable, "-m", "mismatch.cli", "train", "--out", str(run),
           *fleet, "--correction", STUDY_ARMS[cell.arm], *lag,
           "--seed", str(cell.seed), "--quiet", *policy, *cfg.train_args()]
    return cmd + (["--resume"] if resume else [])


def build_policy(cfg: StudyConfig, out: Path) -> Path | None:
    """OUT/policy-<N>: the study's starting policy, built once (`mismatch zoo build` writes it
    atomically and reproducibly); None for the embedded model."""
    if not cfg.policy_name:
        return None
    where = out / cfg.policy_name
    if not (where / "model.safetensors").is_file():
        cmd = [sys.executable, "-m", "mismatch.cli", "zoo", "build", "--out", str(where),
               "--steps", str(cfg.policy_steps), "--seed", "0"]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            last = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
            raise ValueError(f"building the study policy failed: {last[-1] if last else ''}")
    return where


@dataclass
class GridResult:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Finished before this invocation (never rerun)."""
    resumed: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    """Finished elsewhere: their exported logs taken in (logs.adopt_logs)."""
    failed: dict[str, str] = field(default_factory=dict)
    """run name → the last line of its log."""
    seconds: float = 0.0


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
             poll_seconds: float = 1.0, command: str = "", adopt: Path | None = None
             ) -> GridResult:
    """Run every cell not yet done, `jobs` processes at a time (`command`, the invocation, is
    saved in OUT/study.json for the report), after adopting the finished runs of the export
    `adopt` (logs.adopt_logs). `progress` gets
    {"steps": steps logged over all runs, "total": …, "running": [names], "done": n, "failed": n}
    after every poll."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        return _run_grid(cfg, out, jobs, progress, poll_seconds, command, adopt)
    finally:
        lock.close()


def _run_grid(cfg: StudyConfig, out: Path, jobs: int, progress, poll_seconds: float,
              command: str, adopt: Path | None) -> GridResult:
    meta = out / "study.json"
    if meta.exists():
        saved = json.loads(meta.read_text())
        mine = json.loads(json.dumps(asdict(cfg)))
        shared = [k for k in ("steps", "lr", "tasks", "prompts", "samples", "max_turns",
                              "max_new_tokens", "candidates", "policy_steps")
                  if saved.get(k, 0 if k == "policy_steps" else None) != mine.get(k)]
        if shared:
            k = shared[0]
            raise ValueError(f"{out} holds a study with {k}={saved.get(k)!r}, not "
                             f"{mine.get(k)!r}; use the same settings or another --out")
    result = GridResult(adopted=adopt_logs(cfg, out, adopt) if adopt else [])
    atomic_write_text(meta, json.dumps(dict(asdict(cfg), command=command), indent=2) + "\n")
    build_policy(cfg, out)
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
    todo.sort(key=lambda x: run_order(cfg, x[0]))
    total = len(cells(cfg)) * cfg.steps
    running: dict[str, tuple[subprocess.Popen, Path, Any]] = {}
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    death = parent_death_signal(signal.SIGKILL)  # a killed study leaves no orphan run
    slots = core_slots(jobs)
    free = list(range(len(slots))) if slots else []
    held: dict[str, int] = {}  # run name → its slot of `slots`
    logged = {c.name: steps_logged(out / c.name) for c in cells(cfg)}

    def report() -> None:
        if progress is None:
            return
        for name in running:
            logged[name] = steps_logged(out / name)
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
                cpus = None
                if slots:
                    held[cell.name] = free.pop(0)
                    cpus = slots[held[cell.name]]
                    log.write(f"study: on CPUs {','.join(map(str, cpus))}\n".encode())
                    log.flush()
                proc = subprocess.Popen(_command(cfg, cell, run, resume), stdout=log,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True,
                                        preexec_fn=child_setup(death, cpus))
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
                if name in held:
                    free.append(held.pop(name))
                logged[name] = steps_logged(run)
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
