"""The command line: its option set is a snapshot (changing it is a decision, not an accident),
`--help` is fast, and bad input is one line with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from mismatch.cli.main import app

SNAPSHOT = {
    "formats": [],
    "profiles": [],
    "plan": ["--billing", "--cache", "--cold-start", "--episode-tokens", "--force", "--json",
             "--kl", "--model", "--n-prompts", "--no-probe", "--out", "--seed", "--sim-batch",
             "--sim-hours", "--simulate"],
    "monitor": ["--alert-log", "--baseline", "--fail-on", "--follow", "--format", "--json",
                "--kl-floor", "--map", "--masked-loss", "--max-idle", "--poll-interval",
                "--prometheus-port", "--webhook"],
    "probe": ["--batch-size", "--ci-target", "--dtype", "--emulate", "--fleet-shares", "--force",
              "--fp32-reference", "--gpu", "--json",
              "--kv-cache", "--ladder", "--lm-head", "--lm-head-side", "--max-new-tokens", "--max-prompts", "--model", "--n-prompts", "--out",
              "--prompts", "--seed", "--sources", "--staleness-checkpoints", "--staleness-lr",
              "--staleness-max-lag", "--subset-prompts", "--threads", "--top-p",
              "--trainer-dtype", "--trainer-gpu", "--trainer-kernels"],
    "qualify": ["--batch-size", "--concurrency", "--dtype", "--engine", "--force", "--gpu", "--json",
                "--kv-cache", "--launch", "--max-new-tokens", "--model", "--n-prompts", "--out", "--policy",
                "--sampler", "--seed", "--subset-prompts", "--timeout"],
    "quantize": ["--calib-samples", "--calib-seq-len", "--force", "--format", "--kv-cache",
                 "--model", "--out", "--seed"],
    "report": ["--out"],
    "study": ["--adopt", "--arms", "--eval-full-vocab", "--eval-tasks", "--export", "--fleets", "--jobs",
              "--lr", "--n-prompts", "--notes", "--out", "--policy-steps", "--preset", "--prompts", "--quiet", "--report", "--report-only",
              "--samples", "--seeds", "--staleness", "--steps", "--sync-arms", "--tasks"],
    "train": ["--address", "--backend", "--checkpoint-every", "--correction", "--eval-every",
              "--eval-tasks", "--fleet", "--keep-checkpoints", "--lm-head", "--lr", "--max-staleness",
              "--model",
              "--n-prompts", "--out",
              "--placement", "--preset",
              "--prompts", "--quiet", "--replicas", "--resume", "--sampler-processes", "--samples",
              "--seed", "--staleness", "--steps", "--stop-on", "--sync", "--tasks", "--threads",
              "--trainer-dtype", "--trainer-ranks", "--weights-dir", "--workers"],
    "zoo build": ["--out", "--seed", "--steps"],
    "zoo info": ["--model"],
    "zoo path": [],
}
"""Every command and subcommand with its long options."""


def _commands(command, prefix: str = "") -> dict[str, list[str]]:
    """{"zoo build": [long options], ...} for every leaf command under `command`."""
    subs = getattr(command, "commands", None)
    if subs:
        return {name: opts for sub_name, sub in subs.items()
                for name, opts in _commands(sub, f"{prefix} {sub_name}".strip()).items()}
    return {prefix: sorted(opt for p in command.params for opt in p.opts if opt.startswith("--"))}


def test_option_snapshot():
    """The whole command tree, every command and every option: adding or dropping one fails
    here until the snapshot is changed with it."""
    assert _commands(typer.main.get_command(app)) == SNAPSHOT


def test_help_imports_nothing_heavy():
    """`--help` stays instant because the CLI module imports neither torch nor transformers
    (checked by import, not by a timer)."""
    res = subprocess.run([sys.executable, "-m", "mismatch.cli", "--help"], capture_output=True,
                         text=True)
    assert res.returncode == 0 and "probe" in res.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, mismatch.cli; "
                            "print('torch' in sys.modules, 'transformers' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "False False"


def test_formats_and_profiles_print_tables():
    runner = CliRunner()
    res = runner.invoke(app, ["formats"])
    assert res.exit_code == 0 and "nvfp4-act" in res.stdout and "mxfp4-rceil" in res.stdout
    res = runner.invoke(app, ["profiles"])
    assert res.exit_code == 0
    assert "a100          nvfp4" in res.stdout and "cannot run" in res.stdout
    assert "Marlin W8A16" in res.stdout


def test_library_errors_outside_commands_are_one_line_exit_2():
    res = subprocess.run([sys.executable, "-m", "mismatch.cli", "zoo", "info", "--model",
                          "/no/such/dir"], capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mismatch: error:") and "Traceback" not in \
        res.stderr


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mismatch.cli", *args], capture_output=True,
                          text=True)


def test_usage_errors_are_one_line_exit_2_naming_the_help():
    """A value that does not parse, an unknown option or command, a missing argument: one line
    on stderr, exit 2, and the `--help` to read; never typer's boxed panel."""
    cases = {("monitor", "m.jsonl", "--kl-floor", "abc"): ("'--kl-floor'", "monitor --help"),
             ("probe", "--gpu", "a100", "--dtype", "bf16", "--bogus"): ("--bogus", "probe --help"),
             ("nosuch",): ("nosuch", "cli --help"),
             ("zoo", "nosuch"): ("nosuch", "zoo --help"),
             ("monitor",): ("file", "monitor --help")}
    for args, (named, helped) in cases.items():
        res = _main(*args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, (args, res.stderr)
        assert lines[0].startswith("mismatch: error:") and named in lines[0], lines[0]
        assert lines[0].endswith(f"{helped}`)") and "╭" not in res.stderr, lines[0]
        assert res.stdout == "", args


def test_bare_groups_print_their_help_and_exit_2_and_command_codes_pass_through(tmp_path):
    """`mismatch` and `mismatch zoo` alone print their help once (exit 2, as click does); a
    command's own exit code (monitor: 1 on a critical alert, 0 when quiet) comes through."""
    for args in ((), ("zoo",)):
        res = _main(*args)
        assert res.returncode == 2 and res.stdout.count("Usage:") == 1, (args, res.stdout)
        assert res.stderr == ""
    from mismatch.probes.monitor import traces

    for kind, code in (("collapse", 1), ("stable", 0)):
        path = tmp_path / f"{kind}.jsonl"
        records = traces.synthetic_trace(kind, 0).records
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        res = _main("monitor", str(path), "--json")
        assert res.returncode == code, (kind, res.stderr[-500:])


def test_every_command_takes_h_and_draws_flags_without_a_value():
    """`-h` is `--help` everywhere; a flag (`--json`) is drawn with no `<bool>` value it would
    refuse; `--prompts` of train and study (a count) is hidden behind --n-prompts, as in probe,
    where --prompts is a file."""
    runner = CliRunner()
    tree = _commands(typer.main.get_command(app))
    for name in tree:
        res = runner.invoke(app, [*name.split(), "-h"], env={"COLUMNS": "250"})
        assert res.exit_code == 0, (name, res.output)
        assert "Usage:" in res.output and "<bool>" not in res.output, name
    probe = runner.invoke(app, ["probe", "-h"], env={"COLUMNS": "250"}).output
    assert "--json " in probe and "--n-prompts" in probe
    for name in ("train", "study"):
        shown = runner.invoke(app, [name, "-h"], env={"COLUMNS": "250"}).output
        assert "--n-prompts" in shown and "--prompts " not in shown, name
        assert "grpo+topp (or topp)" in shown, name


def test_train_and_study_take_the_same_arm_names_and_the_former_prompts():
    from mismatch.cli.common import ARM_ALIASES, STUDY_ARM_ALIASES, one_of
    from mismatch.train.config import preset_config
    from mismatch.train.loss import ARMS as LOSS_ARMS
    from mismatch.study.cells import STUDY_ARMS

    for study_name, loss_name in STUDY_ARMS.items():  # every study arm is a --correction name
        assert ARM_ALIASES.get(study_name, study_name) == loss_name
        assert preset_config("smoke", correction=ARM_ALIASES.get(study_name, study_name)
                             ).correction == loss_name
    for loss_name in STUDY_ARMS.values():  # and every such loss name is a study --arms name
        assert STUDY_ARM_ALIASES.get(loss_name, loss_name) in STUDY_ARMS
    assert set(STUDY_ARMS.values()) <= set(LOSS_ARMS)
    assert one_of(None, 6) == 6 and one_of(6, None) == 6 and one_of(None, None) is None
    res = subprocess.run([sys.executable, "-m", "mismatch.cli", "train", "--out", "/nonexistent/x",
                          "--n-prompts", "2", "--prompts", "2"], capture_output=True, text=True)
    assert res.returncode == 2 and "--prompts is the former name of --n-prompts" in res.stderr


def test_progress_off_a_terminal_is_plain_lines_at_most_every_30_s():
    from mismatch.cli.common import LineProgress

    now, lines = [0.0], []
    progress = LineProgress(every=30.0, clock=lambda: now[0], write=lines.append)
    for done in range(11):  # 10 items, 10 s apart
        progress("sampling", done, 10)
        now[0] += 10.0
    progress("sampling", 10, 10)  # finished: nothing more
    progress("scoring", 1, 1, "detail")
    assert lines == ["mismatch: sampling: 0/10", "mismatch: sampling: 3/10 (30 s)",
                     "mismatch: sampling: 6/10 (60 s)", "mismatch: sampling: 9/10 (90 s)",
                     "mismatch: sampling: 10/10 done (100 s)", "mismatch: scoring: 1/1 done detail"]


@pytest.mark.parametrize("args", [
    ["probe", "--gpu", "b200", "--dtype", "nvfp4", "--n-prompts", "2", "--max-new-tokens", "4"],
    ["train", "--preset", "smoke", "--steps", "1"],
])
def test_stderr_off_a_terminal_has_progress_lines_and_no_library_chatter(args, tmp_path):
    """A CI log (stderr a pipe) gets progress lines, no blank first line (rich's bar drew one),
    and none of torchao's "Failed to load ... _C_mxfp8" or torch's _pytree notices, from this
    process or the sampler processes it spawns."""
    proc = subprocess.run([sys.executable, "-m", "mismatch.cli", *args, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and lines[0].strip(), proc.stderr
    assert any(line.startswith("mismatch: ") and " done" in line for line in lines), proc.stderr
    for chatter in ("Failed to load", "_pytree", "Warning", "warn("):
        assert chatter not in proc.stderr, proc.stderr
