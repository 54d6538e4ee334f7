"""`mismatch formats`, `mismatch quantize` and `mismatch profiles`: the number formats, real
checkpoints, and the GPU profiles."""

from __future__ import annotations

from pathlib import Path

import typer

from mismatch.cli.common import choice_list, fail
from mismatch.quantize.checkpoint_formats import CHECKPOINT_FORMATS, KV_CACHE_FORMATS

def formats_command() -> None:
    """List the number formats (codecs) this build can encode, decode and emulate."""
    from mismatch.quantize.codecs import CODECS

    width = max(len(name) for name in CODECS)
    for name, spec in CODECS.items():
        typer.echo(f"{name:<{width}}  {spec.description}")


def quantize_command(
    model: Path | None = typer.Option(
        None, "--model",
        help="Hugging Face checkpoint directory (BF16). Default: the embedded model."),
    fmt: str = typer.Option(..., "--format", help=f"{choice_list(CHECKPOINT_FORMATS)}."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized checkpoint to."),
    kv_cache: str | None = typer.Option(
        None, "--kv-cache", help=f"Also quantize the KV cache: {choice_list(KV_CACHE_FORMATS)}."),
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
            model = embedded_model_dir()
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


def embedded_model_dir() -> Path:
    """The embedded default model's directory, or a bad-input error while it is not built."""
    from mismatch.zoo import check_model_dir

    try:
        return check_model_dir(None, tokenizer=False)
    except ValueError as exc:
        raise ValueError(f"no --model given and the embedded model is not available: "
                         f"{exc}") from None


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
