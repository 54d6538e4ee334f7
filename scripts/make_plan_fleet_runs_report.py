"""reports/plan-fleet-runs.md: the planned fleet trained at the study's regime beside L0 and L2 —
held-out reward before / midway / after, collapses, and held-out reward against cumulative
sampling cost (issue 33, part 5).

    python scripts/make_plan_fleet_runs_report.py [--runs reports/plan-fleet-runs]

--runs is a `mismatch study --export` folder (or the study's own --out) of the three-fleet grid:
`mismatch study --fleets PLAN/fleet.toml,L0,L2 --arms sc+mis --seeds 0,1,2 --staleness 8
--sync-arms '' --policy-steps 800` (the study's regime: `--preset full`'s 150 steps of 16 × 8,
lr 1e-4, 64 held-out tasks). Its `plan.json` (the plan the fleet file came from) prices every
group: dollars per sampled token = price per GPU-hour / (3600 × tokens/s per GPU), from the
default price table and the throughput model for the served model (docs/plan.md). A step's
sampling cost is then Σ_g tokens_g × that price:

- a fleet-file run logs it (`sampling_cost_usd`) and that figure is used;
- a preset run that logged its groups' tokens (`group_tokens`) is priced from them, exactly;
- an older log (total tokens only) of a fleet whose groups share the requests equally is priced
  at the mean price per token of its groups: an estimate, checked against the exact figure of
  a run that has both, and labeled.

The tokens are this project's small policy's; the prices per token are those of the served
model the plan was made for. The figures compare the fleets; they are not a bill.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mismatch.io import atomic_write_text, save_figure  # noqa: E402
from mismatch.study.cells import STUDY_FLEETS, cells, fleet_label  # noqa: E402
from mismatch.study.runs import ci95, share_ci, summarize_run  # noqa: E402

OUT = ROOT / "reports" / "plan-fleet-runs.md"
RUNS = ROOT / "reports" / "plan-fleet-runs"
COLORS = {"L0": "tab:blue", "L2": "tab:red"}


def price_per_token(plan: dict) -> dict[tuple[str, str, str], float]:
    """(gpu, dtype, kv_cache) → dollars per sampled token, from a plan.json's groups: the chosen
    ones and every candidate (its equal-capacity comparison holds them all)."""
    groups = [*plan["groups"], *plan.get("compare", {}).get("equal_capacity", {}).get("groups",
                                                                                       [])]
    return {(g["gpu"], g["dtype"], g["kv_cache"]):
            g["price_per_hour"] / (3600.0 * g["tokens_per_s"]) for g in groups}


def fleet_prices(fleet: str, prices: dict) -> dict[str, float]:
    """A study fleet's groups, as its logs name them → dollars per token."""
    if fleet in STUDY_FLEETS:
        from mismatch.fleets import FLEETS

        groups = [(g.name, (g.gpu, g.dtype, g.kv_cache))
                  for g in FLEETS[STUDY_FLEETS[fleet]].groups]
    else:
        from mismatch.train.fleet import fleet_file

        groups = [(g.name, (g.spec.gpu, g.spec.dtype, g.spec.kv_cache))
                  for g in fleet_file(fleet)]
    missing = [key for _, key in groups if key not in prices]
    if missing:
        raise SystemExit(f"plan.json prices no group {'-'.join(missing[0])}; plan a spec "
                         "holding every fleet's groups")
    return {name: prices[key] for name, key in groups}


def step_costs(records: list[dict], per_token: dict[str, float]) -> tuple[list[float], str]:
    """Each step's sampling cost in dollars, and how it was had: logged / exact / estimated."""
    if all(r.get("sampling_cost_usd") is not None for r in records):
        return [float(r["sampling_cost_usd"]) for r in records], "logged"
    if len(per_token) == 1:  # one group: every token is its
        (price,) = per_token.values()
        return [r["sampled_tokens"] * price for r in records], "exact"
    if all(r.get("group_tokens") for r in records):
        return [sum(n * per_token[g] for g, n in r["group_tokens"].items())
                for r in records], "exact"
    mean = sum(per_token.values()) / len(per_token)
    return [r["sampled_tokens"] * mean for r in records], "estimated"


def cumulative(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def summarize(runs: Path, cfg, prices) -> list[dict]:
    rows = []
    for cell in cells(cfg):
        s = summarize_run(runs / cell.name)
        if s is None:
            continue
        per_token = fleet_prices(cell.fleet, prices)
        costs, how = step_costs(s.records, per_token)
        cum = cumulative(costs)
        estimate = None
        if how == "exact" and len(per_token) > 1:  # what the equal-share estimate would say
            est, _ = step_costs([{"sampled_tokens": r["sampled_tokens"]} for r in s.records],
                                per_token)
            estimate = sum(est) / cum[-1] - 1
        adopted = (runs / cell.name / "adopted.json").is_file()
        mid_step = (cfg.steps + 1) // 2
        rows.append({"fleet": fleet_label(cell.fleet), "seed": cell.seed, "summary": s,
                     "steps": s.last_step, "cost": cum[-1], "cost_how": how,
                     "cost_mid": cum[min(mid_step, len(cum)) - 1],
                     "cost_per_step": cum[-1] / len(cum), "estimate_error": estimate,
                     "source": "study's grid (adopted)" if adopted else "this grid"})
    return rows


def plot(rows: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    seen = set()
    for r in rows:
        h = r["summary"].heldout
        if not {"base", "mid", "final"} <= set(h):
            continue
        color = COLORS.get(r["fleet"], "tab:green")
        label = None if r["fleet"] in seen else r["fleet"]
        seen.add(r["fleet"])
        ax.plot([0.0, r["cost_mid"], r["cost"]], [h["base"], h["mid"], h["final"]],
                color=color, marker="o", lw=1.0, alpha=0.5, label=label)
    ax.set_xlabel("cumulative sampling cost, $ (priced per token by the plan)")
    ax.set_ylabel("held-out reward (64 tasks × 4, temperature 1)")
    for fleet in dict.fromkeys(r["fleet"] for r in rows):  # the mean over seeds, bold
        pts = [r for r in rows if r["fleet"] == fleet
               and {"base", "mid", "final"} <= set(r["summary"].heldout)]
        if len(pts) > 1:
            mean = [sum(x) / len(pts) for x in zip(*[
                (0.0, r["cost_mid"], r["cost"], *(r["summary"].heldout[k]
                                                  for k in ("base", "mid", "final")))
                for r in pts])]
            ax.plot(mean[:3], mean[3:], color=COLORS.get(fleet, "tab:green"), lw=3.2,
                    marker="D", ms=6)
    ax.set_title("held-out reward against sampling cost: before, midway, after\n"
                 "thin: one seed; bold: the mean over seeds (emulated samplers)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _fmt_ci(vals: list[float], digits: str = ".3f") -> str:
    if not vals:
        return "–"
    mean, half = ci95(vals)
    return f"{mean:{digits}}" + ("" if math.isnan(half) else f" ± {half:{digits}}")


def _reading(rows: list[dict], per_step: dict[str, float]) -> list[str]:
    """What the table says, in the figures of these runs."""
    fleets = list(per_step)
    if not {"planned", "L0", "L2"} <= set(fleets):
        return []
    final = {f: ci95([r["summary"].heldout.get("final", float("nan")) for r in rows
                      if r["fleet"] == f])[0] for f in fleets}
    runs = {f: sum(r["fleet"] == f for r in rows) for f in fleets}
    collapsed = sum(r["summary"].halved_step is not None for r in rows)
    return [
        f"Reading it: the planned fleet sampled for {1 - per_step['planned'] / per_step['L0']:.1%}"
        f" less per step than homogeneous B200 BF16 samplers (L0) and ended at a held-out reward"
        f" of {final['planned']:.3f} against L0's {final['L0']:.3f} and L2's {final['L2']:.3f}"
        f" (the intervals overlap: {runs['planned']} seeds each cannot tell them apart). "
        f"{collapsed} of {len(rows)} runs collapsed. The study's equal-share mix (L2) sampled "
        f"for {1 - per_step['L2'] / per_step['L0']:.1%} less than L0 — the study reports ~15% — "
        "but its token-weighted KL is several times the plan's budget: it held here because "
        "SC+MIS corrects it, which is what the budget buys insurance against. The planner's "
        "price per token is that of the served model the plan was made for (the fleet file's "
        "[model] config in the throughput model: Qwen3-30B-A3B for "
        "examples/plan/study-fleet.toml) applied to this project's policy's tokens; the "
        "L0 seed-0 run is bit-for-bit the study's own (same policy, same code path), while "
        "L2's seed 0 differs from the study's since mixed batches share an engine batch "
        "(lanes), a change of kernel order that any rerun on new code shows.",
        "",
        "The study's own report and curves of these runs: `mismatch study --out "
        "reports/plan-fleet-runs --report-only --report FILE` (run from the repository's root)."]


def report(rows: list[dict], cfg, plan: dict, runs: Path, figure: str) -> str:
    order = list(dict.fromkeys(r["fleet"] for r in rows))
    out = ["# The planned fleet in training, beside L0 and L2 (`mismatch plan` → "
           "`mismatch study`)", "",
           f"Command: `python scripts/make_plan_fleet_runs_report.py --runs "
           f"{runs.relative_to(ROOT) if runs.is_relative_to(ROOT) else runs}`. The runs: "
           f"SC+MIS, staleness {cfg.staleness[0]}, {cfg.steps} steps of {cfg.prompts} × "
           f"{cfg.samples}, lr {cfg.lr:g}, from policy-{cfg.policy_steps}, "
           f"{cfg.eval_tasks} held-out tasks × 4 at temperature 1 (the study's regime), "
           f"seeds {', '.join(map(str, cfg.seeds))}; every sampler emulated on a CPU.", "",
           f"The plan: `{plan.get('command', 'mismatch plan')}` — "
           + ", ".join(f"{g['share']:.1%} {g['name']}" for g in plan["groups"] if g["share"] > 0)
           + f"; {plan['billing']} billing, ${plan['cost_per_update_usd']:.4f} per update, "
           f"token-weighted KL {plan['kl']:.3g} (budget {plan['kl_budget']:.3g}: 4.7× the "
           "trainer-matched group's).", "",
           "## Per fleet", "",
           "| fleet | runs | held-out before | midway | after | collapsed | critical alerts "
           "| sampling $ per step | vs L0 | $ over the run |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    per_step = {f: ci95([r["cost_per_step"] for r in rows if r["fleet"] == f])[0]
                for f in order}
    for f in order:
        rs = [r for r in rows if r["fleet"] == f]
        h = [r["summary"].heldout for r in rs]
        done = [r for r in rs if r["steps"] >= cfg.steps]
        collapsed = sum(r["summary"].halved_step is not None for r in rs)
        vs_l0 = f"{per_step[f] / per_step['L0'] - 1:+.1%}" if "L0" in per_step else "n/a"
        out.append(
            f"| {f} | {len(done)} of {len(rs)} done | "
            + " | ".join(_fmt_ci([x[k] for x in h if k in x]) for k in ("base", "mid", "final"))
            + f" | {share_ci(collapsed, len(rs))} | "
            f"{sum(r['summary'].critical_alerts for r in rs)} | "
            f"{_fmt_ci([r['cost_per_step'] for r in rs], '.5f')} | "
            f"{vs_l0} | "
            f"{_fmt_ci([r['cost'] for r in rs], '.3f')} |")
    out += ["", *_reading(rows, per_step)]
    out += ["", "Means with 95% t-intervals over seeds; collapsed: the training reward's 5-step "
            "mean fell to half its first 3 steps' (the study's test), with a 95% "
            "Clopper–Pearson interval.", "", f"![held-out reward against sampling cost]"
            f"({figure})", "", "## Per run", "",
            "| run | source | steps | held-out before / mid / after | halved at | KL mean "
            "| $ over the run | cost from |", "|---|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        s, h = r["summary"], r["summary"].heldout
        held = " / ".join(f"{h[k]:.3f}" if k in h else "–" for k in ("base", "mid", "final"))
        how = r["cost_how"] + ("" if r["estimate_error"] is None else
                               f" (equal-share estimate {r['estimate_error']:+.2%})")
        out.append(f"| {r['fleet']}-s{r['seed']} | {r['source']} | {r['steps']} | {held} | "
                   f"{s.halved_step or '–'} | {s.kl_mean:.3g} | {r['cost']:.3f} | {how} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=RUNS, help="the three-fleet grid's --export "
                    "folder (study.json, plan.json, the runs' logs)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from mismatch.study.cells import StudyConfig

    runs = args.runs.resolve()
    try:
        raw = json.loads((runs / "study.json").read_text())
        plan = json.loads((runs / "plan.json").read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{runs}: needs study.json and plan.json ({exc})") from None
    # a fleet file named by a path of the machine that ran the grid: the copy beside the runs
    raw["fleets"] = [f if not f.endswith(".toml") or Path(f).is_file() else str(runs / Path(f).name)
                     for f in raw["fleets"]]
    fields = StudyConfig.__dataclass_fields__
    cfg = StudyConfig(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in raw.items() if k in fields})
    rows = summarize(runs, cfg, price_per_token(plan))
    if not rows:
        raise SystemExit(f"{runs}: no run has logged a step yet")
    figure = plot(rows, args.out.with_suffix(".png"))
    atomic_write_text(args.out, report(rows, cfg, plan, runs, figure))
    print(args.out)


if __name__ == "__main__":
    main()
