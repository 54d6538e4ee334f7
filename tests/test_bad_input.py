"""Bad input is one line and exit 2, before any work: a corrupt or truncated checkpoint, a
quantized checkpoint where the trainer's model belongs, a live server's label half given."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mismatch.zoo.errors import ZooError
from mismatch.zoo.loading import check_model_dir, default_model_dir

CLI = [sys.executable, "-m", "mismatch.cli"]


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)


def _one_line_error(proc: subprocess.CompletedProcess, *match: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("mismatch: error:"), proc.stderr
    for m in match:
        assert m in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def model_copy(tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(default_model_dir(), dst)
    return dst


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_corrupt_checkpoint_is_one_line_for_probe_and_train(model_copy, tmp_path, damage):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"\0" * len(data))
    with pytest.raises(ZooError, match="is corrupt or truncated"):
        check_model_dir(model_copy)
    probe = _cli(["probe", "--gpu", "a100", "--dtype", "bf16", "--model", str(model_copy),
                  "--n-prompts", "2", "--out", str(tmp_path / "p")])
    _one_line_error(probe, "model.safetensors is corrupt or truncated", "copy the checkpoint")
    train = _cli(["train", "--preset", "smoke", "--steps", "1", "--model", str(model_copy),
                  "--out", str(tmp_path / "t")])
    _one_line_error(train, "model.safetensors is corrupt or truncated")
    assert not (tmp_path / "p").exists() and not (tmp_path / "t" / "metrics.jsonl").exists()


def test_a_sharded_checkpoint_missing_a_shard_names_it(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ZooError, match="names model-00002-of-00002.safetensors, which is missing"):
        check_model_dir(model_copy)


def test_a_quantized_checkpoint_is_refused_naming_the_model_it_came_from(model_copy, tmp_path):
    # what `mismatch quantize` writes beside modelopt's export (hf_quant_config.json): the
    # weights themselves stay BF16 here — the refusal reads the metadata, not the tensors
    (model_copy / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None}}))
    (model_copy / "mismatch_quantize.json").write_text(json.dumps(
        {"format": "nvfp4", "kv_cache": None, "source_model": "/models/policy-bf16"}))
    with pytest.raises(ZooError, match="is a nvfp4 checkpoint"):
        check_model_dir(model_copy)
    assert check_model_dir(model_copy, quantized=True) == model_copy  # a server may load it
    probe = _cli(["probe", "--gpu", "a100", "--dtype", "bf16", "--model", str(model_copy),
                  "--n-prompts", "2", "--out", str(tmp_path / "p")])
    _one_line_error(probe, "a nvfp4 checkpoint (a sampler's weights)",
                    "--model /models/policy-bf16 --dtype nvfp4", "mismatch qualify --sampler")
    train = _cli(["train", "--preset", "smoke", "--steps", "1", "--model", str(model_copy),
                  "--out", str(tmp_path / "t")])
    _one_line_error(train, "a nvfp4 checkpoint")
    # without the project's metadata (another tool's export): the format from the config
    (model_copy / "mismatch_quantize.json").unlink()
    config = json.loads((model_copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ZooError, match="is a FP8 checkpoint.*<the BF16 checkpoint it came from>"):
        check_model_dir(model_copy)


@pytest.mark.parametrize("args, match", [
    (["--gpu", "h100"], "--gpu and --dtype label the server together"),
    (["--dtype", "fp8"], "--gpu and --dtype label the server together"),
    (["--gpu", "h900", "--dtype", "fp8"], "unknown gpu 'h900'"),
])
def test_qualify_a_live_server_labels_it_with_both_gpu_and_dtype_or_neither(args, match,
                                                                            tmp_path):
    # port 9 (discard) on loopback: nothing listens; the label is checked before any request
    proc = _cli(["qualify", "--sampler", "http://127.0.0.1:9", "--engine", "vllm",
                 "--out", str(tmp_path / "q"), *args])
    line = _one_line_error(proc, match)
    assert "Traceback" not in proc.stderr and match in line
    assert not (tmp_path / "q").exists()  # refused before anything was written
