"""The trainer side on NVIDIA transformer-engine: the linear layers a Megatron trainer runs.

`--trainer-kernels` names what the trainer scorer's decoder linear layers run on:

    torch      the reference GEMM model (exact products, FP32 sums, rounded once; numerics.py)
    te         transformer_engine.pytorch.Linear in BF16 (cuBLASLt, as Megatron-Core's TE layers)
    te-fp8     + TE's FP8 recipe (Float8CurrentScaling: per-tensor scales from the current amax)
    te-mxfp8   + TE's MXFP8 recipe (MXFP8BlockScaling: E8M0 scales per 32, Blackwell)
    te-nvfp4   + TE's NVFP4 recipe (NVFP4BlockScaling, Blackwell)

(recipe classes: transformer_engine.common.recipe; the autocast context is
`transformer_engine.pytorch.autocast(recipe=...)`, `fp8_autocast(fp8_recipe=...)` before TE 2.9.)
Each decoder nn.Linear gets a TE Linear holding the same BF16 weight for the duration of the
block; fused MoE experts (3-D weights) and the lm_head stay in torch BF16 on the GPU. TE needs
CUDA: without it, or without the `transformer_engine` package, asking for it is a one-line
TEUnavailable error. torch loads where a check or a block runs, so the probe's config and the
command line read `TRAINER_KERNELS` without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["TRAINER_KERNELS", "TEUnavailable", "check_te", "te_linears"]

# name -> TE recipe class (None: TE in BF16; "torch" is the reference, no TE at all)
TRAINER_KERNELS: dict[str, str | None] = {
    "torch": None,
    "te": None,
    "te-fp8": "Float8CurrentScaling",
    "te-mxfp8": "MXFP8BlockScaling",
    "te-nvfp4": "NVFP4BlockScaling",
}


class TEUnavailable(ValueError):
    """transformer-engine was asked for where it cannot run."""


def check_te(kind: str) -> None:
    """Raise a one-line error unless `kind` can run here (TE installed, a CUDA device)."""
    if kind not in TRAINER_KERNELS:
        raise TEUnavailable(f"unknown trainer kernels {kind!r}; valid: "
                            f"{', '.join(TRAINER_KERNELS)}")
    if kind == "torch":
        return
    if importlib.util.find_spec("transformer_engine") is None:
        raise TEUnavailable(f"--trainer-kernels {kind} needs NVIDIA transformer-engine (pip "
                            f"install 'mismatch[te]' on a CUDA machine); use torch")
    import torch

    if not torch.cuda.is_available():
        raise TEUnavailable(f"--trainer-kernels {kind} needs a CUDA GPU (transformer-engine has "
                            f"no CPU kernels); use torch")


def _autocast(te_pytorch, recipe_name: str | None):
    if recipe_name is None:
        return contextlib.nullcontext()
    from transformer_engine.common import recipe as te_recipe

    recipe = getattr(te_recipe, recipe_name, None)
    if recipe is None:
        raise TEUnavailable(f"this transformer-engine has no {recipe_name} recipe; upgrade it")
    if hasattr(te_pytorch, "autocast"):
        return te_pytorch.autocast(enabled=True, recipe=recipe())
    return te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe())


@contextlib.contextmanager
def te_linears(model: torch.nn.Module, kind: str):
    """Run every decoder nn.Linear of a CUDA `model` through a TE Linear inside the block."""
    check_te(kind)
    if kind == "torch":
        yield
        return
    import torch
    import transformer_engine.pytorch as te

    patched = []
    try:
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or ".layers." not in f".{name}." or \
                    name.rsplit(".", 1)[-1] == "gate":  # MoE routers stay in torch
                continue
            layer = te.Linear(module.in_features, module.out_features,
                              bias=module.bias is not None, params_dtype=module.weight.dtype,
                              device=module.weight.device)
            with torch.no_grad():
                layer.weight.copy_(module.weight)
                if module.bias is not None:
                    layer.bias.copy_(module.bias)
            module.forward = layer.forward
            patched.append((module, layer))
        with _autocast(te, TRAINER_KERNELS[kind]):
            yield
    finally:
        for module, _layer in patched:
            del module.forward
