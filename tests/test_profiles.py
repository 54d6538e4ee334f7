"""The accelerator table: what each GPU runs, and clear errors for what it cannot."""

from __future__ import annotations

import pytest

from mismatch.fleets import natural_pairs
from mismatch.profiles import DTYPES, GPUS, ProfileError, resolve, table


def test_every_pair_resolves_or_says_what_the_gpu_can_run():
    for gpu in GPUS:
        for dtype in DTYPES:
            try:
                spec = resolve(gpu, dtype)
            except ProfileError as exc:
                assert f"{gpu} can run: " in str(exc)
                continue
            assert spec.gpu == gpu and spec.dtype == dtype
    assert len(table()) == len(GPUS) * len(DTYPES)


@pytest.mark.parametrize("gpu", ["a100", "h100", "h200"])
def test_nvfp4_w4a4_is_blackwell_only(gpu):
    with pytest.raises(ProfileError, match=rf"{gpu} cannot run nvfp4.*can run: bf16, fp16, fp8, "
                                           r"w4a16-nvfp4, mxfp4"):
        resolve(gpu, "nvfp4")


def test_kernel_paths_follow_numerics_md():
    a100 = resolve("a100", "fp8")
    assert a100.weight_codec == "fp8" and a100.activation_codec is None  # Marlin W8A16
    h100 = resolve("h100", "fp8")
    assert h100.activation_codec == "fp8-act" and h100.accumulation == "hopper-fp8-fast"
    b200 = resolve("b200", "fp8")
    assert b200.activation_codec == "fp8-act" and b200.accumulation == "fp32"
    nv = resolve("b200", "nvfp4")
    assert (nv.weight_codec, nv.activation_codec) == ("nvfp4", "nvfp4-act")
    w4 = resolve("h100", "w4a16-nvfp4")
    assert w4.activation_codec is None
    assert resolve("a100", "bf16").attention == "fa2"
    assert resolve("h200", "bf16").attention == "fa3"
    assert resolve("rtx-pro-6000", "bf16").attention == "flashinfer"


def test_kv_cache_and_names():
    assert resolve("H100", "BF16", "fp8").kv_codec == "fp8-act"
    assert resolve("h100", "bf16").kv_codec is None
    assert resolve("a100", "fp16").kv_cache == "fp16"
    with pytest.raises(ProfileError, match="unknown gpu 'v100'; valid: a100, h100"):
        resolve("v100", "bf16")
    with pytest.raises(ProfileError, match="unknown dtype 'int8'; valid: bf16"):
        resolve("a100", "int8")
    with pytest.raises(ProfileError, match="unknown kv cache 'fp4'"):
        resolve("a100", "bf16", "fp4")


def test_the_study_fleet_resolves():
    pairs = natural_pairs()
    assert len(pairs) == 8
    for gpu, dtype in pairs:
        resolve(gpu, dtype, "fp8")


def test_gemm_accumulation_is_per_gpu():
    """Hopper runs per-tensor FP8 W8A8 with fast accumulation; everything else sums in FP32."""
    from mismatch.profiles import register_gpu

    for name, g in GPUS.items():
        for dtype in ("fp8", "fp8-block128", "nvfp4", "mxfp4"):
            fast = dtype == "fp8" and g.arch == "sm90"
            assert g.accumulation(dtype) == ("hopper-fp8-fast" if fast else "fp32"), (name, dtype)
    with pytest.raises(ValueError, match="registered twice"):
        register_gpu(GPUS["h100"])
