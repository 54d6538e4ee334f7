"""The study's held-out evaluation for the top-p arms, after the fact: from the full vocabulary.

A top-p arm trains the policy truncated to its samplers' nucleus (p = 0.97 after top-k 64), and
evaluates it through the same nucleus. The study evaluated every arm from the full vocabulary
(reference/synopsis.txt: "evaluation samples from the full vocabulary"), so a top-p arm's
figures there also pay for the tail its loss never sees. `mismatch train` now evaluates a top-p
arm both ways (train.evaluation.evaluate_into); a run made before it did only the first. This
evaluates the base and the final policy of such a finished run from the full vocabulary, on the
same held-out tasks and episode streams as the run's own evaluation, and adds them to its
eval.json, as the run itself would have:

    "full_vocab": {"base": {...}, "final": {...}}

The base is the run's starting policy (`config.json`'s model), so it equals the base of the
full-distribution arms of the same seed; the final is `final/`, the policy the run saved.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from mismatch.train.config import TrainConfig
from mismatch.train.heldout import HeldOut
from mismatch.train.rundir import write_json

__all__ = ["needs_full_vocab_eval", "evaluate_full_vocab"]


def _config(run: Path) -> TrainConfig:
    try:
        saved = json.loads((run / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{run}/config.json is missing or unreadable ({exc}); the run cannot "
                         "be evaluated") from None
    return TrainConfig.from_json(saved)


def needs_full_vocab_eval(run: Path) -> bool:
    """A finished top-p run (final/ saved, held-out evaluated) not yet evaluated from the full
    vocabulary."""
    run = Path(run)
    if not (run / "final" / "config.json").exists() or not (run / "eval.json").exists():
        return False
    try:
        cfg = _config(run)
        ev = HeldOut.from_json(json.loads((run / "eval.json").read_text()))
    except (ValueError, KeyError, TypeError):  # json.JSONDecodeError is a ValueError
        return False
    return cfg.samples_top_p and bool(cfg.eval.eval_tasks) and ev.final is not None \
        and (ev.full_vocab is None or ev.full_vocab.final is None)


def evaluate_full_vocab(run: Path, log: Callable[[str], None] = lambda _: None
                        ) -> dict[str, Any]:
    """Evaluate the base and final policy of the finished top-p run `run` from the full
    vocabulary; returns the "full_vocab" entry it wrote into run/eval.json (atomically)."""
    from mismatch.runtime import torch_threads
    from mismatch.zoo import load_model, load_tokenizer

    from mismatch.train.evaluation import evaluate

    run = Path(run)
    cfg = _config(run)
    if not cfg.samples_top_p:
        raise ValueError(f"{run} is a {cfg.correction} run: it already samples its held-out "
                         "episodes from the full vocabulary")
    if not (run / "final" / "config.json").exists():
        raise ValueError(f"{run} has no final/ policy yet; evaluate it when the run has ended")
    ev = json.loads((run / "eval.json").read_text())
    full = dict(ev.get("full_vocab") or {})
    with torch_threads(cfg.pipeline.threads):
        for key, path in (("base", cfg.model), ("final", run / "final")):
            if key in full:
                continue
            log(f"{run.name}: evaluating the {key} policy from the full vocabulary "
                f"({cfg.eval.eval_tasks} tasks × {cfg.eval.eval_samples})")
            res = evaluate(load_model(path, dtype="bfloat16"), load_tokenizer(path), cfg,
                           top_p=False)
            step = HeldOut.from_json(ev).final.step if key == "final" else None
            full[key] = replace(res, step=step).to_json()
    ev["full_vocab"] = full
    write_json(run / "eval.json", ev)
    return full
