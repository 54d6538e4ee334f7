"""`mismatch probe`: the quick total / precision / accelerator probe, or the source probes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from mismatch.cli.common import choice_list, fail, quiet_libraries, run_with_bars
from mismatch.engines.te import TRAINER_KERNELS
from mismatch.probes import SOURCES
from mismatch.probes.config import LM_HEAD_SIDES
from mismatch.profiles import DTYPES, GPUS, KV_CACHES, LM_HEADS, TRAINER_DTYPES

# the choice lists below are the registries' (torch-free modules: `--help` stays instant)
_P_GPU = Annotated[str, typer.Option("--gpu", help=f"Sampler GPU: {choice_list(GPUS, last=', ')}.")]
_P_DTYPE = Annotated[str, typer.Option("--dtype", help="Sampler precision: "
    f"{choice_list(DTYPES, last=', ')}.")]
_P_KV_CACHE = Annotated[str | None, typer.Option("--kv-cache", help="KV cache: "
    f"{choice_list(KV_CACHES)} (default: the compute dtype).")]
_P_TRAINER_DTYPE = Annotated[str, typer.Option("--trainer-dtype", help="Trainer side: "
    f"{choice_list(TRAINER_DTYPES, {'fp32': 'a reference; the quick probe only'})}.")]
_P_LM_HEAD = Annotated[str, typer.Option("--lm-head", help="The LM head's precision: "
    + choice_list(LM_HEADS, {"compute": "the side's dtype, logits rounded to it",
                             "fp32": "inputs, weights and logits in FP32: MiniMax-M1's "
                                     "mitigation"}) + ".")]
_P_LM_HEAD_SIDE = Annotated[str, typer.Option("--lm-head-side", help="Where --lm-head applies: "
    f"{choice_list(LM_HEAD_SIDES)}.")]
_P_FP32_REFERENCE = Annotated[bool, typer.Option("--fp32-reference", help="Also score the "
    "tokens with an FP32 model: two more columns, the sampler and the trainer each against "
    "FP32 (the quick probe).")]
_P_MODEL = Annotated[Path | None, typer.Option("--model", help="Hugging Face model directory "
    "(default: the embedded model).")]
_P_PROMPTS = Annotated[Path | None, typer.Option("--prompts", help="JSONL prompts: {\"messages\": "
    "[...]} or {\"prompt\": \"...\"} per line.")]
_P_N_PROMPTS = Annotated[int, typer.Option("--n-prompts", help="Prompts to sample (held-out "
    "tasks).")]
_P_MAX_NEW_TOKENS = Annotated[int, typer.Option("--max-new-tokens", help="Completion length cap.")]
_P_BATCH_SIZE = Annotated[int, typer.Option("--batch-size", help="Sequences per batch.")]
_P_SEED = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
_P_THREADS = Annotated[int | None, typer.Option("--threads", help="torch threads (default: 1 "
    "for small models, else torch's default).")]
_P_OUT = Annotated[Path | None, typer.Option("--out", help="Write results.json, report.md and "
    "plots here (default: runs/probe-<gpu>-<dtype>). A folder holding anything but an earlier "
    "probe is refused.")]
_P_FORCE = Annotated[bool, typer.Option("--force", help="Replace --out whatever it holds.")]
_P_AS_JSON = Annotated[bool, typer.Option("--json", help="Print one JSON object to stdout.")]
_P_SOURCES = Annotated[str | None, typer.Option("--sources", help="Break the mismatch down by "
    f"source: a comma list of {choice_list(SOURCES, last=', ')}, or all.")]
_P_LADDER = Annotated[bool, typer.Option("--ladder", help="Add the sources one at a time "
    "(kernels -> + precision -> + accelerator) and attribute the total.")]
_P_TRAINER_GPU = Annotated[str, typer.Option("--trainer-gpu", help="The trainer's GPU (the "
    "ladder's first rungs run there).")]
_P_SUBSET_PROMPTS = Annotated[int, typer.Option("--subset-prompts", help="Prompts for the "
    "per-GPU, fleet and sampling probes.")]
_P_FLEET_SHARES = Annotated[str | None, typer.Option("--fleet-shares", help="Capacity shares of "
    "the fleet's groups, e.g. b200-nvfp4=2,h100-fp8=1 (unlisted groups 0; default: equal "
    "shares).")]
_P_TOP_P = Annotated[float, typer.Option("--top-p", help="Top-p of the sampling probe's sampler.")]
_P_STALENESS_MAX_LAG = Annotated[int, typer.Option("--staleness-max-lag",
    help="Largest staleness (optimizer steps) the staleness probe measures.")]
_P_STALENESS_LR = Annotated[float, typer.Option("--staleness-lr", help="AdamW learning rate of "
    "the staleness probe's policy-gradient steps.")]
_P_STALENESS_CHECKPOINTS = Annotated[Path | None, typer.Option("--staleness-checkpoints",
    help="Directory of your checkpoints in training order (subdirectories), instead of "
    "generated steps.")]
_P_CI_TARGET = Annotated[float, typer.Option("--ci-target", help="With --sources: keep drawing "
    "held-out prompts until every headline KL's 95% half-width is under this fraction of its "
    "value, e.g. 0.2 (0: off).")]
_P_MAX_PROMPTS = Annotated[int, typer.Option("--max-prompts", help="Cap on the prompts "
    "--ci-target may draw.")]
_P_EMULATE = Annotated[bool, typer.Option("--emulate", help="On a CUDA machine whose GPU is not "
    "--gpu: emulate --gpu there (without it that is an error; with --gpu the local GPU, the "
    "sampler is measured).")]
_P_TRAINER_KERNELS = Annotated[str, typer.Option("--trainer-kernels", help="Trainer-side linear "
    "layers: torch (reference), or transformer-engine on a CUDA GPU: "
    + choice_list([k for k in TRAINER_KERNELS if k != "torch"], {"te": "BF16"}, last=", ")
    + ".")]


def probe_command(
    gpu: _P_GPU, dtype: _P_DTYPE, kv_cache: _P_KV_CACHE = None,
    trainer_dtype: _P_TRAINER_DTYPE = "bf16", lm_head: _P_LM_HEAD = "compute",
    lm_head_side: _P_LM_HEAD_SIDE = "both", fp32_reference: _P_FP32_REFERENCE = False,
    model: _P_MODEL = None, prompts: _P_PROMPTS = None, n_prompts: _P_N_PROMPTS = 512,
    max_new_tokens: _P_MAX_NEW_TOKENS = 48, batch_size: _P_BATCH_SIZE = 16, seed: _P_SEED = 0,
    threads: _P_THREADS = None, out: _P_OUT = None, force: _P_FORCE = False,
    as_json: _P_AS_JSON = False, sources: _P_SOURCES = None, ladder: _P_LADDER = False,
    trainer_gpu: _P_TRAINER_GPU = "b200", subset_prompts: _P_SUBSET_PROMPTS = 128,
    fleet_shares: _P_FLEET_SHARES = None, top_p: _P_TOP_P = 0.9,
    staleness_max_lag: _P_STALENESS_MAX_LAG = 8, staleness_lr: _P_STALENESS_LR = 1e-4,
    staleness_checkpoints: _P_STALENESS_CHECKPOINTS = None, ci_target: _P_CI_TARGET = 0.0,
    max_prompts: _P_MAX_PROMPTS = 4096, emulate: _P_EMULATE = False,
    trainer_kernels: _P_TRAINER_KERNELS = "torch",
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
                          ci_target=ci_target, max_prompts=max(max_prompts, n_prompts),
                          emulate=emulate, trainer_kernels=trainer_kernels.lower())
        _check_run(cfg)
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


def _check_run(cfg) -> None:
    """What can fail before anything loads (ValueError): each side's numerics (the config
    resolves them once, for the run), --trainer-kernels with the source probes (the quick probe
    checks the local GPU and the kernels itself), the fleet's shares."""
    cfg.sampler_numerics, cfg.trainer_gpu_numerics, cfg.trainer_numerics
    if (cfg.sources or cfg.ladder) and cfg.trainer_kernels != "torch":
        raise ValueError("--trainer-kernels applies to the quick probe; the source probes "
                         "(--sources, --ladder) run the reference trainer")
    if cfg.sources or cfg.ladder:
        from mismatch.fleets import fleet_groups

        fleet_groups(cfg.fleet_shares)


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
