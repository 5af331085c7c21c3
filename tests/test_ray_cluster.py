"""A real multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``: a head with no CPUs
plus three one-CPU worker nodes), each node with its own ``REPACK_SCRATCH`` as separate machines
have, SOURCE and OUT on s3:// (moto on loopback): no filesystem is shared between the driver and
the workers, and the dataset equals the local pool's byte for byte; a node's scratch keeps nothing
of a finished task (its outputs are in the store). A fourth node, whose requests
cross a 1 s latency proxy so that its task is surely mid-way, is removed while it runs: the lost
task is re-run elsewhere (only it), or with ``--retries 0`` fails the job by name, and a re-run
resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_repack
from tests.tools.latency_proxy import LatencyProxy
from tests.tools.photos import make_photo_tree
from tests.tools.s3server import MotoServer, client, objects, s3_env

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

ARGS = ("--shard-size", "10", "--quiet")
WORKER_NODES = 3
# The head's control store declares a node dead after 3 failed health checks 1 s apart (Ray's defaults: 5, 3 s
# apart: a node whose processes were killed was lost ~15 s later); a check's timeout stays Ray's 10 s, so a live
# node slowed by a loaded machine is not taken for dead
NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """40 small photos in 10 classes: 4 shards of 10."""
    root = tmp_path_factory.mktemp("cluster-photos")
    make_photo_tree(root, per_class=4, seed=3, max_side=96)
    return root


@pytest.fixture(scope="module")
def source(server, photos) -> str:
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="src")
    for path in sorted(p for p in photos.rglob("*") if p.is_file()):
        s3.upload_file(str(path), "src", f"photos/{path.relative_to(photos).as_posix()}")
    return "s3://src/photos"


@pytest.fixture(scope="module")
def reference(server, source, tmp_path_factory) -> dict[str, bytes]:
    """The local pool's dataset (same s3:// SOURCE and OUT): every object, job state aside."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="ref")
    scratch = tmp_path_factory.mktemp("ref-scratch")
    run_repack("images", source, "s3://ref/out", *ARGS, "--workers", "2",
               env={**s3_env(server.endpoint), "REPACK_SCRATCH": str(scratch)})
    return dataset(objects(s3, "ref", "out"))


def dataset(objs: dict[str, bytes]) -> dict[str, bytes]:
    """Shards, indexes and the manifest without its run section (timings, executor)."""
    found = {k: v for k, v in objs.items() if not k.startswith(".repack/") and k != "manifest.json"}
    manifest = json.loads(objs["manifest.json"])
    manifest.pop("run")
    found["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return found


@pytest.fixture(scope="module")
def cluster(server, tmp_path_factory):
    """A head (0 CPUs: it runs no task) and three 1-CPU worker nodes, each with its own scratch."""
    scratch = tmp_path_factory.mktemp("nodes")
    env = {**s3_env(server.endpoint), "PYTHONPATH": str(ROOT)}
    made = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": NODE_DEATH, "env_vars": {**env, "REPACK_SCRATCH": str(scratch / "head")}})
    nodes = [made.add_node(num_cpus=1, env_vars={**env, "REPACK_SCRATCH": str(scratch / f"node{i}")})
             for i in range(WORKER_NODES)]
    made.wait_for_nodes()
    made.scratch, made.workers = scratch, nodes
    yield made
    made.shutdown()


def test_three_node_cluster_without_shared_filesystem_matches_local_pool(server, source, reference, cluster,
                                                                         tmp_path):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="cluster")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "driver")}
    proc = run_repack("images", source, "s3://cluster/out", *ARGS, "--executor", "ray",
                      "--ray-address", cluster.address, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert dataset(objects(s3, "cluster", "out")) == reference
    ran_on = {p.parents[3].name for p in cluster.scratch.glob("*/*/.repack/tasks/shard-*.lock")}
    assert len(ran_on) >= 2, ran_on  # the shards were written on several nodes, never by the driver
    assert not list((tmp_path / "driver").glob("*/.repack/tasks/shard-*.lock"))
    assert not list(cluster.scratch.glob("*/*/shard-*")), "a node's scratch kept a published shard"


def lock_owners(scratch: Path, bucket_hash: str) -> dict[str, list[str]]:
    """task id -> the nodes whose scratch holds its task lock (a task leaves one where it started)."""
    owners: dict[str, list[str]] = {}
    for lock in sorted(scratch.glob(f"*/{bucket_hash}/.repack/tasks/*.lock")):
        owners.setdefault(lock.stem, []).append(lock.parents[3].name)
    return owners


def run_and_lose(server, cluster, source: str, out: str, tmp_path: Path, *extra: str, lose: str = "removed"):
    """Run the job on the cluster plus a slow extra node; once a task started on that node, lose it
    (``lose``: "removed": its raylet stopped with SIGTERM; "killed": every process of the node SIGKILLed;
    "driver": the driver SIGKILLed, then the node removed). Returns (the finished driver process, the
    tasks the extra node had started, OUT's scratch folder name)."""
    proxy = LatencyProxy(server.port, delay_s=1.0)  # its 10 GETs take >= 10 s: surely mid-way when lost
    doomed_scratch = cluster.scratch / f"doomed-{tmp_path.name}"
    doomed = cluster.add_node(num_cpus=1, env_vars={**s3_env(proxy.endpoint), "PYTHONPATH": str(ROOT),
                                                    "REPACK_SCRATCH": str(doomed_scratch)})
    try:
        cluster.wait_for_nodes()
        env = {**os.environ, **s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "driver")}
        proc = subprocess.Popen([sys.executable, "-m", "repack", "images", source, out, *ARGS, "--executor", "ray",
                                 "--ray-address", cluster.address, *extra], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while not list(doomed_scratch.glob("*/.repack/tasks/*.lock")):
            if proc.poll() is not None or time.time() >= deadline:  # what the driver said, to tell a crash from
                proc.kill()                                        # a schedule that left the extra node idle
                out, err = proc.communicate()
                raise AssertionError(f"no task started on the extra node (driver exit {proc.returncode}):\n"
                                     f"{out[-2000:]}\n{err[-4000:]}")
            time.sleep(0.05)
        if lose == "driver":
            proc.send_signal(signal.SIGKILL)
        cluster.remove_node(doomed, allow_graceful=lose != "killed")
        stdout, stderr = proc.communicate(timeout=240)  # never hangs
    finally:
        proxy.stop()
    lost = sorted(p.stem for p in doomed_scratch.glob("*/.repack/tasks/*.lock"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), lost, \
        next(doomed_scratch.iterdir()).name


def rerun(server, cluster, source: str, out: str, tmp_path: Path) -> str:
    """The same job again from the same driver host; its stdout."""
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "driver")}
    return run_repack("images", source, out, *ARGS, "--executor", "ray", "--ray-address", cluster.address,
                      env=env).stdout


@pytest.mark.parametrize("lose", ["removed", "killed"])
def test_node_lost_mid_job_reruns_only_its_task(server, source, reference, cluster, tmp_path, lose):
    s3 = client(server.endpoint)
    bucket = f"lost-{lose}"
    s3.create_bucket(Bucket=bucket)
    proc, lost, bucket_hash = run_and_lose(server, cluster, source, f"s3://{bucket}/out", tmp_path, lose=lose)
    assert proc.returncode == 0, proc.stderr
    assert dataset(objects(s3, bucket, "out")) == reference
    assert len(lost) == 1
    owners = lock_owners(cluster.scratch, bucket_hash)
    assert sorted(owners) == [f"shard-{i:06d}" for i in range(4)]
    for task, nodes in owners.items():  # each task ran once, the lost one once more on a surviving node
        assert len(nodes) == (2 if task in lost else 1), (task, nodes)


def test_task_lost_with_its_node_fails_by_name_after_retries_then_resumes(server, source, reference, cluster,
                                                                           tmp_path):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="noretry")
    proc, lost, _ = run_and_lose(server, cluster, source, "s3://noretry/out", tmp_path, "--retries", "0")
    assert proc.returncode == 4, proc.stderr
    assert len(lost) == 1 and "1 task(s) failed" in proc.stderr and lost[0] in proc.stderr
    assert "manifest.json" not in objects(s3, "noretry", "out")
    assert "1 task(s) run, 3 resumed" in rerun(server, cluster, source, "s3://noretry/out", tmp_path)
    assert dataset(objects(s3, "noretry", "out")) == reference


def test_driver_killed_mid_job_rerun_resumes(server, source, reference, cluster, tmp_path):
    """kill -9 of the driver while a task runs on a node: a re-run from the same host takes the lock over
    and finishes the job byte-identical, redoing at least the unfinished task and not the finished ones."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="driver")
    proc, lost, _ = run_and_lose(server, cluster, source, "s3://driver/out", tmp_path, lose="driver")
    assert proc.returncode == -signal.SIGKILL and len(lost) == 1
    done = sorted(k for k in objects(s3, "driver", "out") if k.startswith(".repack/tasks/"))
    assert f".repack/tasks/{lost[0]}.json" not in done
    assert f"{4 - len(done)} task(s) run, {len(done)} resumed" in rerun(server, cluster, source, "s3://driver/out",
                                                                          tmp_path)
    assert dataset(objects(s3, "driver", "out")) == reference


def test_drivers_pool_and_ray_workers_share_an_object_store_job(server, source, tmp_path):
    """SOURCE and OUT on s3:// with the driver's pool (1 CPU held from Ray) beside a Ray worker (a local
    instance of 2 CPUs started by the job): both run tasks (20 shards), and the dataset equals the local
    pool's byte for byte."""
    s3 = client(server.endpoint)
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "driver")}
    args = ("--shard-size", "2", "--quiet", "--workers", "2")
    for bucket, extra in (("pool", ()), ("mixed", ("--executor", "ray", "--ray-driver-cpus", "1"))):
        s3.create_bucket(Bucket=bucket)
        proc = run_repack("images", source, f"s3://{bucket}/out", *args, *extra, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
    mixed = objects(s3, "mixed", "out")
    assert dataset(mixed) == dataset(objects(s3, "pool", "out"))
    ran = json.loads(mixed["manifest.json"])["run"]["tasks_ran"]
    assert ran["driver_pool"] >= 1 and ran["ray"] >= 1 and sum(ran.values()) == 20, ran
