"""quantize/checkpoint.py: modelopt writes the checkpoint, our codecs reproduce every byte of it;
bad input is refused with a one-line message and never leaves a directory behind."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mismatch.quantize.checkpoint import QuantizeConfig, quantize_checkpoint
from mismatch.quantize.checkpoint_formats import QUANTIZE_INFO
from mismatch.quantize.errors import QuantizeError
from mismatch.zoo.errors import ZooError
from mismatch.zoo.loading import check_model_dir

_MODELOPT = "nvidia-modelopt not installed (pip install -e '.[quantize]')"


def _quantize(model: Path, out: Path, fmt: str, **kwargs) -> object:
    return quantize_checkpoint(QuantizeConfig(model=model, out=out, format=fmt, calib_samples=4,
                                              calib_seq_len=32, progress=False, **kwargs))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "w4a16-nvfp4", "mxfp4"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_modelopt_export_bytes_equal_our_encoders(kind, fmt, tiny_qwen3_dir, tiny_moe_dir,
                                                  tmp_path, reference_encode):
    pytest.importorskip("modelopt.torch.quantization", reason=_MODELOPT)
    model = tiny_qwen3_dir if kind == "dense" else tiny_moe_dir
    summary = _quantize(model, tmp_path / "out", fmt)
    source, written = load_file(str(model / "model.safetensors")), load_file(
        str(tmp_path / "out" / "model.safetensors"))
    n_bytes = bad_bytes = n_scales = bad_scales = 0
    for module in summary.quantized:
        ours = reference_encode(source, module, fmt)
        theirs = _as_bytes(written[f"{module}.weight"])
        n_bytes += theirs.numel()
        bad_bytes += int((_as_bytes(ours.codes) != theirs).sum())
        pairs = [(ours.scales, written[f"{module}.weight_scale"])]
        if ours.global_scale is not None:
            pairs.append((ours.global_scale, written[f"{module}.weight_scale_2"]))
        for a, b in pairs:
            n_scales += b.numel()
            bad_scales += int((_as_bytes(a.to(b.dtype)) != _as_bytes(b)).sum())
    expected = {"dense": 14, "moe": 2 * (4 + 8 * 3)}[kind]
    assert len(summary.quantized) == expected, summary.quantized
    assert (bad_bytes, bad_scales) == (0, 0), (
        f"{kind} {fmt}: {bad_bytes} of {n_bytes} weight bytes and {bad_scales} of {n_scales} "
        f"scales differ from modelopt's export over {len(summary.quantized)} tensors")


def test_summary_and_files(tiny_moe_dir, tmp_path):
    pytest.importorskip("modelopt.torch.quantization", reason=_MODELOPT)
    out = tmp_path / "nested" / "out"
    summary = _quantize(tiny_moe_dir, out, "nvfp4", kv_cache="fp8")
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["kv_cache_quant_algo"] == "FP8"
    assert set(summary.excluded) == {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate",
                                     "model.layers.1.mlp.gate"}
    assert "model.layers.1.mlp.experts.7.down_proj" in summary.quantized
    assert 0 < summary.bytes_after < summary.bytes_before
    assert summary.calibration.startswith("random token ids")
    assert summary.wall_seconds > 0
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # no temp or backup left behind
    # readable by a server under another user (modelopt's export alone writes 0600)
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == \
        {p.name: 0o666 & ~umask for p in out.iterdir()}
    info = json.loads((out / QUANTIZE_INFO).read_text())
    assert info == {"format": "nvfp4", "kv_cache": "fp8",
                    "source_model": str(tiny_moe_dir.resolve())}
    # the trainer side refuses it in one line naming the model it came from; a server loads it
    with pytest.raises(ZooError, match=f"nvfp4 checkpoint.*--model {tiny_moe_dir.resolve()}"):
        check_model_dir(out, tokenizer=False)  # the tiny model has no tokenizer
    assert check_model_dir(out, tokenizer=False, quantized=True) == out


def test_tokenizer_is_used_for_calibration_and_saved(tiny_model_factory, tmp_path):
    pytest.importorskip("modelopt.torch.quantization", reason=_MODELOPT)
    model = tiny_model_factory("with_tokenizer", kind="dense", tokenizer=True)
    summary = _quantize(model, tmp_path / "out", "fp8")
    assert summary.calibration.startswith("tokenizer:")
    assert (tmp_path / "out" / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------ bad input


def test_unknown_format_lists_valid_ones(tmp_path):
    with pytest.raises(QuantizeError, match="valid formats: fp8, nvfp4, w4a16-nvfp4, mxfp4"):
        QuantizeConfig(model=tmp_path, out=tmp_path / "o", format="int3")
    with pytest.raises(QuantizeError, match="unknown kv_cache"):
        QuantizeConfig(model=tmp_path, out=tmp_path / "o", format="fp8", kv_cache="int8")


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("no_config", "has no config.json"),
    ("corrupt_config", "is not readable JSON"),
    ("no_weights", "has no \\*.safetensors"),
    ("corrupt_weights", "is not a readable safetensors file"),
])
def test_non_checkpoint_paths_are_refused(case, message, tiny_qwen3_dir, tmp_path):
    path = tmp_path / "model"
    if case == "file":
        path.write_text("hello")
    elif case != "missing":
        path.mkdir()
        if case != "no_config":
            (path / "config.json").write_text((tiny_qwen3_dir / "config.json").read_text())
        if case == "corrupt_config":
            (path / "config.json").write_text('{"model_type": "qwen3",')
        if case == "corrupt_weights":
            data = (tiny_qwen3_dir / "model.safetensors").read_bytes()
            (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(QuantizeError, match=message) as err:
        _quantize(path, tmp_path / "out", "fp8")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_existing_out_is_refused_without_force(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(QuantizeError, match="already exists; pass --force"):
        _quantize(tiny_qwen3_dir, out, "fp8")
    with pytest.raises(QuantizeError, match="would overwrite the source"):
        _quantize(tiny_qwen3_dir, tiny_qwen3_dir.parent, "fp8", force=True)
    assert (out / "keep.txt").read_text() == "mine"


def test_force_replaces_out_only_when_complete(tiny_qwen3_dir, tmp_path):
    pytest.importorskip("modelopt.torch.quantization", reason=_MODELOPT)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    _quantize(tiny_qwen3_dir, out, "mxfp4", force=True)
    assert not (out / "stale.txt").exists() and (out / "hf_quant_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_non_finite_weights_are_refused_naming_tensor_and_count(tiny_model_factory, tmp_path):
    model = tiny_model_factory("nan", kind="dense")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][0, :3] = float("nan")
    weights["model.norm.weight"][5] = float("inf")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizeError) as err:
        _quantize(model, tmp_path / "out", "nvfp4")
    assert "model.layers.1.mlp.down_proj.weight has 3" in str(err.value)
    assert "model.norm.weight has 1" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_indivisible_last_dimension_names_tensor_shape_and_block(tiny_model_factory, tmp_path):
    pytest.importorskip("modelopt.torch.quantization", reason=_MODELOPT)
    model = tiny_model_factory("odd", kind="dense", hidden=120)  # 120 = 7.5 blocks of 16
    with pytest.raises(QuantizeError,
                       match=r"self_attn\.q_proj\.weight of shape \[128, 120\].*block size 16"):
        _quantize(model, tmp_path / "out", "nvfp4")
    assert not (tmp_path / "out").exists()


def test_crash_mid_export_leaves_no_directory(tiny_qwen3_dir, tmp_path, monkeypatch):
    export = pytest.importorskip("modelopt.torch.export", reason=_MODELOPT)

    def crash(model, export_dir):
        (Path(export_dir) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "export_hf_checkpoint", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        _quantize(tiny_qwen3_dir, tmp_path / "out", "fp8")
    assert list(tmp_path.iterdir()) == []


def test_missing_modelopt_says_how_to_install(tiny_qwen3_dir, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "modelopt" or m.startswith("modelopt.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "modelopt", None)  # makes `import modelopt...` fail
    with pytest.raises(QuantizeError, match=r"pip install -e '\.\[quantize\]'"):
        _quantize(tiny_qwen3_dir, tmp_path / "out", "fp8")
    assert not (tmp_path / "out").exists()
