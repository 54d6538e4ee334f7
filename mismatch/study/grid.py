"""`mismatch study`: the reference study's grid (fleet × staleness × correction arm × seed; the
cells and their settings: cells.py) on a zoo policy, run as separate `mismatch train`
processes, then aggregated into one report (mismatch/study/aggregate.py).

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
from mismatch.runtime import child_setup, core_slots, parent_death_signal

from .cells import STUDY_ARMS, STUDY_FLEETS, Cell, StudyConfig, cells, fleet_of, run_order
from .logs import adopt_logs, run_state, steps_logged

__all__ = ["run_grid", "build_policy"]

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
