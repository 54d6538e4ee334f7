"""`mismatch study`: the reference study's grid (fleet x staleness x arm x seed) as separate
`mismatch train` processes, resumably, aggregated into one report (mismatch/study/cells.py,
grid.py and aggregate.py). Registered by mismatch/cli/main.py. Exit codes: 0 every run finished;
1 a run failed (the report still covers the rest); 2 bad input.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mismatch.cli.common import (STUDY_ARM_ALIASES, choice_list, one_of, preset_help,
                                 run_with_state_bar)
from mismatch.study.cells import STUDY_ARMS, STUDY_FLEETS, STUDY_PRESETS

__all__ = ["study_command"]


def _csv(value: str, cast=str) -> tuple:
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    try:
        return tuple(cast(x) for x in items)
    except ValueError:
        raise ValueError(f"expected a comma-separated list, got {value!r}") from None


_S_OUT = Annotated[Path, typer.Option("--out", help="Study directory: one `mismatch train` run "
    "per cell, and study.json.")]
_S_REPORT = Annotated[Optional[Path], typer.Option("--report", help="Markdown report; plots go "
    "beside it (default: OUT/study.md).")]
_S_PRESET = Annotated[str, typer.Option("--preset", help=preset_help(STUDY_PRESETS))]
_S_FLEETS = Annotated[Optional[str], typer.Option("--fleets", help="Comma-separated: "
    f"{choice_list(STUDY_FLEETS, STUDY_FLEETS, last=', ')}, or fleet files (.toml, as "
    "`mismatch plan` writes; runs named by the file's stem).")]
_S_ARMS = Annotated[Optional[str], typer.Option("--arms", help="Comma-separated among "
    + choice_list(STUDY_ARMS, {v: f"or {k}" for k, v in STUDY_ARM_ALIASES.items()}, last=", ")
    + " — the names `mismatch train --correction` takes.")]
_S_SEEDS = Annotated[Optional[str], typer.Option("--seeds", help="Comma-separated seeds (0,1,2).")]
_S_STALENESS = Annotated[Optional[str], typer.Option("--staleness", help="Comma-separated "
    "forced staleness values K.")]
_S_STEPS = Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps per run.")]
_S_LR = Annotated[Optional[float], typer.Option("--lr", help="AdamW learning rate.")]
_S_TASKS = Annotated[Optional[str], typer.Option("--tasks", help="Task kinds (arith).")]
_S_PROMPTS = Annotated[Optional[int], typer.Option("--n-prompts", help="Prompts per step.")]
_S_PROMPTS_ALIAS = Annotated[Optional[int], typer.Option("--prompts", hidden=True,
    help="Former name of --n-prompts.")]
_S_SAMPLES = Annotated[Optional[int], typer.Option("--samples", help="Episodes per prompt.")]
_S_SYNC_ARMS = Annotated[Optional[str], typer.Option("--sync-arms", help="Comma-separated arms "
    "also run on-policy (--sync) as controls, on L0 (empty: none).")]
_S_POLICY_STEPS = Annotated[Optional[int], typer.Option("--policy-steps",
    help="Start from a zoo policy trained N steps (built once into OUT/policy-N; 0: the "
    "embedded model).")]
_S_EVAL_TASKS = Annotated[Optional[int], typer.Option("--eval-tasks", help="Held-out tasks "
    "evaluated before, midway and after each run.")]
_S_JOBS = Annotated[int, typer.Option("--jobs", help="Runs at once, each pinned to cores of its "
    "own (default: the CPU count).")]
_S_NOTES = Annotated[Optional[Path], typer.Option("--notes", help="A markdown file appended to "
    "the report (the discussion).")]
_S_REPORT_ONLY = Annotated[bool, typer.Option("--report-only", help="Aggregate the runs in OUT "
    "without running anything.")]
_S_EXPORT = Annotated[Optional[Path], typer.Option("--export", help="Also copy study.json and "
    "every run's logs (no checkpoints) here, e.g. to commit them; `--report-only --out DIR` "
    "reads them.")]
_S_ADOPT = Annotated[Optional[Path], typer.Option("--adopt", help="An --export folder: its runs "
    "that finished with this grid's settings count as done (their logs are copied into OUT), "
    "so a new machine resumes the grid from committed logs.")]
_S_EVAL_FULL_VOCAB = Annotated[bool, typer.Option("--eval-full-vocab", help="Evaluate the base "
    "and final policy of each finished top-p run that was evaluated only through its nucleus "
    "(made before `mismatch train` did both) from the full vocabulary too, as the study "
    "evaluated, into its eval.json.")]
_S_QUIET = Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")]


def study_command(
    out: _S_OUT = Path("runs/study"), report: _S_REPORT = None, preset: _S_PRESET = "full",
    fleets: _S_FLEETS = None, arms: _S_ARMS = None, seeds: _S_SEEDS = None,
    staleness: _S_STALENESS = None, steps: _S_STEPS = None, lr: _S_LR = None,
    tasks: _S_TASKS = None, prompts: _S_PROMPTS = None, prompts_alias: _S_PROMPTS_ALIAS = None,
    samples: _S_SAMPLES = None, sync_arms: _S_SYNC_ARMS = None,
    policy_steps: _S_POLICY_STEPS = None, eval_tasks: _S_EVAL_TASKS = None,
    jobs: _S_JOBS = max(1, (os.cpu_count() or 1)), notes: _S_NOTES = None,
    report_only: _S_REPORT_ONLY = False, export: _S_EXPORT = None, adopt: _S_ADOPT = None,
    eval_full_vocab: _S_EVAL_FULL_VOCAB = False, quiet: _S_QUIET = False,
) -> None:
    """Run the study's grid (fleet x staleness x arm x seed) as separate processes, resumably,
    and aggregate it into a report."""
    from mismatch.cli.common import fail, quiet_libraries

    quiet_libraries()
    over = {"fleets": fleets and _csv(fleets),
            "arms": arms and tuple(STUDY_ARM_ALIASES.get(a, a) for a in _csv(arms)),
            "seeds": seeds and _csv(seeds, int), "staleness": staleness and _csv(staleness, int),
            "sync_arms": None if sync_arms is None else
            tuple(STUDY_ARM_ALIASES.get(a, a) for a in _csv(sync_arms)),
            "policy_steps": policy_steps, "eval_tasks": eval_tasks, "steps": steps, "lr": lr,
            "tasks": tasks, "samples": samples}
    try:
        over["prompts"] = one_of(prompts, prompts_alias)
        cfg, grid_command = _grid(preset, over, out=out, jobs=jobs, report_only=report_only,
                                  adopt=adopt, notes=notes)
    except ValueError as exc:
        fail(str(exc))
    command = "mismatch " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if report_only and grid_command:  # the report names the run that made it, then this
        command = grid_command + "\n" + command
    result = None if report_only else _run(cfg, out, jobs=jobs, command=command, adopt=adopt,
                                           quiet=quiet)
    if eval_full_vocab:
        _eval_full_vocab(cfg, out, quiet=quiet)
    _report(cfg, out, report, command=command, elapsed=result and result.seconds, notes=notes,
            export=export)
    if result is not None and result.failed:
        raise typer.Exit(1)


def _grid(preset: str, over: dict, *, out: Path, jobs: int, report_only: bool,
          adopt: Path | None, notes: Path | None):
    """The grid to run (the preset with the options given), checked (ValueError: one line),
    and the command that ran it (`--report-only`: the saved grid's)."""
    from dataclasses import replace

    from mismatch.study.cells import STUDY_PRESETS

    if preset not in STUDY_PRESETS:
        raise ValueError(f"unknown study preset {preset!r}; presets: {', '.join(STUDY_PRESETS)}")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if report_only and adopt is not None:
        raise ValueError("--adopt is for a grid that runs; to report on an export, --out it")
    if notes is not None and not notes.is_file():
        raise ValueError(f"--notes {notes}: no such file")
    cfg = replace(STUDY_PRESETS[preset](), **{k: v for k, v in over.items() if v is not None})
    return _saved_study(out, cfg, over) if report_only else (cfg, "")


def _run(cfg, out: Path, *, jobs: int, command: str, adopt: Path | None, quiet: bool):
    """Run the grid's runs (a display over them unless quiet); a line on how they went."""
    from mismatch.cli.common import fail
    from mismatch.study.grid import run_grid

    try:
        result = _with_grid_display(
            lambda p: run_grid(cfg, out, jobs=jobs, progress=p, command=command, adopt=adopt),
            quiet=quiet)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:  # an --out that is a file, a read-only or full disk
        fail(f"cannot run the study in {out}: {exc.strerror or exc}; choose another --out")
    typer.echo(f"{out}: {len(result.done)} run(s) finished, {len(result.skipped)} already "
               f"done ({len(result.adopted)} adopted), {len(result.resumed)} resumed, "
               f"{len(result.failed)} failed ({result.seconds / 60:.1f} min)")
    for name, last in result.failed.items():
        typer.echo(f"failed: {name}: {last} (log: {out / name / 'train.log'})", err=True)
    return result


def _report(cfg, out: Path, report: Path | None, *, command: str, elapsed: float | None,
            notes: Path | None, export: Path | None) -> None:
    """The report (and its plots) of the runs in OUT; their logs copied to --export."""
    from mismatch.cli.common import fail
    from mismatch.study.aggregate import aggregate

    try:
        path = aggregate(cfg, out, report or out / "study.md", command=command,
                         elapsed=elapsed, notes=notes.read_text() if notes else None)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the report {report or out / 'study.md'}: {exc.strerror or exc}")
    typer.echo(f"wrote {path}")
    if export is not None:
        from mismatch.study.logs import export_logs

        try:
            runs = export_logs(cfg, out, export)
        except (ValueError, OSError) as exc:
            fail(f"cannot export to {export}: {exc}")
        typer.echo(f"exported the logs of {len(runs)} run(s) to {export}")


def _eval_full_vocab(cfg, out: Path, *, quiet: bool) -> None:
    """--eval-full-vocab: each finished top-p run of the grid not yet evaluated that way."""
    from mismatch.cli.common import fail
    from mismatch.study.cells import cells
    from mismatch.study.full_vocab import evaluate_full_vocab, needs_full_vocab_eval

    todo = [out / c.name for c in cells(cfg) if needs_full_vocab_eval(out / c.name)]
    for run in todo:
        try:
            full = evaluate_full_vocab(run, log=(lambda m: None) if quiet else typer.echo)
        except (ValueError, OSError) as exc:
            fail(f"cannot evaluate {run} from the full vocabulary: {exc}")
        typer.echo(f"{run.name}: held-out from the full vocabulary, base "
                   f"{full['base']['reward']:.3f} → final {full['final']['reward']:.3f}")


def _saved_study(out: Path, cfg, over: dict):
    """The grid saved in OUT/study.json, with the options given on this command line, and the
    command that ran it."""
    import json
    from dataclasses import fields, replace

    from mismatch.study.cells import StudyConfig

    meta = out / "study.json"
    if not meta.exists():
        raise ValueError(f"{out} holds no study (no study.json); run it first")
    try:
        saved = json.loads(meta.read_text())
        names = {f.name for f in fields(StudyConfig)}
        cfg = StudyConfig(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in saved.items() if k in names})
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{meta} is unreadable ({exc}); rerun the study") from None
    return (replace(cfg, **{k: v for k, v in over.items() if v is not None}),
            str(saved.get("command") or ""))


def _with_grid_display(fn, *, quiet: bool):
    """fn(progress) with a bar over the steps of the whole grid and the runs in flight."""
    return run_with_state_bar(fn, quiet=quiet, label="study", total=lambda st: st["total"],
                              completed=lambda st: st["steps"], describe=lambda st: (
                                  f"runs {st['done']}/{st['runs']} done, {st['failed']} failed; "
                                  f"running {', '.join(st['running']) or '–'}"))
