"""quantize/loader.py: `mismatch quantize` → loader → decode equals our encoder's, bit for bit;
engine fusion rewrites fused shards exactly as vLLM does; bad paths give one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mismatch.cli.main import app
from mismatch.quantize.codecs import decode, encode
from mismatch.quantize.errors import QuantizeError
from mismatch.quantize.loader import load_quantized

_MODELOPT = "nvidia-modelopt not installed (pip install -e '.[quantize]')"


def _cli(*args: str):
    return CliRunner().invoke(app, ["quantize", *args])


@pytest.mark.parametrize("fmt, kv", [("fp8", True), ("nvfp4", True), ("w4a16-nvfp4", False),
                                     ("mxfp4", False)])
def test_cli_round_trip_decodes_like_our_encoder(fmt, kv, tiny_moe_dir, tmp_path,
                                                 reference_encode):
    pytest.importorskip("modelopt.torch.quantization", reason=_MODELOPT)
    out = tmp_path / "out"
    result = _cli("--model", str(tiny_moe_dir), "--format", fmt, "--out", str(out),
                  "--calib-samples", "4", "--calib-seq-len", "32", *(["--kv-cache", "fp8"] * kv))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {out}")
    source = load_file(str(tiny_moe_dir / "model.safetensors"))
    ckpt = load_quantized(out)
    assert ckpt.format.name == fmt and len(ckpt.weights) == 2 * (4 + 8 * 3)
    n_values = bad_codes = bad_values = 0
    for module, qt in ckpt.weights.items():
        ours = reference_encode(source, module, fmt)
        n_values += qt.codes.numel()
        bad_codes += int((qt.codes != ours.codes).sum())
        got, want = decode(qt), decode(ours)
        bad_values += int((got.view(torch.int32) != want.view(torch.int32)).sum())
    assert (bad_codes, bad_values) == (0, 0), (
        f"{fmt}: {bad_codes} codes and {bad_values} decoded values differ of {n_values} "
        f"over {len(ckpt.weights)} tensors")
    for name, tensor in ckpt.tensors.items():  # norms, embeddings, lm_head, routers: untouched
        assert torch.equal(tensor, source[name]), name
    assert set(ckpt.state_dict()) == set(source)
    assert bool(ckpt.kv_scales) == kv
    if kv:
        assert set(ckpt.kv_scales) == {f"model.layers.{i}.self_attn.{w}_scale"
                                       for i in range(2) for w in "kv"}
    if fmt in ("fp8", "nvfp4"):
        assert set(ckpt.input_scales) == set(ckpt.weights)


def test_cli_bad_input_is_one_line_exit_2(tiny_qwen3_dir, tmp_path, monkeypatch):
    import mismatch.zoo.loading

    monkeypatch.setattr(mismatch.zoo.loading, "default_model_dir", lambda: tmp_path / "none")
    (tmp_path / "taken").mkdir()
    cases = [
        (["--model", str(tiny_qwen3_dir), "--format", "int3", "--out", str(tmp_path / "a")],
         "unknown format 'int3'; valid formats: fp8, nvfp4, w4a16-nvfp4, mxfp4"),
        (["--model", str(tmp_path), "--format", "fp8", "--out", str(tmp_path / "b")],
         "has no config.json"),
        (["--model", str(tiny_qwen3_dir), "--format", "fp8", "--out", str(tmp_path / "taken")],
         "already exists; pass --force"),
        (["--format", "fp8", "--out", str(tmp_path / "c")],
         "no --model given and the embedded model is not available"),
    ]
    for args, message in cases:
        result = _cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert result.stderr.startswith("mismatch: error: ") and message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# ------------------------------------------------------------------------------ hand-made files


def _write_checkpoint(path: Path, quant_algo: str, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "test"}, "quantization": {"quant_algo": quant_algo,
                                                        "exclude_modules": ["lm_head"]}}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


_FP8_SHARDS = {  # module → std of its random weight. q/k/v scales are ~1e-5, FP16 subnormals
    "model.layers.0.self_attn.q_proj": 0.0008,  # (< 2^-14), where vLLM's FP16 dequantization
    "model.layers.0.self_attn.k_proj": 0.0012,  # rounds visibly
    "model.layers.0.self_attn.v_proj": 0.0010,
    "model.layers.0.mlp.experts.3.gate_proj": 0.03,
    "model.layers.0.mlp.experts.3.up_proj": 0.01,
}


def _fp8_checkpoint(path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    tensors = {"lm_head.weight": torch.randn(8, 64, generator=gen).to(torch.bfloat16)}
    for i, (module, std) in enumerate(_FP8_SHARDS.items()):
        w = (torch.randn(32 + 16 * (i % 2), 64, generator=gen) * std).to(torch.bfloat16)
        q = encode(w, "fp8")
        tensors[f"{module}.weight"] = q.codes.view(torch.float8_e4m3fn)
        tensors[f"{module}.weight_scale"] = q.scales
        tensors[f"{module}.input_scale"] = torch.tensor(0.01 * (i + 1))
    return _write_checkpoint(path, "FP8", tensors)


def _plain_vllm_requantize(codes_u8: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor):
    """per_tensor_dequantize (FP16 math, as on CUDA) then scaled_fp8_quant (FP32 x · (1/s))."""
    dq = codes_u8.view(torch.float8_e4m3fn).to(torch.float16) * scale.to(torch.float16)
    inv = 1.0 / new_scale.float()
    return (dq.float() * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def test_fp8_engine_fusion_requantizes_shards_to_the_max_scale(tmp_path):
    path = _fp8_checkpoint(tmp_path / "ckpt")
    stored = load_file(str(path / "model.safetensors"))
    plain = load_quantized(path)
    fused = load_quantized(path, engine_fusion=True)
    assert set(plain.weights) == set(_FP8_SHARDS)
    groups = {"model.layers.0.self_attn.qkv_proj": list(_FP8_SHARDS)[:3],
              "model.layers.0.mlp.experts.3.gate_up_proj": list(_FP8_SHARDS)[3:]}
    assert set(fused.weights) == set(groups) and fused.tensors.keys() == {"lm_head.weight"}
    changed = fp32_differs = 0
    for name, shards in groups.items():
        scales = [stored[f"{s}.weight_scale"] for s in shards]
        new_scale = max(scales)
        assert len(set(float(s) for s in scales)) == len(scales)  # the shard scales differ
        want = torch.cat([_plain_vllm_requantize(stored[f"{s}.weight"].view(torch.uint8), sc,
                                                 new_scale) for s, sc in zip(shards, scales)])
        qt = fused.weights[name]
        assert torch.equal(qt.codes, want), name
        assert float(qt.scales) == float(new_scale)
        assert float(fused.input_scales[name]) == max(float(stored[f"{s}.input_scale"])
                                                      for s in shards)
        stored_codes = torch.cat([stored[f"{s}.weight"].view(torch.uint8) for s in shards])
        changed += int((want != stored_codes).sum())
        fp32_dq = torch.cat([
            (stored[f"{s}.weight"].float() * sc * (1.0 / new_scale)).clamp(-448.0, 448.0)
            .to(torch.float8_e4m3fn).view(torch.uint8) for s, sc in zip(shards, scales)])
        fp32_differs += int((fp32_dq != want).sum())
        split = fused.decoded_weights()
        for s, part in zip(shards, want.split([stored[f"{s}.weight"].shape[0] for s in shards])):
            expected = part.view(torch.float8_e4m3fn).float() * new_scale
            assert torch.equal(split[f"{s}.weight"], expected), s
    assert changed > 0  # requantization to a coarser scale really moves codes
    assert fp32_differs > 0  # and dequantizing in FP32 instead of FP16 would not be the same


def test_nvfp4_engine_fusion_shares_max_global_scale_and_keeps_codes(tmp_path):
    gen = torch.Generator().manual_seed(1)
    shards = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
              "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.experts.0.gate_proj",
              "model.layers.1.mlp.experts.0.up_proj"]
    tensors, qts = {}, {}
    for i, module in enumerate(shards):
        q = encode((torch.randn(32, 64, generator=gen) * 0.01 * (i + 1)).to(torch.bfloat16),
                   "nvfp4")
        qts[module] = q
        tensors.update({f"{module}.weight": q.codes, f"{module}.weight_scale": q.scales,
                        f"{module}.weight_scale_2": q.global_scale,
                        f"{module}.input_scale": torch.tensor(0.5 + i)})
    path = _write_checkpoint(tmp_path / "ckpt", "NVFP4", tensors)
    fused = load_quantized(path, engine_fusion=True)
    qkv = fused.weights["model.layers.1.self_attn.qkv_proj"]
    assert torch.equal(qkv.codes, torch.cat([qts[s].codes for s in shards[:3]]))
    assert torch.equal(qkv.scales.view(torch.uint8),
                       torch.cat([qts[s].scales for s in shards[:3]]).view(torch.uint8))
    assert float(qkv.global_scale) == max(float(qts[s].global_scale) for s in shards[:3])
    assert float(fused.input_scales["model.layers.1.self_attn.qkv_proj"]) == 2.5
    w13 = fused.weights["model.layers.1.mlp.experts.0.gate_up_proj"]
    assert float(w13.global_scale) == float(qts[shards[3]].global_scale)  # vLLM keeps w1's


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("bf16", "has no hf_quant_config.json"),
    ("corrupt", "is not a readable safetensors file"),
    ("algo", "unsupported quant_algo 'INT4_AWQ'"),
    ("dtype", "weight has dtype torch.bfloat16, expected torch.float8_e4m3fn"),
])
def test_loader_errors_are_one_line(case, message, tiny_qwen3_dir, tmp_path):
    path = tmp_path / "ckpt"
    if case == "bf16":
        path = tiny_qwen3_dir
    elif case in ("corrupt", "algo"):
        _fp8_checkpoint(path)
        if case == "corrupt":
            data = (path / "model.safetensors").read_bytes()
            (path / "model.safetensors").write_bytes(data[:100])
        else:
            (path / "hf_quant_config.json").write_text(
                '{"quantization": {"quant_algo": "INT4_AWQ"}}')
    elif case == "dtype":
        _write_checkpoint(path, "FP8", {"m.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
                                        "m.weight_scale": torch.tensor(1.0)})
    with pytest.raises(QuantizeError, match=message) as err:
        load_quantized(path)
    assert "\n" not in str(err.value)
