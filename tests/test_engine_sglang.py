"""`mismatch qualify --engine sglang` against a real SGLang server. SGLang runs only on CUDA GPUs:
on a machine without one this file is skipped (marker `gpu`); without SGLang installed it skips
with the reason. The client's parsing of SGLang's response format is tested without a GPU in
tests/test_remote.py, against a local server speaking that format."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mismatch.cli import app
from mismatch.remote.launch import sglang_available, sglang_server

pytestmark = [pytest.mark.gpu, pytest.mark.engine]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not sglang_available():
        pytest.skip("SGLang is not installed in this Python (pip install 'sglang[all]')")
    with sglang_server(log_path=tmp_path_factory.mktemp("sglang") / "server.log") as url:
        yield url


def test_qualify_against_a_real_sglang_server(server, tmp_path):
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["qualify", "--sampler", server, "--engine", "sglang",
                                   "--n-prompts", "32", "--out", str(out), "--json"])
    assert res.exit_code in (0, 1), res.output
    v = json.loads(res.stdout.strip().splitlines()[-1])
    assert v["mode"] == "measured" and "sglang" in v["sampler"]
    kl = next(c for c in v["checks"] if c["metric"] == "kl_k3")
    assert kl["value"] is not None and kl["value"] >= 0
    assert v["throughput"]["tokens_per_s"] > 0
    assert json.loads((out / "results.json").read_text())["canary"]
