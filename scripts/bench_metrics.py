"""The mismatch metrics and corrected losses beside verl's on the same tensors (issue 32, item 5).

Each row times one of ours (mismatch.metrics, train.loss.policy_loss) and its fairest verl 0.9.x
counterpart (volcengine/verl@v0.9.1: verl/trainer/ppo/core_algos.py, rollout_corr_helper.py) on
the same float32 [B, T] log-probs, mask and advantages, in one process, interleaved (ours, verl,
ours, ...), median of N after warm-up. Both sides end in Python floats (verl's functions call
`.item()` on every metric; ours are converted as the trainer and the probe convert them). Loss
rows time forward + backward with respect to the trainer log-probs, and check that both losses
agree (they compute the same objective) before timing.

    .venv-verl/bin/python scripts/bench_metrics.py [--sizes 8x1024,64x4096] [--repeats 21]
        [--threads 1] [--no-write]

Needs verl in the interpreter (scripts/setup_verl_venv.sh builds .venv-verl, with the project in
it). Writes the table into reports/benchmarks.md, section "Metrics vs verl" (replaced if there).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mismatch.io import atomic_write_text  # noqa: E402

SECTION = "## Metrics vs verl"
BAND = "0.5_5"          # the project's MIS band [MIS_LOW, MIS_HIGH] in verl's lower_upper form
TIS_CAP = 2.0           # train.loss's truncated-IS cap, verl's rollout_is_threshold default


def fail(msg: str) -> None:
    print(f"bench_metrics: error: {msg}", file=sys.stderr)
    sys.exit(2)


def cpu_line() -> str:
    """The CPU model and the vector/matrix extensions that decide these kernels' speed."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
            if f in flags]
    amx = "AMX present" if "amx_tile" in flags else "no AMX"
    avx512 = "AVX-512 present" if "avx512f" in flags else "no AVX-512"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    capped = (f"; oneDNN capped at ONEDNN_MAX_CPU_ISA={isa} (BF16 GEMMs as on a CPU without "
              f"those extensions)" if isa else "")
    return (f"{model}; {avx512}, {amx} (flags: {' '.join(have) or 'none of avx2/avx512/amx'}); "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}{capped}")


def inputs(b: int, t: int, seed: int = 0) -> dict:
    """Sampler log-probs in (−4, 0], trainer = sampler + N(0, 0.3²) (ratios on both sides of
    the MIS band), right-padded completions of T/4..T tokens, one advantage per sequence."""
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(b, t, generator=g) * 4
    trainer = (sampler + torch.randn(b, t, generator=g) * 0.3).clamp(max=0)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return dict(trainer=trainer, sampler=sampler, mask=mask, maskf=mask.float(), adv=adv)


def _floats(d: dict) -> dict:
    return {k: float(v) for k, v in d.items() if getattr(v, "dim", lambda: 0)() == 0}


def rows(d: dict) -> list[tuple[str, str, object, object, object]]:
    """(ours, verl's counterpart, our fn, verl's fn, check) per row; check() compares losses."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos as ca
    from verl.trainer.ppo import rollout_corr_helper as rc

    from mismatch.metrics import divergence_summary, kl_estimators, per_sequence, ratio_stats
    from mismatch.train.loss import ARMS, policy_loss

    t, s, m, mf, adv = d["trainer"], d["sampler"], d["mask"], d["maskf"], d["adv"]

    def config(**corr):
        return OmegaConf.create({"policy_loss": {"rollout_correction": dict(
            loss_type="reinforce", **corr)}, "global_batch_info": {}, "clip_ratio": 0.2})

    def ours_loss(arm):
        def run():
            lp = t.clone().requires_grad_()
            loss, metrics = policy_loss(lp, s, adv, m, arm=ARMS[arm])
            loss.backward()
            return float(loss.detach()), _floats(metrics)
        return run

    def verl_loss(cfg, fn=ca.compute_policy_loss_bypass_mode):
        def run():
            lp = t.clone().requires_grad_()
            loss, metrics = fn(s, lp, adv, mf, "token-mean", cfg)
            loss.backward()
            return float(loss), metrics
        return run

    out = []
    for arm, label, cfg in (
            ("grpo", "bypass_mode, reinforce, no IS/RS (+ rollout_corr off-policy metrics)",
             config()),
            ("tis", "bypass_mode, reinforce, rollout_is=token, threshold 2 (+ IS metrics)",
             config(rollout_is="token", rollout_is_threshold=TIS_CAP)),
            ("mis", f"bypass_mode, reinforce, rollout_is=token, IcePop {BAND} (+ IS metrics)",
             config(rollout_is="token", rollout_is_threshold=BAND))):
        out.append((f"policy_loss {arm} fwd+bwd", label, ours_loss(arm), verl_loss(cfg), True))
    vanilla = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
                                "global_batch_info": {}})
    out.append(("policy_loss grpo fwd+bwd", "compute_policy_loss_vanilla (PPO clip; loss, "
                "ppo_kl, clipfrac only: fewer metrics than ours)", ours_loss("grpo"),
                verl_loss(vanilla, ca.compute_policy_loss_vanilla), False))
    out.append(("kl_estimators (k1, k2, k3)", "compute_offpolicy_metrics (kl, k3, ppl, chi2)",
                lambda: _floats(kl_estimators(t, s, mf)),
                lambda: rc.compute_offpolicy_metrics(t, s, mf), False))
    out.append(("ratio_stats", f"compute_rollout_correction_weights(token, {BAND}) "
                "(IS weights + compute_is_metrics)",
                lambda: _floats(ratio_stats(t, s, mf)),
                lambda: rc.compute_rollout_correction_weights(t - s, mf, "token", BAND), False))
    out.append(("divergence_summary + per_sequence",
                f"compute_rollout_correction_and_rejection_mask(rollout_is=token, {BAND}) "
                "(IS + off-policy metrics)",
                lambda: (_floats(divergence_summary(t, s, mf)), per_sequence(t, s, mf)),
                lambda: rc.compute_rollout_correction_and_rejection_mask(
                    t, s, mf, rollout_is="token", rollout_is_threshold=BAND), False))
    return out


def median_times(ours, theirs, repeats: int) -> tuple[float, float]:
    for _ in range(3):  # warm-up: allocator, lazy imports, omegaconf caches
        ours()
        theirs()
    a, b = [], []
    for i in range(repeats):
        pair = ((ours, a), (theirs, b)) if i % 2 == 0 else ((theirs, b), (ours, a))
        for fn, acc in pair:
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def bench(sizes: list[tuple[int, int]], repeats: int) -> list[tuple]:
    table = []
    for b, t in sizes:
        d = inputs(b, t)
        for name, label, ours, theirs, check in rows(d):
            if check:  # the same objective: the losses agree (float32 vs our float64 ratios)
                mine, other = ours()[0], theirs()[0]
                if abs(mine - other) > 1e-5 * max(1.0, abs(other)):
                    fail(f"{name} at {b}x{t}: loss {mine!r} vs verl's {other!r}")
            ta, tb = median_times(ours, theirs, repeats)
            table.append((f"{b}x{t}", name, label, ta, tb))
            print(f"{b}x{t:<5d} {name:34s} {ta * 1e3:9.3f} {tb * 1e3:9.3f} {ta / tb:6.2f}",
                  flush=True)
    return table


def render(table: list[tuple], repeats: int, threads: int) -> str:
    import verl

    head = (f"# {cpu_line()}\n# torch {torch.__version__}, verl {verl.__version__}, "
            f"{threads} thread(s), median of {repeats} interleaved runs after 3 warm-ups; "
            "float32 inputs\n")
    lines = [f"{'B x T':9s} {'ours':34s} {'ms':>8s} {'verl ms':>8s} {'ours/verl':>9s}  "
             "verl counterpart"]
    for size, name, label, ta, tb in table:
        lines.append(f"{size:9s} {name:34s} {ta * 1e3:8.3f} {tb * 1e3:8.3f} {ta / tb:9.2f}  "
                     f"{label}")
    return head + "\n".join(lines)


def write_section(text: str, path: Path, command: str) -> None:
    """Replace (or append) the "Metrics vs verl" section of reports/benchmarks.md."""
    body = (f"{SECTION}\n\nCommand: `{command}`. Rows: our function (mismatch.metrics, "
            "train.loss.policy_loss) and the verl 0.9.1 function that computes the same "
            "figures or the same loss with its own metrics (last column), on the same tensors; "
            "loss rows include the backward pass and were checked to give the same loss.\n\n"
            f"```\n{text}\n```\n")
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(SECTION + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + body
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + body + (old[end + 1:] if end >= 0 else "")
    atomic_write_text(path, new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8x1024,64x4096", help="B x T pairs, comma separated")
    ap.add_argument("--repeats", type=int, default=21, help="timed runs per side (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "benchmarks.md")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    try:
        sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in sizes):
            raise ValueError
    except ValueError:
        fail(f"--sizes must look like 8x1024,64x4096, got {args.sizes!r}")
    if args.repeats < 1 or args.threads < 1:
        fail("--repeats and --threads must be >= 1")
    try:
        import verl  # noqa: F401
        from verl.trainer.ppo import rollout_corr_helper  # noqa: F401
    except ImportError as err:
        fail(f"verl is not importable here ({err}); run with .venv-verl/bin/python "
             "(scripts/setup_verl_venv.sh)")
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    table = bench(sizes, args.repeats)
    text = render(table, args.repeats, args.threads)
    print(text)
    if not args.no_write:
        write_section(text, args.out, " ".join(["python scripts/bench_metrics.py",
                                                *sys.argv[1:]]))


if __name__ == "__main__":
    main()
