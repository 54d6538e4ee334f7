"""`mismatch train` (corrected asynchronous GRPO on a sampler fleet) and `mismatch report DIR`
(the run's curves). Registered by mismatch/cli.py.

Exit codes of `train`: 0 the run reached --steps; 3 it stopped on an alert (`--stop-on`, with a
checkpoint, resumable); 2 bad input (unknown preset or arm, an --out that already holds a run
without --resume, a config that differs from the run being resumed, an unreadable checkpoint).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from mismatch.cli.common import preset_help
from mismatch.train.study import STUDY_PRESETS

__all__ = ["train_command", "report_command", "study_command"]


def train_command(
    out: Path = typer.Option(..., "--out", help="Run directory (metrics.jsonl, alerts.jsonl, "
                             "checkpoints/, eval.json, final/)."),
    preset: str = typer.Option("mixed", "--preset", help="homogeneous | precision | mixed | "
                               "smoke (a few small steps on the mixed fleet, for CI)."),
    correction: str = typer.Option("sc+mis+topp", "--correction", help="Loss arm: grpo, mis, "
                                   "icepop, tis, sc, sc+mis, sc+tis, topp, sc+mis+topp."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (preset's "
                                        "default: 200; smoke: 3)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its "
                                "newest checkpoint."),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW learning rate (1e-4)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", help="Prompts per step (4)."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Episodes per prompt, the "
                                          "GRPO group (8)."),
    max_staleness: Optional[int] = typer.Option(None, "--max-staleness", help="Bound on a "
                                                "token's staleness in steps (unbounded)."),
    staleness: Optional[int] = typer.Option(None, "--staleness", help="Force the lag: step s "
                                            "trains on episodes of version max(0, s-K)."),
    sync: bool = typer.Option(False, "--sync", help="Synchronous: sample with version s, then "
                              "train step s."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Sampler worker threads (1)."),
    sampler_processes: Optional[int] = typer.Option(
        None, "--sampler-processes", help="Local backend: sampler worker processes of one "
        "thread each, beside the trainer (default: one per core on a machine with 2 or more; "
        "0: sample in this process)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads (1)."),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every",
                                                   help="Checkpoint every N steps (10)."),
    eval_tasks: Optional[int] = typer.Option(None, "--eval-tasks", help="Held-out tasks "
                                             "evaluated before and after (64; smoke 0)."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Also evaluate the "
                                             "held-out tasks every N steps (0: no)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Start from this policy (a "
                                         "`mismatch zoo build --out` directory; default: the "
                                         "embedded model)."),
    stop_on: Optional[str] = typer.Option(None, "--stop-on", help="End the run, with a "
                                          "checkpoint, on an alert: warning | critical."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Task mix: zoo, or kinds in turn "
                                        "(arith, word, table, two_step), e.g. arith,table."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Router, task order, sampling."),
    backend: str = typer.Option("local", "--backend", help="local (sampler threads in this "
                                "process) | ray (sampler groups and the trainer as Ray actors)."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray: join this cluster "
                                          "(e.g. 10.0.0.1:6379 or auto) instead of starting a "
                                          "local Ray with this machine's CPUs."),
    replicas: int = typer.Option(1, "--replicas", help="Ray: sampler actors per group."),
    trainer_ranks: int = typer.Option(1, "--trainer-ranks", help="Ray: trainer actors; N > 1 "
                                      "shards the trainer with FSDP2 over N ranks."),
    weights_dir: Optional[Path] = typer.Option(None, "--weights-dir", help="Ray: publish "
                                               "weight versions as files in this directory "
                                               "(a path every node sees) instead of through "
                                               "the object store."),
    placement: str = typer.Option("cpu", "--placement", help="Ray: cpu (each actor a share of "
                                  "the CPUs) | gpu (each sampler one GPU of its group's type, "
                                  "by Ray's accelerator_type label)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Train the embedded model with corrected asynchronous GRPO on a sampler fleet."""
    from mismatch.cli.common import fail, quiet_libraries

    quiet_libraries()
    from mismatch.train.config import preset_config
    from mismatch.train.loop import EXIT_STOPPED, run
    from mismatch.train.rundir import check_out

    try:
        cfg = preset_config(preset, correction=correction, steps=steps, lr=lr,
                            prompts_per_step=prompts, samples_per_prompt=samples,
                            max_staleness=max_staleness, staleness=staleness,
                            sync=sync or None, workers=workers,
                            sampler_processes=_sampler_processes(sampler_processes, backend),
                            threads=threads, checkpoint_every=checkpoint_every,
                            eval_tasks=eval_tasks, eval_every=eval_every, tasks=tasks,
                            seed=seed, model=str(model) if model else None)
        check_out(out, resume, cfg)
        if cfg.model:
            from mismatch.zoo.loading import check_model_dir

            check_model_dir(cfg.model)
        if stop_on not in (None, "warning", "critical"):
            raise ValueError(f"--stop-on must be warning or critical, got {stop_on!r}")
        if backend not in ("local", "ray"):
            raise ValueError(f"--backend must be local or ray, got {backend!r}")
        if backend == "local" and (address or replicas != 1 or placement != "cpu"
                                   or trainer_ranks != 1 or weights_dir):
            raise ValueError("--address, --replicas, --trainer-ranks, --weights-dir and "
                             "--placement are options of --backend ray")
        engine = None
        if backend == "ray":
            from mismatch.train.ray_backend import RayBackend

            engine = RayBackend(address, replicas=replicas, trainer_ranks=trainer_ranks,
                                placement=placement, weights_dir=weights_dir)
    except ValueError as exc:
        fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    command = "mismatch " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def body(progress):
        return run(cfg, out, resume=resume, stop_on=stop_on, progress=progress, backend=engine)

    try:
        result = _with_step_bar(body, cfg.steps, quiet=quiet)
    except ValueError as exc:
        fail(str(exc))
    except RuntimeError as exc:
        from mismatch.train.ray_actors import BackendError

        if not isinstance(exc, BackendError):
            raise
        fail(str(exc))
    (Path(out) / "command.txt").write_text(command + "\n")
    ev = result.evaluation
    lines = [f"{out}: {result.steps_done} steps ({cfg.correction} on {cfg.fleet})"]
    for label, e in (("", ev), (" from the full vocabulary", ev.get("full_vocab") or {})):
        if "base" in e and "final" in e:  # a top-p arm: through its nucleus, then the full one
            during = "".join(f" -> step {k} {v['reward']:.3f}"
                             for k, v in e.get("during", {}).items())
            lines.append(f"held-out reward{label}: base {e['base']['reward']:.3f}{during} -> "
                         f"final {e['final']['reward']:.3f} ({ev['tasks']} tasks x "
                         f"{ev['samples']}, {e['final']['sampling']} sampling)")
    if result.alerts:
        lines.append(f"alerts: {len(result.alerts)} (see {Path(out) / 'alerts.jsonl'})")
    typer.echo("\n".join(lines))
    if result.stopped:
        typer.echo(f"stopped: {result.stopped}; resume with --resume", err=True)
        raise typer.Exit(EXIT_STOPPED)


def _with_bar(fn, *, quiet: bool, label: str, total, completed, describe):
    """fn(progress) with a bar on stderr, opened at the first progress call (so that an error
    before it — a bad checkpoint, say — stays one line). total, completed, describe: of the
    state passed to progress."""
    if quiet:
        return fn(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True))
    task = None

    def progress(state: dict) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(label, total=total(state))
        bar.update(task, completed=completed(state), description=describe(state))

    try:
        return fn(progress)
    finally:
        bar.stop()


def _with_step_bar(fn, total: int, *, quiet: bool):
    """fn(progress) with a bar over the run's optimizer steps."""
    return _with_bar(fn, quiet=quiet, label="training", total=lambda _: total,
                     completed=lambda rec: rec["step"], describe=lambda rec: (
                         f"reward {rec['reward']:.2f} kl {rec['kl']:.1e} "
                         f"stale {rec['staleness_mean']:.1f}"))


def report_command(
    run_dir: Path = typer.Argument(..., help="A `mismatch train` run directory (or several, "
                                   "side by side).", show_default=False),
    others: list[Path] = typer.Argument(None, help="More run directories to compare.",
                                        show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", help="Report directory (default: "
                                       "RUN_DIR/report)."),
) -> None:
    """Draw a training run's curves (reward, KL, format errors, masked fraction, ...)."""
    from mismatch.cli.common import fail

    from mismatch.train.report import write_report

    dirs = [run_dir] + list(others or [])
    try:
        path = write_report(dirs, out or Path(run_dir) / "report")
    except ValueError as exc:
        fail(str(exc))
    typer.echo(f"wrote {path}")


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
                                         "(homogeneous), L1 (precision), L2 (mixed)."),
    arms: Optional[str] = typer.Option(None, "--arms", help="Comma-separated among grpo, mis, "
                                       "sc, sc+mis, grpo+topp, sc+mis+topp."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Comma-separated seeds (0,1,2)."),
    staleness: Optional[str] = typer.Option(None, "--staleness", help="Comma-separated forced "
                                            "staleness values K."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps per run."),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW learning rate."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Task kinds (arith)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", help="Prompts per step."),
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
    from dataclasses import replace

    from mismatch.train.study import STUDY_PRESETS, run_grid
    from mismatch.train.study_report import aggregate

    grid_command = ""
    try:
        if preset not in STUDY_PRESETS:
            raise ValueError(f"unknown study preset {preset!r}; presets: "
                             f"{', '.join(STUDY_PRESETS)}")
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        if report_only and adopt is not None:
            raise ValueError("--adopt is for a grid that runs; to report on an export, --out it")
        if notes is not None and not notes.is_file():
            raise ValueError(f"--notes {notes}: no such file")
        cfg = STUDY_PRESETS[preset]()
        over = {"fleets": fleets and _csv(fleets), "arms": arms and _csv(arms),
                "seeds": seeds and _csv(seeds, int),
                "staleness": staleness and _csv(staleness, int),
                "sync_arms": None if sync_arms is None else _csv(sync_arms),
                "policy_steps": policy_steps, "eval_tasks": eval_tasks,
                "steps": steps, "lr": lr, "tasks": tasks, "prompts": prompts, "samples": samples}
        cfg = replace(cfg, **{k: v for k, v in over.items() if v is not None})
        if report_only:
            cfg, grid_command = _saved_study(out, cfg, over)
    except ValueError as exc:
        fail(str(exc))
    command = "mismatch " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    elapsed = None
    if report_only and grid_command:  # the report names the run that made it, then this
        command = grid_command + "\n" + command
    if not report_only:
        try:
            result = _with_grid_display(
                lambda p: run_grid(cfg, out, jobs=jobs, progress=p, command=command,
                                   adopt=adopt),
                quiet=quiet)
        except ValueError as exc:
            fail(str(exc))
        except OSError as exc:  # an --out that is a file, a read-only or full disk
            fail(f"cannot run the study in {out}: {exc.strerror or exc}; choose another --out")
        elapsed = result.seconds
        typer.echo(f"{out}: {len(result.done)} run(s) finished, {len(result.skipped)} already "
                   f"done ({len(result.adopted)} adopted), {len(result.resumed)} resumed, "
                   f"{len(result.failed)} failed "
                   f"({result.seconds / 60:.1f} min)")
        for name, last in result.failed.items():
            typer.echo(f"failed: {name}: {last} (log: {out / name / 'train.log'})", err=True)
    if eval_full_vocab:
        _eval_full_vocab(cfg, out, quiet=quiet)
    try:
        path = aggregate(cfg, out, report or out / "study.md", command=command,
                         elapsed=elapsed, notes=notes.read_text() if notes else None)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the report {report or out / 'study.md'}: {exc.strerror or exc}")
    typer.echo(f"wrote {path}")
    if export is not None:
        from mismatch.train.study_logs import export_logs

        try:
            runs = export_logs(cfg, out, export)
        except (ValueError, OSError) as exc:
            fail(f"cannot export to {export}: {exc}")
        typer.echo(f"exported the logs of {len(runs)} run(s) to {export}")
    if not report_only and result.failed:
        raise typer.Exit(1)


def _eval_full_vocab(cfg, out: Path, *, quiet: bool) -> None:
    """--eval-full-vocab: each finished top-p run of the grid not yet evaluated that way."""
    from mismatch.cli.common import fail
    from mismatch.train.study import cells
    from mismatch.train.study_eval import evaluate_full_vocab, needs_full_vocab_eval

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

    from mismatch.train.study import StudyConfig

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
    return _with_bar(fn, quiet=quiet, label="study", total=lambda st: st["total"],
                     completed=lambda st: st["steps"], describe=lambda st: (
                         f"runs {st['done']}/{st['runs']} done, {st['failed']} failed; "
                         f"running {', '.join(st['running']) or '–'}"))


def _sampler_processes(given: int | None, backend: str) -> int:
    """--sampler-processes, or its default: one per core where there are two or more (the
    trainer then shares the cores with them), none with the Ray backend (its actors sample)."""
    if backend != "local":
        if given:
            raise ValueError("--sampler-processes is an option of --backend local")
        return 0
    if given is not None:
        return given
    from mismatch.engines.workers import default_processes

    n = default_processes()
    return n if n >= 2 else 0
