"""`mismatch train --backend ray`: a real local Ray (2 CPUs, every listener on 127.0.0.1), the
sampler groups and the trainer as actors, against the local backend; a sampler actor killed with
SIGKILL mid-run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'mismatch[ray]')")

from mismatch.train.config import preset_config  # noqa: E402
from mismatch.train.fleet import fleet  # noqa: E402
from mismatch.train.loop import run  # noqa: E402
from mismatch.train.ray_actors import sampler_resources  # noqa: E402
from mismatch.train.ray_backend import RayBackend  # noqa: E402
from mismatch.train.ray_session import start_ray  # noqa: E402
from mismatch.train.rundir import latest_checkpoint, read_metrics  # noqa: E402

# sync on the one-group fleet: step s samples units [sP, (s+1)P) with version s, one batch —
# the same computation on both backends. Seed 1 with 4 prompts: the first step holds a group
# with mixed rewards, so its loss is a real policy gradient (asserted below); the embedded
# policy answers most arith prompts all right or all wrong.
SYNC = dict(fleet="homogeneous", sync=True, tasks="arith", prompts_per_step=4,
            samples_per_prompt=8, max_new_tokens=40, eval_tasks=0, checkpoint_every=10, seed=1)


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the in-process tests (backends reuse it and leave it up)."""
    session = start_ray(num_cpus=2)
    yield session
    session.close()


@pytest.fixture(scope="module")
def local_sync(tmp_path_factory, model, tok):
    out = tmp_path_factory.mktemp("local-sync")
    run(preset_config("smoke", steps=3, **SYNC), out, model=model, tokenizer=tok,
        log_alerts=False)
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def local_whole_rows(tmp_path_factory, model, tok):
    """local_sync's first 2 steps with each row scored whole, as FSDP2 ranks score them
    (ShardedTrainer.share_prefix)."""
    from mismatch.train.trainer import Trainer

    out = tmp_path_factory.mktemp("local-whole")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "share_prefix", False)
        run(preset_config("smoke", steps=2, **SYNC), out, model=model, tokenizer=tok,
            log_alerts=False)
    return read_metrics(out / "metrics.jsonl")


def _ray_pids() -> set[int]:
    me = psutil.Process()
    return {p.pid for p in me.children(recursive=True)} | {me.pid}


def test_every_ray_listener_is_on_loopback(ray_session):
    import ray

    ray.get(ray.remote(lambda: 1).remote())  # a worker up too
    pids = _ray_pids()
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 4, listening  # GCS, raylet, dashboard, a worker at least
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
    assert {c.laddr.ip for c in listening} <= loopback, listening
    assert ray_session.dashboard_url and ray_session.dashboard_url.startswith("127.0.0.1:")


def test_sync_first_step_matches_the_local_backend(ray_session, local_sync, tmp_path, model,
                                                   tok):
    out = tmp_path / "ray"
    run(preset_config("smoke", steps=1, **SYNC), out, model=model, tokenizer=tok,
        log_alerts=False, backend=RayBackend())
    (first,) = read_metrics(out / "metrics.jsonl")
    ref = local_sync[0]
    assert first["backend"] == "ray" and ref["backend"] == "local"
    assert ref["loss"] != 0.0  # rewards differ within the groups: a real policy gradient
    assert first["units"] == ref["units"] == [0, 1, 2, 3]
    assert first["reward"] == ref["reward"]
    assert first["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-9)
    assert first["kl"] == pytest.approx(ref["kl"], rel=1e-6)
    assert first["group_tokens_per_s"].keys() == {"b200-bf16"}


def test_killed_sampler_actor_is_restarted_and_nothing_is_lost(ray_session, local_sync,
                                                               tmp_path, model, tok, caplog):
    import ray

    backend = RayBackend(replicas=2)
    seen: dict[str, int] = {}

    def kill_during_step_2(rec):
        if rec.step != 1:
            return
        pipe = backend.pipe
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # step 2's units are being sampled
            busy = [key for key, n in list(pipe.inflight.items()) if n > 0]
            if busy:
                break
            time.sleep(0.005)
        assert busy, "no sampling call in flight after step 1"
        group, i = busy[0]
        seen["pid"] = pipe.pids[(group, i)]
        os.kill(seen["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "restarted_pid" not in seen:  # Ray restarts it (calls fail until it is back)
            try:
                seen["restarted_pid"] = pipe.actor_pid(group, i)
            except ray.exceptions.RayActorError:
                assert time.monotonic() < deadline, "the killed actor was not restarted"
                time.sleep(0.2)

    out = tmp_path / "killed"
    with caplog.at_level(logging.WARNING, logger="mismatch.train"):
        run(preset_config("smoke", steps=3, **SYNC), out, model=model, tokenizer=tok,
            log_alerts=False, backend=backend, progress=kill_during_step_2)
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert seen["restarted_pid"] != seen["pid"]
    assert recs[0]["sampler_restarts"] == 0 and recs[0]["requeued_units"] == 0
    assert recs[-1]["sampler_restarts"] == 1
    assert recs[-1]["requeued_units"] == SYNC["prompts_per_step"]  # step 2's units, again
    assert any("died" in m for m in caplog.messages)
    n = SYNC["prompts_per_step"]
    assert any(f"re-queued {n} unit(s) ({n * 8} episodes)" in m for m in caplog.messages)
    # every unit consumed exactly once, in order, and sampled again to the same trajectories
    assert [u for r in recs for u in r["units"]] == list(range(3 * n))
    for got, ref in zip(recs, local_sync):
        assert got["reward"] == ref["reward"]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-9)


def test_a_dead_trainer_ends_the_run_resumably(ray_session, local_sync, tmp_path, model, tok):
    import ray

    from mismatch.train.ray_actors import BackendError

    backend = RayBackend()
    out = tmp_path / "trainer-killed"

    def kill_trainer_after_step_3(rec):  # its step-2 checkpoint is written
        if rec.step == 3:
            os.kill(ray.get(backend._actors[0].pid.remote()), signal.SIGKILL)

    cfg = dict(SYNC, checkpoint_every=2)
    with pytest.raises(BackendError, match="trainer actor died during a step.*--resume"):
        run(preset_config("smoke", steps=4, **cfg), out, model=model, tokenizer=tok,
            log_alerts=False, backend=backend, progress=kill_trainer_after_step_3)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    run(preset_config("smoke", steps=4, **cfg), out, resume=True, model=model, tokenizer=tok,
        log_alerts=False, backend=RayBackend())
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    # step 3 recomputed from the step-2 checkpoint: the uninterrupted run's step 3
    assert recs[2]["units"] == local_sync[2]["units"]
    assert recs[2]["loss"] == pytest.approx(local_sync[2]["loss"], rel=1e-6, abs=1e-9)


def test_weights_lost_with_their_publisher_are_told_from_a_dead_sampler(ray_session):
    """Real Ray: a sampler whose fetch of a version fails because the actor publishing it died
    (RayTaskError wrapping ActorDiedError) is told apart from a sampler actor that died itself
    (which Ray restarts and the pipeline retries): the first ends the run with --resume."""
    import ray

    from mismatch.train.ray_backend import weights_lost

    class Publisher:  # defined here: Ray's workers cannot import this test module
        def publish(self):  # dies while it publishes, as a trainer killed mid-call
            os._exit(1)

    class Sampler:
        def fetch(self, weights):
            return ray.get(weights[0])

        def sleep(self):
            time.sleep(60)

        def pid(self):
            return os.getpid()

    publisher = ray.remote(max_restarts=0)(Publisher).options(num_cpus=0).remote()
    sampler = ray.remote(max_restarts=0)(Sampler).options(num_cpus=0).remote()
    with pytest.raises(ray.exceptions.RayActorError) as lost:
        ray.get(sampler.fetch.remote([publisher.publish.remote()]), timeout=120)
    assert weights_lost(lost.value)
    pid = ray.get(sampler.pid.remote())  # asked first: an actor's calls run one at a time
    call = sampler.sleep.remote()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(call, timeout=120)
    assert not weights_lost(died.value)


def test_fsdp2_trainer_ranks_on_a_shared_weights_path_step_as_one_trainer_and_resume(
        ray_session, local_whole_rows, tmp_path, model, tok):
    local_sync = local_whole_rows
    out, shared = tmp_path / "fsdp", tmp_path / "weights"
    cfg = preset_config("smoke", steps=2, **SYNC)
    run(cfg, out, model=model, tokenizer=tok, log_alerts=False,
        backend=RayBackend(trainer_ranks=2, weights_dir=shared))
    # versions 0, 1, 2 and the final export went through the shared path, the newest kept
    files = sorted(p.name for p in shared.iterdir())
    assert files and all(f.startswith("v-") and f.endswith(".safetensors") for f in files)
    assert files[-1] == "v-00000003.safetensors" and len(files) <= 5
    recs = read_metrics(out / "metrics.jsonl")
    # step 1: the same weights score the same episodes, split over two ranks (BF16 forward)
    assert recs[0]["reward"] == local_sync[0]["reward"]
    assert recs[0]["loss"] == pytest.approx(local_sync[0]["loss"], rel=1e-3, abs=1e-6)
    assert recs[0]["kl"] == pytest.approx(local_sync[0]["kl"], rel=1e-3)
    assert recs[0]["sampled_tokens"] == local_sync[0]["sampled_tokens"]
    # step 2 samples with the FSDP2 trainer's first update: close to the local one's
    assert recs[1]["kl"] == pytest.approx(local_sync[1]["kl"], rel=0.2)
    # its full-state checkpoint resumes on two ranks, and a one-rank resume is refused
    run(preset_config("smoke", steps=3, **SYNC), out, resume=True, model=model, tokenizer=tok,
        log_alerts=False, backend=RayBackend(trainer_ranks=2))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    with pytest.raises(ValueError, match="2-rank trainer"):
        run(preset_config("smoke", steps=4, **SYNC), out, resume=True, model=model,
            tokenizer=tok, log_alerts=False)


def test_smoke_run_on_ray_killed_and_resumed(tmp_path):
    """The CLI end to end with a Ray of its own, HOME an empty directory: killed with SIGKILL
    after its step-2 checkpoint (no Ray process or temporary file survives it), resumed to the
    end; its records have the local backend's keys."""
    home, tmp = tmp_path / "home", Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    home.mkdir()
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp))  # short: Ray's socket paths
    for key in [k for k in env if k.startswith("RAY_")]:
        del env[key]
    outs = {b: tmp_path / b for b in ("local", "ray")}
    cmd = [sys.executable, "-m", "mismatch.cli", "train", "--preset", "smoke", "--steps", "4",
           "--n-prompts", "2", "--samples", "4", "--quiet", "--out"]
    local = subprocess.run(cmd + [str(outs["local"])], env=env, capture_output=True, text=True,
                           timeout=600)
    assert local.returncode == 0, local.stderr[-3000:]
    proc = subprocess.Popen(cmd + [str(outs["ray"]), "--backend", "ray"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while latest_checkpoint(outs["ray"]) is None and proc.poll() is None:  # step 2's
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    started = psutil.Process(proc.pid).children(recursive=True)
    assert len(started) >= 8  # Ray's processes and the actors
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.info for p in alive]
    assert not list(tmp.glob("mm-ray-*"))  # Ray's session directory removed by the reaper
    resumed = subprocess.run(cmd + [str(outs["ray"]), "--backend", "ray", "--resume"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr
    ref, remote = (read_metrics(outs[b] / "metrics.jsonl") for b in ("local", "ray"))
    assert [r["step"] for r in remote] == [1, 2, 3, 4] and len(ref) == 4
    assert [set(r) - {"resumed_discarded_units"} for r in remote] == [set(r) for r in ref]
    assert {r["backend"] for r in remote} == {"ray"}
    assert all(r["queue_depth"] >= 0 and r["sampler_restarts"] == 0 for r in remote)
    from mismatch.zoo import check_model_dir

    check_model_dir(outs["ray"] / "final")  # a whole model directory: config, weights, tokenizer
    assert json.loads((outs["ray"] / "config.json").read_text())["fleet"] == "mixed"
    # HOME keeps one thing: the native CPU kernels' build cache, finished libraries only
    # (mismatch/kernels/native.py; the mixed fleet's FP8 and NVFP4 groups build it)
    cache = Path(".cache", "mismatch", "native")
    left = [p.relative_to(home) for p in home.rglob("*")]
    assert all(p in (Path(".cache"), cache.parent, cache) or
               (p.parent == cache and p.name.startswith("mismatch_native_") and p.suffix == ".so")
               for p in left), left
    assert not list(tmp.glob("mm-ray-*"))
    shutil.rmtree(tmp)


def test_bad_ray_input_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "mismatch.cli", "train", "--preset", "smoke",
           "--out", str(tmp_path / "x")]
    for extra, needle in ((["--backend", "ray", "--replicas", "0"], "replicas must be"),
                          (["--backend", "ray", "--placement", "tpu"], "unknown placement"),
                          (["--replicas", "2"], "options of --backend ray"),
                          (["--backend", "ray", "--address", "127.0.0.1:1"],
                           "cannot reach a Ray cluster at 127.0.0.1:1"),
                          (["--backend", "ray", "--address", "headnode"], "not HOST:PORT"),
                          (["--backend", "slurm"], "--backend must be local or ray")):
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (extra, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()


def test_gpu_placement_asks_for_the_groups_gpu_type():
    groups = {g.name: g for g in fleet("mixed")}
    opts = sampler_resources(groups["h100-fp8"], "gpu", 0.5)
    assert opts == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "H100"}
    assert sampler_resources(groups["b200-nvfp4"], "gpu", 0.5)["accelerator_type"] == "B200"
    assert sampler_resources(groups["a100-bf16"], "cpu", 0.25) == {"num_cpus": 0.25}


def test_close_removes_a_directory_still_being_written_and_ends_its_reaper(tmp_path):
    """After ray.shutdown() Ray's processes may write into the session's directory for a moment
    (a single rmtree then left it behind, and close() timed out waiting for the reaper). Here a
    writer keeps creating files in it for a second while close() runs: close() must return, the
    directory be gone, the reaper be ended. No Ray is started: only the directory and the real
    reaper process of a session."""
    import threading

    from mismatch.train.ray_session import RaySession

    session = object.__new__(RaySession)
    session.address, session.started, session._env = None, False, {}
    session._tmp = tempfile.mkdtemp(prefix="mm-ray-test-", dir=tmp_path)
    session._reaper = session._start_reaper()
    stop = time.monotonic() + 1.0

    def writer() -> None:
        i = 0
        while time.monotonic() < stop:
            d = Path(session._tmp) / "session" / f"logs-{i % 7}"
            try:
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{i}.log").write_text("x")
            except OSError:
                pass
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    tmp, reaper = session._tmp, session._reaper
    time.sleep(0.2)
    session.close()
    thread.join()
    assert not os.path.exists(tmp)
    assert reaper.poll() is not None and session._reaper is None
