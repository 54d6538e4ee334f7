"""`mismatch train` (corrected asynchronous GRPO on a sampler fleet) and `mismatch report DIR`
(the run's curves); `mismatch study` is in mismatch/cli/study.py. Registered by
mismatch/cli/main.py.

Exit codes of `train`: 0 the run reached --steps; 3 it stopped on an alert (`--stop-on`, with a
checkpoint, resumable); 2 bad input (unknown preset or arm, an --out that already holds a run
without --resume, a config that differs from the run being resumed, an unreadable checkpoint).
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mismatch.cli.common import (ARM_ALIASES, STUDY_ARM_ALIASES, choice_list, one_of,
                                 run_with_state_bar)
from mismatch.probes.monitor.signals import SEVERITIES
from mismatch.profiles import LM_HEADS
from mismatch.train.arms import ARMS
from mismatch.train.config import RUN_PRESETS, RUN_TRAINER_DTYPES
from mismatch.zoo.tasks import TASK_KINDS


__all__ = ["train_command", "report_command"]


def _fleet_path(path: Optional[Path]) -> Optional[str]:
    """--fleet as an absolute path (saved in config.json, so a resume elsewhere finds it)."""
    if path is None:
        return None
    if path.suffix.lower() != ".toml":
        raise ValueError(f"--fleet {path}: expected a fleet file ending in .toml (written by "
                         f"`mismatch plan`); fleet presets are chosen with --preset")
    return str(path.resolve())


_T_OUT = Annotated[Path, typer.Option("--out", help="Run directory (metrics.jsonl, "
    "alerts.jsonl, checkpoints/, eval.json, final/).")]
# the choice lists below are the registries' (torch-free modules: `--help` stays instant)
_T_PRESET = Annotated[str, typer.Option("--preset", help=choice_list(
    RUN_PRESETS, {"smoke": "a few small steps on the mixed fleet, for CI"}, sep=" | ",
    last=" | ") + ".")]
_T_FLEET_FILE = Annotated[Optional[Path], typer.Option("--fleet", help="Sample on this fleet "
    "file instead of the preset's fleet (the fleet.toml `mismatch plan` writes: groups and "
    "shares; with prices, every step logs sampling_cost_usd).")]
_T_CORRECTION = Annotated[str, typer.Option("--correction", help="Loss arm: " + choice_list(
    [STUDY_ARM_ALIASES.get(a, a) for a in ARMS], {v: f"or {k}" for k, v in
                                                  STUDY_ARM_ALIASES.items()}, last=", ")
    + " — the names `mismatch study --arms` takes.")]
_T_TRAINER_DTYPE = Annotated[str, typer.Option("--trainer-dtype", help="The trainer's compute "
    "dtype: " + choice_list(RUN_TRAINER_DTYPES, {"fp32": "a reference; samplers still get BF16 "
                                                         "weights"}, last=", or ") + ".")]
_T_LM_HEAD = Annotated[str, typer.Option("--lm-head", help="The LM head's precision on the "
    "trainer and every sampler: " + choice_list(LM_HEADS, {
        "compute": "BF16", "fp32": "inputs, weights and logits in FP32, as MiniMax-M1 "
                                   "trained"}) + ".")]
_T_STEPS = Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (preset's "
    "default: 200; smoke: 3).")]
_T_RESUME = Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its "
    "newest checkpoint.")]
_T_LR = Annotated[Optional[float], typer.Option("--lr", help="AdamW learning rate (1e-4).")]
_T_PROMPTS = Annotated[Optional[int], typer.Option("--n-prompts", help="Prompts per step (4).")]
_T_PROMPTS_ALIAS = Annotated[Optional[int], typer.Option("--prompts", hidden=True,
    help="Former name of --n-prompts.")]
_T_SAMPLES = Annotated[Optional[int], typer.Option("--samples", help="Episodes per prompt, the "
    "GRPO group (8).")]
_T_MAX_STALENESS = Annotated[Optional[int], typer.Option("--max-staleness",
    help="Bound on a token's staleness in steps (unbounded).")]
_T_STALENESS = Annotated[Optional[int], typer.Option("--staleness", help="Force the lag: step s "
    "trains on episodes of version max(0, s-K).")]
_T_SYNC = Annotated[bool, typer.Option("--sync", help="Synchronous: sample with version s, then "
    "train step s.")]
_T_WORKERS = Annotated[Optional[int], typer.Option("--workers", help="Sampler worker threads "
    "(1).")]
_T_SAMPLER_PROCESSES = Annotated[Optional[int], typer.Option("--sampler-processes",
    help="Local backend: sampler worker processes of one thread each, beside the trainer "
    "(default: one per core on a machine with 2 or more; 0: sample in this process).")]
_T_THREADS = Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads "
    "(1).")]
_T_CHECKPOINT_EVERY = Annotated[Optional[int], typer.Option("--checkpoint-every",
    help="Checkpoint every N steps (10).")]
_T_KEEP_CHECKPOINTS = Annotated[Optional[int], typer.Option("--keep-checkpoints",
    help="The newest N checkpoints kept (2; 0: all).")]
_T_EVAL_TASKS = Annotated[Optional[int], typer.Option("--eval-tasks", help="Held-out tasks "
    "evaluated before and after (64; smoke 0).")]
_T_EVAL_EVERY = Annotated[Optional[int], typer.Option("--eval-every", help="Also evaluate the "
    "held-out tasks every N steps (0: no).")]
_T_MODEL = Annotated[Optional[Path], typer.Option("--model", help="Start from this policy (a "
    "`mismatch zoo build --out` directory; default: the embedded model).")]
_T_STOP_ON = Annotated[Optional[str], typer.Option("--stop-on", help="End the run, with a "
    f"checkpoint, on an alert: {choice_list(SEVERITIES, sep=' | ', last=' | ')}.")]
_T_TASKS = Annotated[Optional[str], typer.Option("--tasks", help="Task mix: zoo, or kinds in "
    f"turn ({choice_list(TASK_KINDS, last=', ')}), e.g. arith,table.")]
_T_SEED = Annotated[Optional[int], typer.Option("--seed", help="Router, task order, sampling.")]
_T_BACKEND = Annotated[str, typer.Option("--backend", help="local (sampler threads in this "
    "process) | ray (sampler groups and the trainer as Ray actors).")]
_T_ADDRESS = Annotated[Optional[str], typer.Option("--address", help="Ray: join this cluster "
    "(e.g. 10.0.0.1:6379 or auto) instead of starting a local Ray with this machine's CPUs.")]
_T_REPLICAS = Annotated[int, typer.Option("--replicas", help="Ray: sampler actors per group.")]
_T_TRAINER_RANKS = Annotated[int, typer.Option("--trainer-ranks", help="Ray: trainer actors; N "
    "> 1 shards the trainer with FSDP2 over N ranks.")]
_T_WEIGHTS_DIR = Annotated[Optional[Path], typer.Option("--weights-dir",
    help="Ray: publish weight versions as files in this directory (a path every node sees) "
    "instead of through the object store.")]
_T_PLACEMENT = Annotated[str, typer.Option("--placement", help="Ray: cpu (each actor a share of "
    "the CPUs) | gpu (each sampler one GPU of its group's type, by Ray's accelerator_type "
    "label).")]
_T_QUIET = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]


def train_command(
    out: _T_OUT, preset: _T_PRESET = "mixed", fleet_file: _T_FLEET_FILE = None,
    correction: _T_CORRECTION = "sc+mis+topp", trainer_dtype: _T_TRAINER_DTYPE = "bf16",
    lm_head: _T_LM_HEAD = "compute", steps: _T_STEPS = None, resume: _T_RESUME = False,
    lr: _T_LR = None, prompts: _T_PROMPTS = None, prompts_alias: _T_PROMPTS_ALIAS = None,
    samples: _T_SAMPLES = None, max_staleness: _T_MAX_STALENESS = None,
    staleness: _T_STALENESS = None, sync: _T_SYNC = False, workers: _T_WORKERS = None,
    sampler_processes: _T_SAMPLER_PROCESSES = None, threads: _T_THREADS = None,
    checkpoint_every: _T_CHECKPOINT_EVERY = None, keep_checkpoints: _T_KEEP_CHECKPOINTS = None,
    eval_tasks: _T_EVAL_TASKS = None, eval_every: _T_EVAL_EVERY = None, model: _T_MODEL = None,
    stop_on: _T_STOP_ON = None, tasks: _T_TASKS = None, seed: _T_SEED = None,
    backend: _T_BACKEND = "local", address: _T_ADDRESS = None, replicas: _T_REPLICAS = 1,
    trainer_ranks: _T_TRAINER_RANKS = 1, weights_dir: _T_WEIGHTS_DIR = None,
    placement: _T_PLACEMENT = "cpu", quiet: _T_QUIET = False,
) -> None:
    """Train the embedded model with corrected asynchronous GRPO on a sampler fleet."""
    from mismatch.cli.common import fail, quiet_libraries

    quiet_libraries()
    from mismatch.train.config import preset_config
    from mismatch.train.loop import EXIT_STOPPED, run
    from mismatch.train.rundir import check_out

    try:
        prompts = one_of(prompts, prompts_alias)
        correction = ARM_ALIASES.get(correction, correction)
        cfg = preset_config(preset, correction=correction, lm_head=lm_head.lower(),
                            trainer_dtype=trainer_dtype.lower(), steps=steps, lr=lr,
                            prompts_per_step=prompts, samples_per_prompt=samples,
                            max_staleness=max_staleness, staleness=staleness,
                            sync=sync or None, workers=workers,
                            sampler_processes=_sampler_processes(sampler_processes, backend),
                            threads=threads, checkpoint_every=checkpoint_every,
                            keep_checkpoints=keep_checkpoints,
                            eval_tasks=eval_tasks, eval_every=eval_every, tasks=tasks,
                            seed=seed, model=str(model) if model else None,
                            fleet=_fleet_path(fleet_file))
        check_out(out, resume, cfg)
        if cfg.model:
            from mismatch.zoo.loading import check_model_dir

            check_model_dir(cfg.model)
        if stop_on is not None and stop_on not in SEVERITIES:
            raise ValueError(f"--stop-on must be {choice_list(SEVERITIES)}, got {stop_on!r}")
        engine = _backend(backend, address=address, replicas=replicas, placement=placement,
                          trainer_ranks=trainer_ranks, weights_dir=weights_dir)
    except ValueError as exc:
        fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    command = "mismatch " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def body(progress):
        return run(cfg, out, resume=resume, stop_on=stop_on, progress=progress, backend=engine)

    result = _run_reporting_errors(body, cfg.steps, quiet, out, command)
    (Path(out) / "command.txt").write_text(command + "\n")
    typer.echo("\n".join(_result_lines(out, cfg, result)))
    if result.stopped:
        typer.echo(f"stopped: {result.stopped}; resume with --resume", err=True)
        raise typer.Exit(EXIT_STOPPED)


def _backend(backend: str, *, address, replicas, placement, trainer_ranks, weights_dir):
    """--backend and its options: None for the local backend, else a RayBackend (ValueError for
    an unknown backend, or Ray's options without it)."""
    if backend not in ("local", "ray"):
        raise ValueError(f"--backend must be local or ray, got {backend!r}")
    if backend == "local":
        if address or replicas != 1 or placement != "cpu" or trainer_ranks != 1 or weights_dir:
            raise ValueError("--address, --replicas, --trainer-ranks, --weights-dir and "
                             "--placement are options of --backend ray")
        return None
    from mismatch.train.ray_backend import RayBackend

    return RayBackend(address, replicas=replicas, trainer_ranks=trainer_ranks,
                      placement=placement, weights_dir=weights_dir)


def _run_reporting_errors(body, steps: int, quiet: bool, out: Path, command: str):
    """The run under its step bar; Ctrl-C, bad input and a failed Ray backend end it in one line
    (a bug still raises)."""
    from mismatch.cli.common import fail

    try:
        return _with_step_bar(body, steps, quiet=quiet)
    except KeyboardInterrupt:
        _interrupted(out, command)
    except ValueError as exc:
        fail(str(exc))
    except RuntimeError as exc:
        from mismatch.train.ray_actors import BackendError

        if not isinstance(exc, BackendError):
            raise
        fail(str(exc))


def _result_lines(out: Path, cfg, result) -> list[str]:
    """What the run did, for the terminal: steps, held-out reward (through a top-p arm's nucleus,
    then from the full vocabulary), alerts."""
    ev = result.evaluation
    lines = [f"{out}: {result.steps_done} steps ({cfg.correction} on {cfg.fleet})"]
    for label, e in (("", ev), (" from the full vocabulary", ev.full_vocab)):
        if e is not None and e.complete:
            during = "".join(f" -> step {k} {v.reward:.3f}" for k, v in e.during.items())
            lines.append(f"held-out reward{label}: base {e.base.reward:.3f}{during} -> "
                         f"final {e.final.reward:.3f} ({ev.tasks} tasks x {ev.samples}, "
                         f"{e.final.sampling} sampling)")
    if result.alerts:
        lines.append(f"alerts: {len(result.alerts)} (see {Path(out) / 'alerts.jsonl'})")
    return lines


EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT), as a shell reports it."""


def _interrupted(out: Path, command: str) -> None:
    """Ctrl-C: say where the run stopped and the command that continues it; exit 130."""
    from mismatch.train.rundir import latest_checkpoint, read_metrics

    logged = read_metrics(Path(out) / "metrics.jsonl")
    at = f"after step {logged[-1]['step']}" if logged else "before its first step"
    ckpt = latest_checkpoint(out)
    again = command if "--resume" in command.split() or ckpt is None else \
        f"{command} --resume"
    if ckpt is None:
        typer.echo(f"mismatch: interrupted {at}, before the first checkpoint; {again!s} "
                   f"starts {out} over", err=True)
    else:
        typer.echo(f"mismatch: interrupted {at}; the last checkpoint is {ckpt.name}: "
                   f"continue with {again}", err=True)
    raise typer.Exit(EXIT_INTERRUPTED)


def _with_step_bar(fn, total: int, *, quiet: bool):
    """fn(progress) with a bar over the run's optimizer steps."""
    return run_with_state_bar(fn, quiet=quiet, label="training", total=lambda _: total,
                              completed=lambda rec: rec.step, describe=lambda rec: (
                                  f"reward {rec.reward:.2f} kl {rec.kl:.1e} "
                                  f"stale {rec.staleness_mean:.1f}"))


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
