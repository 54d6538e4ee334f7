"""Targeted measurement for the study: what a stale sampler's ratios look like, token by token
and episode by episode, and what MIS's mask removes of them.

    python scripts/study_stale_ratios.py RUN/checkpoints/step-000030 [more checkpoints…] \
        [--preset mixed] [--prompts 8] [--out FILE.json]

A checkpoint of a forced-lag run holds the trainer's FP32 master (version s) and the published
BF16 weights of the versions before it (`mismatch train --keep-checkpoints 0` keeps every
checkpoint of a run; the default keeps the newest two). From one checkpoint this samples fresh
episodes of the run's next tasks with the fleet's samplers (their emulated numerics) at version
s − K (K = the run's staleness, or --lag), exactly as the run's samplers would, and
teacher-forces them through the trainer's BF16 policy at version s and at version s − K. Per
sampled token the log-ratio of the loss, r = log π_s − log μ_{s−K}, splits into

    r_lag = log π_s − log π_{s−K}   (the optimizer steps between the versions; same numerics)
    r_num = log π_{s−K} − log μ_{s−K}   (the samplers' numerics; same weights)

and it reports, for each: the token-level KL (k3, the runs' `kl`), the ratio's p01/p99, the share
of tokens outside MIS's range [0.5, 5] (what MIS masks); then the sequence level, which the
per-token corrections leave alone: the episode's log-ratio R = Σ r over all its sampled tokens
(the probability of the whole episode, prefixes included, under π_s against μ), the share of
episodes whose exp(R) falls outside [0.5, 5], the effective sample size of the weights exp(R)
as a share of the episodes, and |r| by assistant turn (a later turn's prompt holds the earlier
turns the stale policy wrote). The ratios are those of the full distributions (the sampler's raw
log-probs, the trainer's log-softmax over the vocabulary); a top-p arm's loss renormalizes both
over the nucleus, which changes them only where the nucleus holds less than all of the mass.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import torch

# MIS's range (IcePop: Zhao et al., Ant Group 2025, https://ringtech.notion.site/icepop)
LOW, HIGH = 0.5, 5.0


def load(ckpt: Path, lag: int | None):
    from mismatch.train.config import TrainConfig

    try:
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
        state["config"], state["step"], state["master"]
    except (OSError, RuntimeError, KeyError, TypeError, EOFError, ValueError,
            pickle.UnpicklingError) as exc:
        raise SystemExit(f"{ckpt}: not a readable checkpoint of `mismatch train` ({exc}); pass "
                         "a RUN/checkpoints/step-NNNNNN directory") from None
    cfg = TrainConfig.from_json(state["config"])
    step, older = int(state["step"]), state.get("older_versions") or {}
    k = lag if lag is not None else (cfg.pipeline.staleness or 0)
    if k <= 0:
        raise SystemExit(f"{ckpt}: the run has no forced lag; pass --lag K")
    if step - k not in older:
        raise SystemExit(f"{ckpt}: holds versions {sorted(older)} besides {step}, not {step - k}; "
                         f"pick a lag of at most {step - min(older) if older else 0}")
    return cfg, state, step, step - k, older[step - k]


@torch.no_grad()
def token_logprobs(model, ep) -> torch.Tensor:
    """log π of each sampled token of `ep` (FP32 log-softmax of the model's logits)."""
    ids = torch.tensor([ep.token_ids])
    lsm = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    pos = torch.tensor(ep.sampled_positions)
    return lsm[pos - 1, ids[0, pos]]


def turn_of(ep) -> torch.Tensor:
    """The assistant turn (0-based) of each sampled token."""
    out = []
    for t, (_, n) in enumerate(ep.turn_spans):
        out += [t] * n
    return torch.tensor(out)


def summarize(rs: list[torch.Tensor], turns: list[torch.Tensor]) -> dict:
    tok = torch.cat(rs).double()
    ratio = tok.exp()
    seq = torch.stack([r.double().sum() for r in rs])
    w = seq.exp()
    by_turn = {}
    t_all = torch.cat(turns)
    for t in sorted(set(t_all.tolist())):
        sel = tok[t_all == t]
        by_turn[t + 1] = {"tokens": int(sel.numel()), "mean_abs_r": float(sel.abs().mean())}
    # tokens of turns 2+, by whether the episode's earlier turns (their prefix) already lie
    # outside [0.5, 5] as a whole
    far, near = [], []
    for r, t in zip(rs, turns):
        r = r.double()
        for turn in range(1, int(t.max()) + 1 if t.numel() else 0):
            prefix = r[t < turn].sum().exp()
            (far if prefix < LOW or prefix > HIGH else near).append(r[t == turn].abs())
    prefix = {}
    for name, x in (("outside", far), ("inside", near)):
        x = torch.cat(x) if x else torch.zeros(0, dtype=torch.float64)
        prefix[name] = {"tokens": int(x.numel()),
                        "mean_abs_r": float(x.mean()) if x.numel() else None}
    return {
        "tokens": int(tok.numel()), "episodes": len(rs),
        "kl_k3": float((ratio - 1 - tok).mean()),
        "ratio_p01": float(torch.quantile(ratio, 0.01)),
        "ratio_p99": float(torch.quantile(ratio, 0.99)),
        "token_outside": float(((ratio < LOW) | (ratio > HIGH)).double().mean()),
        "seq_logratio_p05": float(torch.quantile(seq, 0.05)),
        "seq_logratio_p95": float(torch.quantile(seq, 0.95)),
        "seq_outside": float(((w < LOW) | (w > HIGH)).double().mean()),
        "seq_ess": float(w.sum() ** 2 / (w * w).sum() / len(rs)),
        "by_turn": by_turn, "later_turns_by_prefix": prefix,
    }


def trainer_models(base, state: dict, step: int, old_v: int, old_w: dict):
    """The trainer's BF16 policy at version `step` (the checkpoint's master) and at `old_v`.

    Every model here is built as the run builds its own: a copy of the base model cast to the
    compute dtype (train.trainer.Trainer; the samplers through train.sampling.model_at). The cast
    takes the rotary frequencies to BF16 as well, where a freshly loaded model keeps them in
    FP32: models built the other way differ from the run's by that alone."""
    from mismatch.train.unit_sampling import model_at

    return (model_at({}, base, torch.bfloat16, step, state["master"]),
            model_at({}, base, torch.bfloat16, old_v, old_w))


def ratios(ckpt: Path, preset: str | None = None, prompts: int = 8, lag: int | None = None,
           model_dir: Path | None = None) -> dict:
    """The per-token log-ratios of fresh episodes from checkpoint `ckpt`: {"parts": {part:
    ([r of each episode], [turn of each token, per episode])}, "groups": {group: (share, [r])},
    and the run's particulars}."""
    from mismatch.zoo import load_model, load_tokenizer
    from mismatch.train.fleet import fleet
    from mismatch.probes.base import TORCH_DTYPES
    from mismatch.train.unit_sampling import model_at, sample_units

    cfg, state, step, old_v, old_w = load(ckpt, lag)
    base_dir = model_dir or cfg.model  # None: the embedded model
    tok = load_tokenizer(base_dir)
    base = load_model(base_dir, dtype="bfloat16")
    new, old = trainer_models(base, state, step, old_v, old_w)
    groups = fleet(preset or cfg.fleet)
    parts = {"total": ([], []), "lag": ([], []), "numerics": ([], [])}
    per_group = {}
    unit = int(state["next_unit"])
    for g in groups:
        dtype = TORCH_DTYPES[g.spec.compute_dtype]
        sampler = model_at({}, base, dtype, old_v, old_w)
        units = list(range(unit, unit + prompts))
        unit += prompts
        with torch.no_grad():
            eps = sample_units(sampler, tok, cfg, g, units, old_v)
        g_total = []
        for ep in eps:
            mu = torch.tensor([ep.sampler_logprobs[p] for p in ep.sampled_positions])
            lp_new, lp_old = token_logprobs(new, ep), token_logprobs(old, ep)
            turns = turn_of(ep)
            for name, r in (("total", lp_new - mu), ("lag", lp_new - lp_old),
                            ("numerics", lp_old - mu)):
                parts[name][0].append(r)
                parts[name][1].append(turns)
            g_total.append(lp_new - mu)
        per_group[g.name] = (g.share, g_total)
    return {"checkpoint": str(ckpt), "run": ckpt.parent.parent.name, "step": step,
            "sampler_version": old_v, "fleet": preset or cfg.fleet,
            "correction": cfg.correction, "top_p": cfg.samples_top_p,
            "parts": parts, "groups": per_group}


def measure(ckpt: Path, preset: str | None = None, prompts: int = 8, lag: int | None = None,
            model_dir: Path | None = None) -> dict:
    """`ratios`, summarized (JSON-ready)."""
    got = ratios(ckpt, preset, prompts, lag, model_dir)
    groups = {}
    for name, (share, rs) in got.pop("groups").items():
        r = torch.cat(rs).double()
        groups[name] = {"share": share, "kl_k3": float((r.exp() - 1 - r).mean())}
    parts = got.pop("parts")
    return {**got, "groups": groups, **{name: summarize(*parts[name]) for name in parts}}


def table(rows: list[dict]) -> str:
    head = ("| run | step (sampler) | part | KL k3 | ratio p01–p99 | tokens outside [0.5, 5] | "
            "episode log-ratio p05–p95 | episodes outside [0.5, 5] | ESS / N | mean abs r, "
            "turn 1 / 2 / 3+ | mean abs r, turns 2+, prefix outside / inside [0.5, 5] |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for row in rows:
        for part in ("total", "lag", "numerics"):
            s = row[part]
            bt = s["by_turn"]
            later = [v for t, v in bt.items() if int(t) >= 3]
            n3 = sum(v["tokens"] for v in later)
            t3 = f'{sum(v["mean_abs_r"] * v["tokens"] for v in later) / n3:.4f}' if n3 else "–"
            pre = " / ".join("–" if v["mean_abs_r"] is None else
                             f"{v['mean_abs_r']:.4f} ({v['tokens']})"
                             for v in s["later_turns_by_prefix"].values())
            turn = " / ".join(f"{bt[t]['mean_abs_r']:.4f}" if t in bt else "–" for t in (1, 2))
            lines.append(
                f"| {row['run']} | {row['step']} ({row['sampler_version']}) | {part} | "
                f"{s['kl_k3']:.2e} | {s['ratio_p01']:.3f}–{s['ratio_p99']:.3f} | "
                f"{s['token_outside']:.4f} | {s['seq_logratio_p05']:+.3f} to "
                f"{s['seq_logratio_p95']:+.3f} | {s['seq_outside']:.3f} | {s['seq_ess']:.3f} | "
                f"{turn} / {t3} | {pre} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", type=Path, nargs="+",
                    help="checkpoints/step-NNNNNN directories of forced-lag runs")
    ap.add_argument("--preset", default=None, help="Sampler fleet (default: the run's).")
    ap.add_argument("--prompts", type=int, default=8,
                    help="Prompts per sampler group (× the run's samples per prompt).")
    ap.add_argument("--lag", type=int, default=None, help="Versions behind (default: the "
                    "run's staleness).")
    ap.add_argument("--model", type=Path, default=None,
                    help="The runs' base model directory (default: the run's config).")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="Also write the figures as JSON.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(c, args.preset, args.prompts, args.lag, args.model)
            for c in args.checkpoints]
    print(table(rows))
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
