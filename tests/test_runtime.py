"""mismatch.runtime's child-process helpers: CPU slots for concurrent runs (disjoint, within the
CPUs this process may use; none when pinning cannot help) and the preexec hook that applies one
to a real child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mismatch.runtime import child_setup, core_slots, parent_death_signal

linux_only = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"),
                                reason="CPU affinity is a Linux call")


@linux_only
@pytest.mark.parametrize("cpus,jobs,expected", [
    ({0, 1}, 2, [(0,), (1,)]),
    ({0, 1, 2, 3}, 2, [(0, 1), (2, 3)]),
    ({2, 5, 7}, 3, [(2,), (5,), (7,)]),
    ({0, 1, 2, 3, 4}, 2, [(0, 1), (2, 3)]),  # an odd CPU out stays unused, never shared
    ({0, 1}, 1, None),                         # one run: it may use every CPU
    ({0, 1}, 3, None),                         # more runs than CPUs: pinning cannot separate them
])
def test_core_slots_are_disjoint_sets_of_the_allowed_cpus(monkeypatch, cpus, jobs, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    slots = core_slots(jobs)
    assert slots == expected
    if slots:
        flat = [c for s in slots for c in s]
        assert len(flat) == len(set(flat)) and set(flat) <= cpus


@linux_only
def test_child_setup_pins_a_real_child_to_its_slot():
    mine = sorted(os.sched_getaffinity(0))
    want = (mine[-1],)
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=child_setup(parent_death_signal(), want), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(list(want))
    # no slot: the child keeps the parent's CPUs
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          preexec_fn=child_setup(None, None), timeout=60)
    assert proc.stdout.strip() == str(mine)
    assert child_setup(None, None) is None
