"""The fleet file of `mismatch plan`: what an update needs, the budgets, and the candidate groups.

    [update]
    tokens = 1048576          # U: useful sampled tokens per update
    updates_per_hour = 6      # R: the trainer's pace
    [budget]
    kl = 2.0e-3               # B: the fleet's token-weighted exact KL (or kl_ratio = 4.7: B is
                              #    that many times the trainer-matched group's KL)
    masked = 0.01             # B_m: the fleet's token-weighted MIS masked share
    billing = "serverless"    # or "reserved"
    [trainer]                 # optional
    gpu = "b200"              # the trainer's GPU: its BF16 group is the homogeneous comparison
    [model]                   # optional
    config = "config.json"    # the served model's Hugging Face config, for the throughput model
                              # (default: the config of --model, or of the embedded model)
    [[group]]
    name = "b200-nvfp4"       # optional: gpu-dtype[-kv] by default
    gpu = "b200"
    dtype = "nvfp4"
    kv_cache = "fp8"          # optional: bf16
    price_per_hour = 6.25     # optional: mismatch.plan.hardware's dated table
    tokens_per_s = 5200.0     # optional: the throughput model, or `measured`
    measured = "verdict.json" # optional: `mismatch qualify --json` output of this group's server
    kl = 5.2e-3               # optional: from the probe (`mismatch plan --model`), or `measured`
    masked = 0.004            # optional: likewise
    max_gpus = 16             # N_g: GPUs available

`load_spec` parses and validates it; every problem is a `PlanInputError` whose one line names the
file, the key and what to write instead. Figures left out are filled later (`PlanGroup.with_`)
and each records where it came from: given, measured, default table, throughput model, probe.
"""

from __future__ import annotations

import json
import math
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import PlanInputError

__all__ = ["BILLINGS", "PlanGroup", "PlanSpec", "load_spec", "parse_spec"]

BILLINGS = ("serverless", "reserved")

_TOP_KEYS = {"update", "budget", "trainer", "model", "group"}
_MODEL_KEYS = {"config"}
_UPDATE_KEYS = {"tokens", "updates_per_hour", "context"}
_BUDGET_KEYS = {"kl", "kl_ratio", "masked", "billing"}
_TRAINER_KEYS = {"gpu", "dtype", "kv_cache"}
_GROUP_KEYS = {"name", "gpu", "dtype", "kv_cache", "price_per_hour", "tokens_per_s", "measured",
               "measured_gpus", "kl", "masked", "max_gpus"}


@dataclass(frozen=True)
class PlanGroup:
    """One candidate sampler group: a GPU type serving one weight format with one KV format."""

    name: str
    gpu: str
    dtype: str
    kv_cache: str
    max_gpus: int
    price_per_hour: float | None = None
    tokens_per_s: float | None = None
    kl: float | None = None
    masked: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    """Where each figure came from: {"price_per_hour": "given" | "default table", ...}."""

    def with_(self, figure: str, value: float, source: str) -> PlanGroup:
        """This group with `figure` set to `value`, recording its source."""
        return replace(self, **{figure: float(value)}, sources={**self.sources, figure: source})

    def missing(self) -> list[str]:
        return [f for f in ("price_per_hour", "tokens_per_s", "kl", "masked")
                if getattr(self, f) is None]

    def to_json(self) -> dict:
        return {"name": self.name, "gpu": self.gpu, "dtype": self.dtype,
                "kv_cache": self.kv_cache, "max_gpus": self.max_gpus,
                "price_per_hour": self.price_per_hour, "tokens_per_s": self.tokens_per_s,
                "kl": self.kl, "masked": self.masked, "sources": dict(self.sources)}


@dataclass(frozen=True)
class PlanSpec:
    """A parsed fleet file."""

    tokens: float
    """U: useful sampled tokens per update."""
    updates_per_hour: float
    """R: updates per hour (the trainer's pace)."""
    masked: float
    """B_m: the fleet's token-weighted masked-share budget."""
    billing: str
    groups: tuple[PlanGroup, ...]
    kl: float | None = None
    """B: the KL budget; None when given as `kl_ratio`."""
    kl_ratio: float | None = None
    """B as a multiple of the trainer-matched group's KL."""
    trainer_gpu: str = "b200"
    trainer_dtype: str = "bf16"
    trainer_kv_cache: str = "bf16"
    context: int | None = None
    """Context length for the throughput model (tokens of KV per sequence)."""
    served_config: str | None = None
    """The served model's config.json for the throughput model ([model] config), resolved."""
    path: str = "<fleet>"

    def matched_group(self) -> PlanGroup | None:
        """The trainer-matched group (the trainer's GPU serving its precision and KV format), if
        the file lists it: the homogeneous fleet the plan is compared with."""
        for g in self.groups:
            if (g.gpu, g.dtype, g.kv_cache) == (self.trainer_gpu, self.trainer_dtype,
                                                self.trainer_kv_cache):
                return g
        return None

    def kl_budget(self) -> float:
        """B, resolving `kl_ratio` against the trainer-matched group's KL."""
        if self.kl is not None:
            return self.kl
        g = self.matched_group()
        if g is None or g.kl is None:  # load_spec guarantees the group; fill its kl first
            raise PlanInputError(f"{self.path}: budget.kl_ratio needs the trainer-matched group's "
                                 f"KL ({self.trainer_gpu} {self.trainer_dtype}, "
                                 f"kv {self.trainer_kv_cache})")
        return self.kl_ratio * g.kl

    def with_groups(self, groups) -> PlanSpec:
        return replace(self, groups=tuple(groups))


def _bad(path: str, msg: str) -> PlanInputError:
    return PlanInputError(f"{path}: {msg}")


def _number(path: str, where: str, value, *, positive: bool = False, share: bool = False,
            integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(path, f"{where} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise _bad(path, f"{where} must be finite, got {value!r}")
    if integer and (v != int(v) or v < 0):
        raise _bad(path, f"{where} must be a whole number ≥ 0, got {value!r}")
    if positive and v <= 0:
        raise _bad(path, f"{where} must be > 0, got {value!r}")
    if not positive and v < 0:
        raise _bad(path, f"{where} must be ≥ 0, got {value!r}")
    if share and v > 1:
        raise _bad(path, f"{where} is a share of tokens, in [0, 1]; got {value!r}")
    return v


def _table(path: str, data: dict, key: str, allowed: set[str], required: bool) -> dict:
    t = data.get(key)
    if t is None:
        if required:
            raise _bad(path, f"missing the [{key}] table")
        return {}
    if not isinstance(t, dict):
        raise _bad(path, f"[{key}] must be a table")
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise _bad(path, f"unknown key {key}.{unknown[0]}; [{key}] takes "
                   + ", ".join(sorted(allowed)))
    return t


def _check_numerics(path: str, where: str, gpu: str, dtype: str, kv: str) -> None:
    from mismatch.profiles import ProfileError, resolve

    try:
        resolve(gpu, dtype, kv)
    except (ProfileError, ValueError, KeyError) as exc:
        msg = str(exc.args[0] if exc.args else exc).splitlines()[0]
        raise _bad(path, f"{where}: {msg}") from None


def _measured(path: str, where: str, file: str, base: Path) -> dict:
    """tokens/s (and KL, masked share where measured) from `mismatch qualify --json` output."""
    p = Path(file)
    if not p.is_absolute():
        p = base / p
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise _bad(path, f"{where}.measured: cannot read {p} ({exc.strerror or exc})") from None
    except ValueError:
        raise _bad(path, f"{where}.measured: {p} is not JSON; give the output of "
                   f"`mismatch qualify --json`") from None
    if not isinstance(data, dict) or not isinstance(data.get("throughput"), dict):
        raise _bad(path, f"{where}.measured: {p} has no throughput (only `mismatch qualify "
                   f"--sampler URL` measures a server's tokens/s)")
    out = {"tokens_per_s": data["throughput"].get("tokens_per_s")}
    checks = {c.get("metric"): c.get("value") for c in data.get("checks", [])
              if isinstance(c, dict)}  # whole-sampler metrics are named bare (kl_k3, ...)
    for metric in ("kl_exact", "kl_k3"):
        if isinstance(checks.get(metric), (int, float)):
            out["kl"] = checks[metric]
            break
    if isinstance(checks.get("mis_masked_fraction"), (int, float)):
        out["masked"] = checks["mis_masked_fraction"]
    return out


def parse_spec(data: dict, path: str = "<fleet>", base: Path | None = None) -> PlanSpec:
    """Validate a fleet file's parsed TOML (module docstring); raises PlanInputError."""
    from mismatch.profiles import GPUS

    base = base or Path.cwd()
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _bad(path, f"unknown table [{unknown[0]}]; the file holds [update], [budget], "
                   f"[trainer], [model] and [[group]]")
    update = _table(path, data, "update", _UPDATE_KEYS, True)
    budget = _table(path, data, "budget", _BUDGET_KEYS, True)
    trainer = _table(path, data, "trainer", _TRAINER_KEYS, False)
    served = _table(path, data, "model", _MODEL_KEYS, False).get("config")
    if served is not None:
        served_path = Path(str(served))
        served_path = served_path if served_path.is_absolute() else base / served_path
        if not served_path.is_file():
            raise _bad(path, f"model.config {served} is not a file (a Hugging Face config.json "
                       f"of the served model)")
        served = str(served_path)
    for key in ("tokens", "updates_per_hour"):
        if key not in update:
            raise _bad(path, f"missing update.{key}")
    tokens = _number(path, "update.tokens", update["tokens"], positive=True)
    rate = _number(path, "update.updates_per_hour", update["updates_per_hour"], positive=True)
    context = None
    if "context" in update:
        context = int(_number(path, "update.context", update["context"], positive=True,
                              integer=True))
    if ("kl" in budget) == ("kl_ratio" in budget):
        raise _bad(path, "[budget] needs kl (the fleet's token-weighted exact KL) or kl_ratio "
                   "(× the trainer-matched group's KL), one of them")
    kl = _number(path, "budget.kl", budget["kl"], positive=True) if "kl" in budget else None
    ratio = (_number(path, "budget.kl_ratio", budget["kl_ratio"], positive=True)
             if "kl_ratio" in budget else None)
    if "masked" not in budget:
        raise _bad(path, "missing budget.masked (the fleet's masked share, e.g. 0.01)")
    masked = _number(path, "budget.masked", budget["masked"], share=True)
    billing = budget.get("billing", "serverless")
    if billing not in BILLINGS:
        raise _bad(path, f"budget.billing is {billing!r}; choose serverless or reserved")
    t_gpu = str(trainer.get("gpu", "b200")).lower()
    t_dtype = str(trainer.get("dtype", "bf16")).lower()
    t_kv = str(trainer.get("kv_cache", "bf16")).lower()
    if t_gpu not in GPUS:
        raise _bad(path, f"trainer.gpu {t_gpu!r} is unknown; known: {', '.join(GPUS)}")

    raw = data.get("group")
    if not isinstance(raw, list) or not raw:
        raise _bad(path, "no [[group]]: list the candidate sampler groups")
    groups: list[PlanGroup] = []
    for i, g in enumerate(raw):
        where = f"group {i + 1}"
        if not isinstance(g, dict):
            raise _bad(path, f"{where} must be a table")
        extra = sorted(set(g) - _GROUP_KEYS)
        if extra:
            raise _bad(path, f"{where}: unknown key {extra[0]!r}; a group takes "
                       + ", ".join(sorted(_GROUP_KEYS)))
        for key in ("gpu", "dtype", "max_gpus"):
            if key not in g:
                raise _bad(path, f"{where}: missing {key}")
        gpu, dtype = str(g["gpu"]).lower(), str(g["dtype"]).lower()
        kv = str(g.get("kv_cache", "bf16")).lower()
        name = str(g.get("name") or (f"{gpu}-{dtype}" + ("" if kv == "bf16" else f"-kv{kv}")))
        where = f"group {name!r}"
        if gpu not in GPUS:
            raise _bad(path, f"{where}: unknown gpu {gpu!r}; known: {', '.join(GPUS)}")
        _check_numerics(path, where, gpu, dtype, kv)
        group = PlanGroup(name=name, gpu=gpu, dtype=dtype, kv_cache=kv,
                          max_gpus=int(_number(path, f"{where}.max_gpus", g["max_gpus"],
                                               integer=True)))
        if "measured" in g:
            gpus = _number(path, f"{where}.measured_gpus", g.get("measured_gpus", 1),
                           positive=True)
            for figure, value in _measured(path, where, str(g["measured"]), base).items():
                if value is None:
                    continue
                if figure == "tokens_per_s":
                    value = float(value) / gpus
                group = group.with_(figure, value, "measured")
        for figure in ("price_per_hour", "tokens_per_s", "kl", "masked"):
            if figure in g:
                value = _number(path, f"{where}.{figure}", g[figure],
                                positive=figure in ("price_per_hour", "tokens_per_s"),
                                share=figure == "masked")
                group = group.with_(figure, value, "given")
        groups.append(group)
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _bad(path, f"two groups are named {dup[0]!r}; give each a distinct name")
    spec = PlanSpec(tokens=tokens, updates_per_hour=rate, masked=masked, billing=billing,
                    groups=tuple(groups), kl=kl, kl_ratio=ratio, trainer_gpu=t_gpu,
                    trainer_dtype=t_dtype, trainer_kv_cache=t_kv, context=context,
                    served_config=served, path=path)
    if ratio is not None and spec.matched_group() is None:
        raise _bad(path, f"budget.kl_ratio is relative to the trainer-matched group "
                   f"({t_gpu} {t_dtype}, kv_cache {t_kv}); list it as a [[group]] or give kl")
    return spec


def load_spec(path: Path) -> PlanSpec:
    """Read and validate a fleet file (module docstring); raises PlanInputError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanInputError(f"{path} is not valid TOML: {exc}") from None
    return parse_spec(data, str(path), path.parent)
