"""kill -9 of the `repack` process alone (not its group: the OOM killer, a user's `kill`): its pool
workers die with it, an immediate re-run takes the lock and equals an uninterrupted run byte for
byte, for local and s3:// OUT; a writer of a superseded run publishes nothing (run id)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repack.jobs.base import read_plan
from repack.jobs.engine import execute_task
from repack.jobs.run_guard import StaleRunError, check_run, claim_run
from repack.store import open_store
from tests.conftest import ROOT, run_repack
from tests.test_images_job import shard_bytes
from tests.tools.s3server import MotoServer, client, objects, s3_env


@pytest.fixture(scope="module")
def many_jpegs(tmp_path_factory) -> Path:
    """240 small distinct JPEGs (seeded noise) in two classes: 48 tasks of 5, long enough to be killed mid-run."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(21)
    for i in range(240):
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=80)
    return root


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: the killed driver's pool, fork server, ffmpeg."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def kill_driver_mid_run(args: list, env: dict, records_done) -> None:
    """Start `repack ARGS` in a session of its own; once ``records_done()`` is true and workers run,
    SIGKILL the driver alone; assert every process it started is gone within 2 s."""
    proc = subprocess.Popen([sys.executable, "-m", "repack", *map(str, args)], cwd=ROOT, env={**os.environ, **env},
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if records_done() and len(session_pids(proc.pid)) > 1:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the job finished before it could be killed"
        assert len(session_pids(proc.pid)) > 1, "no worker processes to outlive the driver"
        os.kill(proc.pid, signal.SIGKILL)  # the driver only, not its process group
        proc.wait()
        deadline = time.time() + 2.0
        while session_pids(proc.pid) and time.time() < deadline:
            time.sleep(0.02)
        assert session_pids(proc.pid) == [], "processes of the killed run outlived it"
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_local_workers_die_with_the_driver(many_jpegs, tmp_path):
    args = ["images", many_jpegs, tmp_path / "out", "--shard-size", "5", "--workers", "2", "--quiet"]
    tasks = tmp_path / "out" / ".repack" / "tasks"
    kill_driver_mid_run(args, {}, lambda: tasks.is_dir() and len(list(tasks.glob("*.json"))) >= 3)
    assert not (tmp_path / "out" / "manifest.json").exists()
    run_repack(*args)  # right away: no lock error
    run_repack("images", many_jpegs, tmp_path / "ref", "--shard-size", "5", "--workers", "2", "--quiet")
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")


def test_s3_workers_die_with_the_driver(many_jpegs, server, tmp_path):
    """With s3:// OUT the pool starts by forkserver (the lock's heartbeat thread runs): the workers'
    parent is the fork server, which outlived a SIGKILLed driver, and so did they (issue 21)."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="orphans")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    args = ["images", many_jpegs, "s3://orphans/run", "--shard-size", "5", "--workers", "2", "--quiet"]

    def records() -> bool:
        return s3.list_objects_v2(Bucket="orphans", Prefix="run/.repack/tasks/").get("KeyCount", 0) >= 3

    kill_driver_mid_run(args, env, records)
    # as in the issue: right away, --overwrite with another option; no old worker writes after it
    other = [*args[:3], "--shard-size", "6", "--workers", "2", "--quiet", "--overwrite"]
    run_repack(*other, env=env)
    time.sleep(0.5)
    assert run_repack("verify", "s3://orphans/run", env=env).returncode == 0
    # the same options' run into a local folder (an s3:// OUT's shards equal a local run's: tests/test_s3_out.py)
    run_repack("images", many_jpegs, tmp_path / "ref", *other[3:-1])
    run, ref = objects(s3, "orphans", "run"), shard_bytes(tmp_path / "ref")
    assert len(ref) == 80 and {k: v for k, v in run.items() if k.endswith((".tar", ".idx"))} == ref


def _stale_setup(src: Path, out: str, env: dict) -> tuple:
    """A finished job in ``out``; its first task's record removed as if its writer was still at work;
    the writer's (old) run token, and a later run's claim on ``out``."""
    run_repack("images", src, out, "--shard-size", "100", "--workers", "1", "--quiet", env=env)
    store = open_store(out)
    job = json.loads(store.read_bytes(".repack/job.json"))
    task = read_plan(store).tasks[0].to_json()
    old = claim_run(store)
    store.delete(f".repack/tasks/{task['task_id']}.json")
    new = claim_run(store)  # a later run took the lock
    check_run(store, new)
    with pytest.raises(StaleRunError, match="later repack run took the lock"):
        check_run(store, old)
    return store, job, task, old


def test_stale_writer_publishes_nothing_local(many_jpegs, tmp_path):
    out = str(tmp_path / "out")
    store, job, task, old = _stale_setup(many_jpegs, out, {})
    with pytest.raises(StaleRunError):
        execute_task(job["job"], json.dumps(job["spec"]), json.dumps(task), job["plan_digest"], run=old)
    assert store.read_bytes(f".repack/tasks/{task['task_id']}.json") is None  # no record: the next run redoes it


def test_stale_writer_publishes_nothing_s3(many_jpegs, server, tmp_path, monkeypatch):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="stale")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store, job, task, old = _stale_setup(many_jpegs, "s3://stale/out", env)
    shard = "shard-000000.tar"
    s3.delete_object(Bucket="stale", Key=f"out/{shard}")
    with pytest.raises(StaleRunError):
        execute_task(job["job"], json.dumps(job["spec"]), json.dumps(task), job["plan_digest"], run=old)
    left = objects(s3, "stale", "out")
    assert shard not in left and f".repack/tasks/{task['task_id']}.json" not in left


def test_partitions_side_by_side_do_not_wait_for_each_other(many_jpegs, tmp_path):
    """Each partition's workers hold their own workers lock: two partitions with pools run at once."""
    out = tmp_path / "parts"
    args = [sys.executable, "-m", "repack", "images", str(many_jpegs), str(out), "--shard-size", "5", "--workers", "2",
            "--quiet", "--num-nodes", "2"]
    procs = [subprocess.Popen(args + ["--node-rank", str(rank)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    for proc in procs:
        assert proc.wait(120) == 0, proc.stderr.read()
    run_repack("merge", out, "--quiet")
    run_repack("images", many_jpegs, tmp_path / "ref", "--shard-size", "5", "--workers", "2", "--quiet")
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
