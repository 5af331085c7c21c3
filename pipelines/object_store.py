"""Reading a dataset's files where they are: a local path, or an ``s3://bucket/key`` URL.

Objects are read with boto3's configuration (credentials and endpoint the standard AWS way:
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles).
A byte range is a ranged GET whose body is read as it arrives: a shard is streamed, never downloaded
whole first. A connection lost in the middle of a range is resumed from the byte where it stopped.
``read_range_into`` receives a range straight into the caller's buffer (one copy: the socket's).
The first ranged GET of a bucket is boto3's, and teaches the bucket's route; the others are signed and
sent on kept-alive sockets by ``pipelines.s3_ranges`` (~0.1-0.3 ms of client CPU a GET where botocore
spends 3-4 ms; forked DataLoader workers inherit the route and need no boto3 client), and every answer
that is not the range is boto3's to give. One client per process and endpoint (workers make their own).

Waits are bounded and visible as the commands' are, by the same code (``repack.manifest.s3_waits``:
``REPACK_S3_CONNECT_TIMEOUT``, ``REPACK_S3_READ_TIMEOUT``, ``REPACK_S3_ATTEMPTS``, ``REPACK_S3_NOTICE``): a
request to an endpoint that does not answer fails after its attempts with a ``TimeoutError`` naming the
object's URL, and a line on stderr reports every call that waited ``REPACK_S3_NOTICE`` seconds (10 by
default).

Checksums: a whole object read (``read_bytes``) asks for the object's stored checksum and botocore
checks it; a ranged GET does not. S3 returns no whole-object checksum for a range, but some
S3-compatible servers do (rclone ``serve s3`` echoes the upload's ``x-amz-checksum-crc32``), and
botocore's default ("when_supported") then fails every range with a checksum mismatch; a range's
bytes are checked against the tar headers and the DALI index by the readers instead. The readers import nothing from
repack but its manifest, so this small client is theirs, not ``repack.store``'s.
"""

from __future__ import annotations

import io
import os
import threading
import time
from typing import BinaryIO, Callable

from pipelines import s3_ranges
from repack.manifest.s3_waits import S3Limits, WaitWatch, resume_pause, watch_client

RESUME_ATTEMPTS = 5   # re-opened ranged GETs after a stream broke mid-way (each request bounded as above)
_clients: dict[tuple[int, str], object] = {}
_client_lock = threading.Lock()
_sessions: list = []  # the one boto3 Session every client of this process (and its forks) comes from


def is_remote(location: str | os.PathLike) -> bool:
    return str(location).startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b")."""
    bucket, _, key = str(url)[5:].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    return bucket, key


def _session():
    """One boto3 Session, made once (under ``_client_lock``) and inherited by forked DataLoader
    workers. A Session holds no connections, only what it loaded: the S3 service model and endpoint
    rules, whose parsing is most of the cost of a client (measured: 80-105 ms from a fresh Session,
    3-4 ms from a used one). The dataset's manifest is read in the parent, so its Session is loaded
    before the workers fork, and no worker of any epoch pays that again."""
    if not _sessions:
        import boto3

        _sessions.append(boto3.session.Session())
    return _sessions[0]


def _client():
    """This process's S3 client for the endpoint in the environment (boto3 clients are thread-safe: the
    readers' prefetch threads share it). One per process and endpoint: a forked DataLoader worker must not
    reuse its parent's connections, and a process that reads from two endpoints needs two clients. Its
    timeouts and attempts are ``limits()``; every call is watched (``s3_waits.WaitWatch``)."""
    key = (os.getpid(), os.environ.get("AWS_ENDPOINT_URL", ""))
    if key not in _clients:
        with _client_lock:
            if key not in _clients:
                from botocore.config import Config

                bounds = limits()
                options = dict(retries={"total_max_attempts": bounds.attempts, "mode": "standard"},
                               connect_timeout=bounds.connect_timeout, read_timeout=bounds.read_timeout,
                               max_pool_connections=32)
                try:  # checksums checked where asked for (whole objects, see read_bytes), not on ranges
                    config = Config(response_checksum_validation="when_required", **options)
                except TypeError:  # botocore before 1.36 checks no response checksums at all
                    config = Config(**options)
                client = _session().client("s3", config=config)
                watch_client(client, WaitWatch(bounds))
                _clients[key] = client
    return _clients[key]


def limits() -> S3Limits:
    """The ``REPACK_S3_*`` bounds of this process's requests (ValueError naming a bad variable)."""
    return S3Limits.from_env()


class WrongRange(OSError):
    """A ranged GET answered with other bytes than asked (another start, or the object from its start): asked
    again, then raised naming the object."""


def _get_object(url: str, **params):
    """``GetObject`` of ``url`` (``params``: Range, ChecksumMode); an endpoint that never answered
    within the bounds is a TimeoutError naming the URL, one that cannot be reached a ConnectionError, a missing
    key a FileNotFoundError; an error answer an OSError naming it (PermissionError for refused access), but a
    range past the object's end, which the callers read as such (botocore's ClientError InvalidRange)."""
    from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError,
                                     EndpointConnectionError, ReadTimeoutError)

    bucket, key = split_url(url)
    try:
        try:
            return _client().get_object(Bucket=bucket, Key=key, **params)
        except ConnectionClosedError:  # each attempt took a kept-alive connection the endpoint had dropped while
            _drop_idle_connections()   # idle (a NAT gateway or load balancer resets it when it is used again):
            return _client().get_object(Bucket=bucket, Key=key, **params)  # asked again on new connections
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code, status = str(error.get("Code")), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchKey", "404"):
            raise FileNotFoundError(url) from None
        if code == "InvalidRange":
            raise
        message = error.get("Message")
        said = f"{code} ({message})" if message else code
        if code in ("AccessDenied", "403") or status == 403:
            raise PermissionError(f"{url}: the S3 endpoint refused access ({said})") from None
        raise OSError(f"{url}: the S3 endpoint answered {said}, HTTP {status}, after "
                      f"{limits().describe()}") from None
    except (ReadTimeoutError, ConnectTimeoutError, ConnectionClosedError) as exc:
        raise TimeoutError(f"{url}: the S3 endpoint did not answer ({type(exc).__name__}) after "
                           f"{limits().describe()}") from exc
    except EndpointConnectionError as exc:
        raise ConnectionError(f"{url}: cannot reach the S3 endpoint ({exc.kwargs.get('endpoint_url', '?')}); "
                              "check AWS_ENDPOINT_URL") from exc


def _drop_idle_connections() -> None:
    """Close the S3 client's pooled idle connections (botocore's session: urllib3's pool manager)."""
    session = getattr(getattr(_client(), "_endpoint", None), "http_session", None)
    close = getattr(session, "close", None)
    if close is not None:
        close()


def sizes(locations: list[str]) -> list[int | None]:
    """The size of each file or object (None where it does not exist): a stat each, or a HEAD each on 16
    threads."""
    if not any(is_remote(loc) for loc in locations):
        return [os.stat(loc).st_size if os.path.exists(loc) else None for loc in locations]
    from concurrent.futures import ThreadPoolExecutor

    from botocore.exceptions import ClientError

    def size(location: str) -> int | None:
        if not is_remote(location):
            return os.stat(location).st_size if os.path.exists(location) else None
        bucket, key = split_url(location)
        try:
            return int(_client().head_object(Bucket=bucket, Key=key)["ContentLength"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(size, locations))


def read_bytes(location: str | os.PathLike) -> bytes:
    """The whole file or object (FileNotFoundError when it does not exist)."""
    if not is_remote(location):
        from repack.manifest.io import open_regular

        with open_regular(location) as fh:  # a FIFO in a dataset's place is refused, never waited on
            return fh.read()
    # ChecksumMode: the whole object's checksum (where the server stored one) is checked on it
    return _get_object(str(location), ChecksumMode="ENABLED")["Body"].read()


def read_range(location: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a local file or an object, in one read (a pread, or one ranged GET,
    resumed where a broken stream stopped). Shorter only where the file or object ends before
    ``end`` (the caller decides what a short read means); FileNotFoundError when it does not exist."""
    if end <= start:
        return b""
    if not is_remote(location):
        return _read_file_range(location, start, end)
    return _read_object_range(location, start, end)


def _read_file_range(path: str, start: int, end: int) -> bytes:
    return read_file_ranges(path, [(start, end)])[0]


def read_file_ranges(path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Bytes [start, end) of a local file for each range, one pread each (one open for all), each
    read straight into its own bytes; shorter only where the file ends first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [_pread(fd, start, end) for start, end in ranges]
    finally:
        os.close(fd)


def _pread(fd: int, start: int, end: int) -> bytes:
    from repack.read_at import read_at  # a regular file reads short only at its end, or past 2 GiB a call

    return read_at(fd, end - start, start) if end > start else b""


def _read_object_range(url: str, start: int, end: int) -> bytes:
    """``read_range`` of an object: the one ranged-GET loop (``_read_object``) into a buffer of its own,
    made once the answer says how many bytes come (a manifest read "up to the cap" allocates what the
    object holds, not the cap)."""
    made: list[bytearray] = []

    def claim(size: int) -> memoryview:
        made.append(bytearray(size))
        return memoryview(made[0])

    got = _read_object(url, start, end, claim)
    if not made:
        return b""
    return bytes(made[0]) if got == len(made[0]) else bytes(memoryview(made[0])[:got])


def pread_into(fd: int, view, start: int) -> int:
    """Bytes of an open file from ``start`` into ``view`` (preadv until it is full or the file ends);
    how many were read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], start + got)
        if n <= 0:
            break
        got += n
    return got


def read_range_into(location: str, start: int, buffer) -> int:
    """Bytes of a local file or an object from ``start`` straight into ``buffer`` (any writable buffer:
    a bytearray, a memoryview of shared memory, a numpy array), as many as it holds; returns how many
    were read, fewer only where the file or object ends first. The one-copy path: a ``preadv``, or one
    ranged GET whose body the socket writes into ``buffer`` itself (no bytes object in between; measured
    in docs/benchmarks.md), resumed where a broken stream stopped; FileNotFoundError when it does not
    exist, and the waits of ``read_range``."""
    view = memoryview(buffer).cast("B")
    if not len(view):
        return 0
    if not is_remote(location):
        fd = os.open(location, os.O_RDONLY)
        try:
            return pread_into(fd, view, start)
        finally:
            os.close(fd)
    return _read_object(str(location), start, start + len(view), lambda size: view)


def _read_object(url: str, start: int, end: int, claim: Callable[[int], memoryview]) -> int:
    """Bytes [start, end) of an object (fewer where it ends first) into ``claim(n)``, the buffer the
    caller gives once the first answer says how many (``n``) come; how many were read. One ranged GET
    (``_ranged_get``); a stream that broke mid-way is resumed by another from the first byte not yet read."""
    view, got, resumed, stop = None, 0, 0, end
    while start + got < stop:
        at = start + got
        try:
            answer = _ranged_get(url, at, end)
        except WrongRange:  # another range than asked came: asked again (a proxy's fault seldom repeats)
            resumed += 1
            if resumed > RESUME_ATTEMPTS:
                raise
            time.sleep(resume_pause(resumed))
            continue
        if answer is None:  # the object ends before at
            break
        stop = min(end, answer.size)
        if view is None:
            view = claim(stop - start)
        got += answer.receive(view[got:stop - start])
        if start + got >= stop:
            break
        resumed += 1  # the stream broke: resume at the first byte not yet read
        if resumed > RESUME_ATTEMPTS:
            raise OSError(f"{url}: stream ended at byte {start + got}, expected {stop}")
        time.sleep(resume_pause(resumed))
    return got


def _ranged_get(url: str, at: int, end: int):
    """The answer (``.size``: the object's; ``.receive(view)``: its body) of a ranged GET of bytes [at, end)
    of ``url``, or None when the object ends before ``at``. On the wire (``pipelines.s3_ranges``) once the
    bucket's route is known; by boto3 for the first GET of a bucket (which teaches the route) and for every
    answer the wire path does not take (boto3's answer or error is the one given)."""
    bucket, key = split_url(url)
    route = s3_ranges.known_route(bucket)
    if route:
        answer = _range_getter().get(url, route, key, at, end,
                                     lambda text, length: _content_range(url, text, length, at)[1])
        if answer is not None:
            return answer
    return _boto3_ranged_get(url, at, end, learn=route is False)


def _boto3_ranged_get(url: str, at: int, end: int, learn: bool):
    """``_ranged_get`` by boto3; ``learn``: keep the bucket's route from the request it sent."""
    from botocore.exceptions import ClientError

    me, sent = threading.get_ident(), []

    def observe(request, **_):
        if threading.get_ident() == me:
            auth = request.headers.get("Authorization", b"")
            sent.append((request.url, auth.decode("latin-1") if isinstance(auth, bytes) else str(auth)))

    client = _client()
    hook = f"repack-range-route-{me}"
    if learn:
        client.meta.events.register("before-send.s3.GetObject", observe, unique_id=hook)
    try:
        response = _get_object(url, Range=f"bytes={at}-{end - 1}")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "InvalidRange":  # the object ends before at
            _learn(url, sent)
            return None
        raise
    finally:
        if learn:
            client.meta.events.unregister("before-send.s3.GetObject", unique_id=hook)
    try:
        size = _content_range(url, response.get("ContentRange"), response.get("ContentLength"), at)[1]
    except OSError:
        response["Body"].close()
        raise
    if learn:
        _learn(url, sent)
    return _Boto3Answer(response["Body"], size)


def _learn(url: str, sent: list) -> None:
    """The bucket's wire route from the request boto3 sent (none without credentials to sign with)."""
    if sent and _session().get_credentials() is not None:
        bucket, key = split_url(url)
        s3_ranges.learn_route(bucket, key, sent[-1])


class _Boto3Answer:
    """boto3's answer to a ranged GET: the object's ``size`` and its body's ``receive``."""

    def __init__(self, body, size: int) -> None:
        self.body, self.size = body, size

    def receive(self, view: memoryview) -> int:
        from botocore.exceptions import BotoCoreError

        received = 0
        try:
            received = _receive(self.body, view)
        except (BotoCoreError, OSError):
            pass
        finally:
            _finish(self.body, whole=received >= len(view))
        return received


_getters: dict[tuple[int, str], s3_ranges.RangeGetter] = {}


def _range_getter() -> s3_ranges.RangeGetter:
    """This process's wire GETs (one per process and endpoint, as the clients)."""
    key = (os.getpid(), s3_ranges.endpoint())
    getter = _getters.get(key)
    if getter is None:
        with _client_lock:
            getter = _getters.get(key)
            if getter is None:
                from botocore.httpsession import get_cert_path

                session = _session()
                cafile = get_cert_path(session._session.get_config_variable("ca_bundle") or True)  # botocore's
                getter = _getters[key] = s3_ranges.RangeGetter(session.get_credentials(), limits(),
                                                                cafile if isinstance(cafile, str) else None)
    return getter


def _content_range(url: str, text: str | None, length: int | None, at: int) -> tuple[int, int]:
    """(first byte, object size) of a ranged GET's answer (its Content-Range "bytes a-b/size", and
    Content-Length); OSError when the server answered another range than asked (or none past byte 0:
    it sent the object from its start)."""
    first, _, size = str(text or "").removeprefix("bytes ").partition("/")
    first = first.partition("-")[0]
    if not (first.isdigit() and size.isdigit()):
        if at == 0 and length is not None:
            return 0, int(length)
        raise WrongRange(f"{url}: the S3 endpoint answered a ranged GET without its Content-Range")
    if int(first) != at:
        raise WrongRange(f"{url}: asked for bytes from {at}, the S3 endpoint sent them from {first}")
    return int(first), int(size)


def _receive(body, view: memoryview) -> int:
    """Read a GET's body into ``view`` until it is full or the body ends; how many bytes came. The socket
    writes into ``view`` through http.client's ``readinto`` (under botocore's StreamingBody and urllib3's
    response, which copy: kept as the fallback where those layers look otherwise, or the body is encoded)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    direct = fp is not None and hasattr(fp, "readinto") and not raw.headers.get("content-encoding")
    got = 0
    while got < len(view):
        if direct:
            n = fp.readinto(view[got:])
        else:
            data = body.read(min(len(view) - got, 1 << 20))
            n = len(data)
            view[got:got + n] = data
        if not n:
            break
        got += n
    return got


def _finish(body, whole: bool) -> None:
    """A body read to its end hands its connection back to the pool (keep-alive); one cut short closes it."""
    raw = getattr(body, "_raw_stream", None)
    if whole and raw is not None and hasattr(raw, "release_conn"):
        raw.release_conn()
    else:
        body.close()


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


class _ObjectRange(io.RawIOBase):
    """Bytes [start, end) of an object: one ranged GET read as it arrives; when the stream breaks
    (connection reset, short body), a new ranged GET resumes at the first byte not yet read."""

    def __init__(self, url: str, start: int, end: int) -> None:
        self.url = url
        self.bucket, self.key = split_url(url)
        self.pos, self.end = start, end
        self.body = None
        self.resumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        from botocore.exceptions import BotoCoreError, ClientError

        want = min(len(buffer), self.end - self.pos)
        if want <= 0:
            return 0
        while True:
            if self.body is None:  # a request: botocore's attempts, then an error naming the URL
                try:
                    response = _get_object(self.url, Range=f"bytes={self.pos}-{self.end - 1}")
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                        return 0  # the object ends before pos: the caller sees a short read, and says so
                    raise
                self.body = response["Body"]
                ranges = (response.get("ContentRange"), response.get("ContentLength"))
            else:
                ranges = None
            try:
                if ranges is not None:  # the range that came is the one asked for (a server that ignored Range,
                    # or sent another, gave another place's bytes): OSError naming the URL, asked again, raised
                    _content_range(self.url, *ranges, self.pos)
                data = self.body.read(want)
                if data:
                    break
                raise OSError(f"{self.url}: stream ended at byte {self.pos}, expected {self.end}")
            except (BotoCoreError, OSError):
                self.body.close()
                self.body = None
                self.resumed += 1
                if self.resumed > RESUME_ATTEMPTS:
                    raise
                time.sleep(resume_pause(self.resumed))
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        if self.body is not None:
            self.body.close()
            self.body = None
        super().close()


def open_range(location: str, start: int, end: int, buffer: int = 1 << 20) -> BinaryIO:
    """A buffered stream of bytes [start, end) of a local file or an object (ranged GETs)."""
    raw = _ObjectRange(location, start, end) if is_remote(location) else _Window(location, start, end)
    return io.BufferedReader(raw, buffer)
