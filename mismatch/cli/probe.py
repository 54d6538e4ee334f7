"""`mismatch probe`: the quick total / precision / accelerator probe, or the source probes."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mismatch.cli.common import fail, quiet_libraries, run_with_bars

def probe_command(
    gpu: str = typer.Option(..., "--gpu", help="Sampler GPU: a100, h100, h200, b200, b300, "
                            "rtx-pro-6000."),
    dtype: str = typer.Option(..., "--dtype", help="Sampler precision: bf16, fp16, fp8, "
                              "w4a16-nvfp4, nvfp4, mxfp4."),
    kv_cache: str | None = typer.Option(None, "--kv-cache", help="KV cache: bf16 or fp8 "
                                        "(default: the compute dtype)."),
    trainer_dtype: str = typer.Option("bf16", "--trainer-dtype", help="Trainer side: bf16, fp16 "
                                      "or fp32 (a reference; the quick probe only)."),
    lm_head: str = typer.Option("compute", "--lm-head", help="The LM head's precision: compute "
                                "(the side's dtype, logits rounded to it) or fp32 (inputs, "
                                "weights and logits in FP32: MiniMax-M1's mitigation)."),
    lm_head_side: str = typer.Option("both", "--lm-head-side", help="Where --lm-head applies: "
                                     "trainer, sampler or both."),
    fp32_reference: bool = typer.Option(False, "--fp32-reference", help="Also score the tokens "
                                        "with an FP32 model: two more columns, the sampler and "
                                        "the trainer each against FP32 (the quick probe)."),
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
                                    "plots here (default: runs/probe-<gpu>-<dtype>). A "
                                    "folder holding anything but an earlier probe is refused."),
    force: bool = typer.Option(False, "--force", help="Replace --out whatever it holds."),
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
    from mismatch.app.report import format_table, write_probe_outputs

    try:
        from mismatch.probes import parse_sources
        from mismatch.probes.sampling import SamplingConfig
        from mismatch.probes.staleness import StalenessConfig

        cfg = ProbeConfig(gpu=gpu, dtype=dtype, kv_cache=kv_cache,
                          trainer_dtype=trainer_dtype.lower(), lm_head=lm_head.lower(),
                          lm_head_side=lm_head_side.lower(), fp32_reference=fp32_reference,
                          model=model, prompts=prompts, n_prompts=n_prompts,
                          max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                          threads=threads, sources=parse_sources(sources), ladder=ladder,
                          trainer_gpu=trainer_gpu.lower(), subset_prompts=subset_prompts,
                          fleet_shares=parse_shares(fleet_shares),
                          sampling=SamplingConfig(top_p=top_p),
                          staleness=StalenessConfig(max_lag=staleness_max_lag, lr=staleness_lr,
                                                    checkpoints=staleness_checkpoints),
                          ci_target=ci_target,
                          max_prompts=max(max_prompts, n_prompts), emulate=emulate,
                          trainer_kernels=trainer_kernels.lower())
        # fail fast, before loading anything: the config resolves each side once, for the run
        cfg.sampler_numerics, cfg.trainer_gpu_numerics, cfg.trainer_numerics
        # the quick probe checks the local GPU and --trainer-kernels before it loads anything
        if (cfg.sources or cfg.ladder) and cfg.trainer_kernels != "torch":
            raise ValueError("--trainer-kernels applies to the quick probe; the source probes "
                             "(--sources, --ladder) run the reference trainer")
        if cfg.sources or cfg.ladder:
            from mismatch.fleets import fleet_groups

            fleet_groups(cfg.fleet_shares)  # bad shares fail before any work
        from mismatch.io import check_output_dir

        # before any work: an --out that cannot be written, or that holds a user's files
        target = check_output_dir(out or Path("runs") / f"probe-{cfg.gpu}-{cfg.dtype}", "probe",
                                  force=force)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    command = "mismatch " + " ".join(sys.argv[1:]) if sys.argv[1:] else "mismatch probe"
    if cfg.sources or cfg.ladder:
        probe_sources_command(cfg, target, command, as_json)
        return
    try:
        result = run_with_bars(lambda bar: run_probe(cfg, None if bar is None else (
            lambda done, total: bar("sampling and re-scoring", done, total))), quiet=as_json)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    write_probe_outputs(target, result, command)
    print_probe(result.summary, as_json, f"trainer — {result.summary['mode'].upper()}",
                 format_table, f"{target}/results.json, report.md, log_ratio_hist.png, "
                 f"per_position.png")


def print_probe(s: dict, as_json: bool, who: str, table, wrote: str) -> None:
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


def parse_shares(text: str | None) -> tuple[tuple[str, float], ...]:
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


def probe_sources_command(cfg, target: Path, command: str, as_json: bool) -> None:
    """`mismatch probe --sources ... [--ladder]`: run, write, print."""

    from mismatch.app.sources_report import format_sources_table, write_sources_outputs
    from mismatch.app.sources import probe_sources

    try:
        run = run_with_bars(lambda progress: probe_sources(cfg, progress), quiet=as_json)
    except ValueError as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    write_sources_outputs(target, run, command)
    print_probe(run.summary, as_json, f"trainer on {run.summary['trainer_gpu']} — EMULATED",
                 format_sources_table, f"{target}/results.json, report.md and plots")
