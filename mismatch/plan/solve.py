"""The cheapest sampler fleet within a mismatch budget, solved exactly.

Groups g have a price p_g ($/GPU-hour), a throughput r_g (sampled tokens/s per GPU), at most N_g
GPUs, a per-token mismatch κ_g (exact KL of the group's sampler against the trainer) and an MIS
masked share q_g. An update needs U useful (unmasked) sampled tokens; the trainer takes R updates
an hour. The budgets bound the fleet's token-weighted KL by B and its masked share by B_m.

**Serverless** billing (pay for the GPU-seconds used; groups scale to demand). Choose the sampled
tokens per update x_g ≥ 0 of each group:

    minimise   Σ x_g p_g / (3600 r_g)                     ($ per update)
    subject to Σ x_g (1 − q_g) = U                        (the update's useful tokens)
               x_g ≤ N_g r_g · 3600 / R                   (what N_g GPUs sample in 1/R hour)
               Σ x_g κ_g ≤ B Σ x_g,  Σ x_g q_g ≤ B_m Σ x_g

a linear program (scipy.optimize.linprog, HiGHS's dual simplex: a vertex, optimal to its
tolerances).

**Reserved** billing (pay for every GPU held). Choose integers 0 ≤ n_g ≤ N_g; the router sends
each group tokens in proportion to its capacity n_g r_g (as mismatch.train.fleet's router does),
so the token-weighted budgets are linear in n:

    minimise   Σ n_g p_g / R
    subject to Σ n_g r_g (1 − q_g) ≥ U R / 3600           (useful tokens at the trainer's pace)
               Σ n_g r_g (κ_g − B) ≤ 0,  Σ n_g r_g (q_g − B_m) ≤ 0

a mixed-integer program (scipy.optimize.milp, HiGHS's branch and bound, mip_rel_gap 0: proven
optimal).

Rows are scaled to O(1) coefficients before solving, and every solution is checked in float64
against the unscaled constraints: a budget met only within the solver's tolerance is solved again
with the row tightened by that tolerance, so a plan never exceeds a budget.

When no fleet meets the budgets, `PlanInfeasible` names the binding constraint — capacity (the
most the groups can sample at R updates an hour), the KL budget or the masked budget (the least
the fleet can reach under the other constraints, found by bisection on the budget, feasibility
being monotone in it) — and the value that would make the problem feasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import PlanInfeasible, PlanInputError
from .spec import PlanGroup, PlanSpec

__all__ = ["GroupPlan", "Plan", "solve", "solve_numbers", "homogeneous_plan",
           "equal_capacity_plan", "frontier"]

_TIGHTEN = (0.0, 1e-9, 1e-7, 1e-5)  # relative tightenings tried on a budget row, in order


@dataclass(frozen=True)
class GroupPlan:
    """One group's part of a plan."""

    group: PlanGroup
    gpus: float
    """Reserved: GPUs held (an integer). Serverless: the mean number of GPUs busy."""
    share: float
    """Share of the fleet's sampled tokens."""
    tokens_per_update: float
    """Sampled tokens per update (masked ones included)."""
    cost_per_update_usd: float

    def to_json(self) -> dict:
        g = self.group
        return {"name": g.name, "gpu": g.gpu, "dtype": g.dtype, "kv_cache": g.kv_cache,
                "share": self.share, "gpus": self.gpus,
                "tokens_per_update": self.tokens_per_update,
                "cost_per_update_usd": self.cost_per_update_usd,
                "price_per_hour": g.price_per_hour, "tokens_per_s": g.tokens_per_s,
                "kl": g.kl, "masked": g.masked, "max_gpus": g.max_gpus,
                "sources": dict(g.sources)}


@dataclass(frozen=True)
class Plan:
    """A fleet: its groups' parts and the figures the budgets bound."""

    billing: str
    parts: tuple[GroupPlan, ...]
    kl_budget: float | None = None
    masked_budget: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def cost_per_update_usd(self) -> float:
        return sum(p.cost_per_update_usd for p in self.parts)

    @property
    def tokens_per_update(self) -> float:
        return sum(p.tokens_per_update for p in self.parts)

    @property
    def kl(self) -> float:
        """Token-weighted KL of the fleet."""
        return _weighted([p.share for p in self.parts], [p.group.kl for p in self.parts])

    @property
    def masked(self) -> float:
        return _weighted([p.share for p in self.parts], [p.group.masked for p in self.parts])

    @property
    def gpus(self) -> float:
        return sum(p.gpus for p in self.parts)

    def to_json(self) -> dict:
        return {"billing": self.billing, "cost_per_update_usd": self.cost_per_update_usd,
                "kl": self.kl, "masked": self.masked, "kl_budget": self.kl_budget,
                "masked_budget": self.masked_budget,
                "tokens_per_update": self.tokens_per_update, "gpus": self.gpus,
                "groups": [p.to_json() for p in self.parts if p.share > 0 or p.gpus > 0],
                "notes": list(self.notes)}


# ---- the numbers -----------------------------------------------------------------------------

def _arrays(groups) -> tuple[np.ndarray, ...]:
    missing = [(g.name, g.missing()) for g in groups if g.missing()]
    if missing:
        name, figs = missing[0]
        raise PlanInputError(f"group {name!r} has no {', '.join(figs)}: give it in the fleet file "
                             f"or let `mismatch plan` fill it (--model for kl/masked)")
    p = np.array([g.price_per_hour for g in groups], dtype=np.float64)
    r = np.array([g.tokens_per_s for g in groups], dtype=np.float64)
    n = np.array([g.max_gpus for g in groups], dtype=np.float64)
    k = np.array([g.kl for g in groups], dtype=np.float64)
    q = np.array([g.masked for g in groups], dtype=np.float64)
    return p, r, n, k, q


def _serverless_x(p, r, n, k, q, U, R, B, Bm, tighten=0.0):
    """x (tokens per update per group) or None when infeasible."""
    from scipy.optimize import linprog

    caps = n * r * 3600.0 / R / U                 # y = x / U
    cost = p / (3600.0 * r)
    rows, rhs = [], []
    if B is not None:
        rows.append(k / B - 1.0)
        rhs.append(-tighten)
    if Bm is not None:
        rows.append((q - Bm) / max(Bm, 1e-12) if Bm > 0 else q.copy())
        rhs.append(-tighten)
    res = linprog(cost / cost.max(), A_ub=np.array(rows) if rows else None,
                  b_ub=np.array(rhs) if rows else None, A_eq=(1.0 - q)[None, :], b_eq=[1.0],
                  bounds=list(zip(np.zeros_like(caps), caps)), method="highs-ds")
    if res.status == 2:
        return None
    if res.status != 0:
        raise RuntimeError(f"the LP solver stopped: {res.message}")
    return np.clip(res.x, 0.0, caps) * U


def _reserved_n(p, r, n, k, q, U, R, B, Bm, tighten=0.0):
    """n (GPUs per group, integers) or None when infeasible."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    need = U * R / 3600.0
    scale = r / r.max()
    rows, lo, hi = [scale * (1.0 - q) * r.max() / need], [1.0], [np.inf]
    if B is not None:
        rows.append(scale * (k / B - 1.0))
        lo.append(-np.inf)
        hi.append(-tighten * scale.sum())
    if Bm is not None:
        rows.append(scale * ((q - Bm) / Bm if Bm > 0 else q))
        lo.append(-np.inf)
        hi.append(-tighten * scale.sum())
    res = milp(p / p.max(), constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.ones_like(p), bounds=Bounds(np.zeros_like(n), n),
               options={"mip_rel_gap": 0.0, "presolve": True})
    if res.status == 2 or res.x is None:
        return None
    if res.status != 0:
        raise RuntimeError(f"the MILP solver stopped: {res.message}")
    return np.round(res.x)


def _weighted(shares, values) -> float:
    """Σ share × value in float64, in group order: the plan's KL and masked share, computed the
    one way both the plan reports them and `_meets` checks them against the budgets (a dot
    product in another order can round one unit in the last place the other way)."""
    return sum(float(s) * float(v) for s, v in zip(shares, values))


def _meets(x_or_rate, k, q, B, Bm) -> bool:
    """Token-weighted budgets met in float64 by tokens (or rates) per group, as the plan will
    report them (its shares are x / Σx)."""
    tot = x_or_rate.sum()
    if tot <= 0:
        return False
    share = x_or_rate / tot
    ok = B is None or _weighted(share, k) <= B
    return ok and (Bm is None or _weighted(share, q) <= Bm)


def _solve_arrays(billing, p, r, n, k, q, U, R, B, Bm):
    """x (serverless) or n (reserved) meeting every constraint in float64, or None."""
    for tighten in _TIGHTEN:
        if billing == "serverless":
            x = _serverless_x(p, r, n, k, q, U, R, B, Bm, tighten)
            if x is None:
                return None
            if _meets(x, k, q, B, Bm):
                return x
        else:
            m = _reserved_n(p, r, n, k, q, U, R, B, Bm, tighten)
            if m is None:
                return None
            if _meets(m * r, k, q, B, Bm) and float((m * r) @ (1 - q)) >= U * R / 3600.0:
                return m
    return None


def _plan_from(billing, groups, sol, U, R, B, Bm, notes=()) -> Plan:
    p, r, n, k, q = _arrays(groups)
    if billing == "serverless":
        x = sol
        share = x / x.sum()
        gpus = x * R / (3600.0 * r)
        cost = x * p / (3600.0 * r)
    else:
        cap = sol * r
        share = cap / cap.sum()
        x = share * U / float(share @ (1.0 - q))
        gpus = sol
        cost = sol * p / R
    parts = tuple(GroupPlan(group=g, gpus=float(gpus[i]), share=float(share[i]),
                            tokens_per_update=float(x[i]), cost_per_update_usd=float(cost[i]))
                  for i, g in enumerate(groups))
    return Plan(billing=billing, parts=parts, kl_budget=B, masked_budget=Bm, notes=tuple(notes))


def _least_budget(billing, p, r, n, k, q, U, R, B, Bm, which: str) -> float | None:
    """The least budget `which` ("kl" or "masked") feasible with the other as given, by bisection
    (relative 1e-4, rounded up); None if not even the loosest one is."""
    values = k if which == "kl" else q
    hi = float(values.max())
    hi = hi * (1 + 1e-6) + 1e-300

    def ok(b):
        args = (b, Bm) if which == "kl" else (B, b)
        return _solve_arrays(billing, p, r, n, k, q, U, R, *args) is not None

    if not ok(hi):
        return None
    lo = float(values.min())
    if ok(lo):
        return lo
    while hi - lo > 1e-4 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _why_infeasible(billing, p, r, n, k, q, U, R, B, Bm) -> str:
    most = float((n * r * 3600.0 / R) @ (1.0 - q))  # useful tokens per update, every GPU
    if most < U:
        rate = R * most / U
        return (f"capacity binds: all {int(n.sum())} GPUs sample at most {most:.4g} useful tokens "
                f"per update at {R:g} updates/hour ({U:.4g} needed); raise max_gpus or lower "
                f"update.updates_per_hour to ≤ {rate:.4g}")
    kl_least = _least_budget(billing, p, r, n, k, q, U, R, B, Bm, "kl") if B is not None else None
    m_least = (_least_budget(billing, p, r, n, k, q, U, R, B, Bm, "masked")
               if Bm is not None else None)
    if kl_least is not None:
        return (f"the KL budget binds: the least token-weighted KL these groups reach at this "
                f"capacity is {kl_least:.4g} (budget {B:.4g}); raise budget.kl to ≥ "
                f"{kl_least:.4g}, or add GPUs to the groups with the lowest KL")
    if m_least is not None:
        return (f"the masked budget binds: the least masked share these groups reach at this "
                f"capacity is {m_least:.4g} (budget {Bm:.4g}); raise budget.masked to ≥ "
                f"{m_least:.4g}, or add GPUs to the groups with the lowest masked share")
    return ("the KL and masked budgets bind together: no mix meets both at this capacity; raise "
            "one of them or add GPUs to the groups with the lowest KL and masked share")


def solve_numbers(spec: PlanSpec, billing: str | None = None, kl_budget: float | None = None
                  ) -> Plan:
    """The optimal plan for a spec whose groups all have their figures; raises PlanInfeasible."""
    billing = billing or spec.billing
    groups = spec.groups
    p, r, n, k, q = _arrays(groups)
    B = spec.kl_budget() if kl_budget is None else kl_budget
    Bm = spec.masked
    sol = _solve_arrays(billing, p, r, n, k, q, spec.tokens, spec.updates_per_hour, B, Bm)
    if sol is None:
        raise PlanInfeasible(_why_infeasible(billing, p, r, n, k, q, spec.tokens,
                                             spec.updates_per_hour, B, Bm))
    return _plan_from(billing, groups, sol, spec.tokens, spec.updates_per_hour, B, Bm)


solve = solve_numbers


def homogeneous_plan(spec: PlanSpec, billing: str | None = None) -> Plan | None:
    """The trainer-matched group alone (no budget imposed: it is the reference), or None when
    the file does not list it or its GPUs cannot keep the pace."""
    billing = billing or spec.billing
    g = spec.matched_group()
    if g is None or g.missing():
        return None
    U, R = spec.tokens, spec.updates_per_hour
    if g.masked >= 1:
        return None
    if billing == "serverless":
        x = U / (1.0 - g.masked)
        if x > g.max_gpus * g.tokens_per_s * 3600.0 / R:
            return None
        sol = np.array([x])
    else:
        m = math.ceil(U * R / 3600.0 / (g.tokens_per_s * (1.0 - g.masked)) - 1e-9)
        if m > g.max_gpus:
            return None
        sol = np.array([float(m)])
    return _plan_from(billing, (g,), sol, U, R, None, None)


def equal_capacity_plan(spec: PlanSpec, billing: str | None = None) -> Plan | None:
    """Every listed group with an equal share of the sampling (the study's mixed fleet: each of
    its eight groups served a steady share), sized to the pace; None when a group's GPUs cannot
    carry its share. Reserved: each group holds the fewest GPUs giving it the common rate, and
    the router's shares follow the capacities that rounding leaves."""
    billing = billing or spec.billing
    groups = spec.groups
    p, r, n, k, q = _arrays(groups)
    U, R = spec.tokens, spec.updates_per_hour
    useful = float((1.0 - q).sum())
    if useful <= 0:
        return None
    if billing == "serverless":
        x = np.full(len(groups), U / useful)
        if np.any(x > n * r * 3600.0 / R):
            return None
        sol = x
    else:
        rate = U * R / 3600.0 / useful
        m = np.ceil(rate / r - 1e-9)
        if np.any(m > n):
            return None
        sol = m
    return _plan_from(billing, groups, sol, U, R, None, None)


def frontier(spec: PlanSpec, billing: str | None = None, points: int = 24
             ) -> list[tuple[float, float | None]]:
    """[(KL budget, $ per update or None where infeasible)] from the least feasible budget to the
    largest group KL (past it the budget no longer binds), geometrically spaced."""
    billing = billing or spec.billing
    p, r, n, k, q = _arrays(spec.groups)
    U, R, Bm = spec.tokens, spec.updates_per_hour, spec.masked
    least = _least_budget(billing, p, r, n, k, q, U, R, None, Bm, "kl")
    if least is None:
        return []
    top = float(k.max())
    lo = max(least, top * 1e-3, 1e-300)
    budgets = np.geomspace(lo, top, points) if top > lo else np.array([lo])
    out = []
    for b in budgets:
        sol = _solve_arrays(billing, p, r, n, k, q, U, R, float(b), Bm)
        out.append((float(b), None if sol is None else
                    _plan_from(billing, spec.groups, sol, U, R, b, Bm).cost_per_update_usd))
    return out
