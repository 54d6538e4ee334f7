"""The registries' one rule (mismatch.registry), and that every preset table of the project
follows it."""

from __future__ import annotations

import pytest

from mismatch.registry import add_once, table_of


def test_a_name_is_registered_once():
    table: dict[str, int] = {}
    assert add_once(table, "a", 1, "thing") == 1 and table == {"a": 1}
    with pytest.raises(ValueError, match=r"^thing 'a' registered twice$"):
        add_once(table, "a", 2, "thing")
    assert table == {"a": 1}
    assert table_of(["x", "yy"], len, "word") == {1: "x", 2: "yy"}
    with pytest.raises(ValueError, match="word 1 registered twice"):
        table_of(["x", "y"], len, "word")


@pytest.mark.parametrize("register, table, item, what", [
    ("mismatch.quantize.codecs:register", "mismatch.quantize.codecs:CODECS", "nvfp4", "codec"),
    ("mismatch.quantize.precisions:register_precision", "mismatch.quantize.precisions:PRECISIONS",
     "fp8", "precision"),
    ("mismatch.quantize.accumulate:register_accumulation",
     "mismatch.quantize.accumulate:ACCUMULATIONS", None, "accumulation"),
    ("mismatch.profiles:register_gpu", "mismatch.profiles:GPUS", "h100", "gpu profile"),
    ("mismatch.fleets:register_fleet", "mismatch.fleets:FLEETS", "mixed", "fleet"),
])
def test_every_public_registry_refuses_a_second_registration(register, table, item, what):
    import importlib

    def obj(ref):
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    entries = obj(table)
    existing = entries[item] if item is not None else next(iter(entries.values()))
    before = dict(entries)
    with pytest.raises(ValueError, match=f"{what} .* registered twice"):
        obj(register)(existing)
    assert entries == before
