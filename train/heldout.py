"""eval.json as typed records: a policy's held-out score at a point of a run, and the run's
evaluations (before the first step, every `eval_every` steps, after the last; a top-p arm's
also from the full vocabulary).

The file keeps its keys (`tasks`, `samples`, `base`, `during`, `final`, `full_vocab`; each
score's `reward`, `episodes`, `sampling`, `format_error_rate`, `end_reasons`, `step`); readers
(the CLI's summary, the run report, the study) go through `HeldOut.from_json`, so that a renamed
key fails in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HeldOut", "HeldOutScore"]


@dataclass(frozen=True, kw_only=True)
class HeldOutScore:
    """The policy at one point of a run on the held-out tasks."""

    reward: float
    """Mean reward of the episodes."""
    episodes: int
    """Episodes played (tasks × samples)."""
    sampling: str
    """How they were sampled: "full", or the arm's nucleus ("top-p P, top-k K")."""
    format_error_rate: float
    """Share of episodes that ended on repeated format errors."""
    end_reasons: dict[str, int] = field(default_factory=dict)
    """How the episodes ended, counted."""
    step: int | None = None
    """The optimizer steps done at this point (None for the base policy)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reward": self.reward, "episodes": self.episodes,
                               "sampling": self.sampling,
                               "format_error_rate": self.format_error_rate,
                               "end_reasons": dict(self.end_reasons)}
        if self.step is not None:
            out["step"] = self.step
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HeldOutScore:
        return cls(reward=float(d["reward"]), episodes=int(d["episodes"]),
                   sampling=str(d["sampling"]), format_error_rate=float(d["format_error_rate"]),
                   end_reasons={str(k): int(v) for k, v in d.get("end_reasons", {}).items()},
                   step=None if d.get("step") is None else int(d["step"]))


@dataclass(frozen=True, kw_only=True)
class HeldOut:
    """A run's held-out evaluations (eval.json), as far as the run went."""

    tasks: int | None = None
    """Held-out tasks (None in the `full_vocab` entry, which shares the run's)."""
    samples: int | None = None
    """Episodes per task."""
    base: HeldOutScore | None = None
    """Before the first step."""
    during: dict[int, HeldOutScore] = field(default_factory=dict)
    """Every `eval_every` steps: step → score."""
    final: HeldOutScore | None = None
    """After the last step."""
    full_vocab: HeldOut | None = None
    """A top-p arm's evaluations sampled from the full vocabulary."""

    @property
    def complete(self) -> bool:
        """Evaluated before and after."""
        return self.base is not None and self.final is not None

    @property
    def mid(self) -> HeldOutScore | None:
        """The first evaluation during the run (the study's midway point)."""
        return self.during[min(self.during)] if self.during else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tasks is not None:
            out.update(tasks=self.tasks, samples=self.samples)
        if self.full_vocab is not None:
            out["full_vocab"] = self.full_vocab.to_json()
        if self.base is not None:
            out["base"] = self.base.to_json()
        if self.during:
            out["during"] = {str(k): v.to_json() for k, v in sorted(self.during.items())}
        if self.final is not None:
            out["final"] = self.final.to_json()
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HeldOut:
        """An eval.json's object (an empty one: a run that evaluates nothing)."""
        score = HeldOutScore.from_json
        return cls(tasks=d.get("tasks"), samples=d.get("samples"),
                   base=score(d["base"]) if "base" in d else None,
                   during={int(k): score(v) for k, v in (d.get("during") or {}).items()},
                   final=score(d["final"]) if "final" in d else None,
                   full_vocab=cls.from_json(d["full_vocab"]) if d.get("full_vocab") else None)
