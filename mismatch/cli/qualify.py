"""`mismatch qualify`: a sampler against the budgets of a policy, PASS or FAIL."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mismatch.cli.common import fail, quiet_libraries, run_with_bars


def qualify_command(
    gpu: str | None = typer.Option(None, "--gpu", help="Emulated sampler GPU (a100, h100, h200, "
                                   "b200, b300, rtx-pro-6000); with --sampler, the server's GPU "
                                   "(labels the verdict)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Emulated sampler precision (bf16, "
                                     "fp16, fp8, w4a16-nvfp4, nvfp4, mxfp4); with --sampler, the "
                                     "server's weights (labels the verdict)."),
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
                                    "report.md here (default: runs/qualify-<sampler>). A "
                                    "folder holding anything but an earlier qualify is refused."),
    force: bool = typer.Option(False, "--force", help="Replace --out whatever it holds."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object to stdout."),
) -> None:
    """PASS/FAIL a sampler against a mismatch budget: exit 0 pass, 1 fail, 2 bad input."""
    import json as _json

    quiet_libraries()
    from mismatch.app.qualify import load_policy, qualify_emulated, write_outputs
    from mismatch.io import check_output_dir

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
            target = check_output_dir(out or Path("runs") / f"qualify-{spec.gpu}-{spec.dtype}",
                                      "qualify", force=force)
            result = run_with_bars(lambda progress: qualify_emulated(cfg, pol, progress),
                                    quiet=as_json)
        else:
            try:
                from mismatch.app.qualify_remote import qualify_remote
            except ImportError as exc:
                raise ValueError(f"live servers cannot be qualified by this install ({exc}); "
                                 f"qualify an emulated sampler with --gpu/--dtype") from None

            if (gpu is None) != (dtype is None):
                raise ValueError("with --sampler, --gpu and --dtype label the server together "
                                 "(the GPU it runs on, its weights' format): pass both or neither")
            if gpu is not None:
                from mismatch.profiles import resolve

                spec = resolve(gpu, dtype, kv_cache)  # an unknown name is refused here too
                gpu, dtype = spec.gpu, spec.dtype
            target = check_output_dir(out or Path("runs") / "qualify-remote", "qualify",
                                      force=force)
            result = run_with_bars(
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
