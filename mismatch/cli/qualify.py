"""`mismatch qualify`: a sampler against the budgets of a policy, PASS or FAIL."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mismatch.cli.common import choice_list, fail, quiet_libraries, run_with_bars
from mismatch.profiles import DTYPES, GPUS, KV_CACHES
from mismatch.remote.engines import LIVE_ENGINES

_ENGINE = "|".join(LIVE_ENGINES)  # as error messages spell the choice

if TYPE_CHECKING:
    from mismatch.app.qualify import Verdict


def qualify_command(
    gpu: str | None = typer.Option(None, "--gpu", help="Emulated sampler GPU "
                                   f"({choice_list(GPUS, last=', ')}); with --sampler, the "
                                   "server's GPU (labels the verdict)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Emulated sampler precision "
                                     f"({choice_list(DTYPES, last=', ')}); with --sampler, the "
                                     "server's weights (labels the verdict)."),
    kv_cache: str | None = typer.Option(None, "--kv-cache",
                                        help=f"KV cache: {choice_list(KV_CACHES)}."),
    model: Path | None = typer.Option(None, "--model", help="Hugging Face model directory "
                                      "(default: the embedded model); the trainer side."),
    policy: Path | None = typer.Option(None, "--policy", help="Policy TOML of budgets "
                                       "(default: the shipped policies/default.toml)."),
    sampler: str | None = typer.Option(None, "--sampler", help="URL of a live inference "
                                       "server to qualify instead of an emulated one."),
    engine: str | None = typer.Option(None, "--engine", help="The live server's engine: "
                                      f"{choice_list(LIVE_ENGINES)}."),
    launch: str | None = typer.Option(None, "--launch", help="Start this engine "
                                      f"({choice_list(LIVE_ENGINES)}) on 127.0.0.1 serving "
                                      "--model, qualify it, stop "
                                      "it. Each engine runs from its own virtual environment "
                                      "(scripts/setup_vllm_cpu.sh, scripts/setup_sglang_cpu.sh; "
                                      "$MISMATCH_VLLM_VENV, $MISMATCH_SGLANG_VENV)."),
    n_prompts: int = typer.Option(256, "--n-prompts", help="Prompts to sample."),
    subset_prompts: int = typer.Option(64, "--subset-prompts", help="Prompts for the expensive "
                                       "grids and the standalone probes."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Completion length cap."),
    batch_size: int = typer.Option(16, "--batch-size", help="Sequences per batch."),
    concurrency: int = typer.Option(8, "--concurrency", help="Live server: requests in flight."),
    timeout: float = typer.Option(60.0, "--timeout", help="Live server: seconds per request."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    out: Path | None = typer.Option(None, "--out", help="Write verdict.json, results.json and "
                                    "report.md here (default: runs/qualify-<sampler>). A "
                                    "folder holding anything but an earlier qualify is refused."),
    force: bool = typer.Option(False, "--force", help="Replace --out whatever it holds."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object to stdout."),
) -> None:
    """PASS/FAIL a sampler against a mismatch budget: exit 0 pass, 1 fail, 2 bad input."""
    quiet_libraries()
    from mismatch.app.qualify import kept_launch, load_policy, write_outputs

    command = "mismatch " + " ".join(sys.argv[1:]) if sys.argv[1:] else "mismatch qualify"
    common = dict(model=model, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed)
    try:
        pol = load_policy(policy)
        if sampler is None and launch is None:
            target, result = _emulated(gpu, dtype, kv_cache, pol, out, force, as_json, common,
                                       subset_prompts=subset_prompts, batch_size=batch_size)
        else:
            target, result = _live(sampler, engine, launch, gpu, dtype, kv_cache, pol, out,
                                   force, as_json, common, concurrency=concurrency,
                                   timeout=timeout)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    result, server_log = kept_launch(result, target)
    try:
        write_outputs(target, result, command, server_log)
    except OSError as exc:  # the folder is left as it was (written together or not at all)
        fail(f"could not write {target}: {exc.strerror or exc}; choose another --out or free "
             "space there and run again")
    if server_log is not None:
        server_log.unlink(missing_ok=True)  # kept in the output folder
    _print_verdict(result, target, as_json)
    raise typer.Exit(0 if result.passed else 1)


def _emulated(gpu, dtype, kv_cache, pol, out, force, as_json, common, **sizes):
    """(output folder, verdict) of an emulated sampler."""
    if gpu is None or dtype is None:
        raise ValueError("pass --gpu and --dtype for an emulated sampler, --sampler URL "
                         f"--engine {_ENGINE} for a live one, or --launch {_ENGINE} to "
                         "start one")
    from mismatch.app.probe import ProbeConfig
    from mismatch.app.qualify import qualify_emulated
    from mismatch.io import check_output_dir
    from mismatch.profiles import resolve

    spec = resolve(gpu, dtype, kv_cache)
    cfg = ProbeConfig(gpu=gpu, dtype=dtype, kv_cache=kv_cache, **common, **sizes)
    target = check_output_dir(out or Path("runs") / f"qualify-{spec.gpu}-{spec.dtype}",
                              "qualify", force=force)
    return target, run_with_bars(lambda progress: qualify_emulated(cfg, pol, progress),
                                 quiet=as_json)


def _live(sampler, engine, launch, gpu, dtype, kv_cache, pol, out, force, as_json, common,
          **client):
    """(output folder, verdict) of a live server: at --sampler URL, or started by --launch."""
    try:
        from mismatch.app.qualify_remote import qualify_launched, qualify_remote
    except ImportError as exc:
        raise ValueError(f"live servers cannot be qualified by this install ({exc}); "
                         f"qualify an emulated sampler with --gpu/--dtype") from None
    from mismatch.io import check_output_dir

    _check_live(sampler, engine, launch)
    if (gpu is None) != (dtype is None):
        raise ValueError("with --sampler, --gpu and --dtype label the server together "
                         "(the GPU it runs on, its weights' format): pass both or neither")
    if gpu is not None:
        from mismatch.profiles import resolve

        spec = resolve(gpu, dtype, kv_cache)  # an unknown name is refused here too
        gpu, dtype = spec.gpu, spec.dtype
    target = check_output_dir(out or Path("runs") / "qualify-remote", "qualify", force=force)
    options = dict(common, policy=pol, gpu=gpu, dtype=dtype, **client)
    if launch is not None:
        return target, run_with_bars(lambda progress: qualify_launched(
            engine=launch, progress=progress, **options), quiet=as_json)
    return target, run_with_bars(lambda progress: qualify_remote(
        url=sampler, engine=engine, progress=progress, **options), quiet=as_json)


def _print_verdict(result: Verdict, target: Path, as_json: bool) -> None:
    """The verdict on stdout: one JSON object (verdict.json's), or a line per check."""
    if as_json:
        typer.echo(json.dumps(result.to_json()))
        return
    typer.echo(f"{result.sampler}: {result.verdict.upper()} "
               f"({result.mode.upper()}; policy {result.policy}; dominant source "
               f"{result.dominant_source})")
    for c in result.checks:
        value = "-" if c.value is None else f"{c.value:.4g}"
        res = {True: "pass", False: "FAIL", None: "n/a"}[c.passed]
        typer.echo(f"  {res:<5} {c.metric:<42} {value:>11} <= {c.budget:<9.4g} "
                   f"[{c.source}] {c.note}")
    typer.echo(f"wrote {target}/verdict.json, results.json, report.md")


def _check_live(sampler: str | None, engine: str | None, launch: str | None) -> None:
    """A live sampler is either a server you started (--sampler URL --engine E) or one qualify
    starts (--launch E): one line, exit 2, for anything in between."""
    if launch is None:
        return
    if sampler is not None:
        raise ValueError(f"pass --sampler URL (a server you started) or --launch {_ENGINE} "
                         "(qualify starts one), not both")
    if launch.lower() not in LIVE_ENGINES:
        raise ValueError(f"--launch must be {choice_list(LIVE_ENGINES)}, got {launch!r}")
    if engine is not None and engine.lower() != launch.lower():
        raise ValueError(f"--engine {engine} and --launch {launch} disagree; --launch alone "
                         f"names the engine")
