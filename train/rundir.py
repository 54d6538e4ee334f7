"""A run directory (`out`) on disk: checkpoints, the metrics and alert logs, the resume checks.

- `metrics.jsonl`: one object per optimizer step (`step` = steps completed; record.StepRecord),
  the monitor's native format, so `mismatch monitor out/metrics.jsonl` reads it.
- `alerts.jsonl`: the collapse monitor's alerts.
- `checkpoints/step-NNNNNN/state.pt`: FP32 master, AdamW state, the unit cursor, the config and
  the older weight versions a forced lag samples with; written to a temporary sibling and
  renamed, the newest two kept.
- `config.json`, `eval.json`; `final/`, the BF16 policy with its tokenizer, when the run ends.

Resume after a kill: the newest checkpoint is loaded, and `metrics.jsonl` and `alerts.jsonl` are
cut back to its step (a torn last line dropped) so that no step is logged twice.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from mismatch.io import atomic_directory, atomic_write_text, check_writable_dir

from .components import CheckpointConfig
from .config import FLAT_KEYS, TrainConfig

__all__ = ["CheckpointConfig", "run_masks_tokens", "latest_checkpoint", "save_checkpoint",
           "check_ranks", "read_metrics", "cut_jsonl", "check_resume", "check_out", "holds_run",
           "restart_logs", "write_json", "save_final"]


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON, written atomically (config.json, eval.json)."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (renamed into place only when whole)."""
    root = Path(out) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and (p / "state.pt").exists())
    return done[-1] if done else None


def save_checkpoint(out: Path, step: int, state: dict[str, Any], next_unit: int,
                    cfg: TrainConfig, older: dict[int, dict[str, torch.Tensor]] | None = None
                    ) -> Path:
    """Write checkpoints/step-NNNNNN (temporary sibling, then renamed; the newest
    `cfg.checkpoint.keep_checkpoints` kept, every one when 0).
    `state`: the trainer's state to save (`Trainer.state()`: {"master", "optimizer", ...})."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    with atomic_directory(final) as tmp:
        torch.save({"step": step, "next_unit": next_unit, "config": cfg.to_json(), **state,
                    "older_versions": older or {}},
                   tmp / "state.pt")
    held = sorted(p for p in root.glob("step-*") if p.is_dir())
    keep = cfg.checkpoint.keep_checkpoints
    for old in held[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def check_ranks(state: dict[str, Any], ranks: int) -> None:
    """A checkpoint's optimizer state is laid out for the trainer that wrote it."""
    saved = int(state.get("trainer_ranks", 1))
    if (saved == 1) != (ranks == 1):
        raise ValueError(f"the checkpoint was written by a {saved}-rank trainer; resume with "
                         f"--trainer-ranks {'1' if saved == 1 else 'N > 1'} (not {ranks})")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics.jsonl (a torn last line — a kill mid-write — dropped)."""
    out = []
    path = Path(path)
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def cut_jsonl(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the records with step <= `step`, rewritten atomically; return them."""
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    if path.exists():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def check_resume(cfg: TrainConfig, saved: dict[str, Any]) -> None:
    """A resume computes what the saved run computed: only RESUMABLE fields may differ. A field
    the saved config lacks (a run from before the field existed) had its default."""
    defaults = TrainConfig.defaults()
    changed = [name for name in FLAT_KEYS if name not in TrainConfig.RESUMABLE
               and saved.get(name, defaults[name]) != cfg.get(name)]
    if changed:
        name = changed[0]
        raise ValueError(f"the run was started with {name.replace('_', '-')}="
                         f"{saved.get(name)!r}, not {cfg.get(name)!r}; resume with the "
                         f"same settings or use another --out")


def check_out(out: Path, resume: bool, cfg: TrainConfig | None = None) -> Path | None:
    """Validate a run directory for a new run or a resume (of the same `cfg`); returns the
    checkpoint to resume."""
    out = check_writable_dir(out)  # before any work: not under a file, not the working dir
    ckpt = latest_checkpoint(out) if out.is_dir() else None
    if resume and ckpt is None:
        if not holds_run(out):
            raise ValueError(f"{out} holds no run to resume; start it without --resume")
        return None  # stopped before its first checkpoint: it starts over (restart_logs)
    saved = out / "config.json"
    if resume and cfg is not None and saved.exists():
        try:
            check_resume(cfg, json.loads(saved.read_text()))
        except json.JSONDecodeError:
            pass  # the checkpoint's own copy of the config is checked when it is loaded
    if ckpt is None and out.is_dir() and _finished(out):
        raise ValueError(f"{out} holds a finished run without checkpoints; choose another --out")
    if not resume and ckpt is not None:
        raise ValueError(f"{out} already holds a run (checkpoint {ckpt.name}); pass --resume to "
                         "continue it or choose another --out")
    return ckpt if resume else None


_RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "eval.json", "config.json", "command.txt")
"""What a run writes into `out` before its first checkpoint."""


def holds_run(out: Path) -> bool:
    """`out` holds (part of) a run: its logs, its config or its checkpoints."""
    out = Path(out)
    return any((out / name).exists() for name in _RUN_FILES + ("checkpoints",))


def _finished(out: Path) -> bool:
    """A run that ended (its final policy) or one adopted from an export (logs only)."""
    return (out / "final").exists() or (out / "adopted.json").exists()


def restart_logs(out: Path) -> bool:
    """A run directory without a checkpoint (stopped before its first one) starts over: its
    logs, config and half-written checkpoints are removed — only the files a run writes.
    Returns whether there was anything to remove."""
    out = Path(out)
    if not holds_run(out) or latest_checkpoint(out) is not None or _finished(out):
        return False
    for name in _RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return True



def save_final(out: Path, policy: torch.nn.Module, tokenizer) -> None:
    """out/final: the policy and its tokenizer, as a model directory (written whole, renamed)."""
    with atomic_directory(Path(out) / "final") as tmp:
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def run_masks_tokens(path: Path) -> bool:
    """Whether `path` is a run folder (or the metrics.jsonl in one) whose config.json names a
    correction that masks tokens (`TrainConfig.masks_tokens`): what `mismatch monitor` tells
    its monitor (`MonitorConfig.masked_loss`). False for anything else."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config = folder / "config.json"
    if not (config.is_file() and (folder / "metrics.jsonl").is_file()
            and (path.is_dir() or path.name == "metrics.jsonl")):
        return False
    try:
        correction = json.loads(config.read_text()).get("correction")
    except (OSError, ValueError, AttributeError):
        return False  # not a run's config: judged as without one
    from .arms import ARMS

    return isinstance(correction, str) and correction in ARMS and ARMS[correction].weight == "mis"
