"""Process-level settings that make many small tensor operations cheap on a CPU.

glibc's malloc serves a request above its mmap threshold (128 KiB at first, raised dynamically up
to 32 MiB) with a fresh `mmap` and returns it to the system on free. An eager PyTorch forward of
a small model allocates and frees thousands of such temporaries per step, and every fresh mapping
is paid again in page faults and zeroing: measured here, widening a [128, 2, 181, 32] BF16 tensor
to FP32 took 0.86–3.2 ms with a new allocation and 0.21 ms into memory already mapped.
`tune_allocator` raises the mmap and trim thresholds so freed memory stays in the heap and is
reused (the price: the process keeps its peak heap instead of returning it).

`bound_kernel_caches` caps the caches of oneDNN, the library PyTorch's CPU build runs BF16 matrix
products on. Both keep one compiled primitive per matrix shape, ~1.6 MB each for a BF16 GEMM
and its backward, up to 1024 shapes by default. A training step meets new shapes all the time (the
batch's length, the tokens each MoE expert receives), so a trainer's memory in use grew ~105 MB a
step and its resident memory to 5–7.5 GB at 2M parameters. With 64 shapes kept it stays flat at
the same step time (reports/benchmarks.md, "Resident memory of a training process").

`passive_thread_waits` makes torch's OpenMP threads sleep, not spin, when they wait for each
other (OMP_WAIT_POLICY=PASSIVE). GNU OpenMP's default spins a while at every barrier; with one
CPU-bound competitor per core a spinning thread burns the time slice its partner needs, and the
trainer's half of a 16 × 8 step grew from ~2.2 s to 7.5–9.8 s. Passive, it took 4.2–4.7 s under
the same load and the quiet step moved within run-to-run noise (reports/benchmarks.md, "Steady
under load").

`torch_threads(n)` sets torch's intra-op thread count for a block and restores the caller's on
the way out, so a library call never leaves the process on a thread count it did not choose.

For child processes: `parent_death_signal` (a child that dies with its parent), `core_slots` /
`child_setup` (concurrent children pinned to disjoint cores) and `keep_nice` (a child in a session
of its own stays as nice as its parent).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Callable, Iterator

__all__ = ["SMALL_MODEL_PARAMETERS", "QUIETED_WARNINGS", "quiet_library_logs", "default_threads",
           "torch_threads", "tune_allocator", "bound_kernel_caches", "KERNEL_CACHE_SHAPES",
           "passive_thread_waits",
           "parent_death_signal", "core_slots", "child_setup", "keep_nice"]

QUIETED_WARNINGS = (
    # torch.jit's deprecation notices, raised while modelopt and deepspeed import their kernels
    (r"`torch\.jit\.script", DeprecationWarning, ""),
    # the optional quantization libraries' import-time notices (missing CUDA extensions)
    ("", UserWarning, r"(torchao|modelopt|deepspeed)(\.|$)"),
    ("", FutureWarning, r"(torchao|modelopt|deepspeed|transformers)(\.|$)"),
)
"""(message regex, category, module regex) of the only warnings silenced; anything else still
reaches the user."""

QUIETED_LOGGERS = ("torchao", "torch.utils._pytree", "DeepSpeed", "deepspeed", "modelopt")
"""Loggers kept to errors: torchao's "Failed to load ... _C_mxfp8" (CUDA extensions a CPU build
cannot load) and torch's `_pytree` notices about torchao's enums, at every import."""


def quiet_library_logs() -> None:
    """Keep optional libraries' import-time chatter out of stderr, in this process: the CLI
    calls it, and so does every sampler worker process it spawns (a spawned child starts with
    fresh logging and warning filters)."""
    import logging
    import warnings

    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message, category, module in QUIETED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


SMALL_MODEL_PARAMETERS = 50_000_000
"""Below this many parameters one intra-op thread is the fastest for a forward: the per-op work
is too small to pay for the threads' synchronization."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DONE = False


def tune_allocator() -> bool:
    """Keep freed large blocks in the heap (glibc on Linux; a no-op elsewhere, or when
    MISMATCH_DEFAULT_MALLOC=1). Returns whether the settings were applied."""
    global _DONE
    if _DONE:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("MISMATCH_DEFAULT_MALLOC") == "1":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    _DONE = ok
    return ok


KERNEL_CACHE_SHAPES = 64
"""Compiled oneDNN primitives kept (per cache): enough for every GEMM of one step's forward and
backward to find its own again, not the shapes of steps long past."""

_KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",  # oneDNN's own primitive cache
                           "LRU_CACHE_CAPACITY")  # PyTorch's oneDNN (ideep) cache


def bound_kernel_caches(shapes: int = KERNEL_CACHE_SHAPES) -> dict[str, str]:
    """Cap oneDNN's per-shape primitive caches at `shapes` entries, unless the environment
    already sets them (a user's choice wins). Takes effect if called before the process's first
    oneDNN matrix product (importing torch is fine); child processes inherit it. Returns the
    settings in effect."""
    for name in _KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(int(shapes)))
    return {name: os.environ[name] for name in _KERNEL_CACHE_VARIABLES}


def passive_thread_waits() -> str:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment sets it (a user's choice wins). GNU
    OpenMP reads it once, when torch loads it: call before importing torch; child processes
    inherit it. Returns the policy in effect for processes started from now on."""
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block on `n` torch intra-op threads (None or 0: leave the count as it is) and
    restore the previous count afterwards, even on an exception. Yields the count in effect."""
    import torch

    held = torch.get_num_threads()
    if n:
        if n < 1:
            raise ValueError(f"thread count must be >= 1, got {n}")
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != held:
            torch.set_num_threads(held)


def default_threads(model, requested: int | None = None) -> int | None:
    """The intra-op thread count to run `model` on: `requested` when given, else 1 for a model
    under SMALL_MODEL_PARAMETERS, else None (torch's default)."""
    if requested is not None:
        return requested
    n = sum(p.numel() for p in model.parameters())
    return 1 if n < SMALL_MODEL_PARAMETERS else None


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen preexec_fn that makes the child receive `sig` when the thread that started it dies
    (Linux PR_SET_PDEATHSIG), so a killed parent leaves no orphan behind; None where prctl is
    missing. libc is resolved here, in the parent: between fork and exec the hook only calls one
    C function (no import, no lock)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, number = 1, int(sig)
    return lambda: prctl(pr_set_pdeathsig, number)


def core_slots(jobs: int) -> list[tuple[int, ...]] | None:
    """Disjoint sets of the CPUs this process may use, one per concurrent child (Linux, `jobs`
    ≥ 2 and no more than the CPUs); None: leave the children unpinned.

    A training run in a lockstep mode takes every CPU its process may use for its step
    (train.trainer.lockstep_threads). Unpinned, two such runs on two cores put four OpenMP
    threads on two cores whenever their training phases meet; pinned, each has cores of its own
    and as many threads as it has cores."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return None
    if jobs < 2 or jobs > len(cpus):
        return None
    per = len(cpus) // jobs
    return [tuple(cpus[i * per:(i + 1) * per]) for i in range(jobs)]


def child_setup(death: Callable[[], None] | None,
                cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """One Popen preexec_fn from a death-signal hook and a CPU set (either may be None). The
    child also keeps the parent's niceness against other sessions (`keep_nice`)."""
    def setup() -> None:
        if death is not None:
            death()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        keep_nice()
    return setup


def keep_nice() -> None:
    """Give this process's scheduling group the process's own niceness. On Linux with
    autogroups, each session is one group and groups share the CPUs fairly whatever their
    processes' niceness; a child started in a session of its own (`start_new_session`) would
    otherwise compete at full weight, so `nice mismatch study` would not yield to other work.
    A no-op where there are no autogroups."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass
