"""Measured mode and the transformer-engine trainer: the local-GPU check, `--emulate`, and the
one-line errors where CUDA or transformer-engine is missing. The runs themselves need a GPU
(`gpu` tests, skipped with the reason elsewhere); scripts/gpu_selftest.py runs them all."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from mismatch.cli.main import app
from mismatch.profiles import GPUS, ProfileError, check_local_gpu, local_profile

runner = CliRunner()
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))


def _error_line(res) -> str:
    """The one error line of a command that exited 2 ("" if it did not, or said more)."""
    lines = res.stderr.strip().splitlines()
    if res.exit_code != 2 or len(lines) != 1 or not lines[0].startswith("mismatch: error:"):
        return ""
    return lines[0]


def test_local_gpu_must_be_the_named_one():
    assert check_local_gpu("h100", H100, emulate=False) is True  # measured
    assert check_local_gpu("h100", None, emulate=False) is False  # no CUDA: emulated, as ever
    assert check_local_gpu("b200", H100, emulate=True) is False  # asked to emulate
    with pytest.raises(ProfileError, match=r"--gpu b200 .* not this machine's GPU \(NVIDIA H100 "
                       r"80GB HBM3, sm90\); pass --emulate .* or --gpu h100 to measure"):
        check_local_gpu("b200", H100, emulate=False)
    # the name alone is not enough: the compute capability must be the profile's too
    with pytest.raises(ProfileError, match="sm80"):
        check_local_gpu("h100", ("NVIDIA H100 lookalike", (8, 0)), emulate=False)
    assert local_profile(("NVIDIA B300 SXM6 AC", (10, 3))) == "b300"  # sm103 is Blackwell
    assert {g: GPUS[g].capability_major for g in GPUS} == {
        "a100": 8, "h100": 9, "h200": 9, "b200": 10, "b300": 10, "rtx-pro-6000": 12}


def test_probe_on_another_gpu_is_a_one_line_error(monkeypatch):
    """Checked before any model is loaded; --emulate turns it into an emulated probe."""
    monkeypatch.setattr("mismatch.app.probe.local_gpu", lambda: H100)  # where run_probe reads it
    res = runner.invoke(app, ["probe", "--gpu", "b200", "--dtype", "nvfp4", "--model",
                              "/no/such/dir"])
    assert "pass --emulate to emulate b200" in _error_line(res), res.stderr
    # with --emulate the check passes and the run goes on (to the missing model, here)
    res = runner.invoke(app, ["probe", "--gpu", "b200", "--dtype", "nvfp4", "--emulate",
                              "--model", "/no/such/dir"])
    assert res.exit_code == 2 and "emulate" not in res.stderr


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="transformer-engine is installed here: the error path cannot run")
def test_trainer_kernels_te_without_transformer_engine_is_a_one_line_error():
    res = runner.invoke(app, ["probe", "--gpu", "a100", "--dtype", "bf16", "--emulate",
                              "--trainer-kernels", "te-fp8"])
    needle = "--trainer-kernels te-fp8 needs NVIDIA transformer-engine"
    assert needle in _error_line(res), res.stderr
    res = runner.invoke(app, ["probe", "--gpu", "a100", "--dtype", "bf16",
                              "--trainer-kernels", "megatron"])
    assert "unknown --trainer-kernels 'megatron'" in _error_line(res), res.stderr


def test_native_fp8_needs_an_fp8_spec():
    import torch

    from mismatch.engines.numerics import apply_numerics
    from mismatch.profiles import resolve

    with pytest.raises(ValueError, match="native FP8 GEMMs need an FP8 W8A8 spec"):
        with apply_numerics(torch.nn.Linear(2, 2), resolve("b200", "nvfp4"), {"x": 1},
                            native_fp8=True):
            pass


@pytest.mark.gpu
def test_te_trainer_scores_agree_with_the_reference(tmp_path):
    """transformer-engine in BF16 scores the same tokens as the reference trainer to BF16
    noise (needs CUDA and transformer-engine)."""
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("transformer-engine is not installed (pip install 'mismatch[te]')")
    from mismatch.app.probe import ProbeConfig, run_probe
    from mismatch.profiles import local_gpu

    here = local_profile(local_gpu())
    if here is None:
        pytest.skip("the local GPU is not one of the profiled GPUs")
    ref = run_probe(ProbeConfig(gpu=here, dtype="bf16", n_prompts=8, max_new_tokens=8)).summary
    te = run_probe(ProbeConfig(gpu=here, dtype="bf16", n_prompts=8, max_new_tokens=8,
                               trainer_kernels="te")).summary
    assert te["trainer_kernels"] == "te" and te["tokens"] == ref["tokens"]
    assert te["total"]["kl_k3"] < 1e-2


@pytest.mark.gpu
def test_measured_fp8_runs_scaled_mm():
    """On a GPU with FP8 tensor cores an FP8 probe of that GPU is measured (torch._scaled_mm)."""
    from mismatch.app.probe import ProbeConfig, run_probe
    from mismatch.profiles import local_gpu

    here = local_profile(local_gpu())
    if here is None or "fp8" not in GPUS[here].native:
        pytest.skip("the local GPU has no FP8 tensor cores in its profile")
    s = run_probe(ProbeConfig(gpu=here, dtype="fp8", n_prompts=8, max_new_tokens=8)).summary
    assert s["mode"] == "measured" and s["total"]["kl_k3"] > 0
