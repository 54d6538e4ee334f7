"""A connection to Ray for the Ray backend (ray_backend.py): a local single-node instance this
process starts and stops, or a cluster it joins as a driver.

Local Ray (no `address`): started with the machine's CPUs, every listener (GCS, raylet, workers,
dashboard and its agents) on 127.0.0.1, a temporary directory under the system's temp dir that is
removed at the end, and token authentication with a token held in the environment rather than
written to ~/.ray. A reaper process outlives this one: if it dies without closing its Ray
(kill -9), the reaper ends what Ray started and removes the directory. With `address`, the run
joins that cluster as a driver and leaves it running.

Ray is an optional extra: `ray_module()` imports it, or says how to install it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["RaySession", "start_ray", "ray_module"]


def ray_module():
    """The `ray` module (an optional extra: a ValueError saying how to install it)."""
    try:
        import ray
    except ImportError as exc:  # the optional extra
        raise ValueError("--backend ray needs Ray: pip install 'mismatch[ray]'") from exc
    return ray


def _check_reachable(address: str) -> None:
    """A HOST:PORT cluster address must accept a connection (Ray itself retries forever)."""
    if address == "auto" or "://" in address:
        return
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except ValueError:
        raise ValueError(f"--address {address!r} is not HOST:PORT (or auto)") from None
    except OSError as exc:
        raise ValueError(f"cannot reach a Ray cluster at {address} "
                         f"({exc.strerror or type(exc).__name__}); start one with `ray start "
                         "--head` or check the address") from None


class RaySession:
    """A connection to Ray: a local instance this process started (and stops), or a cluster."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 dashboard: bool = True) -> None:
        self.address, self.started, self._tmp, self._reaper = address, False, None, None
        self.dashboard_url: str | None = None
        self._env: dict[str, str | None] = {}
        imported = "ray" in sys.modules
        if imported and sys.modules["ray"].is_initialized():
            return  # a caller's Ray (tests share one): use it, leave it up
        if address is None:
            # a single-node instance: loopback address (Linux otherwise advertises the host's
            # external IP and binds its gRPC servers to every interface) and a token held in the
            # environment (Ray would otherwise write one to ~/.ray/auth_token). Ray reads these
            # when it is imported: set them first, and refresh them if it already was.
            self._setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            self._setenv("RAY_AUTH_MODE", "token")
            self._setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
        ray = ray_module()
        if address is None:
            if imported:
                from ray._private import ray_constants
                from ray._raylet import Config

                ray_constants.ENABLE_RAY_CLUSTER = False
                Config.initialize("")
            self._tmp = tempfile.mkdtemp(prefix="mm-ray-")
            self._reaper = self._start_reaper()  # before Ray starts anything
            try:
                ctx = ray.init(num_cpus=num_cpus or os.cpu_count() or 1,
                               include_dashboard=dashboard, dashboard_host="127.0.0.1",
                               _node_ip_address="127.0.0.1", _temp_dir=self._tmp,
                               log_to_driver=False, configure_logging=False)
            except BaseException:
                self.close()
                raise
            self.dashboard_url = ctx.dashboard_url
        else:
            _check_reachable(address)
            try:
                ctx = ray.init(address=address, log_to_driver=False, configure_logging=False)
                self.dashboard_url = ctx.dashboard_url
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ValueError(f"cannot join the Ray cluster at {address} "
                                 f"({str(exc).splitlines()[0]}); check the address and that "
                                 "`ray status` sees it") from None
        self.started = True

    def _start_reaper(self):
        """A process that outlives this one: it notes this process's descendants every second,
        and if this process dies without close() (kill -9), it kills those still running (Ray's
        agents would otherwise outlive it; process start times guard against reused ids) and
        removes the temporary directory."""
        if not Path("/proc").is_dir():
            return None
        return subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), self._tmp],
                                start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def _setenv(self, key: str, value: str) -> None:
        self._env.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    def close(self) -> None:
        if self.started:
            ray_module().shutdown()
            self.started = False
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env = {}
        if self._tmp:
            _remove_tree(self._tmp)
            self._tmp = None
        if self._reaper is not None:  # it sees the directory gone and exits
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:  # the directory outlived the retries: Ray is shut
                self._reaper.kill()             # down, so the reaper has nothing left to guard
                self._reaper.wait()
            self._reaper = None


def _remove_tree(path: str, seconds: float = 10.0) -> None:
    """Remove a directory that Ray's processes may still be writing into for a moment after
    `ray.shutdown()` returns (a single rmtree can then leave it behind): retry until it is gone,
    for `seconds` at most."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


_REAPER = """
import os, shutil, signal, sys, time
driver, tmp = int(sys.argv[1]), sys.argv[2]

def table():
    parents, starts = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(name))
            starts[int(name)] = fields[19]
    return parents, starts

def below(pid):
    parents, starts = table()
    out, todo = {}, list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        if child != os.getpid():
            out[child] = starts[child]
            todo += parents.get(child, [])
    return out

seen = {}
while os.path.exists(tmp):
    try:
        os.kill(driver, 0)
    except OSError:
        break
    seen.update(below(driver))
    time.sleep(1.0)
if os.path.exists(tmp):  # the driver died without closing its Ray: end what it started
    _, starts = table()
    for pid, start in seen.items():
        if starts.get(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.5)
    shutil.rmtree(tmp, ignore_errors=True)
"""



def start_ray(address: str | None = None, num_cpus: int | None = None,
              dashboard: bool = True) -> RaySession:
    """Start (no `address`) or join Ray; close() the session to stop what it started."""
    return RaySession(address, num_cpus, dashboard)

