"""TRL's GRPOTrainer on CPU with MonitorLogCallback, and `mismatch monitor --follow --format trl`
reading the log live.

Needs trl (the project's `trl` extra, in the README's test command); skips without it. A tiny
Qwen2 built here from a config with the embedded model's tokenizer (no download), three GRPO
steps (~10 s on 2 cores). The monitor follows the log from before the first step; after each log
line the test waits until the monitor has read up to the end of the file, so every record is
seen while the trainer is still running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs trl (pip install -e '.[trl]')")

STEPS = 3
_MAIN = """
from mismatch.cli.main import main
import sys
sys.argv = ["mismatch"] + sys.argv[1:]
main()
"""


def _read_position(pid: int, path: Path) -> int | None:
    """How far process `pid` has read `path` (from /proc/PID/fdinfo), or None if not open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == os.path.realpath(path):
                return int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split()[1])
        except OSError:
            continue
    return None


def _wait_caught_up(proc: subprocess.Popen, path: Path, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _read_position(proc.pid, path) == path.stat().st_size:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs Linux /proc")
def test_grpo_steps_logged_and_monitored_live(tmp_path):
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mismatch.integrations.trl import MonitorLogCallback
    from mismatch.zoo import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True))
    rewards_per_call: list[list[float]] = []

    def reward_len(completions, **kwargs):
        out = [float(len(c)) for c in completions]
        rewards_per_call.append(out)
        return out

    log = tmp_path / "metrics.jsonl"
    log.touch()
    monitor = subprocess.Popen(
        [sys.executable, "-c", _MAIN, "monitor", str(log), "--follow", "--format", "trl",
         "--json", "--poll-interval", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    caught_up: list[int] = []

    class WaitForMonitor(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if _wait_caught_up(monitor, log):
                caught_up.append(state.global_step)

    try:
        assert _wait_caught_up(monitor, log), "the monitor did not open the log"
        args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3,
                          num_generations=3, max_completion_length=8, max_steps=STEPS,
                          logging_steps=1, learning_rate=0.1, report_to="none", use_cpu=True,
                          save_strategy="no", seed=0)
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_len, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": [f"count to {i}:" for i in range(12)]}),
            callbacks=[MonitorLogCallback(log), WaitForMonitor()])
        trainer.train()
        assert _wait_caught_up(monitor, log)
        monitor.send_signal(signal.SIGTERM)
        out, err = monitor.communicate(timeout=30)
    finally:
        monitor.kill()

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    step_lines = [e for e in lines if "reward" in e]
    assert [e["step"] for e in step_lines] == list(range(1, STEPS + 1))
    # one generation per step: the logged reward is the mean of what reward_len returned
    assert len(rewards_per_call) == STEPS
    for entry, rewards in zip(step_lines, rewards_per_call):
        assert entry["reward"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
        assert 0 < entry["completions/mean_length"] <= 8
    # the monitor had read each log line before training went on (the final summary log too)
    assert caught_up == [e["step"] for e in lines] and len(lines) == STEPS + 1
    assert monitor.returncode == 0, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert (summary["records"], summary["first_step"], summary["last_step"]) == (STEPS, 1, STEPS)
    assert summary["alerts"] == {"warning": 0, "critical": 0}
    assert summary["skipped"]["lines_without_signals"] + \
        summary["skipped"]["other_events"] == 1  # TRL's end-of-training summary line
