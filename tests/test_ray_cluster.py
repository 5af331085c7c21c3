"""A real multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``: a head with no CPUs
plus three one-CPU worker nodes), each node with its own ``REPACK_SCRATCH`` as separate machines
have, SOURCE and OUT on s3:// (moto on loopback): no filesystem is shared between the driver and
the workers, and the dataset equals the local pool's byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_repack
from tests.tools.photos import make_photo_tree
from tests.tools.s3server import MotoServer, client, objects, s3_env

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

ARGS = ("--shard-size", "10", "--quiet")
WORKER_NODES = 3


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
        "num_cpus": 0, "include_dashboard": False, "env_vars": {**env, "REPACK_SCRATCH": str(scratch / "head")}})
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
    ran_on = {p.parent.parent.name for p in cluster.scratch.glob("*/*/shard-*.tar")}
    assert len(ran_on) >= 2, ran_on  # the shards were written on several nodes, never by the driver
    assert not list((tmp_path / "driver").glob("*/shard-*.tar"))
