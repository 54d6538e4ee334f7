"""The study's grid as data: its fleets (`STUDY_FLEETS`: L0 homogeneous, L1 precision, L2 mixed,
or a fleet file), its arms (`STUDY_ARMS`: the study's names for train's loss arms), the settings
every run shares (`StudyConfig`) and their presets (`STUDY_PRESETS`: full, edge, ci), one `Cell`
per run, and the order the runs go in (`run_order`). Running them is grid.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mismatch.registry import table_of

__all__ = ["STUDY_FLEETS", "fleet_of", "fleet_label", "STUDY_ARMS", "StudyConfig",
           "STUDY_PRESETS", "Cell", "cells", "run_order"]


STUDY_FLEETS = {"L0": "homogeneous", "L1": "precision", "L2": "mixed"}
"""Study fleet name → train.fleet preset. A study fleet may also be a fleet file (a path ending
in .toml, as `mismatch plan` writes): its runs train with `--fleet FILE` and are named by the
file's stem."""


def fleet_of(name: str) -> str:
    """What `mismatch train` trains a study fleet on: its preset (L0–L2), or the fleet file's
    absolute path. Raises ValueError with one line for anything else (`StudyConfig` also parses
    each fleet file once, when the grid is made)."""
    if name in STUDY_FLEETS:
        return STUDY_FLEETS[name]
    from mismatch.train.fleet import is_fleet_file

    if not is_fleet_file(name):
        raise ValueError(f"unknown fleet {name!r}; fleets: {', '.join(STUDY_FLEETS)} or a fleet "
                         f"file ending in .toml (`mismatch plan` writes one)")
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"fleet file {name} does not exist; `mismatch plan ... --out DIR` "
                         f"writes DIR/fleet.toml")
    return str(path)


def fleet_label(name: str) -> str:
    """A study fleet's name in run folders and tables: L0–L2, or a fleet file's stem."""
    return name if name in STUDY_FLEETS else Path(name).stem


STUDY_ARMS = {"grpo": "grpo", "mis": "mis", "sc": "sc", "sc+mis": "sc+mis", "grpo+topp": "topp",
        "sc+mis+topp": "sc+mis+topp"}
"""Study arm name → train.loss arm."""


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """The grid and the settings every run shares."""

    fleets: tuple[str, ...] = ("L0", "L1", "L2")
    staleness: tuple[int, ...] = (4,)
    arms: tuple[str, ...] = tuple(STUDY_ARMS)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 32
    lr: float = 3e-4
    tasks: str = "arith"
    prompts: int = 4
    samples: int = 8
    max_turns: int = 4
    max_new_tokens: int = 64
    candidates: int = 128
    checkpoint_every: int = 10
    sync_arms: tuple[str, ...] = ()
    """Arms also run on-policy (`--sync`: staleness 0) as controls, on `sync_fleets`."""
    sync_fleets: tuple[str, ...] = ("L0",)
    policy_steps: int = 0
    """Start every run from a zoo policy trained this many steps (`mismatch zoo build --steps
    N --seed 0`, built once into OUT/policy-<N>); 0: the embedded model."""
    eval_tasks: int = 0
    """Held-out tasks (× 4 episodes, temperature 1) evaluated before the first step, midway and
    after the last (0: none)."""

    def __post_init__(self) -> None:
        for f in dict.fromkeys((*self.fleets, *self.sync_fleets)):
            if f not in STUDY_FLEETS:
                from mismatch.train.fleet import fleet_file

                fleet_file(fleet_of(f))  # parses, or one line on what is wrong
        labels = [fleet_label(f) for f in dict.fromkeys((*self.fleets, *self.sync_fleets))]
        if len(set(labels)) != len(labels):
            raise ValueError(f"two fleets share a name ({', '.join(labels)}): rename a fleet "
                             f"file so each run folder is its own")
        for a in (*self.arms, *self.sync_arms):
            if a not in STUDY_ARMS:
                raise ValueError(f"unknown arm {a!r}; arms: {', '.join(STUDY_ARMS)}")
        if not (self.fleets and self.arms and self.seeds and self.staleness):
            raise ValueError("the grid needs at least one fleet, arm, seed and staleness")
        if any(k < 0 for k in self.staleness):
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.policy_steps < 0 or self.eval_tasks < 0:
            raise ValueError(f"policy-steps and eval-tasks must be >= 0, got "
                             f"{self.policy_steps}, {self.eval_tasks}")

    @property
    def policy_name(self) -> str | None:
        """The study's starting policy's folder in OUT (None: the embedded model)."""
        return f"policy-{self.policy_steps}" if self.policy_steps else None

    def train_args(self) -> list[str]:
        midway = (self.steps + 1) // 2 if self.eval_tasks and self.steps > 1 else 0
        return ["--steps", str(self.steps), "--lr", repr(self.lr), "--tasks", self.tasks,
                "--prompts", str(self.prompts), "--samples", str(self.samples),
                "--checkpoint-every", str(self.checkpoint_every),
                "--eval-tasks", str(self.eval_tasks), "--eval-every", str(midway),
                "--threads", "1", "--sampler-processes", "0"]  # each run on the cores of its slot


def full() -> StudyConfig:
    """L0 and L2 × 5 arms × 3 seeds, staleness 8, 150 steps of 16 × 8, lr 1e-4, sync controls.

    The study's regime at this scale: a policy with headroom (held-out reward ~0.45 at
    temperature 1; `mismatch zoo build --steps 800`), lr 1e-4, 16 prompts × 8 episodes, 150
    steps, forced staleness 8, on-policy controls; held-out reward before, midway, after."""
    return StudyConfig(fleets=("L0", "L2"), staleness=(8,),
                       arms=("grpo", "mis", "sc", "sc+mis", "sc+mis+topp"), steps=150, lr=1e-4,
                       tasks="zoo", prompts=16, samples=8, sync_arms=("grpo", "sc+mis"),
                       policy_steps=800, eval_tasks=64)


def edge() -> StudyConfig:
    """The first grid: 3 fleets × 6 arms, 32 steps of 4 × 8, lr 3e-4, staleness 4.

    reports/study-edge.md: the embedded policy at its ceiling (StudyConfig's defaults)."""
    return StudyConfig()


def ci() -> StudyConfig:
    """Three short runs on L2 for CI: grpo, sc+mis and a sync grpo control."""
    return StudyConfig(fleets=("L2",), arms=("grpo", "sc+mis"), seeds=(0,), staleness=(2,),
                       steps=3, prompts=2, samples=4, checkpoint_every=2, sync_arms=("grpo",),
                       sync_fleets=("L2",), eval_tasks=2)


def _registry(*presets: Callable[[], StudyConfig]) -> dict[str, Callable[[], StudyConfig]]:
    return table_of(presets, lambda fn: fn.__name__, "study preset")


STUDY_PRESETS: dict[str, Callable[[], StudyConfig]] = _registry(full, edge, ci)
"""`mismatch study --preset` name → the function returning its grid."""


@dataclass(frozen=True)
class Cell:
    fleet: str
    staleness: int | None
    """Forced staleness K; None: an on-policy control (`--sync`)."""
    arm: str
    seed: int

    @property
    def name(self) -> str:
        lag = "sync" if self.staleness is None else f"k{self.staleness}"
        return f"{fleet_label(self.fleet)}-{lag}-{self.arm.replace('+', '_')}-s{self.seed}"


def cells(cfg: StudyConfig) -> list[Cell]:
    """The grid's cells, then its on-policy controls."""
    return ([Cell(f, k, a, s) for f in cfg.fleets for k in cfg.staleness for a in cfg.arms
             for s in cfg.seeds]
            + [Cell(f, None, a, s) for f in cfg.sync_fleets for a in cfg.sync_arms
               for s in cfg.seeds])


def run_order(cfg: StudyConfig, cell: Cell) -> tuple:
    """The sort key of the order cells run in: the central comparison (uncorrected vs SC+MIS)
    over the first two seeds first, so that a sitting that ends mid-grid leaves the central
    claim with a spread over seeds; then seed by seed every cell (the central pair, the other
    arms, the on-policy controls), so that every claim has an answer before the intervals
    tighten; the fastest fleet first in each (the presets L0 < L1 < L2, then fleet files)."""
    fleets = sorted({*cfg.fleets, *cfg.sync_fleets},
                    key=lambda f: (f not in STUDY_FLEETS, fleet_label(f)))
    rank = {f: i for i, f in enumerate(fleets)}
    seed = cfg.seeds.index(cell.seed)
    kind = 0 if cell.arm in ("grpo", "sc+mis") and cell.staleness is not None else (
        2 if cell.staleness is None else 1)
    return (0 if kind == 0 and seed < 2 else 1 + seed), kind, seed, rank[cell.fleet]
