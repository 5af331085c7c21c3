"""Bounded, visible waits for the readers (issue 27, item 7): against a real loopback TCP server that
accepts connections and never answers, every way a PyTorch or DALI-side reader reads s3:// (the
manifest, a tar block's ranged GET, a ranged stream for PyAV and the token readers) fails within
the REPACK_S3_* bounds with an error naming the object's URL, after a wait line on stderr; the
readers read those variables exactly as the commands do."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from pipelines import object_store
from pipelines.ranged_file import RangedObjectFile
from pipelines.torch_text import DocumentDataset
from pipelines.torch_webdataset import ImageShardDataset
from repack.errors import UsageError
from repack.store import s3_client
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
    assert took < 2 * object_store.limits().request_limit_s + 2, took  # 2 attempts of 1 s (+ backoff)
    assert str(caught.value).startswith(f"{url}: the S3 endpoint did not answer")
    assert "REPACK_S3_READ_TIMEOUT" in str(caught.value)
    assert silent.accepted >= 2  # each attempt a connection that got no answer
    waits = [line for line in capfd.readouterr().err.splitlines() if line.startswith("repack: waiting")]
    assert waits and f"GetObject {url}" in waits[0] and "not answering" in waits[0], waits


def test_the_readers_and_the_commands_read_the_bounds_through_one_module(monkeypatch):
    """One reading of the REPACK_S3_* variables (repack.manifest.s3_waits, which the readers may import):
    the same limits for every environment, and no second copy of the parsing anywhere."""
    for env in ({}, LOW, {"REPACK_S3_ATTEMPTS": "7", "REPACK_S3_READ_TIMEOUT": "45.5"}):
        for name in VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(s3_client, "_limits", {})  # the commands cache theirs per process
        assert object_store.limits() == s3_client.limits()
        assert object_store.limits().describe() == s3_client.limits().describe()
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert object_store.limits().notice_after == 10 and object_store.limits().request_limit_s <= 120
    monkeypatch.setenv("REPACK_S3_NOTICE", "never")
    with pytest.raises(ValueError, match="REPACK_S3_NOTICE='never'"):  # a reader: a plain ValueError
        object_store.limits()
    monkeypatch.setattr(s3_client, "_limits", {})
    with pytest.raises(UsageError, match="REPACK_S3_NOTICE='never'"):  # a command: a bad job, exit 2
        s3_client.limits()
    root = Path(__file__).resolve().parents[1]
    readers = [p.relative_to(root).as_posix() for package in ("repack", "pipelines")
               for p in sorted((root / package).rglob("*.py")) if "REPACK_S3_READ_TIMEOUT\"" in p.read_text()]
    assert readers == ["repack/manifest/s3_waits.py"], readers


def test_every_pause_before_asking_again_is_scaled_by_one_variable(monkeypatch):
    from repack.manifest.s3_waits import S3Limits, bounded_pause, resume_pause, retry_pause

    for name in VARIABLES + ("REPACK_S3_BACKOFF",):
        monkeypatch.delenv(name, raising=False)
    assert S3Limits.from_env().backoff == 1
    assert all(0 <= retry_pause(attempt) <= min(20.0, 2.0 ** (attempt - 1)) for attempt in range(1, 9))
    assert resume_pause(3) == 0.8 and bounded_pause(2, time.monotonic() + 60) == 2.0
    assert bounded_pause(9, time.monotonic() + 60) == 8.0 and bounded_pause(2, time.monotonic() - 1) == 0
    monkeypatch.setenv("REPACK_S3_BACKOFF", "0.1")
    assert abs(resume_pause(3) - 0.08) < 1e-12 and abs(bounded_pause(2, time.monotonic() + 60) - 0.2) < 1e-12
    assert all(retry_pause(attempt) <= 0.1 * min(20.0, 2.0 ** (attempt - 1)) for attempt in range(1, 9))
    monkeypatch.setenv("REPACK_S3_BACKOFF", "0")
    assert retry_pause(5) == resume_pause(5) == bounded_pause(5, time.monotonic() + 60) == 0
    monkeypatch.setenv("REPACK_S3_BACKOFF", "-1")
    with pytest.raises(ValueError, match="REPACK_S3_BACKOFF='-1'"):
        retry_pause(1)
    # no pause of its own anywhere else: every S3 retry sleeps one of these
    root = Path(__file__).resolve().parents[1]
    pause = re.compile(r"random\.random\(\)\s*\*\s*min\(|\b0\.[15]\s*\*\s*2\s*\*\*")  # a doubling pause written out
    own = [p.relative_to(root).as_posix() for package in ("repack", "pipelines") for p in sorted((root / package).rglob("*.py"))
           if pause.search(p.read_text())]
    assert own == ["repack/manifest/s3_waits.py"], own
