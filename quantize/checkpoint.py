"""Write calibrated modelopt checkpoints (FP8, NVFP4, W4A16-NVFP4, MXFP4) from a BF16 HF model.

`quantize_checkpoint(QuantizeConfig(...))` loads a Hugging Face causal LM, runs NVIDIA modelopt's
post-training quantization with max calibration, and exports a checkpoint that vLLM / SGLang /
TensorRT-LLM load (`hf_quant_config.json` + `model.safetensors`). Nothing is half-written: the
export goes to a hidden sibling `.{out}.tmp-<pid>` that is renamed into place at the end and
removed on any failure.

Bad input is refused before any heavy work, with a `QuantizeError` (a ValueError) naming the
problem: an unknown format, a path that is not a HF checkpoint, an existing `out` without
`force`, a quantized weight whose last dimension does not split into the format's blocks, and
any non-finite value in any tensor of the source checkpoint (a NaN/inf weight is corruption;
modelopt would turn it into a NaN amax and silently poison the whole tensor's scales).

Facts about modelopt 0.47 on CPU (torch 2.13, transformers 5.14), found by experiment on tiny
Qwen3 / Qwen3-MoE models; the source files named are under modelopt/torch/:
- Configs (quantization/config.py): FP8_DEFAULT_CFG, NVFP4_DEFAULT_CFG, W4A16_NVFP4_CFG,
  MXFP4_DEFAULT_CFG; each is {"quant_cfg": [ordered list of {"quantizer_name", "cfg"|"enable"}],
  "algorithm": "max" (MXFP4: None)}. The FP8 KV cache is appended with
  `update_quant_cfg_with_kv_cache_quant(cfg, FP8_KV_CFG["quant_cfg"])`
  (quantization/utils/core_utils.py), which also sets algorithm "max" where it was None.
- All four calibrate and export on CPU. Max calibration only records amax, so it never runs the
  FP4 fake-quant kernels; a forward *after* quantize does, and asserts CUDA for NVFP4/W4A16
  ("amax must be a CUDA tensor for dynamic block quantization") and MXFP4 ("Skipping extension
  modelopt_cuda_ext_mx because CUDA is not available"). FP8 fake-quant forward works on CPU.
- `quantize(model, cfg, loop)` = insert quantizers + `calibrate(model, cfg["algorithm"], loop)`
  (quantization/model_quant.py); running the two halves separately (algorithm None, then
  `calibrate`) exports byte-identical files, which lets us check block divisibility between them.
  modelopt itself only notices an indivisible weight at export time, with an AssertionError
  ("Weight shape is not divisible for block size", export/hf_export_handlers.py).
- Export (export/unified_export_hf.py) needs `config.architectures` (None: TypeError "'NoneType'
  object is not iterable"), and `config.dtype` must be a torch.dtype: a string there ("bfloat16", as in config.json) fails with RuntimeError "Invalid
  device string: 'bfloat16'" (from_pretrained in transformers 5.14 stores a dtype; we set it
  explicitly anyway). It prints to stdout (captured here) and writes config.json (with
  `quantization_config`, quant_method "modelopt"), generation_config.json, hf_quant_config.json
  and model.safetensors, but no tokenizer (saved here).
- hf_quant_config.json `quant_algo`: "FP8", "NVFP4", "W4A16_NVFP4", and lower-case "mxfp4";
  `kv_cache_quant_algo` "FP8" or null; `group_size` 16 for the NVFP4 pair only;
  `exclude_modules`: lm_head, model.embed_tokens and each MoE router `model.layers.N.mlp.gate`.
- Tensors per quantized linear: FP8 `weight` F8_E4M3, `weight_scale` and `input_scale` 0-dim F32;
  NVFP4 `weight` U8 [out, in/2], `weight_scale` F8_E4M3 [out, in/16], `weight_scale_2` and
  `input_scale` 0-dim F32 (W4A16: no input_scale); MXFP4 `weight` U8 [out, in/2], `weight_scale`
  U8 E8M0 [out, in/32] and no activation scale. FP8 KV: `self_attn.k_proj.k_scale` and
  `self_attn.v_proj.v_scale` (0-dim F32, on the projections, not on the attention module).
- Fusion at export (`_fuse_shared_input_modules`, unified_export_hf.py): for NVFP4/W4A16 (any
  format but FP8) the linears that read the same input — q/k/v, and a dense MLP's gate/up —
  get the max of their weight amaxes and of their input amaxes, so they share `weight_scale_2`
  and `input_scale`. FP8 is skipped: q/k/v keep their own `weight_scale`; they share
  `input_scale` only because they saw the same input.
- Fused MoE experts (transformers 5: `mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I] as 3-D parameters) are wrapped by `_QuantFusedExperts`
  (quantization/plugins/huggingface.py; modelopt forces `experts_implementation="eager"` so
  F.linear is intercepted): one weight quantizer per expert for the whole gate_up slice, one per
  expert for down_proj, one input quantizer per projection shared by all experts. Export
  (export/moe_utils.py `_export_fused_experts`) splits them back into the per-expert names of
  the original checkpoint: `model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`
  (+ scales). Hence gate and up of one expert share their FP8 `weight_scale` / NVFP4
  `weight_scale_2` (amax of the fused [2I, H] slice), and every expert has the same
  `input_scale`. An expert that saw no calibration token falls back to its weight amax (warning).
- With these rules, quantize.codecs' encoders ("fp8", "nvfp4", "w4a16-nvfp4", "mxfp4-modelopt")
  reproduce every exported weight byte and scale (tests/test_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.io import atomic_directory, check_writable_dir

from .checkpoint_formats import CHECKPOINT_FORMATS, KV_CACHE_FORMATS, QUANTIZE_INFO
from .errors import QuantizeError

__all__ = ["QuantizeConfig", "QuantizeSummary", "quantize_checkpoint"]

INSTALL_HINT = "pip install -e '.[quantize]'"


@dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """What `quantize_checkpoint` does."""

    model: Path
    """Directory of the source Hugging Face checkpoint (config.json + *.safetensors)."""
    format: str
    """Checkpoint format, a key of CHECKPOINT_FORMATS."""
    out: Path
    """Directory to write; must not exist unless `force`."""
    kv_cache: str | None = None
    """Also quantize the KV cache (a key of KV_CACHE_FORMATS), or None for BF16 KV."""
    calib_samples: int = 16
    """Calibration sequences run through the model (max calibration of activation scales)."""
    calib_seq_len: int = 128
    """Tokens per calibration sequence."""
    force: bool = False
    """Replace `out` if it exists (only once the new checkpoint is complete)."""
    seed: int = 0
    """Seed of the calibration data (window offsets, or random token ids)."""
    progress: bool = True
    """Show a progress bar on stderr during calibration."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        object.__setattr__(self, "out", Path(self.out))
        if self.format not in CHECKPOINT_FORMATS:
            raise QuantizeError(f"unknown format {self.format!r}; valid formats: "
                                f"{', '.join(CHECKPOINT_FORMATS)}")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_FORMATS:
            raise QuantizeError(f"unknown kv_cache format {self.kv_cache!r}; valid: "
                                f"{', '.join(KV_CACHE_FORMATS)} (or none)")
        if self.calib_samples < 1 or self.calib_seq_len < 1:
            raise QuantizeError(f"calib_samples and calib_seq_len must be >= 1, got "
                                f"{self.calib_samples} and {self.calib_seq_len}")


@dataclass(frozen=True, kw_only=True)
class QuantizeSummary:
    """What was written."""

    format: str
    """Checkpoint format name."""
    kv_cache: str | None
    """KV-cache format, or None."""
    model: Path
    """Source checkpoint."""
    out: Path
    """Written checkpoint."""
    quantized: tuple[str, ...]
    """Modules with quantized weights, as named in the written safetensors."""
    excluded: tuple[str, ...]
    """`exclude_modules` of hf_quant_config.json (kept in high precision)."""
    bytes_before: int
    """Total size of the source *.safetensors files."""
    bytes_after: int
    """Total size of the written *.safetensors files."""
    wall_seconds: float
    """Time from start to the final rename."""
    calibration: str
    """Where the calibration tokens came from."""


def quantize_checkpoint(config: QuantizeConfig) -> QuantizeSummary:
    """Quantize `config.model` into `config.out`; see the module docstring."""
    from .calibration import calibration_batches, forward_loop
    from .loader import load_json, safetensors_bytes

    start = time.perf_counter()
    fmt = CHECKPOINT_FORMATS[config.format]
    model_dir, out = config.model, config.out
    _check_out(model_dir, out, config.force)
    source_config = _check_source(model_dir)
    mtq, export_hf_checkpoint, kv_update = _import_modelopt()
    recipe = getattr(mtq, fmt.modelopt_config)
    captured = io.StringIO()  # modelopt prints its whole recipe and its progress to stdout
    if config.kv_cache is not None:
        with contextlib.redirect_stdout(captured):
            recipe = kv_update(recipe, getattr(mtq, KV_CACHE_FORMATS[config.kv_cache])["quant_cfg"])
    with _quiet(captured, calibrated=recipe["algorithm"] is not None):
        model, tokenizer = _load_model(model_dir, source_config)
        model = mtq.quantize(model, {**recipe, "algorithm": None})  # insert quantizers only
        _check_blocks(model)
        batches, calibration = calibration_batches(
            tokenizer, vocab_size=model.config.vocab_size, samples=config.calib_samples,
            seq_len=config.calib_seq_len, seed=config.seed, source=config.model)
        mtq.calibrate(model, recipe["algorithm"], forward_loop(batches, progress=config.progress))
        with atomic_directory(out) as tmp:
            export_hf_checkpoint(model, export_dir=str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            (tmp / QUANTIZE_INFO).write_text(json.dumps({
                "format": fmt.name, "kv_cache": config.kv_cache,
                "source_model": str(model_dir.resolve())}, indent=2) + "\n")
            _readable(tmp)
            quant = load_json(tmp / "hf_quant_config.json").get("quantization", {})
            quantized, bytes_after = _quantized_modules(tmp), safetensors_bytes(tmp)
    return QuantizeSummary(
        format=fmt.name, kv_cache=config.kv_cache, model=model_dir, out=out,
        quantized=quantized, excluded=tuple(quant.get("exclude_modules", [])),
        bytes_before=safetensors_bytes(model_dir), bytes_after=bytes_after,
        wall_seconds=time.perf_counter() - start, calibration=calibration)


def _readable(directory: Path) -> None:
    """modelopt's export writes model.safetensors owner-only (0600); a checkpoint is read by
    servers under other users, so give every file the mode a plain write would (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _check_source(model_dir: Path) -> dict[str, Any]:
    """config.json of the source, after checking it is an unquantized, all-finite checkpoint."""
    import torch

    from .loader import iter_tensors, read_config

    config = read_config(model_dir)
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise QuantizeError(f"{model_dir} is already quantized (quant_method {method!r}); "
                            f"start from the BF16 checkpoint")
    bad = []
    for name, tensor in iter_tensors(model_dir):
        if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            n_bad = int((~torch.isfinite(tensor)).sum())
            if n_bad:
                bad.append(f"{name} has {n_bad}")
    if bad:
        more = f" (and {len(bad) - 3} more tensors)" if len(bad) > 3 else ""
        raise QuantizeError(f"{model_dir} holds non-finite weights: {'; '.join(bad[:3])} NaN/inf "
                            f"value(s){more}; refusing to quantize a corrupt checkpoint")
    return config


def _check_out(model_dir: Path, out: Path, force: bool) -> None:
    try:  # before calibration: an --out under a file, on the working directory, unwritable
        check_writable_dir(out)
    except ValueError as exc:
        raise QuantizeError(str(exc)) from None
    src, dst = model_dir.resolve(), out.resolve()
    if dst == src or dst in src.parents:
        raise QuantizeError(f"--out {out} would overwrite the source checkpoint {model_dir}")
    if out.exists() and not force:
        raise QuantizeError(f"output {out} already exists; pass --force to replace it")


@contextlib.contextmanager
def _quiet(captured: io.StringIO, *, calibrated: bool = True):
    """Keep library chatter off the terminal; restores every setting it touches (`finally`).

    modelopt prints its recipe and export steps to stdout (captured); transformers shows
    load/save progress bars and deprecation notes; modelopt's export warns about a tensor copy,
    and, without calibration (MXFP4 weights only), that no MoE expert was calibrated.
    """
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stdout(captured), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="To copy construct from a tensor")
            if not calibrated:  # a dynamic-scale format has no calibrated weight amax to miss
                warnings.filterwarnings("ignore", message=r"Expert \d+ .* was not calibrated")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _import_modelopt():
    # Importing modelopt logs warnings about optional CUDA extensions (torchao's cutlass kernels,
    # deepspeed's accelerator probe) that say nothing about CPU export; failures still raise.
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
        from modelopt.torch.quantization.utils.core_utils import (
            update_quant_cfg_with_kv_cache_quant,
        )
    except ImportError as exc:
        raise QuantizeError(f"writing quantized checkpoints needs NVIDIA modelopt, which is not "
                            f"installed ({exc}); install it with: {INSTALL_HINT}") from exc
    finally:
        logging.disable(disabled)
    return mtq, export_hf_checkpoint, update_quant_cfg_with_kv_cache_quant


def _load_model(model_dir: Path, config: dict[str, Any]):
    """The model in its checkpoint dtype, and its tokenizer (None when the dir has none)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = {"float16": torch.float16, "float32": torch.float32}.get(str(name), torch.bfloat16)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QuantizeError(f"transformers cannot load {model_dir} as a causal LM: "
                            f"{first}") from exc
    model.eval()
    model.config.dtype = dtype  # a dtype string here makes modelopt's export fail (docstring)
    if not model.config.architectures:  # modelopt's export names the model class from it
        model.config.architectures = [type(model).__name__]
    tokenizer = None
    if any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise QuantizeError(f"{model_dir} has tokenizer files that do not load: {exc}") from exc
    return model, tokenizer


def _check_blocks(model) -> None:
    """Refuse a quantized weight whose last dimension does not split into whole blocks."""
    for module_name, module in model.named_modules():
        if not hasattr(module, "iter_weights_for_calibration"):
            continue
        for weight, quantizer in module.iter_weights_for_calibration():
            block_sizes = getattr(quantizer, "block_sizes", None)
            if not getattr(quantizer, "is_enabled", False) or not block_sizes:
                continue
            block = block_sizes.get(-1) or block_sizes.get(weight.dim() - 1)
            if block and weight.shape[-1] % block:
                raise QuantizeError(
                    f"cannot quantize {_weight_name(module_name, module, weight)} of shape "
                    f"{list(weight.shape)}: its last dimension is not a multiple of the block "
                    f"size {block}")


def _weight_name(module_name: str, module, weight) -> str:
    """The parameter name of `weight` (a parameter of `module`, or one expert's slice of it)."""
    for pname, param in module.named_parameters(recurse=False):
        if weight is param:
            return f"{module_name}.{pname}"
        if weight._base is param:
            index = (weight.storage_offset() - param.storage_offset()) // param.stride(0)
            return f"{module_name}.{pname}[{index}]"
    return module_name


def _quantized_modules(export_dir: Path) -> tuple[str, ...]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.update(k.removesuffix(".weight_scale") for k in f.keys()
                         if k.endswith(".weight_scale"))
    return tuple(sorted(names))
