"""`mismatch qualify` on emulated samplers: policies, verdicts, exit codes, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch.cli.main import app
from mismatch.app.qualify import (DEFAULT_POLICY, Policy, PolicyError, dominant_source, evaluate,
                              load_policy, needed_sources, verdict)

runner = CliRunner()
SMALL = ["--n-prompts", "8", "--subset-prompts", "8", "--max-new-tokens", "8",
         "--batch-size", "8"]


def _policy(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return p


def test_default_policy_loads_and_cites_its_sources():
    policy = load_policy()
    assert policy.path == DEFAULT_POLICY
    assert {"kl_k3", "mis_masked_fraction", "abs_logprob_diff_p99", "routing.flip_rate_any_layer",
            "retokenization.changed_sequence_fraction",
            "sampling.sampler_mass_outside"} <= set(policy.budgets)
    text = DEFAULT_POLICY.read_text()
    # every default says where it comes from: the primary sources are named, and each budget
    # line has its comment just above it
    for source in ("He et al.", "arXiv:2510.11370", "IcePop"):
        assert source in text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#") and i > lines.index("[budgets]"):
            assert lines[i - 1].startswith("#"), line
    assert needed_sources(policy) == ("kernels", "precision", "accelerator", "routing",
                                      "retokenization", "sampling")


@pytest.mark.parametrize("text, needle", [
    ("[budgets]\nkl_k3 = \n", "not valid TOML"),
    ("[budgets]\nvibes = 1\n", "unknown figure 'vibes'"),
    ("[budgets]\nkl_k3 = -1\n", "finite number >= 0"),
    ("[budgets]\nkl_k3 = \"low\"\n", "finite number >= 0"),
    ("[sources.moonphase]\nkl_k3 = 1\n", "unknown source"),
    ("[limits]\nkl_k3 = 1\n", "unknown table [limits]"),
    ("# nothing\n", "sets no limits"),
])
def test_bad_policies_are_one_line_errors(tmp_path, text, needle):
    with pytest.raises(PolicyError) as err:
        load_policy(_policy(tmp_path, text))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_evaluate_checks_limits_sources_and_unmeasured_figures():
    policy = Policy(path=Path("p.toml"), budgets={"kl_k3": 1e-3, "routing.flip_rate_mean": 0.1,
                                                  "sampling.sampler_mass_outside": 0.03},
                    sources={"precision": {"kl_k3": 1e-4}})
    summary = {"total": {"kl_k3": 2e-3},
               "sources": {"kernels": {"kl_exact": 1e-5}, "precision": {"kl_exact": 5e-4,
                                                                        "kl_k3": 4e-4},
                           "routing": {"applies": False}}}
    checks = {c.metric: c for c in evaluate(policy, summary)}
    assert checks["kl_k3"].passed is False and checks["kl_k3"].source == "precision"
    assert checks["routing.flip_rate_mean"].passed is None
    assert "dense" in checks["routing.flip_rate_mean"].note
    assert checks["sampling.sampler_mass_outside"].passed is None
    assert checks["precision: kl_k3"].passed is False
    assert verdict(list(checks.values())) == "fail"
    assert dominant_source(summary) == "precision"
    loose = Policy(path=Path("p.toml"), budgets={"kl_k3": 1.0})
    assert verdict(evaluate(loose, summary)) == "pass"


def _qualify(*args: str):
    return runner.invoke(app, ["qualify", *args])


def test_strict_policy_fails_nvfp4_and_loose_passes(tmp_path):
    strict = _policy(tmp_path, "[budgets]\nkl_k3 = 1e-5\nmis_masked_fraction = 0.5\n")
    out = tmp_path / "strict"
    res = _qualify("--gpu", "b200", "--dtype", "nvfp4", "--policy", str(strict), "--out",
                   str(out), "--json", *SMALL)
    assert res.exit_code == 1, res.output
    v = json.loads(res.stdout.strip().splitlines()[-1])
    assert v["verdict"] == "fail" and v["mode"] == "emulated"
    assert v["dominant_source"] in ("kernels", "precision", "accelerator", "routing")
    kl = next(c for c in v["checks"] if c["metric"] == "kl_k3")
    assert kl["passed"] is False and kl["value"] > kl["budget"] == 1e-5
    assert json.loads((out / "verdict.json").read_text()) == v  # the verdict as printed
    evidence = json.loads((out / "results.json").read_text())
    assert evidence["gpu"] == "b200" and evidence["dtype"] == "nvfp4"
    assert evidence["total"]["kl_k3"] == kl["value"]
    assert "FAIL" in (out / "report.md").read_text()
    loose = _policy(tmp_path, "[budgets]\nkl_k3 = 10\n[sources.precision]\nkl_k3 = 10\n")
    res = _qualify("--gpu", "b200", "--dtype", "nvfp4", "--policy", str(loose), "--out",
                   str(tmp_path / "loose"), *SMALL)
    assert res.exit_code == 0, res.output
    assert "PASS" in res.stdout and "precision: kl_k3" in res.stdout


def _check_one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mismatch: error:") and needle in err[0], err


def test_bad_input_exits_2_and_leaves_nothing(tmp_path):
    out = tmp_path / "q"
    _check_one_line_error(_qualify("--gpu", "a100", "--dtype", "nvfp4", "--out", str(out)),
                          "a100 cannot run nvfp4")
    _check_one_line_error(_qualify("--dtype", "fp8", "--out", str(out)), "--gpu and --dtype")
    _check_one_line_error(_qualify("--gpu", "h100", "--dtype", "fp8", "--policy",
                                   str(tmp_path / "none.toml"), "--out", str(out)),
                          "does not exist")
    assert not out.exists() and not list(tmp_path.glob(".q.tmp-*"))


def test_an_output_folder_that_cannot_be_written_is_a_one_line_error(tmp_path, monkeypatch):
    """The verdict is reached but its folder cannot be written (a full disk): one line, exit 2,
    and the folder as it was (written together or not at all)."""
    import errno

    import mismatch.app.qualify as app_qualify
    import mismatch.cli.qualify as cli_qualify
    from mismatch.app.qualify import verdict_result

    body = json.loads((Path(__file__).parent / "data" / "probe-results" /
                       "sources-results.json").read_text())
    body.pop("command")
    v = verdict_result(load_policy(), body, mode="emulated", sampler="b200-nvfp4")
    out = tmp_path / "q"
    monkeypatch.setattr(cli_qualify, "_emulated", lambda *a, **k: (out, v))

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app_qualify, "write_outputs", full)
    _check_one_line_error(_qualify("--gpu", "b200", "--dtype", "nvfp4", "--out", str(out)),
                          "No space left on device")
    assert not out.exists()


def test_a_launched_servers_log_is_kept_in_the_output_folder(tmp_path):
    """`qualify --launch`: the server's log goes into the output folder as server.log, written
    with the verdict (or not at all), and the verdict names that copy; a verdict of a server
    nobody launched writes no log."""
    from dataclasses import replace

    from mismatch.app.qualify import (SERVER_LOG, Launched, kept_launch, verdict_result,
                                      write_outputs)

    body = json.loads((Path(__file__).parent / "data" / "probe-results" /
                       "sources-results.json").read_text())
    body.pop("command")
    v = verdict_result(load_policy(), body, mode="measured", sampler="vllm")
    log = tmp_path / "mismatch-qualify-vllm-123.log"
    log.write_text("INFO vllm serve --port 8123\nready\n")
    launched = replace(v, launched=Launched(engine="vllm", model="embedded", log=str(log)))
    out = tmp_path / "q"
    kept, source = kept_launch(launched, out)
    assert source == log and kept.launched.log == str(out.resolve() / SERVER_LOG)
    write_outputs(out, kept, "mismatch qualify --launch vllm", source)
    assert (out / SERVER_LOG).read_text() == log.read_text()
    written = json.loads((out / "verdict.json").read_text())
    assert written["launched"]["log"] == str(out.resolve() / SERVER_LOG)
    assert kept_launch(v, out) == (v, None)
    write_outputs(tmp_path / "e", v, "mismatch qualify --gpu b200 --dtype nvfp4")
    assert not (tmp_path / "e" / SERVER_LOG).exists()
    gone = replace(v, launched=Launched(engine="vllm", model="embedded",
                                        log=str(tmp_path / "removed.log")))
    assert kept_launch(gone, tmp_path / "g") == (gone, None)  # no log to keep: no copy, no crash


def test_verdict_record_is_the_json_written_and_printed():
    from dataclasses import replace

    from mismatch.app.qualify import (Launched, Throughput, Verdict, markdown, verdict_result)

    body = json.loads((Path(__file__).parent / "data" / "probe-results" /
                       "sources-results.json").read_text())
    body.pop("command")
    policy = load_policy()
    v = verdict_result(policy, body, mode="emulated", sampler="b200 nvfp4")
    assert isinstance(v, Verdict) and v.summary is body
    out = v.to_json()
    assert list(out) == ["verdict", "mode", "sampler", "policy", "dominant_source", "checks",
                         "throughput"]
    assert out["verdict"] == v.verdict and v.passed == (v.verdict == "pass")
    assert out["checks"] == [c.to_json() for c in evaluate(policy, body)]
    assert out["throughput"] is None and out["dominant_source"] == dominant_source(body)
    t = {"requests": 6, "retries": 0, "completion_tokens": 30, "seconds": 1.5,
         "tokens_per_s": 20.0}
    live = replace(v, mode="measured", throughput=Throughput.from_json(t),
                   launched=Launched(engine="vllm", model="embedded", log="/tmp/x.log"))
    out = live.to_json()
    assert out["throughput"] == t and list(out["throughput"]) == list(t)
    assert list(out)[-1] == "launched" and out["launched"]["engine"] == "vllm"
    text = markdown(live, "mismatch qualify")
    assert "server throughput: 20.0 completion tokens/s over 6 requests (0 retries)" in text
    assert f"| {v.checks[0].metric} |" in text
