"""A study's logs away from its run directories: `export_logs` copies every run's logs (no
checkpoints, no weights) somewhere they can be committed, and `adopt_logs` takes the finished
runs of such an export back into a study directory, so that a grid resumed on a new machine
does not rerun what it already holds (`mismatch study --adopt DIR`).

A run is adopted only when its exported log reached the grid's steps, its held-out evaluation
(when the grid has one) holds the final one, and its config.json was made with the settings this
grid would give it (arm, fleet, staleness, seed, steps, lr, tasks, prompts, episodes, held-out
tasks, starting policy); a finished export made with other settings is an error, not a skip.
An adopted run has its logs and an `adopted.json` marker, no checkpoint and no `final/`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mismatch.io import atomic_path, atomic_write_text

from .cells import STUDY_ARMS, cells, fleet_of

__all__ = ["LOGS", "ADOPTED", "export_logs", "adopt_logs", "steps_logged", "run_state"]

LOGS = ("metrics.jsonl", "alerts.jsonl", "eval.json", "config.json", "command.txt")
"""What a run directory holds that the report reads (no checkpoints, no weights)."""
ADOPTED = "adopted.json"
"""The marker of a run whose finished logs were adopted from an export."""


def steps_logged(run: Path) -> int:
    """The last step a run's metrics.jsonl records (0: none)."""
    from mismatch.train.rundir import read_metrics  # torch: not at import (light --help)

    recs = read_metrics(Path(run) / "metrics.jsonl")
    return recs[-1]["step"] if recs else 0


def export_logs(cfg, out: Path, dest: Path) -> list[str]:
    """Copy OUT/study.json and every run's logs (`LOGS`, and an adopted run's marker) into `dest`
    (each file written to a temporary name and renamed), so that `--report-only --out DEST`
    rebuilds the report without the checkpoints. A run that logged fewer steps than `dest`
    already holds of it (a rerun still behind an earlier export) is left out. Returns the runs
    copied."""
    out, dest = Path(out), Path(dest)
    if not (out / "study.json").is_file():
        raise ValueError(f"{out} holds no study (no study.json); run it first")
    copied = []
    for cell in cells(cfg):
        run = out / cell.name
        if not (run / "metrics.jsonl").is_file():
            continue
        if steps_logged(run) < steps_logged(dest / cell.name):
            continue
        (dest / cell.name).mkdir(parents=True, exist_ok=True)
        for name in (*LOGS, ADOPTED):  # an adopted run says so in the export too
            if (run / name).is_file():
                with atomic_path(dest / cell.name / name) as tmp:
                    shutil.copyfile(run / name, tmp)
        copied.append(cell.name)
    with atomic_path(dest / "study.json") as tmp:
        shutil.copyfile(out / "study.json", tmp)
    return copied


def _expected(cfg, cell) -> dict:
    """The config.json fields a run of `cell` in grid `cfg` is made with (the model by name:
    the policy folder's path differs from machine to machine)."""
    return {"fleet": fleet_of(cell.fleet), "correction": STUDY_ARMS[cell.arm],
            "sync": cell.staleness is None, "staleness": cell.staleness, "seed": cell.seed,
            "steps": cfg.steps, "lr": cfg.lr, "tasks": cfg.tasks,
            "prompts_per_step": cfg.prompts, "samples_per_prompt": cfg.samples,
            "eval_tasks": cfg.eval_tasks, "model": cfg.policy_name}


def _finished(run: Path, cfg) -> bool:
    if steps_logged(run) < cfg.steps:
        return False
    if not cfg.eval_tasks:
        return True
    try:
        from mismatch.train.heldout import HeldOut

        return HeldOut.from_json(json.loads((run / "eval.json").read_text())).final is not None
    except (OSError, ValueError, KeyError, TypeError):  # unreadable or malformed: not finished
        return False


def adopt_logs(cfg, out: Path, src: Path) -> list[str]:
    """Copy into OUT the logs of every run of grid `cfg` that OUT has not finished and `src`
    (an export) holds finished; a run directory OUT held for it (an unfinished run, checkpoints
    included) is replaced. Returns the runs adopted. Raises ValueError for a `src` that is not
    a directory, or a finished run there made with other settings than this grid's."""
    out, src = Path(out), Path(src)
    if not src.is_dir():
        raise ValueError(f"--adopt {src}: no such directory; pass a study's --export folder")
    todo = []  # every run checked before any is copied: a refusal leaves OUT as it was
    for cell in cells(cfg):
        run, theirs = out / cell.name, src / cell.name
        if run_state(run, cfg.steps) == "done" or not _finished(theirs, cfg):
            continue
        try:
            made = json.loads((theirs / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{theirs}/config.json unreadable ({exc}); re-export the run or "
                             "remove it") from None
        model = made.get("model")
        made = dict(made, model=Path(model).name if model else None)
        for key, want in _expected(cfg, cell).items():
            if made.get(key) != want:
                raise ValueError(f"{theirs} was made with {key}={made.get(key)!r}, not "
                                 f"{want!r}: not a run of this grid; use the grid's settings "
                                 "or another --adopt folder")
        todo.append((cell.name, run, theirs))
    for name, run, theirs in todo:
        if run.exists():
            shutil.rmtree(run)
        run.mkdir(parents=True)
        for log in LOGS:
            if (theirs / log).is_file():
                shutil.copyfile(theirs / log, run / log)
        marker = {"from": str(theirs), "steps": steps_logged(theirs)}
        atomic_write_text(run / ADOPTED, json.dumps(marker, indent=2) + "\n")
    return [name for name, _, _ in todo]


def run_state(run: Path, steps: int) -> str:
    """done | resume (a checkpoint to continue from) | fresh (nothing, or nothing worth keeping)"""
    from mismatch.train.rundir import latest_checkpoint

    finished = (run / "final").is_dir() or (run / ADOPTED).is_file()  # adopted: adopt_logs
    if finished and steps_logged(run) >= steps:
        return "done"
    if latest_checkpoint(run) is not None:
        return "resume"
    return "fresh"
