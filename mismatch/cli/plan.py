"""`mismatch plan FLEET.toml`: the cheapest sampler fleet within a mismatch budget.

Exit codes: 0 a plan, 1 no fleet meets the budgets (the binding constraint is named), 2 bad input
(malformed file, unknown GPU or format, a negative price, a GPU with no default price).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mismatch.cli.common import choice_list, fail
from mismatch.plan.spec import BILLINGS


def plan_command(
    fleet: Path = typer.Argument(..., help="Fleet file (TOML): [update], [budget], [[group]] "
                                 "(docs/plan.md)."),
    billing: str | None = typer.Option(None, "--billing", help=f"{choice_list(BILLINGS)} "
                                       "(default: the file's budget.billing)."),
    kl: float | None = typer.Option(None, "--kl", help="KL budget, overriding the file's."),
    model: Path | None = typer.Option(None, "--model", help="Hugging Face model directory whose "
                                      "throughput and probes fill figures the file leaves out "
                                      "(default: the embedded model)."),
    n_prompts: int = typer.Option(128, "--n-prompts", min=1, help="Prompts per group probe."),
    seed: int = typer.Option(0, "--seed", help="Probe seed."),
    no_probe: bool = typer.Option(False, "--no-probe", help="Refuse to probe: every group must "
                                  "give kl and masked."),
    cache: Path | None = typer.Option(None, "--cache", help="Probe cache folder (default: "
                                      "$XDG_CACHE_HOME/mismatch/plan-probes)."),
    out: Path | None = typer.Option(None, "--out", help="Write plan.json, fleet.toml, "
                                    "frontier.png and report.md here (default: "
                                    "runs/plan-<file name>). A folder holding anything but an "
                                    "earlier plan is refused."),
    simulate: Path | None = typer.Option(None, "--simulate", help="Also run the plan over this "
                                         "capacity trace (CSV time_s,group,gpus): staleness, "
                                         "utilisation and cost per update over time, replanned "
                                         "at each change of capacity."),
    sim_hours: float = typer.Option(2.0, "--sim-hours", help="Simulated hours."),
    cold_start: float = typer.Option(120.0, "--cold-start", help="Seconds a GPU added mid-run "
                                     "takes to serve."),
    episode_tokens: float = typer.Option(1024.0, "--episode-tokens", help="Sampled tokens per "
                                         "episode (simulation)."),
    sim_batch: int = typer.Option(64, "--sim-batch", help="Episodes each GPU decodes at once "
                                  "(simulation)."),
    force: bool = typer.Option(False, "--force", help="Replace --out whatever it holds."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object to stdout."),
) -> None:
    """Plan the cheapest sampler fleet within a mismatch budget: exit 0 plan, 1 infeasible, 2 bad
    input."""
    from mismatch.plan import PlanInfeasible, PlanInputError

    command = "mismatch " + " ".join(sys.argv[1:]) if sys.argv[1:] else "mismatch plan"
    try:
        spec, target = _inputs(fleet, billing=billing, kl=kl, model=model, out=out, force=force,
                               n_prompts=n_prompts, seed=seed, cache=cache, no_probe=no_probe,
                               as_json=as_json)
    except (PlanInputError, ValueError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    try:
        result = _solve(spec, billing, kl, simulate, seed=seed, hours=sim_hours,
                        cold_start_s=cold_start, episode_tokens=episode_tokens, batch=sim_batch)
    except PlanInfeasible as exc:
        fail(f"no fleet meets the budgets: {exc}", code=1)
    except PlanInputError as exc:
        fail(str(exc).splitlines()[0])
    _print(result, target, command, as_json)


def _inputs(fleet: Path, *, billing, kl, model, out, force, n_prompts, seed, cache, no_probe,
            as_json):
    """The fleet file read and its missing figures filled (probing the groups where the file
    leaves their KL out), and the output folder checked: (spec, target)."""
    from mismatch.io import check_output_dir
    from mismatch.plan import PlanInputError
    from mismatch.plan.spec import BILLINGS, load_spec

    if billing is not None and billing not in BILLINGS:
        raise PlanInputError(f"--billing {billing!r}: choose serverless or reserved")
    if kl is not None and not kl > 0:
        raise PlanInputError(f"--kl must be > 0, got {kl}")
    if model is not None and not Path(model).is_dir():
        raise PlanInputError(f"--model {model} is not a directory")
    spec = load_spec(fleet)
    target = check_output_dir(out or Path("runs") / f"plan-{fleet.stem}", "plan", force=force)
    from mismatch.app.plan import default_cache_dir, fill_figures

    if spec.groups and any(g.kl is None or g.masked is None for g in spec.groups) \
            and not no_probe:
        from mismatch.cli.common import quiet_libraries

        quiet_libraries()
    log = (lambda line: None) if as_json else (lambda line: typer.echo(line, err=True))
    return fill_figures(spec, model, n_prompts=n_prompts, seed=seed,
                        cache=cache or default_cache_dir(), probe=not no_probe, log=log), target


def _solve(spec, billing, kl, simulate: Path | None, *, seed: int, **sim):
    """The exact plan, and its run over a capacity trace with --simulate (`sim`: hours,
    cold_start_s, episode_tokens, batch)."""
    from mismatch.app.plan import plan_fleet
    from mismatch.plan import PlanInputError

    result = plan_fleet(spec, billing, kl)
    if simulate is None:
        return result
    from mismatch.app.plan import simulate_plan

    for name, key in (("--sim-hours", "hours"), ("--episode-tokens", "episode_tokens"),
                      ("--sim-batch", "batch")):
        if not sim[key] > 0:
            raise PlanInputError(f"{name} must be > 0, got {sim[key]}")
    return simulate_plan(result, simulate, seed=seed, **sim)


def _print(result, target: Path, command: str, as_json: bool) -> None:
    """Write the outputs; the plan on stdout (a table, or one JSON object)."""
    import json

    from mismatch.app.plan import render_table, simulation_lines, write_outputs

    names = write_outputs(target, result, command)
    if as_json:
        typer.echo(json.dumps(result.to_json(), allow_nan=False))
        return
    typer.echo(render_table(result))
    if result.simulation is not None:
        typer.echo("")
        for line in simulation_lines(result.simulation):
            typer.echo(line)
    typer.echo(f"wrote {target}/" + ", ".join(names))
