"""`mismatch probe` end to end on a tiny random Qwen3-MoE with a tokenizer, and its bad input."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from conftest import build_tiny_model
from mismatch.cli.main import app

runner = CliRunner()
KEYS = ("kl_k3", "kl_k1", "abs_logprob_diff_mean", "abs_logprob_diff_max", "mis_masked_fraction",
        "kl_exact")


def _probe(*args: str):
    # --emulate: these runs emulate the named GPU on any machine (on a CUDA machine whose GPU is
    # another one, --gpu without it is an error; tests/test_measured_mode.py covers that)
    return runner.invoke(app, ["probe", *args, "--emulate"])


def test_probe_json_schema_and_outputs(moe_dir, prompt_file, tmp_path):
    out = tmp_path / "run"
    res = _probe("--gpu", "b200", "--dtype", "nvfp4", "--model", str(moe_dir), "--prompts",
                 str(prompt_file), "--max-new-tokens", "12", "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout.strip().splitlines()[-1])
    assert (s["gpu"], s["dtype"], s["mode"], s["model"]) == ("b200", "nvfp4", "emulated",
                                                             str(moe_dir))
    assert s["tokens"] > 0
    for block in (s["total"], s["sources"]["precision"], s["sources"]["accelerator"]):
        for k in KEYS:
            assert math.isfinite(block[k]), k
        lo, hi = block["kl_exact_ci95"]
        assert 0 <= lo <= block["kl_exact"] <= hi
    assert s["total"]["kl_k3"] > 0 and s["sources"]["precision"]["kl_k3"] > 0
    written = json.loads((out / "results.json").read_text())
    from mismatch.probes.summary import ProbeSummary

    record = ProbeSummary.from_json(written)  # the file reads back as its record
    assert record.to_json() == s and record.total.kl_k3 == s["total"]["kl_k3"]
    assert written.pop("command").startswith("mismatch") and written == s
    for name in ("log_ratio_hist.png", "per_position.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    assert "EMULATED" in report and f"{s['tokens']}" in report
    assert not list(tmp_path.glob(".run.tmp-*"))


def test_probe_table_for_bf16(moe_dir, prompt_file, tmp_path):
    res = _probe("--gpu", "a100", "--dtype", "bf16", "--model", str(moe_dir), "--prompts",
                 str(prompt_file), "--max-new-tokens", "8", "--out", str(tmp_path / "r"))
    assert res.exit_code == 0, res.output
    assert "EMULATED" in res.stdout and "KL k3" in res.stdout
    rows = res.stdout.splitlines()
    head = next(i for i, line in enumerate(rows) if line.split() == ["total", "precision",
                                                                      "accelerator"])
    assert rows[head + 1].startswith("KL exact ") and rows[head + 2].startswith("KL exact 95% CI")
    s = json.loads((tmp_path / "r" / "results.json").read_text())
    assert s["total"]["kl_k3"] > 0  # kernels alone: decode path, FA2 tiling, BF16 P
    assert s["sources"]["precision"]["kl_k3"] == 0  # BF16 weights are the trainer's own
    assert s["sources"]["precision"]["kl_exact"] == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "| **KL exact** |" in report and "not additive" in report


def _check_one_line_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mismatch: error:"), res.stderr
    assert "Traceback" not in res.output
    for n in needles:
        assert n in err[0], err[0]


def test_bad_gpu_dtype_and_pair():
    _check_one_line_error(_probe("--gpu", "v100", "--dtype", "bf16"), "unknown gpu 'v100'", "a100")
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "int3"), "unknown dtype", "nvfp4")
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "nvfp4"), "a100 cannot run nvfp4",
                    "can run: bf16")


def test_missing_model_and_missing_tokenizer(tmp_path, prompt_file):
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "bf16", "--model", str(tmp_path / "nope")),
                    "does not exist")
    no_tok = build_tiny_model(tmp_path / "notok", kind="moe", tokenizer=False)
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "bf16", "--model", str(no_tok),
                           "--prompts", str(prompt_file)), "tokenizer")


def test_empty_prompt_file_and_too_long_prompts(moe_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "bf16", "--model", str(moe_dir),
                           "--prompts", str(empty)), "holds no prompts")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 400}) + "\n")
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "bf16", "--model", str(moe_dir),
                           "--prompts", str(long)), "exceeds the model's context")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    _check_one_line_error(_probe("--gpu", "a100", "--dtype", "bf16", "--model", str(moe_dir),
                           "--prompts", str(bad)), "not JSON")


@pytest.mark.gpu
def test_measured_mode_on_the_named_gpu(tmp_path):
    """On a machine whose CUDA device is one of the profiles, a BF16 probe of that GPU runs the
    real kernels and says `measured`; any other GPU name is emulated when asked (--emulate)."""
    import torch

    from mismatch.app.probe import ProbeConfig, run_probe
    from mismatch.profiles import GPUS

    name = torch.cuda.get_device_name(0)
    here = [g for g, p in GPUS.items() if any(n in name for n in p.cuda_names)]
    if not here:
        pytest.skip(f"{name} is not one of the profiled GPUs")
    s = run_probe(ProbeConfig(gpu=here[0], dtype="bf16", n_prompts=8, max_new_tokens=8)).summary
    assert s["mode"] == "measured" and s["tokens"] > 0
    other = next(g for g in GPUS if g not in here)
    assert run_probe(ProbeConfig(gpu=other, dtype="bf16", n_prompts=4, max_new_tokens=4,
                                 emulate=True)).summary["mode"] == "emulated"


def test_probe_summary_json_keeps_each_runs_keys_in_order():
    """results.json's key order is a contract: the quick probe's and the sources runner's
    summaries come from one record and keep their own keys, optional ones only where set."""
    from mismatch.probes.base import SourceResult
    from mismatch.probes.kl_summary import KLSummary
    from mismatch.probes.summary import CITarget, ProbeSummary

    head = dict(gpu="b200", dtype="nvfp4", kv_cache="bf16", trainer_dtype="bf16",
                mode="emulated", model="embedded", kernel_path="k", attention="a", prompts=4,
                tokens=96, total=KLSummary(kl_k3=1e-3),
                sources={"precision": KLSummary(kl_k3=2e-3)})
    quick = ProbeSummary(**head, trainer_kernels="torch").to_json()
    assert list(quick) == ["gpu", "dtype", "kv_cache", "trainer_dtype", "trainer_kernels", "mode",
                           "model", "kernel_path", "attention", "prompts", "tokens", "total",
                           "sources"]
    runner = ProbeSummary(**head, trainer_gpu="b200",
                          ci_target=CITarget(target=0.0, met=None, unmet=[]),
                          ladder=SourceResult(name="ladder", headline=None,
                                              extra={"steps": []})).to_json()
    assert list(runner) == ["gpu", "dtype", "kv_cache", "trainer_dtype", "trainer_gpu", "mode",
                            "model", "kernel_path", "attention", "prompts", "tokens", "total",
                            "ci_target", "sources", "ladder"]
    assert runner["tokens"] == 96 and runner["sources"]["precision"]["kl_k3"] == 2e-3
    assert "ladder" not in ProbeSummary(**head).to_json()
    for body in (quick, runner):
        assert list(ProbeSummary.from_json(body).to_json()) == list(body)
    with pytest.raises(ValueError, match=r"unknown keys \['totals'\]"):
        ProbeSummary.from_json({**quick, "totals": {}})
