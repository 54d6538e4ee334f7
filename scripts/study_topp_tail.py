"""Targeted measurement for the study: what top-p mask replay leaves untrained.

    python scripts/study_topp_tail.py --base OUT/policy-800 --run OUT/L0-k8-sc_mis-s0 \
        --run OUT/L0-k8-sc_mis_topp-s0 [--tasks 64] [--out FILE]

A top-p arm's loss renormalizes the trainer's π over the samplers' nucleus (p = 0.97 after top-k
64): the logits outside it get no gradient, and at a position whose nucleus is a single token
(one token holds ≥ 0.97) the renormalized log-prob is 0, so the position gets no gradient at
all. Evaluated from the full vocabulary, as the study evaluated, the policy still samples that
tail. This measures it on one fixed set of held-out episodes (sampled once by the base policy at
temperature 1 from the full vocabulary, under the trainer's numerics), teacher-forced through
each policy in FP32: per sampled position, the mass outside the policy's own nucleus, the share
of positions whose nucleus is one token, and the chance that a whole reply of the episode's
length stays inside the nucleus (the product over its positions of the nucleus mass).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch


def episodes(base: Path, n_tasks: int, seed: int):
    """Held-out episodes of the base policy: `n_tasks` tasks × 1, full vocabulary."""
    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.zoo.tasks import make_task, task_seeds
    from mismatch.train.batch import unit_seed
    from mismatch.train.fleet import fleet
    from mismatch.train.rollout import run_episodes

    tasks = [make_task(s) for s in task_seeds("heldout", n_tasks)]  # the zoo's mix of kinds
    model, tok = load_model(base, dtype="bfloat16"), load_tokenizer(base)
    with torch.no_grad():
        eps = run_episodes(model, tok, tasks, fleet("homogeneous")[0], version=-1,
                           top_k_candidates=1,
                           episode_seeds=[unit_seed(i, seed + 1) * 1_009 for i in range(n_tasks)])
    return eps


@torch.no_grad()
def tail_stats(policy: Path, eps) -> dict[str, float]:
    from mismatch.engines.logits import SamplingParams, process_logits
    from mismatch.zoo import load_model

    model = load_model(policy, dtype="float32")
    params = SamplingParams(top_p=0.97, top_k=64)
    tails, singles, keep_logs = [], [], []
    for ep in eps:
        ids = torch.tensor([ep.token_ids])
        logits = model(ids).logits[0, :-1].float()                 # predicts token t+1
        pos = torch.tensor(ep.sampled_mask[1:]).bool()
        lg = logits[pos]
        nucleus = torch.isfinite(process_logits(lg, params))       # (n, V)
        mass = torch.softmax(lg, -1).masked_fill(~nucleus, 0).sum(-1)
        tails += (1 - mass).tolist()
        singles += (nucleus.sum(-1) == 1).tolist()
        keep_logs.append(mass.clamp_min(1e-30).log().sum().item())
    return {"tail": sum(tails) / len(tails), "single": sum(singles) / len(singles),
            "inside": math.exp(sum(keep_logs) / len(keep_logs)), "positions": len(tails)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="The runs' starting policy.")
    ap.add_argument("--run", type=Path, action="append", default=[],
                    help="A finished run directory (its final/ policy); repeatable.")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eps = episodes(args.base, args.tasks, args.seed)
    rows = [("base", tail_stats(args.base, eps))]
    rows += [(run.name, tail_stats(run / "final", eps)) for run in args.run]
    print(f"{len(eps)} held-out episodes of the base policy (full vocabulary), "
          f"{rows[0][1]['positions']} sampled positions, teacher-forced in FP32")
    print(f"{'policy':24} {'tail mass/pos':>14} {'one-token nucleus':>18} "
          f"{'episode inside (geo mean)':>26}")
    for name, r in rows:
        print(f"{name:24} {r['tail']:14.4f} {r['single']:18.3f} {r['inside']:26.3f}")


if __name__ == "__main__":
    main()
