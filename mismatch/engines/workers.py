"""Sampler worker processes: rollouts on every core, beside a trainer in the main process.

Python threads share one interpreter lock, so sampler threads and the trainer in one process
take turns on the CPU. `WorkerPool` starts `n` worker processes (spawned, not forked: a forked
copy of a process whose torch thread pools already run can deadlock), each with one torch thread,
and runs calls of module-level functions in them:

- **Setup once.** Each worker receives a `setup` payload when it starts (the base model, the
  tokenizer) and keeps it, with anything the calls cache (models per weight version, calibrated
  scales, numerics tables), in its own `state` dict for its whole life.
- **Weights shared, not copied.** Arguments travel with torch's multiprocessing pickler: a tensor
  goes through shared memory, so a weight version published once is mapped by every worker
  without a copy on the wire (a worker copies it into its model once per version). Results come
  back as one plain pickle (tensors as bytes): a worker never holds the trainer's memory.
- **Faults.** A worker dies with the process that started it (Linux: its parent-death signal),
  so a killed trainer leaves no sampler behind. A call waits on its worker's pipe and on the
  process itself. A worker that dies mid-call (killed, out of memory, a crash in native code) is
  restarted and the call sent again — the call must be deterministic in its arguments, as
  seeded rollouts are — up to
  `max_restarts` times in the pool's life; then the call raises `WorkerError` naming the worker,
  its exit code and the call. An exception raised by the function itself is re-raised in the
  caller with the worker's traceback text. Nothing waits for ever.

Calls from several threads run in parallel, one per idle worker (`call` blocks until a worker is
free); `map` spreads a list of calls over the pool; `paused` stops the workers, or all but some,
for a block (their cores go to the caller: the trainer's step in an asynchronous run).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

__all__ = ["WorkerPool", "WorkerError", "worker_state", "default_processes"]

_POLL_S = 0.2  # how often a waiting call checks its worker is alive
_START_TIMEOUT_S = 300.0  # spawning imports torch and transformers: slow on a loaded machine

_STATE: dict[str, Any] = {}


def worker_state() -> dict[str, Any]:
    """Inside a worker: the dict that holds its setup payload (key "setup") and whatever calls
    cache between them. In the main process: an empty dict of its own (calls run inline)."""
    return _STATE


class WorkerError(RuntimeError):
    """A worker process died, or could not start."""


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it ends (the parent is killed)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _main(conn, index: int, threads: int, tied: bool) -> None:
    from ..runtime import bound_kernel_caches, quiet_library_logs, torch_threads, tune_allocator

    if tied:
        _die_with_parent()
    quiet_library_logs()
    tune_allocator()
    bound_kernel_caches()
    with torch_threads(threads):
        _serve(conn, index)


def _serve(conn, index: int) -> None:
    """Receive the setup, then run each (fn, args, kwargs) sent until None or a closed pipe."""
    try:
        _STATE["setup"] = conn.recv()
        _STATE["index"] = index
        conn.send_bytes(b"ready")
    except EOFError:
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        fn, args, kwargs = message
        try:
            out = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # the caller re-raises it, with this traceback
            out = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
        try:
            payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result: say so rather than die
            payload = pickle.dumps(("error", (type(exc).__name__, f"result of {fn.__name__} "
                                              f"cannot be sent back: {exc}", "")))
        conn.send_bytes(payload)


class _Worker:
    def __init__(self, ctx, index: int, threads: int, setup: Any, name: str) -> None:
        self.index, self.name = index, f"{name}-{index}"
        self.conn, child = ctx.Pipe()
        # tied to the parent's life only when started from its main thread (the death signal
        # follows the starting thread, which must outlive the pool)
        tied = threading.current_thread() is threading.main_thread()
        self.process = ctx.Process(target=_main, args=(child, index, threads, tied),
                                   name=self.name, daemon=True)
        self.process.start()
        child.close()
        self.conn.send(setup)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.conn.poll(_POLL_S):
            if not self.process.is_alive():
                raise WorkerError(f"sampler worker {self.name} (pid {self.process.pid}) exited "
                                  f"with code {self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"sampler worker {self.name} did not start within "
                                  f"{_START_TIMEOUT_S:.0f} s")
        if self.conn.recv_bytes() != b"ready":
            raise WorkerError(f"sampler worker {self.name} sent an unexpected greeting")

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """`n` worker processes of one torch thread each (see the module docstring)."""

    def __init__(self, n: int, setup: Any, *, threads: int = 1, max_restarts: int = 3,
                 name: str = "sampler") -> None:
        import torch.multiprocessing as mp

        if n < 1:
            raise ValueError(f"a worker pool needs at least one process, got {n}")
        self._ctx = mp.get_context("spawn")
        self._setup, self._threads, self._name = setup, threads, name
        self.max_restarts, self.restarts = max_restarts, 0
        self._lock = threading.Condition()
        self._workers: list[_Worker] = []
        try:
            for i in range(n):
                self._workers.append(_Worker(self._ctx, i, threads, setup, name))
            for w in self._workers:
                w.wait_ready()
        except BaseException:
            self.close()
            raise
        self._idle = list(self._workers)
        self._stopped: set[int] = set()  # pids stopped by `paused`
        self._closed = False

    @property
    def size(self) -> int:
        return len(self._workers)

    def _take_idle(self) -> _Worker:
        """An idle worker, a running one before a stopped one (under the lock). A call given a
        stopped worker starts at its next turn, or when `paused` ends."""
        for i in range(len(self._idle) - 1, -1, -1):
            if self._idle[i].process.pid not in self._stopped:
                return self._idle.pop(i)
        return self._idle.pop()

    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """fn(*args, **kwargs) in an idle worker; blocks until one is free and the call ends."""
        with self._lock:
            while not self._idle:
                if self._closed:
                    raise WorkerError("the worker pool is closed")
                self._lock.wait(1.0)
            worker = self._take_idle()
        held = [worker]  # the worker to give back (a restart replaces it)
        try:
            return self._run(held, fn, args, kwargs)
        finally:
            with self._lock:
                self._idle.append(held[0])
                self._lock.notify()

    def map(self, fn: Callable, calls: list[tuple]) -> list[Any]:
        """[fn(*args) for args in calls], spread over the pool's workers."""
        if len(calls) <= 1 or self.size == 1:
            return [self.call(fn, *args) for args in calls]
        with ThreadPoolExecutor(max_workers=self.size) as ex:
            return list(ex.map(lambda args: self.call(fn, *args), calls))

    def _run(self, held: list[_Worker], fn: Callable, args, kwargs) -> Any:
        worker = held[0]
        what = f"{getattr(fn, '__qualname__', fn)}"
        while True:
            try:
                worker.conn.send((fn, args, kwargs))
                while not worker.conn.poll(_POLL_S):
                    if not worker.process.is_alive():
                        raise EOFError
                status, value = pickle.loads(worker.conn.recv_bytes())
                break
            except (EOFError, OSError, BrokenPipeError):
                worker.process.join(timeout=5)
                code = worker.process.exitcode
                with self._lock:
                    self.restarts += 1
                    give_up = self.restarts > self.max_restarts
                if give_up:
                    raise WorkerError(
                        f"sampler worker {worker.name} (pid {worker.process.pid}) died with exit "
                        f"code {code} during {what}; {self.restarts - 1} restarts already used "
                        f"(max {self.max_restarts})") from None
                replacement = _Worker(self._ctx, worker.index, self._threads, self._setup,
                                      self._name)
                worker.conn.close()
                with self._lock:
                    self._workers[self._workers.index(worker)] = replacement
                worker = held[0] = replacement
                worker.wait_ready()
        if status == "error":
            name, message, trace = value
            raise RuntimeError(f"{name} in sampler worker {worker.name}: {message}\n{trace}")
        return value

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    @contextlib.contextmanager
    def paused(self, keep: int = 0, turn_s: float = 0.05) -> Iterator[None]:
        """For the block, at most `keep` worker processes run; the others are stopped (SIGSTOP)
        and all continue after, whatever the block raises. The stopped workers' cores are the
        caller's meanwhile; a call in flight on a stopped worker just takes longer. With
        0 < `keep` < the pool's size the workers take turns (every `turn_s` seconds the next
        `keep` of them in index order run, the others stop), so every call in flight moves on
        at keep/size of its speed instead of some stalling whole. A worker killed meanwhile is
        found dead by its call, as always."""
        with self._lock:
            pids = [w.process.pid for w in sorted(self._workers, key=lambda w: w.index)]
        if keep >= len(pids):
            yield
            return

        def send(pid: int, sig: int) -> None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

        def run_only(running: list[int]) -> None:
            with self._lock:
                self._stopped = set(pids) - set(running)
            for pid in pids:  # stop before continuing: never more than `keep` run at once
                if pid not in running:
                    send(pid, signal.SIGSTOP)
            for pid in running:
                send(pid, signal.SIGCONT)

        done = threading.Event()

        def turns() -> None:
            turn = 0
            while not done.wait(turn_s):
                turn += keep
                run_only([pids[(turn + j) % len(pids)] for j in range(keep)])

        run_only(pids[:keep])
        rotor = threading.Thread(target=turns, name="worker-turns", daemon=True) \
            if keep > 0 else None
        try:
            if rotor is not None:
                rotor.start()
            yield
        finally:
            done.set()
            if rotor is not None and rotor.is_alive():
                rotor.join()
            with self._lock:
                self._stopped = set()
            for pid in pids:
                send(pid, signal.SIGCONT)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for w in self._workers:
            w.close()
        self._workers = []


def default_processes() -> int:
    """One sampler process per core the machine gives this process, at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
