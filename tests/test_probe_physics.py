"""Physics of the emulated samplers on the embedded model (`slow`: five probes of 1024 prompts).

Each figure comes from enough tokens that the 95% intervals of the compared configurations do
not overlap (reports/probe-physics.md has the full-size run). The five probes are independent
and each runs on one thread (the embedded model's default): they run in one process per core,
the figures the same as one after another."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from mismatch.app.probe import ProbeConfig, run_probe
from mismatch.engines.workers import default_processes

pytestmark = pytest.mark.slow


def _k3(kw: dict) -> tuple[float, float, float]:
    s = run_probe(ProbeConfig(n_prompts=1024, emulate=True, **kw)).summary  # even on a GPU
    lo, hi = s["total"]["kl_k3_ci95"]
    return s["total"]["kl_k3"], lo, hi


_PROBES = {"nvfp4": dict(gpu="b200", dtype="nvfp4"), "fp8": dict(gpu="b200", dtype="fp8"),
           "bf16": dict(gpu="b200", dtype="bf16"),
           "kv8": dict(gpu="b200", dtype="bf16", kv_cache="fp8"),
           "fp16": dict(gpu="b200", dtype="fp16", trainer_dtype="fp16")}


@pytest.fixture(scope="module")
def b200():
    with ProcessPoolExecutor(max_workers=min(len(_PROBES), default_processes()),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(_PROBES, pool.map(_k3, _PROBES.values())))


def test_precision_ordering(b200):
    bf16, fp8, nvfp4 = b200["bf16"], b200["fp8"], b200["nvfp4"]
    assert nvfp4[1] > fp8[2], (nvfp4, fp8)  # intervals do not overlap
    assert fp8[1] > bf16[2], (fp8, bf16)


def test_fp8_kv_cache_adds_kl(b200):
    assert b200["kv8"][1] > b200["bf16"][2], (b200["kv8"], b200["bf16"])


def test_fp16_both_sides_beats_bf16_both_sides(b200):
    assert b200["fp16"][2] < b200["bf16"][1], (b200["fp16"], b200["bf16"])
    assert b200["fp16"][0] > 0
