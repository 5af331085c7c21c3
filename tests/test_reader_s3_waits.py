"""Bounded, visible waits for the readers (issue 27, item 7): against a real loopback TCP server that
accepts connections and never answers, every way a PyTorch or DALI-side reader reads s3:// (the
manifest, a tar block's ranged GET, a ranged stream for PyAV and the token readers) fails within
the REPACK_S3_* bounds with an error naming the object's URL, after a wait line on stderr; the
readers read those variables exactly as the commands do."""

from __future__ import annotations

import time

import pytest

from pipelines import object_store
from pipelines.ranged_file import RangedObjectFile
from pipelines.s3_waits import ReaderLimits
from pipelines.torch_text import DocumentDataset
from pipelines.torch_webdataset import ImageShardDataset
from repack.errors import UsageError
from repack.store.s3_waits import S3Limits
from tests.tools.s3server import SilentServer, s3_env

LOW = {"REPACK_S3_READ_TIMEOUT": "1", "REPACK_S3_CONNECT_TIMEOUT": "1", "REPACK_S3_ATTEMPTS": "2",
       "REPACK_S3_NOTICE": "0.5"}
VARIABLES = ("REPACK_S3_CONNECT_TIMEOUT", "REPACK_S3_READ_TIMEOUT", "REPACK_S3_ATTEMPTS", "REPACK_S3_NOTICE",
             "REPACK_S3_RETRY_BUDGET")

READS = {
    "ImageShardDataset": (lambda: ImageShardDataset("s3://bucket/data"), "s3://bucket/data/manifest.json"),
    "DocumentDataset": (lambda: DocumentDataset("s3://bucket/text"), "s3://bucket/text/manifest.json"),
    "tar block": (lambda: object_store.read_range("s3://bucket/data/shard-000000.tar", 0, 4096),
                  "s3://bucket/data/shard-000000.tar"),
    "ranged file": (lambda: RangedObjectFile("s3://bucket/v/a.mp4", 5000).read(100), "s3://bucket/v/a.mp4"),
    "range into a buffer": (lambda: object_store.read_range_into("s3://bucket/data/shard-000001.tar", 0, bytearray(4096)),
                            "s3://bucket/data/shard-000001.tar"),
}


@pytest.fixture
def silent(monkeypatch):
    server = SilentServer()
    for name, value in {**s3_env(server.endpoint), **LOW}.items():
        monkeypatch.setenv(name, value)
    yield server
    server.close()


@pytest.mark.parametrize("read", list(READS))
def test_a_silent_endpoint_fails_the_reader_within_the_bounds_naming_the_url(silent, capfd, read):
    call, url = READS[read]
    started = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        call()
    took = time.monotonic() - started
    assert took < 2 * ReaderLimits.from_env().request_limit_s + 2, took  # 2 attempts of 1 s (+ backoff)
    assert str(caught.value).startswith(f"{url}: the S3 endpoint did not answer")
    assert "REPACK_S3_READ_TIMEOUT" in str(caught.value)
    assert silent.accepted >= 2  # each attempt a connection that got no answer
    waits = [line for line in capfd.readouterr().err.splitlines() if line.startswith("repack: waiting")]
    assert waits and f"GetObject {url}" in waits[0] and "not answering" in waits[0], waits


def test_the_readers_read_the_same_bounds_as_the_commands(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    fields = ("connect_timeout", "read_timeout", "attempts", "notice_after")
    for env in ({}, LOW, {"REPACK_S3_ATTEMPTS": "7", "REPACK_S3_READ_TIMEOUT": "45.5"}):
        for name in VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        reader, command = ReaderLimits.from_env(), S3Limits.from_env()
        assert [getattr(reader, f) for f in fields] == [getattr(command, f) for f in fields]
        assert reader.describe() == command.describe()
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert ReaderLimits.from_env().notice_after == 10 and ReaderLimits.from_env().request_limit_s <= 120
    monkeypatch.setenv("REPACK_S3_NOTICE", "never")
    with pytest.raises(ValueError, match="REPACK_S3_NOTICE='never'"):
        ReaderLimits.from_env()
    with pytest.raises(UsageError, match="REPACK_S3_NOTICE='never'"):
        S3Limits.from_env()
