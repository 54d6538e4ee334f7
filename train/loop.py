"""The asynchronous training loop (`run`): sampler workers generate with the weights they hold,
the trainer takes corrected GRPO steps and publishes new weights, the collapse monitor watches.

Each step the trainer takes the first `prompts_per_step` finished units off the pipeline's queue
(pipeline.py; a unit staler than `max_staleness` when consumed is discarded and counted), builds
the batch (batch.py), steps (trainer.py), publishes the BF16 cast as version step+1, appends the
step's record to metrics.jsonl (record.py) and feeds it to the monitor, evaluates every
`eval_every` steps (evaluation.py) and checkpoints every `checkpoint_every` (rundir.py).

Resume after a kill: the newest checkpoint is loaded; `metrics.jsonl` and `alerts.jsonl` are cut
back to its step (a torn last line dropped), the monitor replays the kept records to rebuild its
baselines, and the units claimed after the checkpoint — in flight or queued at the kill — are
counted, logged and regenerated. No optimizer step is lost (they are recomputed from the
checkpoint) and none is duplicated (the log is cut back first). In `sync` mode the resumed run is
bit-identical to an uninterrupted one: the batch of step s is units [s·P, (s+1)·P), each seeded by
its number, sampled with version s.

Backends: `LocalBackend` (the trainer in this process, samplers in its threads or in sampler
processes) or ray_backend.RayBackend (both as Ray actors); the loop is the same.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mismatch.runtime import torch_threads
from mismatch.step_record import StepRecord, read_steps

from .batch import Unit, build_batch
from .components import PipelineConfig
from .config import TrainConfig
from .evaluation import evaluate_into
from .fleet import SamplerGroup, run_fleet
from .heldout import HeldOut
from .pipeline import Pipeline, Publisher
from .record import step_record
from .rundir import (check_out, check_resume, cut_jsonl, restart_logs,
                     save_final, write_json)
from .trainer import Trainer

__all__ = ["run", "RunResult", "LocalBackend", "EXIT_STOPPED"]

log = logging.getLogger("mismatch.train")

EXIT_STOPPED = 3
"""`mismatch train`'s exit code when the run stopped on an alert (resumable)."""


@dataclass
class RunResult:
    out: Path
    steps_done: int
    stopped: str | None = None
    """Why the run stopped early (a critical alert), or None."""
    resumed_from: int | None = None
    discarded_units: int = 0
    alerts: list = field(default_factory=list)
    evaluation: HeldOut = field(default_factory=HeldOut)
    """The held-out evaluations (eval.json): before the first step, every `eval_every` steps,
    after the last (when eval_tasks > 0)."""


LOGS = ("metrics.jsonl", "alerts.jsonl", "eval.json")
"""A run's logs in its directory: the step records, the monitor's alerts, the held-out scores."""


class LocalBackend:
    """The trainer in this process; samplers in its worker threads, or (with
    cfg.pipeline.sampler_processes) in worker processes of one torch thread each, fed weights
    through shared memory (`--backend local`)."""

    name = "local"

    def __init__(self) -> None:
        self.pool = None

    def trainer(self, model: torch.nn.Module, cfg: TrainConfig) -> Trainer:
        return Trainer(model, cfg)

    def pipeline(self, cfg: TrainConfig, groups: list[SamplerGroup], model, tokenizer,
                 publisher: Publisher, start_unit: int) -> Pipeline:
        if cfg.pipeline.sampler_processes and self.pool is None:
            from mismatch.engines.workers import WorkerPool

            log.info("starting %d sampler processes", cfg.pipeline.sampler_processes)
            self.pool = WorkerPool(cfg.pipeline.sampler_processes,
                                   (copy.deepcopy(model), tokenizer))
        return Pipeline(cfg, groups, model, tokenizer, publisher, start_unit, pool=self.pool)

    def put(self, weights: dict[str, torch.Tensor]):
        """A published weight version as the pipeline holds it (here: the tensors)."""
        return weights

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def run(cfg: TrainConfig, out: Path, *, resume: bool = False, stop_on: str | None = None,
        model=None, tokenizer=None, progress: Callable[[StepRecord], None] | None = None,
        log_alerts: bool = True, monitor_config=None, backend=None) -> RunResult:
    """Train `cfg.steps` steps into `out` (see the module docstring). `stop_on`: end the run,
    with a checkpoint, on the first alert of that severity or worse. `monitor_config`: the
    collapse monitor's rules (probes.monitor.MonitorConfig; its defaults otherwise, with
    `masked_loss` from the correction). `backend`: where the samplers and the trainer run
    (LocalBackend when None; train.ray_backend.RayBackend for Ray actors). The run owns it: it
    is closed at the end."""
    backend = backend or LocalBackend()
    try:
        if stop_on not in (None, "warning", "critical"):
            raise ValueError(f"stop-on must be warning or critical, got {stop_on!r}")
        out = Path(out)
        ckpt = check_out(out, resume, cfg)
        # the process's threads (workers and trainer share them)
        with torch_threads(cfg.pipeline.threads):
            if model is None or tokenizer is None:
                from mismatch.zoo import load_model, load_tokenizer

                model = model or load_model(cfg.model, dtype="bfloat16")
                tokenizer = tokenizer or load_tokenizer(cfg.model)
            out.mkdir(parents=True, exist_ok=True)
            return _run(cfg, out, ckpt, backend, stop_on=stop_on, model=model,
                        tokenizer=tokenizer, progress=progress, log_alerts=log_alerts,
                        monitor_config=monitor_config)
    finally:
        backend.close()


def _restore(cfg: TrainConfig, out: Path, ckpt: Path | None, trainer):
    """Load `ckpt` into `trainer` and cut the logs back to it (or note a run that stopped before
    its first checkpoint). Returns (step, next unit, units discarded, kept log, state)."""
    metrics_path, alerts_path = out / "metrics.jsonl", out / "alerts.jsonl"
    if ckpt is None:
        if restart_logs(out):
            log.warning("%s holds a run stopped before its first checkpoint: starting it over",
                        out)
        return 0, 0, 0, [], {}
    try:
        state = torch.load(ckpt / "state.pt", weights_only=False)
    except Exception as exc:  # a checkpoint that cannot be read is bad input, not a bug
        raise ValueError(f"checkpoint {ckpt} is unreadable ({type(exc).__name__}); delete "
                         "it to resume from the one before") from exc
    check_resume(cfg, state["config"])
    trainer.load(state)
    step, next_unit = int(state["step"]), int(state["next_unit"])
    before = read_steps(metrics_path)
    claimed = max((r.units_claimed for r in before), default=next_unit)
    discarded = max(0, claimed - next_unit)
    history = [StepRecord.from_json(r) for r in cut_jsonl(metrics_path, step)]
    cut_jsonl(alerts_path, step)
    log.warning("resuming %s at step %d: %d later step(s) of the log dropped; %d unit(s) "
                "(%d episodes) claimed after the checkpoint are discarded and regenerated",
                out, step, len(before) - len(history), discarded,
                discarded * cfg.samples_per_prompt)
    return step, next_unit, discarded, history, state


def _base_evaluation(cfg: TrainConfig, out: Path, trainer, tokenizer) -> HeldOut:
    """eval.json as far as it goes, with the base policy evaluated where it is not yet."""
    eval_path = out / "eval.json"
    held = HeldOut.from_json(json.loads(eval_path.read_text())) if eval_path.exists() \
        else HeldOut()
    if cfg.eval.eval_tasks and held.base is None:
        log.info("evaluating the base policy on %d held-out tasks × %d", cfg.eval.eval_tasks,
                 cfg.eval.eval_samples)
        held = evaluate_into(HeldOut(tasks=cfg.eval.eval_tasks, samples=cfg.eval.eval_samples),
                             "base", trainer.policy(), tokenizer, cfg)
        write_json(eval_path, held.to_json())
    return held


def _monitor(cfg: TrainConfig, monitor_config, history: list[StepRecord],
             alerts_path: Path, log_alerts: bool):
    """The collapse monitor, its baselines and debouncing rebuilt from the kept log, then its
    sinks attached (so the replay writes no alert twice)."""
    from mismatch.probes.monitor import CollapseMonitor, JsonlSink, MonitorConfig, TerminalSink

    monitor = CollapseMonitor(monitor_config or MonitorConfig(masked_loss=cfg.masks_tokens))
    for rec in history:
        monitor.update(rec)
    monitor.sinks = [JsonlSink(alerts_path)] + ([TerminalSink()] if log_alerts else [])
    return monitor


def _take_units(pipe, cfg: TrainConfig, step: int) -> tuple[list[Unit], int]:
    """The step's `prompts_per_step` units in claim order, dropping those staler than the bound;
    returns them and how many were dropped."""
    units: list[Unit] = []
    stale_dropped = 0
    while len(units) < cfg.prompts_per_step:
        unit = pipe.take()
        bound = cfg.pipeline.staleness_bound
        if bound is not None and step - unit.version > bound:
            stale_dropped += 1
            continue
        units.append(unit)
    units.sort(key=lambda x: x.index)
    return units, stale_dropped


def _core_handoff(pipeline: PipelineConfig, pipe, trainer) -> Callable[[], Any]:
    """What the trainer's step runs under in an asynchronous run whose sampler processes fill
    every core: each side gets its cores explicitly. The trainer steps on half the cores (at
    least one) and the sampler processes take turns on the rest (`WorkerPool.paused` with
    `keep`: at most that many run at once, rotating, so every batch in flight moves on). On
    two cores, three busy parties (the trainer beside both samplers) made the step slower than
    `--sync`'s; pausing every sampler while the trainer stepped on both cores overlapped
    nothing (async ~1.0x sync), and pausing one sampler outright stalled its half-step batch
    (0.93x); taking turns overlapped sampling with the step (1.19x: reports/benchmarks.md).
    Said once in the log. Otherwise (a free core, sampler threads, Ray, lockstep modes)
    nothing changes."""
    import contextlib
    import functools

    from mismatch.engines.workers import default_processes

    pool = getattr(pipe, "pool", None)
    cores = default_processes()
    if pipeline.lockstep or pool is None or pool.size < cores:
        return contextlib.nullcontext
    trainer.threads = max(1, cores // 2)
    keep = cores - trainer.threads
    if keep:
        log.info("asynchronous on %d cores with %d sampler processes: the trainer steps on %d "
                 "core(s) while the sampler processes take turns on the other %d and go on "
                 "sampling ahead", cores, pool.size, trainer.threads, keep)
    else:
        log.info("asynchronous on 1 core with %d sampler process(es): they pause while the "
                 "trainer steps and sample ahead the rest of the time", pool.size)
    return functools.partial(pool.paused, keep=keep)


def _run(cfg: TrainConfig, out: Path, ckpt: Path | None, backend, *, stop_on, model, tokenizer,
         progress, log_alerts, monitor_config) -> RunResult:
    metrics_path, alerts_path, eval_path = (out / n for n in LOGS)
    trainer = backend.trainer(model, cfg)
    step, next_unit, discarded, history, state = _restore(cfg, out, ckpt, trainer)
    write_json(out / "config.json", cfg.to_json())
    evaluation = _base_evaluation(cfg, out, trainer, tokenizer)
    groups = run_fleet(cfg)
    cost_per_token = {g.name: g.cost_per_token for g in groups if g.cost_per_token is not None}
    monitor = _monitor(cfg, monitor_config, history, alerts_path, log_alerts)
    publisher = Publisher(step, trainer.published(), keep=cfg.pipeline.lag, history={
        v: backend.put(w) for v, w in (state.get("older_versions") or {}).items()})
    pipe = backend.pipeline(cfg, groups, model, tokenizer, publisher, next_unit)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = RunResult(out=out, steps_done=step, resumed_from=step if ckpt else None,
                       discarded_units=discarded)
    consumed_max, consumed_total = next_unit - 1, next_unit
    pipe.start()
    handoff = _core_handoff(cfg.pipeline, pipe, trainer)
    try:
        with open(metrics_path, "a") as mfile:
            steplog = _StepLog(mfile, monitor, result, progress, backend.name,
                               cost_per_token, discarded)
            last_ckpt = step
            while step < cfg.steps:
                t0 = time.perf_counter()
                units, stale_dropped = _take_units(pipe, cfg, step)
                waited, depth, t1 = time.perf_counter() - t0, pipe.results.qsize(), \
                    time.perf_counter()
                batch = build_batch(units, step, pad_id)
                with handoff():
                    m = trainer.step(batch)
                step += 1
                publisher.publish(step, trainer.published())
                consumed_total += len(units)
                consumed_max = max([consumed_max] + [u.index for u in units])
                pipe.notify(consumed=consumed_total)
                train_s = time.perf_counter() - t1
                wall = time.perf_counter() - t0
                alerts = steplog.write(step, units, batch, m, pipe, waited=waited,
                                       train_s=train_s, wall=wall, stale_dropped=stale_dropped,
                                       queue_depth=depth)
                stopped = _stop_reason(alerts, stop_on)
                evaluation = _evaluate_during(cfg, step, evaluation, trainer, tokenizer,
                                              eval_path)
                if step % cfg.checkpoint.checkpoint_every == 0 or step == cfg.steps or stopped:
                    trainer.save(out, step, consumed_max + 1, publisher.older())
                    last_ckpt = step
                if stopped:
                    result.stopped = stopped
                    break
            if last_ckpt != step:
                trainer.save(out, step, consumed_max + 1, publisher.older())
    finally:
        pipe.stop()
        monitor.close()
    result.steps_done = step
    result.evaluation = _evaluate_final(cfg, step, evaluation, trainer, tokenizer, eval_path)
    save_final(out, trainer.policy(), tokenizer)
    return result


@dataclass
class _StepLog:
    """Where each step's record goes: metrics.jsonl, the collapse monitor (which writes the
    alerts) and the progress bar."""

    file: Any
    monitor: Any
    result: RunResult
    progress: Callable[[StepRecord], None] | None
    backend: str
    cost_per_token: dict[str, float]
    discarded: int
    """Units claimed after the checkpoint a resumed run starts from (logged on its first step)."""

    def write(self, step: int, units: list[Unit], batch, m, pipe, **figures) -> list:
        """Log step `step`; returns the monitor's alerts on it."""
        resumed = self.result.resumed_from
        first = resumed is not None and step == resumed + 1
        rec = step_record(step, units, batch, m, claimed=pipe.cursor, backend=self.backend,
                          faults=pipe.faults,
                          resumed_discarded_units=self.discarded if first else None,
                          cost_per_token=self.cost_per_token, **figures)
        self.file.write(json.dumps(rec.to_json()) + "\n")
        self.file.flush()
        alerts = self.monitor.update(rec)  # also written to the alert file and the log
        self.result.alerts.extend(alerts)
        if self.progress:
            self.progress(rec)
        return alerts


def _stop_reason(alerts: list, stop_on: str | None) -> str | None:
    """--stop-on: the alert that ends the run, in words (None: the run goes on)."""
    if stop_on is None or not any(a.severity == "critical" or stop_on == "warning"
                                  for a in alerts):
        return None
    worst = max(alerts, key=lambda a: a.severity == "critical")
    return f"{worst.severity} alert on {worst.signal} at step {worst.step}"


def _evaluate_final(cfg: TrainConfig, step: int, held: HeldOut, trainer, tokenizer,
                    eval_path: Path) -> HeldOut:
    """The trained policy on the held-out tasks (where the run evaluates): eval.json's "final"."""
    if cfg.eval.eval_tasks:
        log.info("evaluating the trained policy (step %d)", step)
        held = evaluate_into(held, "final", trainer.policy(), tokenizer, cfg, step=step)
        write_json(eval_path, held.to_json())
    return held


def _evaluate_during(cfg: TrainConfig, step: int, held: HeldOut, trainer, tokenizer,
                     eval_path: Path) -> HeldOut:
    """--eval-every: the held-out tasks at this step, unless done (a resumed run) or final."""
    if (cfg.eval.eval_tasks and cfg.eval.eval_every and step % cfg.eval.eval_every == 0
            and step < cfg.steps and step not in held.during):
        log.info("evaluating the policy at step %d", step)
        held = evaluate_into(held, step, trainer.policy(), tokenizer, cfg, step=step)
        write_json(eval_path, held.to_json())
    return held
