"""The driver's pool beside Ray's workers (the default ``--ray-driver-cpus``) when the cluster's only worker
node is lost mid-job: its batches can never be scheduled again (the driver's CPU is held for the pool), and
the job used to wait for them forever. The pool takes their tasks now; the dataset equals the local pool's.
A cluster's messages ("(raylet) A worker died ...") go to stderr: ``--json`` keeps stdout one document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.test_ray_cluster import ARGS, NODE_DEATH, dataset, photos, reference, server, source  # noqa: F401 - fixtures
from tests.tools.latency_proxy import LatencyProxy
from tests.tools.s3server import client, objects, s3_env

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")


def test_the_only_worker_node_lost_beside_the_drivers_pool_finishes(server, source, reference, tmp_path):  # noqa: F811
    scratch = tmp_path / "nodes"
    env = {**s3_env(server.endpoint), "PYTHONPATH": str(ROOT)}
    cluster = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={  # its CPU: the driver's pool
        "num_cpus": 1, "include_dashboard": False, "_system_config": NODE_DEATH, "env_vars": {**env, "REPACK_SCRATCH": str(scratch / "head")}})
    proxy = LatencyProxy(server.port, delay_s=1.0)  # the worker node's GETs: its batch is surely mid-way
    # the driver's too: its pool starts before Ray answers where the head offers CPUs, and on a fast run it took
    # all 4 tasks before Ray handed the worker node one (the test then failed on "no task started")
    driver_proxy = LatencyProxy(server.port, delay_s=0.2)
    try:
        doomed = cluster.add_node(num_cpus=1, env_vars={**s3_env(proxy.endpoint), "PYTHONPATH": str(ROOT),
                                                        "REPACK_SCRATCH": str(scratch / "doomed")})
        cluster.wait_for_nodes()
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="shared-lost")
        proc = subprocess.Popen([sys.executable, "-m", "repack", "images", source, "s3://shared-lost/out", *ARGS,
                                 "--json", "--executor", "ray", "--ray-address", cluster.address], cwd=ROOT, text=True,
                                env={**os.environ, **s3_env(driver_proxy.endpoint),
                                     "REPACK_SCRATCH": str(tmp_path / "d")},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while not list((scratch / "doomed").glob("*/.repack/tasks/*.lock")):
            if proc.poll() is not None or time.time() >= deadline:
                proc.kill()
                raise AssertionError(f"no task started on the worker node:\n{proc.communicate()[1][-4000:]}")
            time.sleep(0.05)
        cluster.remove_node(doomed, allow_graceful=False)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if "proc" in locals() and proc.poll() is None:
            proc.kill()
        proxy.stop()
        driver_proxy.stop()
        cluster.shutdown()
    assert proc.returncode == 0, stderr
    assert dataset(objects(s3, "shared-lost", "out")) == reference
    assert json.loads(stdout)["totals"]["samples"] == 40
    ran = json.loads(objects(s3, "shared-lost", "out")["manifest.json"])["run"]["tasks_ran"]
    assert ran["driver_pool"] >= 1 and sum(ran.values()) == 4, ran


def test_an_unanswering_ray_address_from_the_environment_fails_fast(tmp_path):
    """RAY_ADDRESS, which the executor joins as --ray-address, is checked as that is: exit 2 at once (ray.init
    retried for minutes)."""
    from tests.conftest import run_repack

    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"\xff\xd8\xff")
    started = time.time()
    done = run_repack("images", tmp_path / "src", tmp_path / "out", "--executor", "ray", check=False,
                      env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 2 and "cannot reach the Ray cluster at 127.0.0.1:1" in done.stderr
    assert time.time() - started < 30
