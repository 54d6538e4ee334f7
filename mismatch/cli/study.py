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
from typing import Optional

import typer

from mismatch.cli.common import STUDY_ARM_ALIASES, one_of, preset_help, run_with_state_bar
from mismatch.study.cells import STUDY_PRESETS

__all__ = ["study_command"]


def _csv(value: str, cast=str) -> tuple:
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    try:
        return tuple(cast(x) for x in items)
    except ValueError:
        raise ValueError(f"expected a comma-separated list, got {value!r}") from None


def study_command(
    out: Path = typer.Option(Path("runs/study"), "--out", help="Study directory: one "
                             "`mismatch train` run per cell, and study.json."),
    report: Optional[Path] = typer.Option(None, "--report", help="Markdown report; plots go "
                                          "beside it (default: OUT/study.md)."),
    preset: str = typer.Option("full", "--preset", help=preset_help(STUDY_PRESETS)),
    fleets: Optional[str] = typer.Option(None, "--fleets", help="Comma-separated: L0 "
                                         "(homogeneous), L1 (precision), L2 (mixed), or fleet "
                                         "files (.toml, as `mismatch plan` writes; runs named "
                                         "by the file's stem)."),
    arms: Optional[str] = typer.Option(None, "--arms", help="Comma-separated among grpo, mis, "
                                       "sc, sc+mis, grpo+topp (or topp), sc+mis+topp — the "
                                       "names `mismatch train --correction` takes."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Comma-separated seeds (0,1,2)."),
    staleness: Optional[str] = typer.Option(None, "--staleness", help="Comma-separated forced "
                                            "staleness values K."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps per run."),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW learning rate."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Task kinds (arith)."),
    prompts: Optional[int] = typer.Option(None, "--n-prompts", help="Prompts per step."),
    prompts_alias: Optional[int] = typer.Option(None, "--prompts", hidden=True,
                                                help="Former name of --n-prompts."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Episodes per prompt."),
    sync_arms: Optional[str] = typer.Option(None, "--sync-arms", help="Comma-separated arms "
                                            "also run on-policy (--sync) as controls, on L0 "
                                            "(empty: none)."),
    policy_steps: Optional[int] = typer.Option(None, "--policy-steps", help="Start from a zoo "
                                               "policy trained N steps (built once into "
                                               "OUT/policy-N; 0: the embedded model)."),
    eval_tasks: Optional[int] = typer.Option(None, "--eval-tasks", help="Held-out tasks "
                                             "evaluated before, midway and after each run."),
    jobs: int = typer.Option(max(1, (os.cpu_count() or 1)), "--jobs", help="Runs at once, "
                             "each pinned to cores of its own (default: the CPU count)."),
    notes: Optional[Path] = typer.Option(None, "--notes", help="A markdown file appended to "
                                         "the report (the discussion)."),
    report_only: bool = typer.Option(False, "--report-only", help="Aggregate the runs in OUT "
                                     "without running anything."),
    export: Optional[Path] = typer.Option(None, "--export", help="Also copy study.json and "
                                          "every run's logs (no checkpoints) here, e.g. to "
                                          "commit them; `--report-only --out DIR` reads them."),
    adopt: Optional[Path] = typer.Option(None, "--adopt", help="An --export folder: its runs "
                                         "that finished with this grid's settings count as "
                                         "done (their logs are copied into OUT), so a new "
                                         "machine resumes the grid from committed logs."),
    eval_full_vocab: bool = typer.Option(False, "--eval-full-vocab", help="Evaluate the base "
                                         "and final policy of each finished top-p run that was "
                                         "evaluated only through its nucleus (made before "
                                         "`mismatch train` did both) from the full vocabulary "
                                         "too, as the study evaluated, into its eval.json."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
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
