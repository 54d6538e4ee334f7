"""The outputs of the fleet simulation (mismatch.plan.simulate): per update, per group and for
the run, and the figure of cost per update and staleness over the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["UpdateRecord", "GroupUsage", "SimResult", "plot"]


@dataclass(frozen=True)
class UpdateRecord:
    """One trainer update."""

    version: int
    """The version it published (1 for the first update)."""
    consumed_s: float
    """When the trainer took its tokens."""
    time_s: float
    """When it published (consumed_s + trainer_step_s)."""
    trainer_wait_s: float
    """How long the trainer waited for tokens before taking them."""
    staleness_mean: float
    """Useful-token-weighted mean staleness of its tokens, in versions."""
    staleness_max: int
    staleness_tokens: dict[int, float]
    """Useful tokens per staleness."""
    group_tokens: dict[str, float]
    """Useful tokens per group that supplied any."""
    cost_serverless_usd: float
    """Spent since the previous publication, serverless billing."""
    cost_reserved_usd: float
    """Spent since the previous publication, reserved billing."""
    buffered_tokens: float
    """Useful tokens left waiting in the buffer once it took its own."""

    def to_json(self) -> dict:
        return {"version": self.version, "consumed_s": self.consumed_s, "time_s": self.time_s,
                "trainer_wait_s": self.trainer_wait_s, "staleness_mean": self.staleness_mean,
                "staleness_max": self.staleness_max,
                "staleness_tokens": {str(k): v for k, v in sorted(self.staleness_tokens.items())},
                "group_tokens": dict(self.group_tokens),
                "cost_serverless_usd": self.cost_serverless_usd,
                "cost_reserved_usd": self.cost_reserved_usd,
                "buffered_tokens": self.buffered_tokens}


@dataclass(frozen=True)
class GroupUsage:
    """What one group's GPUs did over the run."""

    name: str
    held_gpu_s: float
    """GPU-seconds held (cold-starting included): what reserved billing charges."""
    productive_gpu_s: float
    """GPU-seconds past their cold start."""
    busy_gpu_s: float
    """GPU-seconds decoding (busy slot-seconds / batch): what serverless billing charges."""
    sampled_tokens: float
    """Tokens of the episodes it finished."""
    consumed_tokens: float
    """Useful tokens of its episodes the trainer consumed."""
    lost_tokens: float
    """Tokens decoded on removed GPUs, discarded."""
    lost_episodes: int
    cost_serverless_usd: float
    cost_reserved_usd: float

    @property
    def utilisation(self) -> float:
        """Busy GPU-seconds over available (held) GPU-seconds; 0 when it held none."""
        return self.busy_gpu_s / self.held_gpu_s if self.held_gpu_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"name": self.name, "held_gpu_s": self.held_gpu_s,
                "productive_gpu_s": self.productive_gpu_s, "busy_gpu_s": self.busy_gpu_s,
                "utilisation": self.utilisation, "sampled_tokens": self.sampled_tokens,
                "consumed_tokens": self.consumed_tokens, "lost_tokens": self.lost_tokens,
                "lost_episodes": self.lost_episodes,
                "cost_serverless_usd": self.cost_serverless_usd,
                "cost_reserved_usd": self.cost_reserved_usd}


@dataclass(frozen=True)
class SimResult:
    """A simulated run: its updates in order, each group's usage and the capacity it had."""

    updates: tuple[UpdateRecord, ...]
    groups: tuple[GroupUsage, ...]
    duration_s: float
    capacity: tuple[tuple[float, str, int, int], ...]
    """(time_s, group, GPUs held, GPUs productive) at the start and after every change."""
    params: dict = field(default_factory=dict)
    """The inputs, for the record."""

    @property
    def updates_per_hour(self) -> float:
        """The pace between the first and the last publication (3600 (N − 1) / (t_N − t_1));
        with fewer than two updates, N per hour of the run."""
        u = self.updates
        if len(u) >= 2 and u[-1].time_s > u[0].time_s:
            return 3600.0 * (len(u) - 1) / (u[-1].time_s - u[0].time_s)
        return 3600.0 * len(u) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def staleness_tokens(self) -> dict[int, float]:
        """Useful tokens per staleness over every update."""
        out: dict[int, float] = {}
        for u in self.updates:
            for k, v in u.staleness_tokens.items():
                out[k] = out.get(k, 0.0) + v
        return dict(sorted(out.items()))

    @property
    def staleness_mean(self) -> float:
        hist = self.staleness_tokens
        total = sum(hist.values())
        return sum(k * v for k, v in hist.items()) / total if total > 0 else 0.0

    @property
    def staleness_max(self) -> int:
        return max((u.staleness_max for u in self.updates), default=0)

    def cost_usd(self, billing: str) -> float:
        """The whole run's spend under `billing` ("serverless" or "reserved")."""
        attr = _billing_attr(billing)
        return sum(getattr(g, attr) for g in self.groups)

    def cost_per_update(self, billing: str) -> list[tuple[float, float]]:
        """[(publication time_s, $ spent since the previous one)] under `billing`: cost per
        update over time."""
        attr = _billing_attr(billing)
        return [(u.time_s, getattr(u, attr)) for u in self.updates]

    def token_shares(self) -> dict[str, float]:
        """Each group's share of the sampled tokens."""
        total = sum(g.sampled_tokens for g in self.groups)
        return {g.name: (g.sampled_tokens / total if total > 0 else 0.0) for g in self.groups}

    def to_json(self) -> dict:
        n = len(self.updates)
        return {"duration_s": self.duration_s, "updates": n,
                "updates_per_hour": self.updates_per_hour,
                "staleness_mean": self.staleness_mean, "staleness_max": self.staleness_max,
                "staleness_tokens": {str(k): v for k, v in self.staleness_tokens.items()},
                "cost_usd": {b: self.cost_usd(b) for b in ("serverless", "reserved")},
                "cost_per_update_usd": {b: (self.cost_usd(b) / n if n else None)
                                        for b in ("serverless", "reserved")},
                "token_shares": self.token_shares(),
                "groups": [g.to_json() for g in self.groups],
                "capacity": [{"time_s": t, "group": g, "held": h, "productive": p}
                             for t, g, h, p in self.capacity],
                "per_update": [u.to_json() for u in self.updates],
                "params": dict(self.params)}


def _billing_attr(billing: str) -> str:
    if billing not in ("serverless", "reserved"):
        raise ValueError(f"billing is {billing!r}; choose serverless or reserved")
    return f"cost_{billing}_usd"


def plot(result: SimResult, path: Path | str) -> str:
    """Cost per update (both billings) and staleness (mean and max) over the run, capacity
    changes marked; written atomically (`mismatch.io.save_figure`). Returns the file's name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mismatch.io import save_figure

    fig, (ax_cost, ax_st) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [u.time_s / 3600.0 for u in result.updates]
    for billing, style in (("serverless", "-"), ("reserved", "--")):
        ax_cost.plot(t, [c for _, c in result.cost_per_update(billing)], style, lw=1.2,
                     label=billing)
    ax_cost.set_ylabel("$ per update")
    ax_cost.legend(loc="best", fontsize=8)
    ax_st.plot(t, [u.staleness_mean for u in result.updates], "-", lw=1.2, label="mean")
    ax_st.plot(t, [u.staleness_max for u in result.updates], ":", lw=1.0, label="max")
    ax_st.set_ylabel("staleness (versions)")
    ax_st.set_xlabel("time (hours)")
    ax_st.legend(loc="best", fontsize=8)
    changes = sorted({c[0] for c in result.capacity if c[0] > 0})
    for ax in (ax_cost, ax_st):
        for c in changes:
            ax.axvline(c / 3600.0, color="0.7", lw=0.8, zorder=0)
        ax.grid(alpha=0.3)
    ax_cost.set_title(f"{len(result.updates)} updates, {result.updates_per_hour:.3g}/hour; "
                      f"grey: capacity changes")
    return save_figure(fig, Path(path))
