"""An asynchronous RL run on a sampler fleet over time: a discrete-event simulation.

`mismatch plan` solves for a steady fleet; a run is not steady. Spot GPUs are reclaimed, scale-ups
take minutes to load weights, and the trainer's pace and the fleet's meet in a buffer whose depth
sets how stale the sampled tokens are. `simulate` plays a run on a fleet of `PlanGroup`s under a
capacity trace and reports, per update, its time, staleness and cost, and per group what its GPUs
did. The events are scheduled with SimPy (https://simpy.readthedocs.io, a process-based
discrete-event library); the model is deliberately small:

**Samplers.** Group g has n_g(t) GPUs, each decoding `batch` sequences at once (continuous
batching, Yu et al., "Orca", OSDI 2022) at an aggregate r_g = `tokens_per_s` sampled tokens/s, so
one episode of L tokens lasts L · batch / r_g seconds whatever the other sequences do (a fuller
batch does not slow a sequence down, nor an emptier one speed it up). Each slot starts a new
episode the moment it frees, with the newest published weight version; episode lengths are drawn
(seeded, with replacement) from a list, e.g. `episode_lengths_from_metrics` of a `mismatch train`
run. An episode's useful tokens are its tokens × (1 − q_g), the group's MIS masked share applied
as an expectation.

**Router.** Because every slot pulls its next episode when it frees, the next episode starts on
group g with probability proportional to the rate at which g's slots free, n_g · batch /
(L · batch / r_g) = n_g r_g / L: capacity-proportional routing, the long-run shares of
mismatch.train.fleet's Router with shares n_g r_g / Σ n r, with no group left idle while another
queues. A user's `replan(capacity) -> shares` callback (the planner, say) is called at the start
and whenever a group's productive GPU count changes, with {group: productive GPUs}; its shares
(weights, normalised over the groups that have productive GPUs) are enforced as a cap on each
group's concurrent episodes: with c_g = n_g r_g, the fleet's pace is S = min over s_g > 0 of
c_g / s_g (the group that runs out first), and group g may run round(n_g · batch · s_g S / c_g)
episodes at once (at least 1 where s_g > 0), so its token share is s_g up to that rounding. A
share the capacity cannot carry leaves the other groups' GPUs partly idle — which serverless
billing does not charge and reserved billing does.

**Capacity.** A trace (`load_trace`: CSV `time_s,group,gpus`, one row per change) sets each
group's GPU count over time; a group it does not name keeps the count the caller gives (`gpus`,
else the group's `max_gpus`). The GPUs present at time 0 are productive at once, their slots
already in a steady state when `warm_start` (slot j of K starts with (j + ½)/K of its first
episode left, sampled with version 0: the run begins on a fleet that has been sampling, not with
every slot starting together). GPUs added later decode only after `cold_start_s` (weights loading,
CUDA graphs); they are held, and billed under reserved billing, from the moment they are added.
A removal is immediate: cold-starting GPUs go first, then productive ones, newest first; an
episode in flight on a removed GPU is lost (its tokens discarded, its GPU-seconds still billed)
and resampled — the same length is started afresh by the next free slot, so removals do not bias
the length distribution towards short episodes — as when a spot instance is reclaimed without
notice.

**Trainer.** Finished episodes wait in a FIFO buffer. The trainer takes exactly U =
`tokens_per_update` useful tokens (an episode that straddles two updates is split between them:
the token-weighted figures stay exact, and a real trainer packing whole episodes differs by less
than one episode per update), trains for `trainer_step_s`, and publishes version v + 1 after step
v. A consumed token's staleness is the trainer's version at consumption minus the version its
episode was sampled with (≥ 0). Without `max_staleness` the samplers never wait: when they
outpace the trainer the buffer, and the staleness, grow without bound. With `max_staleness` η a
slot starts a new episode only while the useful tokens started so far are below (v + η + 1) · U,
v the published version (the bounded staleness of AReaL, Fu et al., arXiv:2505.24298, in tokens
rather than trajectories): staleness then stays ≤ η whenever episodes finish in the order they
start.

**Billing**, both at once from the same run: *serverless* pays the GPU-seconds a group's GPUs
decode — busy slot-seconds / batch, i.e. a GPU decoding k of its `batch` sequences is k/batch
busy, as a platform packing requests on the fewest GPUs bills, which makes a sampled token cost
p_g / (3600 r_g), the planner's serverless price — and *reserved* pays every GPU held, cold ones
included. An update's cost is what was spent between the previous update's publication and its
own.

Bad input (a trace naming an unknown group, a negative or fractional GPU count, unsorted or
garbled rows, a group without a price or throughput) raises `PlanInputError` with one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from . import PlanInputError
from .simresult import GroupUsage, SimResult, UpdateRecord, plot
from .simrun import _Gpu, _Run
from .spec import PlanGroup
from .trace import CapacityTrace, _check_groups, episode_lengths_from_metrics, load_trace

__all__ = ["CapacityTrace", "UpdateRecord", "GroupUsage", "SimResult", "load_trace",
           "episode_lengths_from_metrics", "simulate", "plot"]

Replan = Callable[[dict[str, int]], Mapping[str, float]]


def simulate(groups: Sequence[PlanGroup], lengths: Sequence[float], *,
             tokens_per_update: float, trainer_step_s: float,
             duration_s: float | None = None, updates: int | None = None,
             trace: CapacityTrace | Path | str | None = None,
             gpus: Mapping[str, int] | None = None, cold_start_s: float = 0.0,
             batch: int | Mapping[str, int] = 1, replan: Replan | None = None,
             max_staleness: int | None = None, seed: int = 0,
             warm_start: bool = True) -> SimResult:
    """Simulate an asynchronous RL run on `groups` (module docstring for the model).

    groups: PlanGroups with tokens_per_s (per GPU) and price_per_hour; masked (q_g) 0 when None.
    lengths: episode lengths in sampled tokens, drawn with replacement (seeded).
    tokens_per_update: U, useful tokens per update. trainer_step_s: one update's training time.
    duration_s / updates: stop at that simulated time, or after that many updates (whichever
    comes first; one of them is needed).
    trace: a CapacityTrace or the path of a trace CSV (`load_trace`). gpus: {group: GPUs} for
    the groups the trace leaves out or before their first row (default: the group's max_gpus).
    cold_start_s: seconds a GPU added after the start takes to become productive.
    batch: sequences each GPU decodes at once (one for all groups, or {group: batch}).
    replan: called with {group: productive GPUs} at the start and whenever that changes; returns
    {group: token share}. None: shares follow capacity.
    max_staleness: η, the admission bound (module docstring); None: samplers never wait.
    warm_start: the fleet at time 0 is mid-stream (module docstring); False: every slot starts a
    whole episode at time 0.
    """
    groups = list(groups)
    _check_groups(groups)
    names = [g.name for g in groups]
    lengths = [float(x) for x in lengths]
    if not lengths or any(not (math.isfinite(x) and x > 0) for x in lengths):
        raise PlanInputError("simulate: episode lengths must be a non-empty list of positive "
                             "token counts")
    for label, v in (("tokens_per_update", tokens_per_update),
                     ("trainer_step_s", trainer_step_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise PlanInputError(f"simulate: {label} must be a positive number, got {v!r}")
    if not (isinstance(cold_start_s, (int, float)) and math.isfinite(cold_start_s)
            and cold_start_s >= 0):
        raise PlanInputError(f"simulate: cold_start_s must be ≥ 0, got {cold_start_s!r}")
    if duration_s is None and updates is None:
        raise PlanInputError("simulate: give duration_s or updates (when to stop)")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise PlanInputError(f"simulate: duration_s must be > 0, got {duration_s!r}")
    if updates is not None and (int(updates) != updates or updates < 1):
        raise PlanInputError(f"simulate: updates must be a whole number ≥ 1, got {updates!r}")
    if max_staleness is not None and (int(max_staleness) != max_staleness or max_staleness < 0):
        raise PlanInputError(f"simulate: max_staleness must be a whole number ≥ 0, got "
                             f"{max_staleness!r}")
    if isinstance(batch, Mapping):
        unknown = sorted(set(batch) - set(names))
        if unknown:
            raise PlanInputError(f"simulate: batch names unknown group {unknown[0]!r}")
        b = [batch.get(n, 1) for n in names]
    else:
        b = [batch] * len(names)
    if any(isinstance(x, bool) or int(x) != x or x < 1 for x in b):
        raise PlanInputError(f"simulate: batch must be a whole number ≥ 1, got {batch!r}")
    b = [int(x) for x in b]
    gpus = dict(gpus or {})
    unknown = sorted(set(gpus) - set(names))
    if unknown:
        raise PlanInputError(f"simulate: gpus names unknown group {unknown[0]!r}")
    default = {g.name: gpus.get(g.name, g.max_gpus) for g in groups}
    for n, k in default.items():
        if isinstance(k, bool) or int(k) != k or k < 0:
            raise PlanInputError(f"simulate: gpus of {n!r} must be a whole number ≥ 0, got {k!r}")
    if trace is None:
        trace = CapacityTrace()
    elif not isinstance(trace, CapacityTrace):
        trace = load_trace(trace, groups)
    unknown = sorted(set(trace.changes) - set(names))
    if unknown:
        raise PlanInputError(f"{trace.path}: unknown group {unknown[0]!r}; the fleet's groups: "
                             f"{', '.join(names)}")
    for name, rows in trace.changes.items():
        times = [t for t, _ in rows]
        if any(not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0) for t in times) \
                or any(b <= a for a, b in zip(times, times[1:])):
            raise PlanInputError(f"{trace.path}: the changes of {name!r} need increasing times "
                                 f"≥ 0, got {times}")
        if any(isinstance(n, bool) or int(n) != n or n < 0 for _, n in rows):
            raise PlanInputError(f"{trace.path}: the GPU counts of {name!r} must be whole "
                                 f"numbers ≥ 0, got {[n for _, n in rows]}")

    run = _Run(groups, lengths, float(tokens_per_update), float(trainer_step_s), b,
               float(cold_start_s), replan, None if max_staleness is None else int(max_staleness),
               seed)
    env = run.env
    # the fleet at time 0: productive at once, mid-stream when warm
    for g, grp in enumerate(groups):
        n0 = int(trace.at(grp.name, 0.0, int(default[grp.name])))
        total_slots = n0 * b[g]
        for i in range(n0):
            gpu = _Gpu(g)
            run.gpus[g].append(gpu)
            res = ([(i * b[g] + k + 0.5) / total_slots for k in range(b[g])]
                   if warm_start else None)
            run._bring_up(gpu, res)
        run.record_capacity(g)
    run.capacity_changed()
    for g, grp in enumerate(groups):
        later = [(t, n) for t, n in trace.changes.get(grp.name, ()) if t > 0]
        if later:
            env.process(run.trace_process(g, later))
    done = env.event()
    env.process(run.trainer(updates, done))
    until = done if updates is not None else duration_s
    if updates is not None and duration_s is not None:
        stop = env.timeout(duration_s)
        until = env.any_of([done, stop])
    try:
        env.run(until=until)
    except RuntimeError as exc:  # the event queue ran dry: nothing samples any more
        if "No scheduled events left" not in str(exc):
            raise
        raise PlanInputError(f"simulate: the run stops at t = {env.now:g} s after "
                             f"{len(run.updates)} of {updates} updates: no GPU can sample "
                             f"(check the capacity trace and replan's shares)") from None
    run.advance()
    usage = tuple(GroupUsage(
        name=grp.name, held_gpu_s=run.held_s[g], productive_gpu_s=run.up_s[g],
        busy_gpu_s=run.busy_s[g], sampled_tokens=run.sampled[g],
        consumed_tokens=run.consumed[g], lost_tokens=run.lost_tokens[g],
        lost_episodes=run.lost_eps[g], cost_serverless_usd=run.busy_s[g] * run.p[g],
        cost_reserved_usd=run.held_s[g] * run.p[g]) for g, grp in enumerate(groups))
    params = {"groups": [grp.to_json() for grp in groups], "tokens_per_update": tokens_per_update,
              "trainer_step_s": trainer_step_s, "duration_s": duration_s, "updates": updates,
              "gpus": default, "trace": trace.to_json(), "cold_start_s": cold_start_s,
              "batch": dict(zip(names, b)), "replan": replan is not None,
              "max_staleness": max_staleness, "seed": seed, "warm_start": warm_start,
              "lengths": {"n": len(lengths), "mean": float(np.mean(lengths)),
                          "min": min(lengths), "max": max(lengths)}}
    return SimResult(updates=tuple(run.updates), groups=usage, duration_s=float(env.now),
                     capacity=tuple(run.capacity), params=params)
