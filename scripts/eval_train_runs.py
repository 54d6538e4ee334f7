"""Held-out reward of training runs' base and final policies under both samplings (the full
distribution at temperature 1, and the top-p nucleus the top-p arms sample from).

    python scripts/eval_train_runs.py RUN_DIR [RUN_DIR ...] [--tasks 64] [--samples 4]

The base policy is the embedded model; the final one RUN_DIR/final. Same tasks and seeds for all
(train.evaluation.evaluate), so the differences are the policies'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    from mismatch.cli.common import quiet_libraries

    quiet_libraries()
    import torch

    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.train.config import TrainConfig
    from mismatch.train.evaluation import evaluate

    torch.set_num_threads(2)
    tok = load_tokenizer()
    models = {"base": load_model(dtype="bfloat16")}
    for run in args.runs:
        models[str(run)] = load_model(run / "final", dtype="bfloat16")
    rows = []
    for name, model in models.items():
        cfg_path = Path(name) / "config.json"
        saved = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        cfg = TrainConfig.from_json(saved).updated(eval_tasks=args.tasks,
                                                   eval_samples=args.samples)
        full = evaluate(model, tok, cfg, top_p=False)["reward"]
        nucleus = evaluate(model, tok, cfg, top_p=True)["reward"]
        rows.append((name, full, nucleus))
        print(f"{name}: full {full:.3f}, top-p {nucleus:.3f}", flush=True)
    print(f"\n{args.tasks} held-out tasks × {args.samples} episodes, temperature 1\n")
    print("| policy | held-out reward, full distribution | held-out reward, top-p 0.97 (≤64) |")
    print("|---|---|---|")
    for name, full, nucleus in rows:
        print(f"| {name} | {full:.3f} | {nucleus:.3f} |")


if __name__ == "__main__":
    main()
