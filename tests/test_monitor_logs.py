"""`mismatch monitor` on what runs really leave on disk: TensorBoard event files written by
torch.utils.tensorboard.SummaryWriter and W&B offline runs written by wandb itself (never by
hand), a `mismatch train` run folder, an empty log, too few steps to judge.

Every check runs the real command line in a subprocess (`python -m mismatch.cli monitor`). The
logs use the keys verl and slime log (probes/monitor/formats/frameworks.py cites where), filled
with the monitor's synthetic collapse and stable traces (mismatch.probes.monitor.traces).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mismatch.probes.monitor import traces

tensorboard = pytest.importorskip("torch.utils.tensorboard", reason="needs tensorboard: "
                                  "pip install 'mismatch[logs]'")
pytest.importorskip("wandb", reason="needs wandb: pip install 'mismatch[logs]'")

_VERL = {"reward": "critic/score/mean", "kl": "rollout_corr/k3_kl", "entropy": "actor/entropy",
         "response_length": "response_length/mean"}
"""verl's metric names (frameworks.py, verl adapter) for the trace's signals."""


def _monitor(*args: str, timeout: float = 120, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mismatch.cli", "monitor", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _json_out(res: subprocess.CompletedProcess) -> tuple[list[dict], dict]:
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    return lines[:-1], lines[-1]["summary"]


def _verl_metrics(record: dict) -> dict:
    metrics = {name: record[signal] for signal, name in _VERL.items()}
    metrics["actor/ppo_kl"] = 0.01  # logged by verl, not the sampler–trainer KL: not read
    return metrics


def _write_tensorboard(folder: Path, trace: traces.Trace, delay: float = 0.0) -> Path:
    """verl's tensorboard logger: add_scalar(key, value, step) per metric (tracking.py)."""
    writer = tensorboard.SummaryWriter(str(folder))
    for r in trace.records:
        for key, value in _verl_metrics(r).items():
            writer.add_scalar(key, value, r["step"])
        if delay:
            writer.flush()
            time.sleep(delay)
    writer.close()
    return folder


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _as_verl_jsonl(path: Path, trace: traces.Trace, cast=float) -> Path:
    """The same metrics as verl's file logger writes them ({step, data}: tracking.py FileLogger),
    values through `cast` (float32 for TensorBoard's simple_value)."""
    path.write_text("".join(json.dumps({"step": r["step"], "data": {
        k: cast(v) for k, v in _verl_metrics(r).items()}}) + "\n" for r in trace.records))
    return path


def _check_collapse(res: subprocess.CompletedProcess, trace: traces.Trace,
                    same_as: Path | None = None, fmt: str = "verl") -> dict:
    """A collapse read right: a critical alert from its onset on, by the time the reward has
    halved (how early is the rules' business: tests/test_monitor.py), every step read; with
    `same_as`, exactly the alerts (steps, signals, values) the same metrics give as
    JSON lines."""
    assert res.returncode == 1, res.stderr
    alerts, summary = _json_out(res)
    assert (summary["steps"], summary["first_step"], summary["last_step"]) == (200, 0, 199)
    critical = [a for a in alerts if a["severity"] == "critical"]
    assert critical, alerts
    first = critical[0]
    assert trace.onset <= first["step"] <= trace.half_step, (first, trace.onset)
    if same_as is not None:
        expected = _json_out(_monitor(same_as, "--format", fmt, "--json"))[0]
        assert alerts == expected
    return summary


def test_tensorboard_folder_of_a_verl_run(tmp_path):
    trace = traces.synthetic_trace("collapse", 3)
    run = _write_tensorboard(tmp_path / "tensorboard_log" / "proj" / "exp", trace)
    lines = _as_verl_jsonl(tmp_path / "verl.jsonl", trace, cast=_f32)
    summary = _check_collapse(_monitor(run, "--format", "verl", "--json"), trace, lines)
    assert summary["records"] == 200
    [event_file] = run.glob("events.out.tfevents.*")
    _check_collapse(_monitor(event_file, "--format", "verl", "--json"), trace, lines)
    stable = _write_tensorboard(tmp_path / "stable", traces.synthetic_trace("stable", 3))
    res = _monitor(stable, "--format", "verl", "--json")
    alerts, summary = _json_out(res)
    assert res.returncode == 0 and alerts == [] and summary["records"] == 200, res.stderr
    # a known-good TensorBoard run as --baseline: the same verdicts as the JSON-lines baseline
    stable_lines = _as_verl_jsonl(tmp_path / "stable.jsonl", traces.synthetic_trace("stable", 3),
                                  cast=_f32)
    judged = [_json_out(_monitor(run, "--format", "verl", "--json", "--baseline", base))
              for base in (stable, stable_lines)]
    assert judged[0] == judged[1] and judged[0][0], judged
    res = _monitor(run, "--format", "verl", "--baseline", tmp_path / "nothing")
    assert res.returncode == 2 and res.stderr.startswith("mismatch: error: --baseline ")
    res = _monitor(tmp_path / "tensorboard_log" / "proj", "--format", "verl")  # the project
    assert res.returncode == 2 and "runs under it: exp" in res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("mismatch: error: ")


def _slime_log(writers: dict, folder: Path, trace: traces.Trace, per_rollout: int) -> Path:
    """slime's logging of `trace` into TensorBoard writers ("rollout", "train") as
    logging_utils.log does (add_scalar of each key but the step key, at the step key's value);
    returns the same dicts as JSON lines (float32 values), which --format slime reads too."""
    lines = []
    for r in trace.records:
        rid = r["step"]
        calls = [("rollout", {"rollout/raw_reward": r["reward"], "rollout/response_len/mean":
                              r["response_length"], "rollout/step": rid}, "rollout/step")]
        calls += [("train", {"train/mis_k3_kl": r["kl"], "train/entropy_loss": r["entropy"],
                             "train/step": rid * per_rollout + i}, "train/step")
                  for i in range(per_rollout)]
        calls.append(("rollout", {"eval/score": 0.1, "eval/step": rid}, "eval/step"))
        for writer, metrics, step_key in calls:
            for key, value in metrics.items():
                if key != step_key:
                    writers[writer].add_scalar(key, value, metrics[step_key])
            lines.append({k: v if k == step_key else _f32(v) for k, v in metrics.items()})
    for writer in writers.values():
        writer.close()
    path = folder.parent / f"{folder.name}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_tensorboard_folder_of_a_slime_run(tmp_path):
    """slime's --use-tensorboard: the trainer and the rollout manager each open a writer on the
    same folder; train metrics go at train/step, rollout metrics at rollout/step (the step key
    taken out of the dict: slime/observability/logging_utils.py log)."""
    trace = traces.synthetic_trace("collapse", 4, steps=120)
    folder = tmp_path / "tensorboard_log" / "slime" / "run"
    writers = {"rollout": tensorboard.SummaryWriter(str(folder), filename_suffix=".rollout"),
               "train": tensorboard.SummaryWriter(str(folder), filename_suffix=".train")}
    lines = _slime_log(writers, folder, trace, per_rollout=2)
    res = _monitor(folder, "--format", "slime", "--json")
    assert res.returncode == 1, res.stderr
    alerts, summary = _json_out(res)
    assert (summary["first_step"], summary["last_step"]) == (0, 119)  # rollout ids, not train
    critical = [a for a in alerts if a["severity"] == "critical"]
    assert critical and trace.onset <= critical[0]["step"] <= trace.half_step, critical
    assert "train records put on the rollout axis" in res.stderr
    assert alerts == _json_out(_monitor(lines, "--format", "slime", "--json"))[0]
    quiet = traces.synthetic_trace("stable", 4, steps=120)
    stable = tmp_path / "stable"
    _slime_log({"rollout": tensorboard.SummaryWriter(str(stable))} | {
        "train": tensorboard.SummaryWriter(str(stable))}, stable, quiet, per_rollout=1)
    res = _monitor(stable, "--format", "slime", "--json")
    assert res.returncode == 0 and _json_out(res)[0] == [], res.stderr


_WANDB_WRITER = textwrap.dedent("""
    import json, sys, time, wandb
    records, delay = json.load(open(sys.argv[1])), float(sys.argv[2])
    run = wandb.init(project="proj", name="exp", mode="offline")
    for r in records:
        run.log(r["metrics"], step=r["step"])  # verl: Tracking.log → wandb.log(data, step)
        if delay:
            time.sleep(delay)
    run.finish()
    print(run.id)
""")


def _write_wandb(root: Path, trace: traces.Trace, delay: float = 0.0,
                 wait: bool = True) -> subprocess.Popen | Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = root / "rows.json"
    rows.write_text(json.dumps([{"step": r["step"], "metrics": _verl_metrics(r)}
                                for r in trace.records]))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
           "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true"}
    proc = subprocess.Popen([sys.executable, "-c", _WANDB_WRITER, str(rows), str(delay)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    [run] = (root / "wandb").glob(f"offline-run-*-{out.split()[-1]}")
    return run


def test_wandb_offline_run_of_verl(tmp_path):
    trace = traces.synthetic_trace("collapse", 6)
    run = _write_wandb(tmp_path / "collapse", trace)
    lines = _as_verl_jsonl(tmp_path / "verl.jsonl", trace)
    summary = _check_collapse(_monitor(run, "--format", "verl", "--json"), trace, lines)
    assert summary["records"] == 200 and summary["skipped"]["malformed_lines"] == 0
    [run_file] = run.glob("run-*.wandb")
    _check_collapse(_monitor(run_file, "--format", "verl", "--json"), trace, lines)
    stable = _write_wandb(tmp_path / "stable", traces.synthetic_trace("stable", 6))
    res = _monitor(stable, "--format", "verl", "--json")
    alerts, summary = _json_out(res)
    assert res.returncode == 0 and alerts == [] and summary["records"] == 200, res.stderr


def test_wandb_chunk_failing_its_checksum_is_skipped_and_counted(tmp_path):
    trace = traces.synthetic_trace("stable", 7)
    run_file = next(_write_wandb(tmp_path, trace).glob("run-*.wandb"))
    data = bytearray(run_file.read_bytes())
    at = data.index(b"critic/score/mean", len(data) // 2)  # inside one history record
    data[at] ^= 0xFF
    run_file.write_bytes(bytes(data))
    res = _monitor(run_file, "--format", "verl", "--json")
    assert res.returncode == 0, res.stderr
    summary = _json_out(res)[1]
    assert summary["skipped"]["malformed_lines"] == 1
    per_block = 32768 / (len(data) / 200) + 2  # about how many steps' records one block holds
    assert 200 - per_block <= summary["records"] < 200  # the rest of that block, no more


def _follow_until_done(path: Path, fmt: str, start_writer) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "mismatch.cli", "monitor", str(path), "--follow",
                             "--format", fmt, "--json", "--poll-interval", "0.05",
                             "--max-idle", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        start_writer()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_follow_a_growing_tensorboard_folder(tmp_path):
    trace = traces.synthetic_trace("collapse", 8)
    folder = tmp_path / "run"
    _write_tensorboard(folder, replace(trace, records=trace.records[:100]))  # the run so far
    rest = replace(trace, records=trace.records[100:])
    thread = threading.Thread(target=_write_tensorboard, args=(folder, rest, 0.01))
    res = _follow_until_done(folder, "verl", lambda: (time.sleep(2), thread.start()))
    thread.join(60)
    # a restarted writer's second file is picked up as it grows
    _check_collapse(res, trace, _as_verl_jsonl(tmp_path / "verl.jsonl", trace, cast=_f32))
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2


def test_follow_a_growing_wandb_run(tmp_path):
    trace = traces.synthetic_trace("collapse", 9)
    writer = _write_wandb(tmp_path, trace, delay=0.02, wait=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(tmp_path.glob("wandb/offline-run-*/run-*"
                                                                 ".wandb")):
        time.sleep(0.1)
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    res = _follow_until_done(run, "verl", lambda: None)
    writer.communicate(timeout=60)
    _check_collapse(res, trace, _as_verl_jsonl(tmp_path / "verl.jsonl", trace))


_BLOCKED = textwrap.dedent("""
    import sys
    sys.modules["tensorboard"] = sys.modules["wandb"] = None  # as if not installed
    sys.argv = ["mismatch", *sys.argv[1:]]
    from mismatch.cli.main import main
    main()
""")


def test_without_the_reader_package_one_line_says_what_to_install(tmp_path):
    tb = _write_tensorboard(tmp_path / "tb", traces.synthetic_trace("stable", 1))
    wb = _write_wandb(tmp_path / "wb", traces.synthetic_trace("stable", 1))
    for path, package in ((tb, "tensorboard"), (wb, "wandb")):
        res = subprocess.run([sys.executable, "-c", _BLOCKED, "monitor", str(path), "--format",
                              "verl"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.startswith("mismatch: error: ") and res.stderr.count("\n") == 1
        assert package in res.stderr and "pip install 'mismatch[logs]'" in res.stderr


def test_an_empty_log_is_an_error_not_a_pass(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    tb = tmp_path / "tb"
    tensorboard.SummaryWriter(str(tb)).close()  # a run that logged nothing
    for path in (empty, tb):
        res = _monitor(path, "--json")
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.startswith("mismatch: error: ") and res.stderr.count("\n") == 1
        assert "not one record to monitor" in res.stderr


def test_a_mismatch_train_run_folder_reads_its_metrics_jsonl(tmp_path):
    trace = traces.synthetic_trace("collapse", 2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace.records))
    path = tmp_path / "metrics.jsonl"
    path.write_text((run / "metrics.jsonl").read_text())
    summary = _check_collapse(_monitor(run, "--json"), trace, path, fmt="native")
    assert summary["records"] == 200


def test_too_few_steps_to_judge_is_said(tmp_path):
    def log(name: str, n: int) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"step": s, "kl": 1e-3, "reward": 0.5}) + "\n"
                                for s in range(n)))
        return path

    short = _monitor(log("short.jsonl", 5))
    assert short.returncode == 0, short.stderr
    assert "only 5 steps: too few to judge (the baseline needs 14)" in short.stdout
    summary = _json_out(_monitor(log("short.jsonl", 5), "--json"))[1]
    assert (summary["steps"], summary["steps_needed"]) == (5, 14)
    assert "too few" not in _monitor(log("long.jsonl", 14)).stdout
    assert "too few" in _monitor(log("thirteen.jsonl", 13)).stdout
    judged = _monitor(log("short.jsonl", 5), "--baseline", log("good.jsonl", 20))
    assert judged.returncode == 0 and "too few" not in judged.stdout  # judged from step 1
