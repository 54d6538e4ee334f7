"""`mismatch plan`: fill each group's figures, solve, compare, and write the plan.

Figures a fleet file leaves out are filled, each saying where it came from:

- `price_per_hour`: the dated, sourced table of mismatch.plan.hardware (a GPU without a published
  price there is a one-line error asking for one);
- `tokens_per_s`: mismatch.plan.throughput's roofline model of decode for the model's config;
- `kl` and `masked`: the probe (mismatch.app.probe.run_probe, emulated) of the group's numerics
  against the BF16 trainer on the model: the `total` column's exact KL and MIS masked share.
  Probes are cached per model contents × group × probe settings, so planning again is instant.

Then mismatch.plan.solve finds the optimum under the file's billing, and the plan is set beside
two fleets of the same groups: the trainer-matched group alone (homogeneous) and every group with
an equal share (as the reference study ran its mixed fleet). The frontier — cost per update
against the KL budget — is drawn with the chosen plan marked.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mismatch.io import atomic_write_text, mark_output, save_figure, user_cache_dir
from mismatch.plan import PlanInfeasible, PlanInputError
from mismatch.plan.solve import (Plan, equal_capacity_plan, frontier, homogeneous_plan,
                                 solve_numbers)
from mismatch.plan.spec import PlanGroup, PlanSpec

__all__ = ["PlanResult", "fill_figures", "plan_fleet", "render_table", "write_outputs",
           "fleet_toml", "default_cache_dir", "simulate_plan", "simulation_lines"]

PROBE_VERSION = 1
"""Bumped when what the cached probe figures mean changes (invalidates the cache)."""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/mismatch/plan-probes (~/.cache by default)."""
    return user_cache_dir("plan-probes")


def _model_key(model: Path | None) -> str:
    """A digest of the model's contents (config and weights), so that a rebuilt model at the same
    path is probed again."""
    from mismatch.zoo.loading import default_model_dir

    d = Path(model) if model else default_model_dir()
    h = hashlib.sha256()
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    if not files:
        raise PlanInputError(f"--model {d} holds no config.json or safetensors weights")
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:20]


def _probe_figures(group: PlanGroup, model: Path | None, model_key: str, n_prompts: int,
                   seed: int, cache: Path | None, log: Callable[[str], None]) -> tuple[dict, bool]:
    """{"kl": exact KL, "masked": MIS masked share} of the group's sampler vs the trainer, and
    whether it came from the cache (`model_key`: _model_key(model), computed once per plan)."""
    key = {"version": PROBE_VERSION, "model": model_key, "gpu": group.gpu,
           "dtype": group.dtype, "kv_cache": group.kv_cache, "n_prompts": n_prompts,
           "seed": seed}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json"
    if cache is not None and (cache / name).is_file():
        try:
            got = json.loads((cache / name).read_text())
            if got.get("key") == key:
                return got["figures"], True
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # a damaged entry is probed again and rewritten
    from mismatch.app.probe import ProbeConfig, run_probe

    log(f"probing {group.name} ({group.gpu} {group.dtype}, KV {group.kv_cache}) on "
        f"{n_prompts} prompts")
    result = run_probe(ProbeConfig(gpu=group.gpu, dtype=group.dtype, kv_cache=group.kv_cache,
                                   model=model, n_prompts=n_prompts, seed=seed, emulate=True))
    total = result.record.total
    figures = {"kl": float(total.kl_exact), "masked": float(total.mis_masked_fraction),
               "mode": result.record.mode}
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache / name, json.dumps({"key": key, "figures": figures}))
        except OSError:
            pass  # no cache: the next plan probes again
    return figures, False


def fill_figures(spec: PlanSpec, model: Path | None = None, *, n_prompts: int = 128,
                 seed: int = 0, cache: Path | None = None, probe: bool = True,
                 log: Callable[[str], None] = lambda _line: None) -> PlanSpec:
    """The spec with every group's missing figures filled (module docstring)."""
    shape = None
    model_key = None
    groups = []
    for g in spec.groups:
        if g.price_per_hour is None:
            from mismatch.plan.hardware import default_price

            g = g.with_(
                "price_per_hour", default_price(g.gpu), "default table")
        if g.tokens_per_s is None:
            from mismatch.plan.throughput import ModelShape, decode_throughput

            if shape is None:
                shape = _shape(model, ModelShape, spec.served_config)
            kwargs = {} if spec.context is None else {"context": spec.context}
            est = decode_throughput(shape, g.gpu, g.dtype, g.kv_cache, **kwargs)
            g = g.with_("tokens_per_s", est.tokens_per_s, "throughput model")
        if g.kl is None or g.masked is None:
            if not probe:
                raise PlanInputError(f"group {g.name!r} has no {' or '.join(g.missing())}: give "
                                     f"it in {spec.path}, or drop --no-probe to probe it")
            if model_key is None:
                model_key = _model_key(model)  # reads every weight file: once per plan
            figures, cached = _probe_figures(g, model, model_key, n_prompts, seed, cache, log)
            source = "probe (emulated, cached)" if cached else "probe (emulated)"
            if g.kl is None:
                g = g.with_("kl", figures["kl"], source)
            if g.masked is None:
                g = g.with_("masked", figures["masked"], source)
        groups.append(g)
    return spec.with_groups(groups)


def _shape(model: Path | None, ModelShape, served_config: str | None = None):
    """The throughput model's shape: the fleet file's served config, else --model's."""
    from mismatch.zoo.loading import default_model_dir

    if served_config is not None:
        try:
            return ModelShape.from_config(json.loads(Path(served_config).read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise PlanInputError(f"cannot read the served model's config {served_config}: "
                                 f"{exc}") from None
    d = Path(model) if model else default_model_dir()
    try:
        return ModelShape.from_dir(d)
    except (OSError, ValueError, KeyError) as exc:
        raise PlanInputError(f"cannot read the model config in {d}: {exc}") from None


@dataclass(frozen=True)
class PlanResult:
    """A solved plan with its comparisons."""

    spec: PlanSpec
    plan: Plan
    homogeneous: Plan | None
    equal: Plan | None
    frontier: list[tuple[float, float | None]]
    simulation: object | None = None
    """mismatch.plan.simulate.SimResult of the plan over a capacity trace (`--simulate`)."""

    def to_json(self) -> dict:
        out = self.plan.to_json()
        if self.simulation is not None:
            out["simulation"] = self.simulation.to_json()

        def side(other: Plan | None) -> dict | None:
            if other is None:
                return None
            cost = other.cost_per_update_usd
            return {"cost_per_update_usd": cost, "kl": other.kl, "masked": other.masked,
                    "gpus": other.gpus, "within_budget": other.kl <= self.plan.kl_budget
                    and other.masked <= self.plan.masked_budget,
                    "saving": 1.0 - self.plan.cost_per_update_usd / cost if cost > 0 else None,
                    "groups": [p.to_json() for p in other.parts]}

        out.update(updates_per_hour=self.spec.updates_per_hour,
                   useful_tokens_per_update=self.spec.tokens,
                   compare={"homogeneous": side(self.homogeneous),
                            "equal_capacity": side(self.equal)},
                   frontier=[{"kl_budget": b, "cost_per_update_usd": c} for b, c in self.frontier])
        return out


def plan_fleet(spec: PlanSpec, billing: str | None = None, kl_budget: float | None = None,
               frontier_points: int = 24) -> PlanResult:
    """Solve a filled spec and build its comparisons; raises PlanInfeasible."""
    billing = billing or spec.billing
    plan = solve_numbers(spec, billing, kl_budget)
    return PlanResult(spec=spec, plan=plan, homogeneous=homogeneous_plan(spec, billing),
                      equal=equal_capacity_plan(spec, billing),
                      frontier=frontier(spec, billing, frontier_points)
                      if frontier_points else [])


def simulate_plan(result: PlanResult, trace: Path, *, hours: float = 2.0,
                  cold_start_s: float = 120.0, episode_tokens: float = 1024.0, batch: int = 64,
                  trainer_step_s: float | None = None, max_staleness: int | None = 4,
                  seed: int = 0) -> PlanResult:
    """The plan over a capacity trace (mismatch.plan.simulate): every group of the file, the
    plan's GPUs where the trace says nothing, and on each change of capacity the planner run
    again with the GPUs then available (the cheapest shares within the budgets; where no fleet
    meets them, shares follow capacity). The trainer takes 3600 / R seconds an update unless
    `trainer_step_s` is given. Samplers admit new episodes only `max_staleness` updates ahead
    (AReaL's bound, mismatch.plan.simulate): a fleet with more GPUs than the pace needs then
    idles instead of sampling tokens no update consumes."""
    from dataclasses import replace

    from mismatch.plan.simulate import simulate

    spec, plan = result.spec, result.plan
    by_name = {p.group.name: p for p in plan.parts}
    gpus = {g.name: int(math.ceil(by_name[g.name].gpus - 1e-9)) for g in spec.groups}
    kl_budget = plan.kl_budget

    def replan(capacity: dict[str, int]) -> dict[str, float]:
        groups = [replace(g, max_gpus=int(capacity.get(g.name, 0))) for g in spec.groups]
        try:
            again = solve_numbers(spec.with_groups(groups), plan.billing, kl_budget)
            shares = {p.group.name: p.share for p in again.parts}
        except PlanInfeasible:
            shares = {g.name: capacity.get(g.name, 0) * g.tokens_per_s for g in spec.groups}
        if sum(shares.values()) <= 0:
            shares = {g.name: 1.0 for g in spec.groups}
        return shares

    sim = simulate(spec.groups, [episode_tokens], tokens_per_update=spec.tokens,
                   trainer_step_s=trainer_step_s or 3600.0 / spec.updates_per_hour,
                   duration_s=hours * 3600.0, trace=trace, gpus=gpus, cold_start_s=cold_start_s,
                   batch=batch, replan=replan, max_staleness=max_staleness, seed=seed)
    return replace(result, simulation=sim)


def simulation_lines(sim) -> list[str]:
    """The simulation in a few lines: pace, staleness, cost per update, utilisation."""
    lines = [f"simulated {sim.duration_s / 3600:.3g} h: {len(sim.updates)} updates, "
             f"{sim.updates_per_hour:.3g} per hour; staleness mean {sim.staleness_mean:.2f}, "
             f"max {sim.staleness_max}"]
    for billing in ("serverless", "reserved"):
        costs = [c for _, c in sim.cost_per_update(billing)]
        if costs:
            lines.append(f"  $ per update, {billing}: mean {sum(costs) / len(costs):.4g}, "
                         f"min {min(costs):.4g}, max {max(costs):.4g}")
    used = [f"{g.name} {g.utilisation:.0%}" for g in sim.groups if g.held_gpu_s > 0]
    if used:
        lines.append("  sampler utilisation: " + ", ".join(used))
    return lines


def render_table(result: PlanResult) -> str:
    """The plan as text: per group, then the fleet beside the two comparison fleets."""
    plan = result.plan
    gpus_label = "GPUs" if plan.billing == "reserved" else "GPUs busy"
    lines = [f"plan: {plan.billing} billing, {result.spec.tokens:.4g} useful tokens per update, "
             f"{result.spec.updates_per_hour:g} updates/hour; budgets KL ≤ {plan.kl_budget:.3g}, "
             f"masked ≤ {plan.masked_budget:.3g}", ""]
    head = (f"{'group':<22}{gpus_label:>10}{'share':>8}{'tokens/update':>15}{'$/update':>11}"
            f"{'KL':>10}{'masked':>9}  figures from")
    lines.append(head)
    for p in plan.parts:
        g = p.group
        src = sorted(set(g.sources.values()))
        gp = f"{p.gpus:.0f}" if plan.billing == "reserved" else f"{p.gpus:.2f}"
        lines.append(f"{g.name:<22}{gp:>10}{p.share:>8.1%}{p.tokens_per_update:>15.4g}"
                     f"{p.cost_per_update_usd:>11.4f}{g.kl:>10.3g}{g.masked:>9.3g}  "
                     f"{', '.join(src)}")
    lines.append("")
    lines.append(f"{'fleet':<30}{'$/update':>10}{'KL':>10}{'masked':>9}{'saving':>9}")
    rows = [("planned", plan), ("homogeneous (trainer-matched)", result.homogeneous),
            ("equal capacity, same groups", result.equal)]
    for label, other in rows:
        if other is None:
            lines.append(f"{label:<30}{'n/a':>10}  (not in the file, or its GPUs cannot keep "
                         f"the pace)")
            continue
        cost = other.cost_per_update_usd
        saving = "" if other is plan else (f"{1 - plan.cost_per_update_usd / cost:>9.1%}"
                                           if cost > 0 else f"{'n/a':>9}")
        flag = "" if other is plan or (other.kl <= plan.kl_budget
                                       and other.masked <= plan.masked_budget) else \
            "  over budget"
        lines.append(f"{label:<30}{cost:>10.4f}{other.kl:>10.3g}{other.masked:>9.3g}"
                     f"{saving}{flag}")
    return "\n".join(lines)


def fleet_toml(result: PlanResult) -> str:
    """The planned fleet as a fleet file: its groups with their shares and figures."""
    plan = result.plan
    out = ["# The fleet `mismatch plan` chose: each group's share of the sampled tokens.",
           f"# billing {plan.billing}; $ {plan.cost_per_update_usd:.6g} per update; token-weighted "
           f"KL {plan.kl:.6g} (budget {plan.kl_budget:.6g}); masked {plan.masked:.6g}", ""]
    for p in plan.parts:
        if p.share <= 0:
            continue
        g = p.group
        out += ["[[group]]", f'name = "{g.name}"', f'gpu = "{g.gpu}"', f'dtype = "{g.dtype}"',
                f'kv_cache = "{g.kv_cache}"', f"share = {p.share:.9g}",
                f"gpus = {p.gpus:.9g}", f"price_per_hour = {g.price_per_hour:.9g}",
                f"tokens_per_s = {g.tokens_per_s:.9g}", f"kl = {g.kl:.9g}",
                f"masked = {g.masked:.9g}", ""]
    return "\n".join(out)


def _frontier_figure(result: PlanResult):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pts = [(b, c) for b, c in result.frontier if c is not None]
    if pts:
        ax.plot([b for b, _ in pts], [c for _, c in pts], "o-", ms=3, label="cheapest fleet")
    plan = result.plan
    ax.plot([plan.kl_budget], [plan.cost_per_update_usd], "r*", ms=14,
            label=f"this plan (KL {plan.kl:.2e})")
    for label, other, marker in (("homogeneous", result.homogeneous, "s"),
                                 ("equal capacity", result.equal, "^")):
        if other is not None:
            ax.plot([other.kl], [other.cost_per_update_usd], marker, ms=8, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("KL budget (token-weighted exact KL)")
    ax.set_ylabel("$ per update")
    ax.set_title(f"Cost per update against the KL budget ({plan.billing})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def write_outputs(out: Path, result: PlanResult, command: str) -> list[str]:
    """plan.json, fleet.toml, frontier.png and report.md into `out`, written whole (a temporary
    sibling, then renamed)."""
    from mismatch.io import atomic_directory

    names = []
    with atomic_directory(out) as tmp:
        body = result.to_json()
        body["command"] = command
        (tmp / "plan.json").write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")
        (tmp / "fleet.toml").write_text(fleet_toml(result))
        names += ["plan.json", "fleet.toml"]
        if result.frontier:
            names.append(save_figure(_frontier_figure(result), tmp / "frontier.png"))
        if result.simulation is not None:
            from mismatch.plan.simulate import plot

            names.append(plot(result.simulation, tmp / "simulation.png"))
        report = ["# Fleet plan", "", f"Command: `{command}`", "", "```", render_table(result),
                  "```", ""]
        if result.frontier:
            report += ["![cost per update against the KL budget](frontier.png)", ""]
        if result.simulation is not None:
            report += ["## Over a capacity trace", "", "```",
                       *simulation_lines(result.simulation), "```", "",
                       "![cost per update and staleness over the run](simulation.png)", ""]
        (tmp / "report.md").write_text("\n".join(report))
        names.append("report.md")
        mark_output(tmp, "plan")
    return names

