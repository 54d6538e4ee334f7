"""The `mismatch` command line. Thin: each command builds a config and calls the library.

Heavy imports (torch, transformers, modelopt) happen inside the commands so that
`mismatch --help` stays instant. User errors (ValueError and its subclasses raised for bad
input) become one line on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
    name="mismatch",
    help="Numerics mismatch profiler and simulator for large-model RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_BAD_INPUT = 2


_QUIETED_WARNINGS = (
    # torch.jit's deprecation notices, raised while modelopt and deepspeed import their kernels
    (r"`torch\.jit\.script", DeprecationWarning, ""),
    # the optional quantization libraries' import-time notices (missing CUDA extensions)
    ("", UserWarning, r"(torchao|modelopt|deepspeed)(\.|$)"),
    ("", FutureWarning, r"(torchao|modelopt|deepspeed|transformers)(\.|$)"),
)
"""(message regex, category, module regex) of the only warnings the CLI silences; anything else
still reaches the user."""


def quiet_libraries() -> None:
    """Silence import-time chatter of optional libraries (torchao's missing CUDA extensions,
    deepspeed's accelerator notice, transformers' progress bars) and stay offline: every model
    this tool loads is a local directory."""
    import logging
    import os
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in ("torchao", "torch.utils._pytree", "DeepSpeed", "deepspeed", "modelopt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message, category, module in _QUIETED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@app.callback()
def _root() -> None:
    """Numerics mismatch profiler and simulator for large-model RL."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print one line to stderr and exit."""
    typer.echo(f"mismatch: error: {message}", err=True)
    raise typer.Exit(code)


@app.command("formats")
def formats_command() -> None:
    """List the number formats (codecs) this build can encode, decode and emulate."""
    from mismatch.quantize.codecs import CODECS

    width = max(len(name) for name in CODECS)
    for name, spec in CODECS.items():
        typer.echo(f"{name:<{width}}  {spec.description}")


@app.command("quantize")
def quantize_command(
    model: Path | None = typer.Option(
        None, "--model",
        help="Hugging Face checkpoint directory (BF16). Default: the embedded model."),
    fmt: str = typer.Option(..., "--format", help="fp8, nvfp4, w4a16-nvfp4 or mxfp4."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint to."),
    kv_cache: str | None = typer.Option(
        None, "--kv-cache", help="Also quantize the KV cache: fp8."),
    calib_samples: int = typer.Option(16, "--calib-samples", help="Calibration sequences."),
    calib_seq_len: int = typer.Option(
        128, "--calib-seq-len", help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, "--seed", help="Seed of the calibration data."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Write a calibrated modelopt checkpoint (needs the `quantize` extra: nvidia-modelopt)."""
    try:
        from mismatch.quantize.checkpoint import QuantizeConfig, quantize_checkpoint

        if model is None:
            model = _embedded_model_dir()
        summary = quantize_checkpoint(QuantizeConfig(
            model=model, format=fmt, out=out, kv_cache=kv_cache, calib_samples=calib_samples,
            calib_seq_len=calib_seq_len, seed=seed, force=force))
    except ValueError as exc:  # QuantizeError and other bad input
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    mib = 1024 * 1024
    typer.echo(f"wrote {summary.out} ({summary.format}"
               f"{', KV ' + summary.kv_cache if summary.kv_cache else ''}) in "
               f"{summary.wall_seconds:.1f} s")
    typer.echo(f"  quantized {len(summary.quantized)} linear layers; kept "
               f"{len(summary.excluded)} in high precision: {', '.join(summary.excluded[:6])}"
               f"{' ...' if len(summary.excluded) > 6 else ''}")
    typer.echo(f"  safetensors {summary.bytes_before / mib:.2f} MiB -> "
               f"{summary.bytes_after / mib:.2f} MiB")
    typer.echo(f"  calibration: {summary.calibration}")


def _embedded_model_dir() -> Path:
    """The embedded default model's directory, or a bad-input error while it is not built."""
    from mismatch.zoo import check_model_dir

    try:
        return check_model_dir(None, tokenizer=False)
    except ValueError as exc:
        raise ValueError(f"no --model given and the embedded model is not available: "
                         f"{exc}") from None


@app.command("profiles")
def profiles_command() -> None:
    """Print what each GPU runs for each precision (the accelerator table)."""
    from mismatch.profiles import table

    typer.echo(f"{'gpu':<14}{'dtype':<13}{'attention':<12}runs as")
    for row in table():
        if isinstance(row, tuple):
            gpu, dtype, reason = row
            typer.echo(f"{gpu:<14}{dtype:<13}{'-':<12}cannot run: {reason}")
        else:
            typer.echo(f"{row.gpu:<14}{row.dtype:<13}{row.attention:<12}{row.kernel_path}")


@app.command("probe")
def probe_command(
    gpu: str = typer.Option(..., "--gpu", help="Sampler GPU: a100, h100, h200, b200, b300, "
                            "rtx-pro-6000."),
    dtype: str = typer.Option(..., "--dtype", help="Sampler precision: bf16, fp16, fp8, "
                              "w4a16-nvfp4, nvfp4, mxfp4."),
    kv_cache: str | None = typer.Option(None, "--kv-cache", help="KV cache: bf16 or fp8 "
                                        "(default: the compute dtype)."),
    trainer_dtype: str = typer.Option("bf16", "--trainer-dtype", help="Trainer side: bf16 or fp16."),
    model: Path | None = typer.Option(None, "--model", help="Hugging Face model directory "
                                      "(default: the embedded model)."),
    prompts: Path | None = typer.Option(None, "--prompts", help="JSONL prompts: "
                                        "{\"messages\": [...]} or {\"prompt\": \"...\"} per line."),
    n_prompts: int = typer.Option(512, "--n-prompts", help="Prompts to sample (held-out tasks)."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Completion length cap."),
    batch_size: int = typer.Option(16, "--batch-size", help="Sequences per batch."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: int | None = typer.Option(None, "--threads", help="torch threads (default: 1 for "
                                       "small models, else torch's default)."),
    out: Path | None = typer.Option(None, "--out", help="Write results.json, report.md and "
                                    "plots here (default: runs/probe-<gpu>-<dtype>)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object to stdout."),
    sources: str | None = typer.Option(
        None, "--sources", help="Break the mismatch down by source: a comma list of kernels, "
        "precision, accelerator, routing, staleness, retokenization, sampling, or all."),
    ladder: bool = typer.Option(False, "--ladder", help="Add the sources one at a time "
                                "(kernels -> + precision -> + accelerator) and attribute the "
                                "total."),
    trainer_gpu: str = typer.Option("b200", "--trainer-gpu", help="The trainer's GPU (the "
                                    "ladder's first rungs run there)."),
    subset_prompts: int = typer.Option(128, "--subset-prompts", help="Prompts for the "
                                       "per-GPU, fleet and sampling probes."),
    fleet_shares: str | None = typer.Option(
        None, "--fleet-shares", help="Capacity shares of the fleet's groups, e.g. "
        "b200-nvfp4=2,h100-fp8=1 (unlisted groups 0; default: equal shares)."),
    top_p: float = typer.Option(0.9, "--top-p", help="Top-p of the sampling probe's sampler."),
    staleness_max_lag: int = typer.Option(8, "--staleness-max-lag", help="Largest staleness "
                                          "(optimizer steps) the staleness probe measures."),
    staleness_lr: float = typer.Option(1e-4, "--staleness-lr", help="AdamW learning rate of "
                                       "the staleness probe's policy-gradient steps."),
    staleness_checkpoints: Path | None = typer.Option(
        None, "--staleness-checkpoints", help="Directory of your checkpoints in training order "
        "(subdirectories), instead of generated steps."),
    ci_target: float = typer.Option(0.0, "--ci-target", help="With --sources: keep drawing "
                                    "held-out prompts until every headline KL's 95% half-width "
                                    "is under this fraction of its value, e.g. 0.2 (0: off)."),
    max_prompts: int = typer.Option(4096, "--max-prompts", help="Cap on the prompts "
                                    "--ci-target may draw."),
    emulate: bool = typer.Option(False, "--emulate", help="On a CUDA machine whose GPU is not "
                                 "--gpu: emulate --gpu there (without it that is an error; "
                                 "with --gpu the local GPU, the sampler is measured)."),
    trainer_kernels: str = typer.Option("torch", "--trainer-kernels", help="Trainer-side linear "
                                        "layers: torch (reference), or transformer-engine on a "
                                        "CUDA GPU: te (BF16), te-fp8, te-mxfp8, te-nvfp4."),
) -> None:
    """Measure sampler-trainer log-prob divergence for a GPU x precision, by source."""

    quiet_libraries()

    from mismatch.app.probe import ProbeConfig, run_probe
    from mismatch.profiles import resolve
    from mismatch.app.report import format_table, write_probe_outputs

    try:
        resolve(gpu, dtype, kv_cache)  # fail fast, before loading anything
        resolve(trainer_gpu, trainer_dtype)
        from mismatch.probes import parse_sources
        from mismatch.probes.sampling import SamplingConfig
        from mismatch.probes.staleness import StalenessConfig

        cfg = ProbeConfig(gpu=gpu, dtype=dtype, kv_cache=kv_cache, trainer_dtype=trainer_dtype,
                          model=model, prompts=prompts, n_prompts=n_prompts,
                          max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                          threads=threads, sources=parse_sources(sources), ladder=ladder,
                          trainer_gpu=trainer_gpu.lower(), subset_prompts=subset_prompts,
                          fleet_shares=_parse_shares(fleet_shares),
                          sampling=SamplingConfig(top_p=top_p),
                          staleness=StalenessConfig(max_lag=staleness_max_lag, lr=staleness_lr,
                                                    checkpoints=staleness_checkpoints),
                          ci_target=ci_target,
                          max_prompts=max(max_prompts, n_prompts), emulate=emulate,
                          trainer_kernels=trainer_kernels.lower())
        # the quick probe checks the local GPU and --trainer-kernels before it loads anything
        if (cfg.sources or cfg.ladder) and cfg.trainer_kernels != "torch":
            raise ValueError("--trainer-kernels applies to the quick probe; the source probes "
                             "(--sources, --ladder) run the reference trainer")
        if cfg.sources or cfg.ladder:
            from mismatch.fleets import fleet_groups

            fleet_groups(cfg.fleet_shares)  # bad shares fail before any work
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    command = "mismatch " + " ".join(sys.argv[1:]) if sys.argv[1:] else "mismatch probe"
    target = out or Path("runs") / f"probe-{cfg.gpu}-{cfg.dtype}"
    if cfg.sources or cfg.ladder:
        _probe_sources(cfg, target, command, as_json)
        return
    try:
        result = _with_progress(run_probe, cfg, quiet=as_json)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    write_probe_outputs(target, result, command)
    _print_probe(result.summary, as_json, f"trainer — {result.summary['mode'].upper()}",
                 format_table, f"{target}/results.json, report.md, log_ratio_hist.png, "
                 f"per_position.png")


def _print_probe(s: dict, as_json: bool, who: str, table, wrote: str) -> None:
    """A probe summary: one JSON object, or a header, the table and what was written."""
    import json as _json

    if as_json:
        typer.echo(_json.dumps(s))
        return
    typer.echo(f"{s['gpu']} {s['dtype']} sampler vs {s['trainer_dtype']} {who} "
               f"({s['kernel_path']}; attention {s['attention']})")
    typer.echo(f"{s['tokens']} completion tokens from {s['prompts']} prompts, model {s['model']}")
    typer.echo(table(s))
    typer.echo(f"wrote {wrote}")


@app.command("qualify")
def qualify_command(
    gpu: str | None = typer.Option(None, "--gpu", help="Emulated sampler GPU (a100, h100, h200, "
                                   "b200, b300, rtx-pro-6000)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Emulated sampler precision (bf16, "
                                     "fp16, fp8, w4a16-nvfp4, nvfp4, mxfp4)."),
    kv_cache: str | None = typer.Option(None, "--kv-cache", help="KV cache: bf16 or fp8."),
    model: Path | None = typer.Option(None, "--model", help="Hugging Face model directory "
                                      "(default: the embedded model); the trainer side."),
    policy: Path | None = typer.Option(None, "--policy", help="Policy TOML of budgets "
                                       "(default: the shipped policies/default.toml)."),
    sampler: str | None = typer.Option(None, "--sampler", help="URL of a live inference "
                                       "server to qualify instead of an emulated one."),
    engine: str | None = typer.Option(None, "--engine", help="The live server's engine: vllm "
                                      "or sglang."),
    n_prompts: int = typer.Option(256, "--n-prompts", help="Prompts to sample."),
    subset_prompts: int = typer.Option(64, "--subset-prompts", help="Prompts for the expensive "
                                       "grids and the standalone probes."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Completion length cap."),
    batch_size: int = typer.Option(16, "--batch-size", help="Sequences per batch."),
    concurrency: int = typer.Option(8, "--concurrency", help="Live server: requests in flight."),
    timeout: float = typer.Option(60.0, "--timeout", help="Live server: seconds per request."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    out: Path | None = typer.Option(None, "--out", help="Write verdict.json, results.json and "
                                    "report.md here (default: runs/qualify-<sampler>)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object to stdout."),
) -> None:
    """PASS/FAIL a sampler against a mismatch budget: exit 0 pass, 1 fail, 2 bad input."""
    import json as _json

    quiet_libraries()
    from mismatch.app.qualify import load_policy, qualify_emulated, write_outputs

    command = "mismatch " + " ".join(sys.argv[1:]) if sys.argv[1:] else "mismatch qualify"
    try:
        pol = load_policy(policy)
        if sampler is None:
            if gpu is None or dtype is None:
                raise ValueError("pass --gpu and --dtype for an emulated sampler, or --sampler "
                                 "URL --engine vllm|sglang for a live one")
            from mismatch.app.probe import ProbeConfig
            from mismatch.profiles import resolve

            spec = resolve(gpu, dtype, kv_cache)
            cfg = ProbeConfig(gpu=gpu, dtype=dtype, kv_cache=kv_cache, model=model,
                              n_prompts=n_prompts, subset_prompts=subset_prompts,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
            target = out or Path("runs") / f"qualify-{spec.gpu}-{spec.dtype}"
            result = _run_with_bars(lambda progress: qualify_emulated(cfg, pol, progress),
                                    quiet=as_json)
        else:
            try:
                from mismatch.app.qualify_remote import qualify_remote
            except ImportError as exc:
                raise ValueError(f"live servers cannot be qualified by this install ({exc}); "
                                 f"qualify an emulated sampler with --gpu/--dtype") from None

            target = out or Path("runs") / "qualify-remote"
            result = _run_with_bars(
                lambda progress: qualify_remote(
                    url=sampler, engine=engine, model=model, policy=pol, n_prompts=n_prompts,
                    max_new_tokens=max_new_tokens, seed=seed, concurrency=concurrency,
                    timeout=timeout, gpu=gpu, dtype=dtype, progress=progress),
                quiet=as_json)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    write_outputs(target, result, command)
    if as_json:
        typer.echo(_json.dumps({k: v for k, v in result.items() if k != "summary"}))
    else:
        typer.echo(f"{result['sampler']}: {result['verdict'].upper()} "
                   f"({result['mode'].upper()}; policy {result['policy']}; dominant source "
                   f"{result['dominant_source']})")
        for c in result["checks"]:
            value = "-" if c["value"] is None else f"{c['value']:.4g}"
            res = {True: "pass", False: "FAIL", None: "n/a"}[c["passed"]]
            typer.echo(f"  {res:<5} {c['metric']:<42} {value:>11} <= {c['budget']:<9.4g} "
                       f"[{c['source']}] {c['note']}")
        typer.echo(f"wrote {target}/verdict.json, results.json, report.md")
    raise typer.Exit(0 if result["verdict"] == "pass" else 1)


def _run_with_bars(fn, *, quiet: bool):
    """fn(progress) with one progress bar per label on stderr (none when quiet)."""
    if quiet:
        return fn(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done, total=total)

        return fn(progress)


def _parse_shares(text: str | None) -> tuple[tuple[str, float], ...]:
    """"b200-nvfp4=2,h100-fp8=1" → (("b200-nvfp4", 2.0), ("h100-fp8", 1.0))."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            out.append((name.strip().lower(), float(value)))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--fleet-shares: {item.strip()!r} is not GROUP=SHARE "
                             f"(e.g. b200-nvfp4=2)")
    return tuple(out)


def _probe_sources(cfg, target: Path, command: str, as_json: bool) -> None:
    """`mismatch probe --sources ... [--ladder]`: run, write, print."""

    from mismatch.app.sources_report import format_sources_table, write_sources_outputs
    from mismatch.app.sources import probe_sources

    try:
        run = _run_with_bars(lambda progress: probe_sources(cfg, progress), quiet=as_json)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    write_sources_outputs(target, run, command)
    _print_probe(run.summary, as_json, f"trainer on {run.summary['trainer_gpu']} — EMULATED",
                 format_sources_table, f"{target}/results.json, report.md and plots")


def _with_progress(fn, cfg, *, quiet: bool):
    """Run fn(cfg, progress) with a progress bar on stderr (none when quiet)."""
    if quiet:
        return fn(cfg, None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("sampling and re-scoring", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return fn(cfg, progress)


def _register_zoo() -> None:
    from mismatch.cli.zoo import zoo_app

    app.add_typer(zoo_app, name="zoo")


def _register_monitor() -> None:
    from mismatch.cli.monitor import monitor_command

    app.command("monitor")(monitor_command)


def _register_train() -> None:
    from mismatch.cli.train import report_command, study_command, train_command

    app.command("train")(train_command)
    app.command("report")(report_command)
    app.command("study")(study_command)


_register_zoo()
_register_monitor()
_register_train()


def main() -> None:
    """Console-script entry point."""
    from mismatch.runtime import tune_allocator

    tune_allocator()
    try:
        app()
    except ValueError as exc:  # bad input reported by the library, outside a command's own check
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        typer.echo(f"mismatch: error: {message}", err=True)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
