"""Planning a sampler fleet: the cheapest mix of GPU × format groups whose token-weighted
mismatch stays within a budget (`mismatch plan`).

- `mismatch.plan.hardware`: the GPUs' memory, bandwidth and peak dense throughput per format, and
  a dated, sourced table of on-demand prices;
- `mismatch.plan.throughput`: a roofline model of decode throughput for a Hugging Face config on
  each GPU × format;
- `mismatch.plan.spec`: the fleet file (TOML) and its validation;
- `mismatch.plan.solve`: the exact optimum under serverless (a linear program) and reserved (a
  mixed-integer program) billing;
- `mismatch.plan.simulate`: a discrete-event simulation (SimPy) of an asynchronous run on a
  fleet over a capacity trace: staleness, utilisation and cost per update over time.
"""

from __future__ import annotations

__all__ = ["PlanInputError", "PlanInfeasible"]


class PlanInputError(ValueError):
    """Bad input to the planner (malformed file, unknown GPU or format, a negative price): the
    message is one line that says what to fix."""


class PlanInfeasible(RuntimeError):
    """No fleet meets the budgets: the message names the binding constraint and what would make
    the problem feasible."""
