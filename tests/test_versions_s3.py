"""A dataset over time with OUT on s3:// (moto's S3 server on loopback, real boto3): append, remove
and gc under the store's lock give the same dataset files as the same steps on a local folder."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_repack
from tests.test_dataset_versions import add_inputs, make_source
from tests.tools.s3server import MotoServer, client, objects, s3_env


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def test_append_remove_gc_on_s3_equal_local(server, tmp_path):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="nightly")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    src, local, url = make_source(tmp_path / "src"), tmp_path / "local", "s3://nightly/ds"
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\ncat/new0.jpg\n")
    steps = [lambda out: ("images", src, out, "--shard-size", "4", "--quiet"),
             lambda out: ("images", src, out, "--shard-size", "4", "--append", "--quiet"),
             lambda out: ("remove", out, "--sources", tmp_path / "takedown.txt", "--quiet"),
             lambda out: ("gc", out, "--keep", "1")]
    removed = (src / "cat" / "c1.jpg").read_bytes()
    for number, step in enumerate(steps):
        if number == 1:
            add_inputs(src)
            removed_new = (src / "cat" / "new0.jpg").read_bytes()
        run_repack(*step(local))
        run_repack(*step(url), env=env)
        remote = {k: v for k, v in objects(s3, "nightly", "ds").items() if not k.startswith(".repack/")}
        here = {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()}
        assert remote.keys() == here.keys(), number
        for name, data in here.items():
            if name.startswith("manifest"):  # the run section holds timings
                mine, theirs = json.loads(data), json.loads(remote[name])
                mine.pop("run"), theirs.pop("run")
                mine["created_by"].pop("command", None), theirs["created_by"].pop("command", None)
                assert mine.keys() == theirs.keys()
                assert mine["shards"] == theirs["shards"] and mine.get("dataset_version", {}).get("number") == \
                    theirs.get("dataset_version", {}).get("number")
            else:
                assert remote[name] == data, name
        assert run_repack("verify", url, env=env).returncode == 0
    assert json.loads(remote["manifest.json"])["dataset_version"]["number"] == 3
    every = objects(s3, "nightly", "ds")
    assert not any(removed in blob or removed_new in blob for blob in every.values())
