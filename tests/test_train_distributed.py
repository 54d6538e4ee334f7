"""The FSDP2 trainer (train/distributed.py): two gloo ranks launched by torchrun take the same step
as one process on the whole batch — the loss over the global token count, the updated master."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from mismatch.zoo import load_model, load_tokenizer
from mismatch.train.fleet import fleet
from mismatch.train.rollout import run_episodes
from mismatch.train.batch import Unit, build_batch, task_of
from mismatch.train.config import TrainConfig
from mismatch.train.trainer import Trainer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    tok, model = load_tokenizer(), load_model(dtype="bfloat16").eval()
    group = fleet("homogeneous")[0]
    units = []
    for u in range(40):  # 3 prompts × 3 episodes with mixed outcomes: 9 rows, split 4 + 5
        eps = run_episodes(model, tok, [task_of(u, 0, ("arith",))] * 3, group, version=0,
                           top_k_candidates=16, seed=u)
        if len({ep.reward for ep in eps}) > 1:  # a group with a signal (nonzero advantages)
            units.append(Unit(index=u, group=group.name, version=0, episodes=eps, seconds=0.0))
        if len(units) == 3:
            break
    assert len(units) == 3, "the embedded policy gave too few prompts with mixed outcomes"
    batch = build_batch(units, 0, tok.pad_token_id)
    assert bool((batch.advantages != 0).any())
    path = tmp_path_factory.mktemp("dist") / "batch.pt"
    torch.save(batch, path)
    return path, batch


_SIGNAL_DEATH = re.compile(r"exitcode\s*:\s*-(?:6|9)\b")


def _torchrun(batch_path, out, dtype: str, lr: float):
    """Launch the two ranks; a launch whose rank died by a signal (SIGABRT/SIGKILL, not a Python
    error) is retried once, with a warning. Seen once in CI on a loaded 2-core machine: rank 1
    aborted ("terminate called without an active exception") before it had loaded the model,
    i.e. before this module's code ran any collective; 66 local launches under the same load did
    not repeat it. A Python error, a wrong result or a second signal death still fails."""
    for attempt in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
               str(_free_port()), "-m", "mismatch.train.distributed", "--batch",
               str(batch_path), "--out", str(out), "--lr", repr(lr), "--compute-dtype", dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            return torch.load(out, weights_only=False)
        if attempt == 1 and _SIGNAL_DEATH.search(proc.stderr):
            warnings.warn("a torchrun rank died by a signal; relaunching once:\n"
                          + proc.stderr[-1500:])
            continue
        break
    raise AssertionError(proc.stderr[-3000:])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_rank_fsdp2_step_equals_one_process(batch_file, tmp_path, dtype):
    path, batch = batch_file
    lr = 1e-3
    got = _torchrun(path, tmp_path / "state.pt", dtype, lr)
    assert got["world"] == 2
    cfg = TrainConfig.flat(fleet="homogeneous", correction="sc+mis", lr=lr)
    ref = Trainer(load_model(dtype="float32"), cfg,
                  compute_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    ref.share_prefix = False  # whole rows, as the sharded trainer scores them
    before = {k: v.clone() for k, v in ref.master.state_dict().items()}
    metrics = ref.step(batch)
    want = ref.master.state_dict()
    assert got["metrics"].valid_tokens == metrics.valid_tokens  # the global count
    # FP32: summation order only. BF16: the same math, but the GEMMs over 4-5 rows round
    # differently from those over 9, and the loss is a small sum of ± advantage terms
    rel = 1e-5 if dtype == "fp32" else 5e-2
    assert got["metrics"].loss == pytest.approx(metrics.loss, rel=rel, abs=1e-7)
    assert got["metrics"].grad_norm == pytest.approx(metrics.grad_norm, rel=rel * 10)
    moved, flips, total = 0, 0, 0
    for name, w in want.items():
        g = got["master"][name]
        assert g.shape == w.shape and g.dtype == torch.float32, name
        if dtype == "fp32":  # same math, other summation order: FP32 rounding only
            # (AdamW's first step is lr·g/(|g| + eps) per coordinate: one whose gradient is near
            # eps = 1e-8 moves by a fraction of lr that FP32 noise changes — measured 4e-6 and
            # 1.3e-5 at lr 1e-3 on 1 of 8192 weights, on two CPUs; never more than a flipped step)
            diff = (g - w).abs()
            assert float(diff.max()) <= 2 * lr * 1.001, name
            assert float((diff > 1e-6).float().mean()) < 1e-3, name
        else:
            # BF16 gradients of half batches summed in FP32 vs one BF16 gradient: AdamW's first
            # step is ±lr per coordinate, so one whose gradient is within BF16 rounding of zero
            # may move the other way (a flip: |Δ| = 2·lr); the rest agree
            diff = (g - w).abs()
            assert float(diff.max()) <= 2 * lr * 1.001, name  # never more than one flipped step
            flipped = float((diff > lr).float().mean())
            assert flipped < 1e-3, (name, flipped)
            flips += int((diff > lr).sum())
            total += diff.numel()
        moved += int((w != before[name]).sum())
    if dtype == "bf16":
        # measured: 3e-6 of all coordinates (6 of ~2M) — with the rotary buffers in BF16 on
        # both sides; FP32 rotary on the sharded side alone flipped about 3%
        assert flips / total < 1e-4, flips / total
    assert moved > 0  # the step changed the weights (the comparison is not of two no-ops)
