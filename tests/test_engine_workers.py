"""Sampler worker processes: calls, shared weights, a worker killed mid-call, training through
them, pausing them for the trainer's step."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from mismatch.engines.workers import WorkerError, WorkerPool, worker_state


def _whoami(x: int) -> tuple[int, int, int, str]:
    return x * 2, os.getpid(), torch.get_num_threads(), worker_state()["setup"]


def _sum_shared(weights: dict[str, torch.Tensor]) -> tuple[float, bool]:
    w = weights["w"]
    return float(w.sum()), w.is_shared()


def _fail() -> None:
    raise ValueError("bad input in the worker")


def _slow_once(marker: str) -> str:
    """Sleeps (to be killed) the first time; returns at once when called again."""
    path = Path(marker)
    if path.exists():
        return f"again in {os.getpid()}"
    path.write_text(str(os.getpid()))
    time.sleep(120)
    return "not killed"


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, "payload", max_restarts=1)
    yield p
    p.close()


def test_calls_run_in_one_thread_processes_and_in_parallel(pool):
    out = pool.map(_whoami, [(i,) for i in range(6)])
    assert [o[0] for o in out] == [0, 2, 4, 6, 8, 10]
    assert {o[1] for o in out} <= set(pool.pids()) and os.getpid() not in {o[1] for o in out}
    assert all(o[2] == 1 and o[3] == "payload" for o in out)


def test_weights_travel_through_shared_memory(pool):
    w = torch.arange(1000, dtype=torch.float32)
    total, shared = pool.call(_sum_shared, {"w": w})
    assert total == float(w.sum()) and shared
    assert w.is_shared()  # moved to shared memory once, mapped by the worker


def test_an_error_in_the_worker_is_raised_in_the_caller(pool):
    with pytest.raises(RuntimeError, match="ValueError in sampler worker sampler-.: bad input"):
        pool.call(_fail)
    assert pool.call(_whoami, 1)[0] == 2  # the worker lives on


def test_a_worker_killed_mid_call_is_restarted_and_the_call_sent_again(tmp_path):
    pool = WorkerPool(1, "payload", max_restarts=1)
    try:
        marker = tmp_path / "pid"
        killer = threading.Thread(target=_kill_when_written, args=(marker,))
        killer.start()
        t0 = time.monotonic()
        out = pool.call(_slow_once, str(marker))
        killer.join()
        assert out.startswith("again in ") and int(out.split()[-1]) != int(marker.read_text())
        assert pool.restarts == 1 and time.monotonic() - t0 < 100
        # the restart budget is spent: the next death is an error naming the worker, not a hang
        marker.unlink()
        killer = threading.Thread(target=_kill_when_written, args=(marker,))
        killer.start()
        with pytest.raises(WorkerError, match=r"sampler worker sampler-0 \(pid \d+\) died with "
                                              r"exit code -9 during _slow_once"):
            pool.call(_slow_once, str(marker))
        killer.join()
    finally:
        pool.close()


def _kill_when_written(marker: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if marker.exists() and marker.read_text():
            os.kill(int(marker.read_text()), signal.SIGKILL)
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_training_through_sampler_processes_matches_in_process_sampling(tmp_path):
    """Two sync steps on the mixed fleet: the same episodes, losses and metrics whether the
    samplers run in this process (one thread: the step's units in one batch) or in two worker
    processes (half the units each, split along their groups' attention). The batches differ in
    composition: the same tokens, and log-probs that a BF16 GEMM over a different number of rows
    or a split-KV partition over another longest context may round differently
    (mismatch.engines.engine: batch invariance), which moves the KL figures by about 1%. A
    group's own KL rests on its 4 episodes' ~100 tokens: one position moved by a rounding (up to
    0.12 nats, tests/test_engine_lanes.py) moves it by up to ~0.12²/2/100 ≈ 7e-5. kl_k1, the
    signed mean of log μ − log π over the step's N sampled tokens, is linear in each: a
    rounding of δ nats moves it by δ/N whatever its value, which cancellation keeps small
    (7e-4 here), so it is held to an absolute bound (measured 4.1e-5: 0.02 nats in all)."""
    from mismatch.train.config import TrainConfig
    from mismatch.train.loop import run
    from mismatch.train.rundir import read_metrics

    records = {}
    for n in (0, 2):
        cfg = TrainConfig.flat(fleet="mixed", correction="sc+mis", steps=2, prompts_per_step=4,
                               samples_per_prompt=4, sync=True, max_turns=2, max_new_tokens=32,
                               candidates=16, sampler_processes=n, checkpoint_every=5, threads=1)
        run(cfg, tmp_path / f"p{n}", log_alerts=False)
        records[n] = read_metrics(tmp_path / f"p{n}" / "metrics.jsonl")
    exact = ("sampled_tokens", "reward", "end_reasons")
    assert [{k: r[k] for k in exact} for r in records[0]] == \
        [{k: r[k] for k in exact} for r in records[2]]
    close = ("loss", "kl", "entropy", "grad_norm")
    for a, b in zip(records[0], records[2]):
        assert {k: a[k] for k in close} == pytest.approx({k: b[k] for k in close}, rel=0.05,
                                                          abs=1e-6)
        assert a["kl_k1"] == pytest.approx(b["kl_k1"], rel=0, abs=1e-4)
        assert a["group_kl"] == pytest.approx(b["group_kl"], rel=0.1, abs=1e-4)
    assert all(r["sampler_restarts"] == 0 for r in records[2])


def _busy_count(path: str, seconds: float) -> int:
    """Count up for `seconds` of wall time, writing the count as it goes."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += 1
        if n % 1000 == 0:
            Path(path).write_text(str(n))
    return n


def _state(pid: int) -> str:
    """The kernel's one-letter state of a process (R running, S sleeping, T stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_paused_workers_stop_and_continue_and_their_calls_complete(pool, tmp_path):
    """`paused` stops every worker process for the block (SIGSTOP: the kernel shows them
    stopped, a call in flight makes no progress) and continues them after; the call completes."""
    marker = tmp_path / "count"
    result = []
    caller = threading.Thread(target=lambda: result.append(
        pool.call(_busy_count, str(marker), 1.5)))
    caller.start()
    while not marker.exists():
        time.sleep(0.02)
    with pool.paused():
        deadline = time.perf_counter() + 5  # a signal is delivered soon, not at once
        while {_state(pid) for pid in pool.pids()} != {"T"} and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert {_state(pid) for pid in pool.pids()} == {"T"}
        time.sleep(0.05)
        before = marker.read_text()
        time.sleep(0.3)
        assert marker.read_text() == before
    deadline = time.perf_counter() + 5
    while "T" in {_state(pid) for pid in pool.pids()} and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert "T" not in {_state(pid) for pid in pool.pids()}
    caller.join(timeout=30)
    assert result and result[0] > 0
    assert pool.call(_whoami, 3)[0] == 6


def test_the_async_core_handoff_only_where_samplers_fill_every_core(monkeypatch):
    """Where sampler processes fill the cores, an asynchronous run's trainer steps on half of
    them (at least one) and the samplers on the rest keep sampling (the others pause); a free
    core, threads or lockstep: nothing changes."""
    import contextlib
    from types import SimpleNamespace

    import mismatch.engines.workers as workers
    from mismatch.train.loop import _core_handoff

    class FakePool:
        def __init__(self, size):
            self.size = size

        def paused(self, keep=0):
            return ("paused", keep)

    for cores, size, lockstep, want in ((2, 2, False, (1, ("paused", 1))),
                                        (1, 1, False, (1, ("paused", 0))),
                                        (4, 4, False, (2, ("paused", 2))),
                                        (4, 6, False, (2, ("paused", 2))),
                                        (2, 2, True, None), (2, None, False, None),
                                        (2, 1, False, None)):
        monkeypatch.setattr(workers, "default_processes", lambda n=cores: n)
        trainer = SimpleNamespace(threads=None)
        pool = FakePool(size) if size else None
        got = _core_handoff(SimpleNamespace(lockstep=lockstep), SimpleNamespace(pool=pool),
                            trainer)
        if want is None:
            assert got is contextlib.nullcontext and trainer.threads is None
        else:
            assert (trainer.threads, got()) == want, (cores, size)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_paused_with_keep_lets_the_workers_take_turns(pool, tmp_path):
    """`paused(keep=1)` on two busy workers: one runs at a time (the kernel shows one stopped),
    they take turns so both calls in flight move on, and both continue after the block. With
    `keep` at the pool's size nothing stops."""
    markers = [tmp_path / "a", tmp_path / "b"]
    results: list = []
    callers = [threading.Thread(target=lambda m=m: results.append(
        pool.call(_busy_count, str(m), 3.0))) for m in markers]
    for c in callers:
        c.start()
    while not all(m.exists() for m in markers):
        time.sleep(0.02)

    def count(path: Path) -> int:  # the writer truncates, then writes
        for _ in range(100):
            try:
                return int(path.read_text())
            except ValueError:
                time.sleep(0.001)
        raise AssertionError(f"{path} never held a count")

    with pool.paused(keep=1, turn_s=0.05):
        time.sleep(0.2)
        start = [count(m) for m in markers]
        samples, one_stopped = 0, 0
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            states = [_state(pid) for pid in pool.pids()]
            samples += 1
            one_stopped += states.count("T") == 1
            time.sleep(0.003)
        moved = [count(m) - s for m, s in zip(markers, start)]
        # one stopped at almost every look (a turn's change takes a signal's delivery)
        assert one_stopped >= 0.8 * samples, (one_stopped, samples)
        assert all(n > 0 for n in moved), moved  # both took turns
    deadline = time.perf_counter() + 5
    while "T" in {_state(pid) for pid in pool.pids()} and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert "T" not in {_state(pid) for pid in pool.pids()}
    for c in callers:
        c.join(timeout=60)
    assert len(results) == 2 and all(r > 0 for r in results)
    with pool.paused(keep=2):  # keep >= the pool's size: nothing stops
        assert "T" not in {_state(pid) for pid in pool.pids()}
        assert pool.call(_whoami, 1)[0] == 2


def test_an_async_run_with_samplers_on_every_core_splits_the_cores_and_says_so(tmp_path, caplog):
    """Two asynchronous steps with two sampler processes on a machine (or affinity) of two
    cores or fewer: the log says how the cores are split while the trainer steps (two: it on
    one, the samplers taking turns on the other; one: the samplers pause), and the run ends."""
    import logging

    from mismatch.train.config import TrainConfig
    from mismatch.train.loop import run
    from mismatch.train.rundir import read_metrics

    cores = len(os.sched_getaffinity(0))
    cfg = TrainConfig.flat(fleet="homogeneous", correction="grpo", steps=2, prompts_per_step=4,
                           samples_per_prompt=4, max_turns=2, max_new_tokens=32, candidates=16,
                           sampler_processes=max(2, cores), checkpoint_every=5, threads=1)
    with caplog.at_level(logging.INFO, logger="mismatch.train"):
        run(cfg, tmp_path / "run", log_alerts=False)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    said = "take turns on the other 1" if cores >= 2 else "they pause while the trainer steps"
    assert any(said in r.getMessage() for r in caplog.records)


def test_a_claim_is_spread_over_the_processes_its_thread_has_to_itself():
    """Lockstep: the step's one claim over every sampler process. Asynchronous: one sampler
    thread per process claims its own share, which stays whole (halving it again made batches
    half as large and the step slower than --sync's)."""
    from types import SimpleNamespace

    from mismatch.train.pipeline import _spread, spread_width

    for lockstep, workers, processes, want in ((True, 1, 2, 2), (True, 1, 4, 4),
                                               (False, 1, 2, 1), (False, 2, 2, 1),
                                               (False, 1, 1, 1)):
        cfg = SimpleNamespace(lockstep=lockstep, workers=workers)
        assert spread_width(cfg, processes) == want
    share = [[(u, "g") for u in range(8)]]
    assert [len(b) for b in _spread(share, spread_width(
        SimpleNamespace(lockstep=False, workers=1), 2))] == [8]
    assert [len(b) for b in _spread(share, spread_width(
        SimpleNamespace(lockstep=True, workers=1), 2))] == [4, 4]


def test_a_lane_batch_is_halved_along_its_groups_attention():
    """A step of the study's mixed fleet over two processes: the groups that attend alike (one
    kernel family, one KV-cache format) stay in one process — the FA3 groups in one, the NVFP4
    (TRT-LLM), A100 (FA2) and RTX (FlashInfer) groups in the other — as many units each, every
    unit once, each half in the claims' order. One group (or plain names) halves as before."""
    from mismatch.train.fleet import fleet
    from mismatch.train.pipeline import _spread

    groups = fleet("mixed")
    claims = [(u, groups[u % len(groups)]) for u in range(16)]
    halves = _spread([claims], 2)
    assert [len(h) for h in halves] == [8, 8]
    assert sorted(u for h in halves for u, _ in h) == list(range(16))
    families = [{g.spec.attention for _, g in h} for h in halves]
    assert families == [{"fa3"}, {"trtllm", "fa2", "flashinfer"}]
    assert all([u for u, _ in h] == sorted(u for u, _ in h) for h in halves)
    # four processes: each set of alike groups cut only where it must be
    quarters = _spread([claims], 4)
    assert [len(q) for q in quarters] == [4, 4, 4, 4]
    assert [{g.name for _, g in q} for q in quarters][2:] == [
        {"b200-nvfp4", "b300-nvfp4"}, {"a100-bf16", "rtx-pro-6000-bf16"}]
    # a set larger than a half is cut at the half: 12 FA3 units and 4 others
    fa3 = [g for g in groups if g.spec.attention == "fa3"]
    lopsided = [(u, fa3[u % 4]) for u in range(12)] + [(12 + u, groups[0]) for u in range(4)]
    a, b = _spread([lopsided], 2)
    assert [u for u, _ in a] == list(range(8))
    assert [u for u, _ in b] == list(range(8, 16))
    homogeneous = [(u, fleet("homogeneous")[0]) for u in range(7)]
    assert [[u for u, _ in h] for h in _spread([homogeneous], 2)] == [[0, 1, 2], [3, 4, 5, 6]]
