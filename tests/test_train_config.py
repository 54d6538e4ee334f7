"""TrainConfig composes its components' configs (train.components) and keeps the flat
out/config.json form: every committed run config reads back through it and writes back byte for
byte; flat field names build, replace and override as before the components."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mismatch.train.components import (CheckpointConfig, EvalConfig, OptimConfig,
                                       PipelineConfig, RolloutConfig)
from mismatch.train.config import FLAT_KEYS, TrainConfig, preset_config
from mismatch.train.rundir import write_json

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "train-config"


def _committed_configs() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "reports"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.split()
    return [ROOT / p for p in listed if p.endswith("/config.json")]


def test_committed_run_configs_round_trip(monkeypatch):
    """Each reports/*/config.json → TrainConfig → the same bytes. Configs written before a field
    existed (26 or 27 keys) hold the same keys in the same order, and the new ones their
    defaults (what check_resume assumes of them)."""
    import mismatch.train.fleet as fleet_module

    monkeypatch.setattr(fleet_module, "fleet_file", lambda path: [])  # the study's .toml paths
    paths = _committed_configs()
    if not paths:
        pytest.skip("not a git checkout")
    full = 0
    for path in paths:
        text = path.read_text()
        saved = json.loads(text)
        cfg = TrainConfig.from_json(saved)
        back = cfg.to_json()
        assert list(back) == list(FLAT_KEYS)
        kept = {k: v for k, v in back.items() if k in saved}
        assert json.dumps(kept, indent=2) + "\n" == text, path
        defaults = TrainConfig.defaults()
        assert all(back[k] == defaults[k] for k in back if k not in saved), path
        full += len(saved) == len(FLAT_KEYS)
    assert full, "some committed config holds every field"


def test_smoke_config_json_as_before(tmp_path):
    """`mismatch train --preset smoke --steps 1 --sync`'s config.json (on 2 cores: 2 sampler
    processes), as the flat config wrote it before the components
    (tests/data/train-config/smoke-sync.json)."""
    cfg = preset_config("smoke", steps=1, sync=True, sampler_processes=2)
    write_json(tmp_path / "config.json", cfg.to_json())
    assert (tmp_path / "config.json").read_text() == (DATA / "smoke-sync.json").read_text()


def test_flat_names_build_the_components():
    cfg = preset_config("smoke", lr=3e-4, grad_clip=0.5, max_turns=3, top_p=0.9, staleness=2,
                        workers=2, threads=2, keep_checkpoints=0, eval_tasks=8, eval_every=2,
                        seed=5)
    assert cfg.optim == OptimConfig(lr=3e-4, grad_clip=0.5)
    assert cfg.rollout == RolloutConfig(max_turns=3, max_new_tokens=48, candidates=32, top_p=0.9)
    assert cfg.pipeline == PipelineConfig(staleness=2, workers=2, threads=2)
    assert cfg.checkpoint == CheckpointConfig(checkpoint_every=2, keep_checkpoints=0)
    assert cfg.eval == EvalConfig(eval_tasks=8, eval_every=2)
    assert (cfg.fleet, cfg.steps, cfg.seed) == ("mixed", 3, 5)
    assert cfg.pipeline.lag == 2 and cfg.pipeline.lockstep and cfg.pipeline.staleness_bound == 2
    assert cfg.get("lr") == 3e-4 and cfg.get("fleet") == "mixed"
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert TrainConfig.flat(**cfg.to_json()) == cfg
    assert cfg.updated(lr=1e-4, steps=9) == TrainConfig.flat(**dict(cfg.to_json(), lr=1e-4,
                                                                    steps=9))
    assert preset_config("smoke", lr=None, sync=None) == preset_config("smoke")
    with pytest.raises(TypeError, match="no field 'learning_rate'"):
        preset_config("smoke", learning_rate=1e-3)
    with pytest.raises(TypeError, match="optim must be a OptimConfig"):
        TrainConfig(optim=EvalConfig())


@pytest.mark.parametrize("kind, bad, message", [
    (OptimConfig, {"lr": 0.0}, "lr must be a positive number"),
    (OptimConfig, {"lr": float("nan")}, "lr must be a positive number"),
    (RolloutConfig, {"max_turns": 0}, "max-turns must be >= 1, got 0"),
    (RolloutConfig, {"top_p_max_tokens": 0}, "top-p-max-tokens must be >= 1"),
    (RolloutConfig, {"top_p": 1.5}, r"top-p must be in \(0, 1\]"),
    (PipelineConfig, {"sampler_processes": -1}, "sampler-processes must be >= 0"),
    (PipelineConfig, {"queue_steps": 0}, "queue-steps must be >= 1"),
    (PipelineConfig, {"staleness": 1, "max_staleness": 2}, "cannot be combined"),
    (PipelineConfig, {"max_staleness": -1}, "max-staleness must be >= 0"),
    (CheckpointConfig, {"checkpoint_every": 0}, "checkpoint-every must be >= 1"),
    (CheckpointConfig, {"keep_checkpoints": -1}, "keep-checkpoints must be >= 0"),
    (EvalConfig, {"eval_samples": 0}, "eval-samples >= 1"),
])
def test_each_component_checks_its_own_fields(kind, bad, message):
    with pytest.raises(ValueError, match=message):
        kind(**bad)
    with pytest.raises(ValueError, match=message):  # and through the flat names
        TrainConfig.flat(**bad)
    with pytest.raises(ValueError, match=message):
        preset_config("smoke", **bad)


def test_steps_and_group_checks_stay_with_the_run():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="prompts-per-step must be >= 1"):
        TrainConfig(prompts_per_step=0)
    assert TrainConfig.defaults()["lr"] == 1e-4 and TrainConfig.defaults()["model"] is None
