"""The command line's choice lists are its registries': every option whose --help lists names
lists exactly what its registry holds, in the registry's order, and nothing beside them; and the
config and registry modules the command line reads import without torch (each checked in a
fresh interpreter), so that building those lists keeps `mismatch --help` instant."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import typer

from mismatch.cli.main import app

TORCH_FREE = (
    "mismatch.profiles", "mismatch.fleets", "mismatch.ratios",
    "mismatch.quantize", "mismatch.quantize.precisions", "mismatch.quantize.codec_table",
    "mismatch.quantize.format_table", "mismatch.quantize.checkpoint_formats",
    "mismatch.train.config", "mismatch.train.components", "mismatch.train.arms",
    "mismatch.probes", "mismatch.engines.te",
    "mismatch.study.cells", "mismatch.zoo.tasks", "mismatch.probes.monitor.signals",
    "mismatch.probes.monitor.formats", "mismatch.plan.spec", "mismatch.probes.config",
    "mismatch.remote.engines", "mismatch.step_record", "mismatch.cli",
)
"""The config and registry modules (and the command line, which reads them)."""


@pytest.mark.parametrize("module", TORCH_FREE)
def test_config_and_registry_modules_import_without_torch(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"importing {module} loads {res.stdout.strip()}"


class Choices(NamedTuple):
    """What an option's help lists."""

    shown: list[str]
    """The names listed, in the registry's order."""
    also: tuple[str, ...] = ()
    """Names the help must hold too, e.g. in a note: an alias, "grpo+topp (or topp)"."""
    beside: tuple[str, ...] = ()
    """Words that may follow the list as if a name: "..., or fleet files"."""


def _choice_lists() -> dict[tuple[str, str], Choices]:
    """(command, option) → what its help lists, from the registries."""
    from mismatch.app.qualify_remote import ENGINES  # the live engines' clients (imports torch)
    from mismatch.cli.common import ARM_ALIASES, STUDY_ARM_ALIASES
    from mismatch.engines.te import TRAINER_KERNELS
    from mismatch.plan.spec import BILLINGS
    from mismatch.probes import SOURCES
    from mismatch.probes.config import LM_HEAD_SIDES
    from mismatch.probes.monitor.formats import ADAPTERS
    from mismatch.probes.monitor.signals import SEVERITIES
    from mismatch.profiles import DTYPES, GPUS, KV_CACHES, LM_HEADS, TRAINER_DTYPES
    from mismatch.quantize.checkpoint_formats import CHECKPOINT_FORMATS, KV_CACHE_FORMATS
    from mismatch.study.cells import STUDY_ARMS, STUDY_FLEETS, STUDY_PRESETS
    from mismatch.train.arms import ARMS
    from mismatch.train.config import RUN_PRESETS, RUN_TRAINER_DTYPES
    from mismatch.zoo.tasks import TASK_KINDS

    sampler = {"--gpu": Choices(list(GPUS)), "--dtype": Choices(list(DTYPES)),
               "--kv-cache": Choices(list(KV_CACHES))}
    return {
        **{("probe", flag): c for flag, c in sampler.items()},
        ("probe", "--trainer-dtype"): Choices(list(TRAINER_DTYPES)),
        ("probe", "--lm-head"): Choices(list(LM_HEADS)),
        ("probe", "--lm-head-side"): Choices(list(LM_HEAD_SIDES)),
        ("probe", "--sources"): Choices([*SOURCES, "all"]),
        ("probe", "--trainer-kernels"): Choices(list(TRAINER_KERNELS),
                                                beside=("transformer-engine",)),
        **{("qualify", flag): c for flag, c in sampler.items()},
        ("qualify", "--engine"): Choices(list(ENGINES)),
        ("qualify", "--launch"): Choices(list(ENGINES)),
        ("quantize", "--format"): Choices(list(CHECKPOINT_FORMATS)),
        ("quantize", "--kv-cache"): Choices(list(KV_CACHE_FORMATS)),
        ("train", "--preset"): Choices(list(RUN_PRESETS)),
        ("train", "--correction"): Choices([STUDY_ARM_ALIASES.get(a, a) for a in ARMS],
                                           also=(*ARMS, *ARM_ALIASES)),
        ("train", "--trainer-dtype"): Choices(list(RUN_TRAINER_DTYPES)),
        ("train", "--lm-head"): Choices(list(LM_HEADS)),
        ("train", "--stop-on"): Choices(list(SEVERITIES)),
        ("train", "--tasks"): Choices(["zoo", *TASK_KINDS], beside=("kinds",)),
        ("study", "--preset"): Choices(list(STUDY_PRESETS)),
        ("study", "--fleets"): Choices(list(STUDY_FLEETS), also=tuple(STUDY_FLEETS.values()),
                                       beside=("fleet",)),
        ("study", "--arms"): Choices(list(STUDY_ARMS), also=tuple(STUDY_ARM_ALIASES)),
        ("monitor", "--format"): Choices(list(ADAPTERS)),
        ("monitor", "--fail-on"): Choices(list(SEVERITIES)),
        ("plan", "--billing"): Choices(list(BILLINGS)),
    }


CHECKED = (
    ("probe", "--gpu"), ("probe", "--dtype"), ("probe", "--kv-cache"),
    ("probe", "--trainer-dtype"), ("probe", "--lm-head"), ("probe", "--lm-head-side"),
    ("probe", "--sources"), ("probe", "--trainer-kernels"),
    ("qualify", "--gpu"), ("qualify", "--dtype"), ("qualify", "--kv-cache"),
    ("qualify", "--engine"), ("qualify", "--launch"),
    ("quantize", "--format"), ("quantize", "--kv-cache"),
    ("train", "--preset"), ("train", "--correction"), ("train", "--trainer-dtype"),
    ("train", "--lm-head"), ("train", "--stop-on"), ("train", "--tasks"),
    ("study", "--preset"), ("study", "--fleets"), ("study", "--arms"),
    ("monitor", "--format"), ("monitor", "--fail-on"), ("plan", "--billing"),
)

_NAME = r"[A-Za-z0-9](?:[\w+\-]*[\w+])?"
_BEFORE, _AFTER = r"(?<![\w+\-])", r"(?![\w+\-])"
_NOTE = r"(?: \((?:[^()]|\([^()]*\))*\))?"  # "name (a note, (nested) once)"
_SEP = r"(?:, or |, | or | \| )"
_PAIR = re.compile(rf"(?={_BEFORE}({_NAME}){_NOTE}{_SEP}({_NAME}){_AFTER})")


def _pairs(text: str) -> list[tuple[str, str]]:
    """Every two words a help text lists side by side: "a, b", "a or b", "a | b", "a (note), b"."""
    return [(m.group(1), m.group(2)) for m in _PAIR.finditer(text)]


def _at(text: str, name: str) -> int | None:
    m = re.search(rf"{_BEFORE}{re.escape(name)}{_AFTER}", text)
    return m.start() if m else None


def _options():
    """(command path, option flag, click option) of every option of every command."""
    def walk(command, path):
        subs = getattr(command, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, f"{path} {name}".strip())
            return
        for param in command.params:
            for flag in param.opts:
                if flag.startswith("--") and param.param_type_name == "option":
                    yield path, flag, param

    yield from walk(typer.main.get_command(app), "")


def _option(command: str, flag: str):
    return next(p for c, f, p in _options() if (c, f) == (command, flag))


def test_the_checked_options_are_the_table():
    assert set(_choice_lists()) == set(CHECKED)


@pytest.mark.parametrize("command, flag", CHECKED)
def test_choice_list_names_its_registry(command, flag):
    """Each name in the registry's order, the aliases too, no other word listed beside them
    (a name the registry lost), and the option's default among them."""
    choices = _choice_lists()[(command, flag)]
    option = _option(command, flag)
    text = option.help
    at = [_at(text, name) for name in choices.shown]
    missing = [name for name, where in zip(choices.shown, at) if where is None]
    assert not missing, f"{command} {flag} help lacks {missing}: {text!r}"
    assert at == sorted(at) and len(set(at)) == len(at), f"not in registry order: {text!r}"
    assert all(_at(text, name) is not None for name in choices.also), text
    known = {*choices.shown, *choices.also}
    stale = [(a, b) for a, b in _pairs(text)
             if (a in known) != (b in known) and ({a, b} - known).pop() not in choices.beside]
    assert not stale, f"{command} {flag} help lists names its registry lacks: {stale}"
    if isinstance(option.default, str):
        assert option.default in known, (command, flag, option.default)


def test_every_option_that_lists_names_of_a_registry_is_checked():
    """An option whose help lists two names of one registry side by side is in the table, so a
    new hand-written list cannot go unchecked."""
    from mismatch.fleets import FLEETS
    from mismatch.quantize.codec_table import CODECS

    registries = [set(c.shown) | set(c.also) for c in _choice_lists().values()]
    registries += [set(FLEETS), set(CODECS)]
    unchecked = sorted({(command, flag) for command, flag, option in _options()
                        if (command, flag) not in CHECKED
                        for a, b in _pairs(option.help or "")
                        if any(a in names and b in names for names in registries)})
    assert not unchecked, f"choice lists not checked against their registry: {unchecked}"


def test_study_fleets_are_fleet_presets_and_study_arms_loss_arms():
    from mismatch.fleets import FLEETS
    from mismatch.study.cells import STUDY_ARMS, STUDY_FLEETS
    from mismatch.train.arms import ARMS

    assert set(STUDY_FLEETS.values()) <= set(FLEETS)
    assert set(STUDY_ARMS.values()) <= set(ARMS)


def test_choice_list_renders_a_registry_and_refuses_a_stale_note():
    from mismatch.cli.common import choice_list

    assert choice_list(["a"]) == "a"
    assert choice_list(["a", "b", "c"]) == "a, b or c"
    assert choice_list({"a": 1, "b": 2}, {"b": "note"}, sep=" | ", last=" | ") == "a | b (note)"
    with pytest.raises(ValueError, match="choice notes for gone"):
        choice_list(["a", "b"], {"gone": "a note"})
