"""Control for the study's halving criterion: the base policy's reward on each seed's training
tasks, in the grid's order (32 steps × 4 prompts × 8 episodes, the trainer's numerics). If a
stretch of hard prompts alone made the 5-step mean fall, it would show here.

    python scripts/study_task_difficulty.py
"""

import torch

from mismatch.zoo import load_model, load_tokenizer
from mismatch.train.fleet import fleet
from mismatch.train.rollout import run_episodes
from mismatch.train.batch import task_of
torch.set_num_threads(2)
tok = load_tokenizer(); m = load_model(dtype="bfloat16").eval()
g = fleet("homogeneous")[0]
for seed in (0, 1, 2):
    per_step = []
    for s in range(32):
        tasks = [task_of(u, seed, ("arith",)) for u in range(4*s, 4*s+4) for _ in range(8)]
        eps = run_episodes(m, tok, tasks, g, version=0, seed=1000+s)
        per_step.append(sum(e.reward for e in eps)/len(eps))
    ma = [sum(per_step[max(0,i-4):i+1])/len(per_step[max(0,i-4):i+1]) for i in range(32)]
    print(seed, "base policy reward per step:", " ".join(f"{x:.2f}" for x in per_step))
    low = min(ma[4:])
    print(seed, "5-step mean min", f"{low:.2f}", "at step", ma.index(low) + 1, flush=True)
