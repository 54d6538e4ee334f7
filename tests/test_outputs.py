"""A user's files are never lost and a run is never wasted: an --out that holds anything but an
earlier output of the same command is refused (or replaced with --force), an --out that cannot be
written fails in one line before any work, and Ctrl-C says where a run stopped and how to go on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mismatch.io import OUTPUT_MARKER, check_output_dir, check_writable_dir

CLI = [sys.executable, "-m", "mismatch.cli"]
QUICK_PROBE = ["probe", "--gpu", "a100", "--dtype", "bf16", "--n-prompts", "4",
               "--max-new-tokens", "8", "--json"]


def _cli(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=600, cwd=cwd)


def _one_line_error(proc: subprocess.CompletedProcess, match: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("mismatch: error:") and match in lines[0], \
        proc.stderr


# -- the checks themselves ----------------------------------------------------------------------

def test_an_output_dir_is_replaced_only_when_nothing_is_lost(tmp_path):
    assert check_output_dir(tmp_path / "new", "probe") == tmp_path / "new"  # does not exist
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", "probe")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    with pytest.raises(ValueError, match=r"holds files that are not an earlier `mismatch probe` "
                                         r"output \(notes.txt\).*--force"):
        check_output_dir(mine, "probe")
    check_output_dir(mine, "probe", force=True)
    # an earlier output: its marker names the command (and only that command)
    done = tmp_path / "done"
    done.mkdir()
    (done / OUTPUT_MARKER).write_text("probe\n")
    (done / "results.json").write_text("{}")
    check_output_dir(done, "probe")
    with pytest.raises(ValueError, match="not an earlier `mismatch qualify` output"):
        check_output_dir(done, "qualify")
    # written before the marker: results.json records the command, nothing else is there
    old = tmp_path / "old"
    old.mkdir()
    (old / "results.json").write_text(json.dumps({"command": "mismatch probe --gpu a100"}))
    (old / "report.md").write_text("#")
    (old / "plot.png").write_bytes(b"")
    check_output_dir(old, "probe")
    (old / "notes.txt").write_text("added by hand")
    with pytest.raises(ValueError, match="notes.txt"):
        check_output_dir(old, "probe")


def test_an_output_that_cannot_be_written_fails_before_any_work(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_writable_dir(a_file / "x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_writable_dir(a_file / "x" / "y")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_writable_dir(a_file)
    monkeypatch.chdir(tmp_path)
    for here in (".", str(tmp_path), ".."):
        with pytest.raises(ValueError, match="working directory"):
            check_writable_dir(Path(here))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot write"):
            check_writable_dir(locked / "out")
    assert check_writable_dir(tmp_path / "a" / "b" / "out") == tmp_path / "a" / "b" / "out"
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "out").exists()
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == []  # no probe left


# -- through the command line -------------------------------------------------------------------

def test_probe_keeps_a_users_files_and_replaces_its_own_output(tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    (out / "earlier-probe-notes.txt").write_text("keep me")
    _one_line_error(_cli(QUICK_PROBE + ["--out", str(out)]), "--force")
    assert (out / "earlier-probe-notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["earlier-probe-notes.txt"]
    fresh = tmp_path / "fresh"
    assert _cli(QUICK_PROBE + ["--out", str(fresh)]).returncode == 0
    assert (fresh / OUTPUT_MARKER).read_text().strip() == "probe"
    first = json.loads((fresh / "results.json").read_text())
    assert _cli(QUICK_PROBE + ["--out", str(fresh), "--seed", "1"]).returncode == 0  # its own
    assert json.loads((fresh / "results.json").read_text())["command"] != first["command"]
    forced = _cli(QUICK_PROBE + ["--out", str(out), "--force"])
    assert forced.returncode == 0, forced.stderr
    assert not (out / "earlier-probe-notes.txt").exists() and (out / "results.json").exists()


@pytest.mark.parametrize("args", [
    QUICK_PROBE,
    ["qualify", "--gpu", "a100", "--dtype", "bf16", "--n-prompts", "4"],
    ["quantize", "--format", "fp8"],
    ["train", "--preset", "smoke"],
    ["zoo", "build", "--steps", "1"],
], ids=["probe", "qualify", "quantize", "train", "zoo-build"])
def test_an_out_under_a_file_or_on_the_working_dir_is_one_line_before_any_work(tmp_path, args):
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0")
    started = time.monotonic()
    _one_line_error(_cli(args + ["--out", str(a_file / "x")]), "is a file, not a directory")
    _one_line_error(_cli(args + ["--out", "."], cwd=tmp_path), "working directory")
    # seconds, not the minutes the work takes: nothing was probed, calibrated or trained
    print(f"{args[0]}: both refused in {time.monotonic() - started:.1f} s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"]


def _ctrl_c_delivered() -> None:
    """In the child: SIGINT's default action. A test suite started in the background by a
    non-interactive shell (`./.ci/run &`) inherits SIGINT ignored, as POSIX shells set it for
    background jobs, and Python keeps an ignored SIGINT ignored: the run would never see the
    Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_says_where_the_run_stopped_and_a_rerun_starts_it_over(tmp_path):
    import shutil

    out = tmp_path / "run"
    base = ["train", "--preset", "smoke", "--out", str(out), "--quiet", "--sampler-processes",
            "0", "--n-prompts", "2", "--samples", "4"]
    args = base + ["--steps", "20", "--checkpoint-every", "10"]
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_ctrl_c_delivered)
    deadline = time.monotonic() + 300
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.exists() and metrics.stat().st_size):
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # after the first step, long before the first checkpoint
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "interrupted after step" in err and "before the first checkpoint" in err, err
    assert f"--out {out}" in err and "starts" in err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    # both a rerun and --resume accept the directory, and start it over
    for again in (["--steps", "1"], ["--steps", "1", "--resume"]):
        done = _cli(base + again)
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in rows] == [1]
        shutil.rmtree(out / "checkpoints")
        shutil.rmtree(out / "final")
    # with a checkpoint, the message names it and the command that continues the run
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_ctrl_c_delivered)
    ckpts = out / "checkpoints"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not (
            ckpts.exists() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "the last checkpoint is step-000010" in err and err.strip().endswith("--resume"), err
