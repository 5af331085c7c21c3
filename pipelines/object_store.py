"""Reading a dataset's files where they are: a local path, or an ``s3://bucket/key`` URL.

Objects are read with boto3 (credentials and endpoint the standard AWS way: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles). A byte range is
a ranged GET whose body is read as it arrives: a shard is streamed, never downloaded whole first.
One client per process (DataLoader workers make their own).
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

REQUEST_ATTEMPTS = 8
_clients: dict[int, object] = {}


def is_remote(location: str | os.PathLike) -> bool:
    return str(location).startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b")."""
    bucket, _, key = str(url)[5:].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return bucket, key


def _client():
    pid = os.getpid()
    if pid not in _clients:
        import boto3
        from botocore.config import Config

        config = Config(retries={"max_attempts": REQUEST_ATTEMPTS, "mode": "standard"}, read_timeout=120)
        _clients[pid] = boto3.session.Session().client("s3", config=config)
    return _clients[pid]


def read_bytes(location: str | os.PathLike) -> bytes:
    """The whole file or object (FileNotFoundError when it does not exist)."""
    if not is_remote(location):
        with open(location, "rb") as fh:
            return fh.read()
    from botocore.exceptions import ClientError

    bucket, key = split_url(str(location))
    try:
        return _client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            raise FileNotFoundError(str(location)) from None
        raise


class _Window(io.RawIOBase):
    """Bytes [start, end) of a local file, as a stream."""

    def __init__(self, path: str, start: int, end: int) -> None:
        self._fh = open(path, "rb", buffering=0)
        self._fh.seek(start)
        self._left = end - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer)[:self._left]
        n = self._fh.readinto(view) if len(view) else 0
        self._left -= n
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def open_range(location: str, start: int, end: int, buffer: int = 1 << 20) -> BinaryIO:
    """A buffered stream of bytes [start, end) of a local file or an object (one ranged GET)."""
    if not is_remote(location):
        return io.BufferedReader(_Window(location, start, end), buffer)
    bucket, key = split_url(location)
    return _client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
