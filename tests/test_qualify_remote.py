"""`mismatch qualify --sampler URL` against a stand-in server process (tests/fault_server.py:
vLLM's and SGLang's response formats, and every fault, including those no real engine can be made
to produce on demand). The trainer side is the embedded model. The command against real vLLM and
SGLang servers: tests/test_engine_vllm.py, tests/test_engine_sglang.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mismatch.cli.main import app

runner = CliRunner()
SMALL = ["--n-prompts", "6", "--max-new-tokens", "6", "--timeout", "2"]


def _qualify(*args: str):
    return runner.invoke(app, ["qualify", *args])


def _loose(tmp_path):
    p = tmp_path / "loose.toml"
    p.write_text("[budgets]\nkl_k3 = 1e9\nmis_masked_fraction = 1\n"
                 "\"retokenization.changed_sequence_fraction\" = 1\n"
                 "\"routing.flip_rate_any_layer\" = 1\n")
    return p


@pytest.mark.parametrize("engine, mode", [("vllm", "vllm-ok"), ("sglang", "sglang-ok")])
def test_live_server_verdicts(serve, tmp_path, engine, mode):
    url = serve(mode)
    out = tmp_path / "q"
    res = _qualify("--sampler", url, "--engine", engine, "--policy", str(_loose(tmp_path)),
                   "--out", str(out), "--json", *SMALL)
    assert res.exit_code == 0, res.output
    v = json.loads(res.stdout.strip().splitlines()[-1])
    assert v["verdict"] == "pass" and v["mode"] == "measured" and engine in v["sampler"]
    checks = {c["metric"]: c for c in v["checks"]}
    assert checks["kl_k3"]["value"] > 0  # the fake server's log-probs are not the model's
    assert checks["routing.flip_rate_any_layer"]["passed"] is None  # not measurable remotely
    assert v["throughput"]["requests"] >= 6 and v["throughput"]["tokens_per_s"] > 0
    summary = json.loads((out / "results.json").read_text())
    assert summary["canary"] and summary["tokens"] > 0
    # the same server against a strict budget fails with exit 1
    strict = tmp_path / "strict.toml"
    strict.write_text("[budgets]\nkl_k3 = 1e-9\n")
    res = _qualify("--sampler", url, "--engine", engine, "--policy", str(strict),
                   "--out", str(tmp_path / "s"), *SMALL)
    assert res.exit_code == 1 and "FAIL" in res.stdout, res.output


@pytest.mark.parametrize("mode, needle", [
    ("hang", "did not answer"),
    ("http500", "500"),
    ("malformed", "JSON"),
    ("no-logprobs", "log-prob"),
    ("short-logprobs", "log-prob"),
    ("bad-tokenizer", "tokenizer disagrees"),
])
def test_faults_are_one_line_exit_2_and_leave_nothing(serve, tmp_path, mode, needle):
    url = serve(mode)
    out = tmp_path / "q"
    res = _qualify("--sampler", url, "--engine", "vllm", "--out", str(out), *SMALL)
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mismatch: error:"), res.stderr
    assert needle.lower() in err[0].lower(), err[0]
    assert not out.exists() and not list(tmp_path.glob(".q.tmp-*"))


def test_connection_refused_and_bad_engine(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    out = tmp_path / "q"
    res = _qualify("--sampler", f"http://127.0.0.1:{port}", "--engine", "vllm", "--out",
                   str(out), *SMALL)
    assert res.exit_code == 2 and "refused" in res.stderr, res.output
    res = _qualify("--sampler", f"http://127.0.0.1:{port}", "--engine", "tgi", "--out", str(out))
    assert res.exit_code == 2 and "--engine must be one of vllm, sglang" in res.stderr
    assert not out.exists()


def test_launch_is_refused_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    """`--launch` with a sampler URL, an unknown engine, an --engine that disagrees, SGLang
    without a dense --model, or an engine that is not installed: one line, exit 2, no output.
    (Launching a real vLLM server: tests/test_engine_vllm.py.)"""
    out = tmp_path / "q"
    monkeypatch.setenv("MISMATCH_VLLM_VENV", str(tmp_path / "no-venv"))
    cases = [(["--launch", "vllm", "--sampler", "http://127.0.0.1:9"], "not both"),
             (["--launch", "tgi"], "--launch must be vllm or sglang"),
             (["--launch", "vllm", "--engine", "sglang"], "disagree"),
             (["--launch", "sglang"], "dense checkpoint"),
             (["--launch", "vllm"], "setup_vllm_cpu.sh")]
    for args, needle in cases:
        res = _qualify(*args, "--out", str(out), *SMALL)
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not out.exists()
