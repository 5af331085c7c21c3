"""Many whole-object GETs in flight from one thread: the read-ahead of an s3:// SOURCE's objects.

A worker packing small objects is bound by how many GETs it keeps in flight, and a thread per GET
costs more client CPU than the GET (GIL hand-offs, futures: ~0.4 ms per GET on 2 loaded cores,
~0.16 ms for the same GET sent alone). Here the calling thread keeps up to ``depth`` GETs in flight,
one per kept-alive connection (non-blocking sockets under one selector), and hands the objects out
in the order asked: while the caller checks and writes one object, the server answers the next ones.
Between two objects the caller's ``next()`` sends the requests that fit (at most ``depth`` in flight,
at most ``ahead_bytes`` of planned sizes asked for and not yet handed out) and reads every answer
that has arrived; it blocks only when the object it needs has not.

Each request is the one ``repack.store.s3_get.ObjectGetter`` signs, on the bucket's route it
learnt (the first object of a bucket in a process is read by ``ObjectGetter.get``, which learns it).
Whatever is not a whole object in a 200 answer (a 404 or 403, a 5xx, a body cut or stalled past
``REPACK_S3_READ_TIMEOUT``, a checksum mismatch, a chunked answer, a refused connection) is handed
to ``ObjectGetter.get_after`` on a small thread pool with the attempts it has spent, so retries,
boto3's answers and the error messages are the getter's own. A kept-alive connection the server
closed meanwhile (no byte of an answer) is asked again on a new one, no attempt spent.

Connections stay open between calls (per ``Fetcher``: one per process, ``repack.store.s3_client``).
"""

from __future__ import annotations

import selectors
import ssl
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

from repack.manifest.s3_wire import IdleConnections
from repack.store.s3_get import (HEADER_LIMIT, RECV_BYTES, RETRY_STATUS, BucketRoute, ObjectGetter, Transient,
                                 _Delegate, checksum_mismatch, open_socket, parse_head)

DEPTH = 32               # GETs in flight per calling thread
AHEAD_BYTES = 64 << 20   # planned bytes asked for and not handed out yet, at most (one object over it: alone)
SLOW_THREADS = 4         # GETs handed to ObjectGetter (failures, buckets boto3 reads) at once
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class _Wire:
    """A kept-alive non-blocking connection and the answer it is reading (one request at a time)."""

    __slots__ = ("sock", "key", "used", "index", "url", "out", "head", "length", "status", "headers", "body", "got",
                 "last", "token")

    def __init__(self, sock, host: tuple) -> None:
        sock.setblocking(False)
        self.sock, self.key, self.used = sock, host, False
        self.index = -1

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def start(self, index: int, url: str, request: bytes) -> None:
        self.index, self.url, self.out = index, url, request
        self.head, self.length, self.status, self.headers, self.body, self.got = bytearray(), -1, 0, {}, None, 0
        self.last = time.monotonic()

    def send(self) -> None:
        """Send what is left of the request (OSError: the connection failed)."""
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except _WOULD_BLOCK:
                return
            self.out = self.out[sent:]
            self.last = time.monotonic()

    def receive(self) -> bool:
        """Read what has arrived; True once the whole answer is in. Transient when the connection drops
        (``before_answer``: before any byte of it), _Delegate when its length is not given."""
        while True:
            try:
                if self.body is None:
                    chunk = self.sock.recv(RECV_BYTES)
                    n = len(chunk)
                else:
                    n = self.sock.recv_into(memoryview(self.body)[self.got:])
            except _WOULD_BLOCK:
                return False
            except (ConnectionError, TimeoutError, ssl.SSLError) as exc:
                raise Transient(f"{self.url}: {type(exc).__name__}: {exc}", before_answer=not self.head) from None
            if not n:
                if self.body is None and not self.head:
                    raise Transient(f"{self.url}: the connection closed before an answer", before_answer=True)
                raise Transient(f"{self.url}: the body was cut at byte {self.got} of {max(self.length, 0)}")
            self.last = time.monotonic()
            if self.body is not None:
                self.got += n
            else:
                self.head += chunk
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.head) > HEADER_LIMIT:
                        raise Transient(f"{self.url}: the S3 endpoint sent a header block over {HEADER_LIMIT} bytes")
                    continue
                self.status, self.headers, self.length = parse_head(bytes(self.head[:end + 2]), self.url)
                rest = len(self.head) - end - 4
                if rest >= self.length:  # a small object: whole in what came with the headers
                    self.body = self.head[end + 4:end + 4 + self.length]
                    self.got = self.length
                else:
                    self.body = bytearray(self.length)
                    self.body[:rest] = self.head[end + 4:]
                    self.got = rest
                self.head = b"-"  # not empty: an answer began
            if self.got >= self.length:
                return True


class Fetcher:
    """Whole-object GETs of one process, many in flight per calling thread (see the module docstring).
    ``slow(bucket, key, spent, why, delegate)``: the object's bytes as ``ObjectGetter.get_after`` reads
    them (its exception is handed out in place of the object)."""

    def __init__(self, getter: ObjectGetter, slow: Callable[[str, str, int, str, bool], bytes], depth: int = DEPTH,
                 ahead_bytes: int = AHEAD_BYTES) -> None:
        self.getter = getter
        self.slow = slow
        self.depth = depth
        self.ahead_bytes = ahead_bytes
        self._idle = IdleConnections()  # threads that fetch at once share the idle connections
        self._pool: ThreadPoolExecutor | None = None

    def fetch(self, objects: list[tuple[str, str]], sizes: list[int] | None = None) -> Iterator[bytes | BaseException]:
        """The bytes of each (bucket, key) of ``objects`` (or the exception reading it), in order;
        ``sizes``: their planned sizes (bounds the bytes asked for ahead)."""
        if not objects:
            return
        bucket = objects[0][0]
        first = 0
        if self.getter.known_route(bucket) is False:  # the first object of the bucket learns the route
            yield self._read_slow(bucket, objects[0][1], 0, "", False)
            first = 1
        route = self.getter.known_route(bucket)
        if not isinstance(route, BucketRoute) or any(b != bucket for b, _ in objects):
            yield from self._all_slow(objects[first:])
            return
        yield from _Run(self, route, objects, sizes, first).results()

    # --- the slow path: ObjectGetter on a few threads ------------------------------------------------
    def _read_slow(self, bucket: str, key: str, spent: int, why: str, delegate: bool) -> bytes | BaseException:
        try:
            return self.slow(bucket, key, spent, why, delegate)
        except Exception as exc:  # noqa: BLE001 - handed out in place of the object
            return exc

    def submit_slow(self, bucket: str, key: str, spent: int = 0, why: str = "", delegate: bool = False) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(SLOW_THREADS, thread_name_prefix="repack-s3-get")
        return self._pool.submit(self._read_slow, bucket, key, spent, why, delegate)

    def _all_slow(self, objects: list[tuple[str, str]]) -> Iterator[bytes | BaseException]:
        window: list[Future] = []
        ahead = 4 * SLOW_THREADS
        for i in range(len(objects) + ahead):
            if i < len(objects):
                window.append(self.submit_slow(*objects[i]))
            if i >= ahead:
                yield window[i - ahead].result()
                window[i - ahead] = None  # type: ignore[call-overload]

    # --- connections ---------------------------------------------------------------------------------
    def take(self, route: BucketRoute) -> _Wire:
        """An idle connection to the route's host, else a new one (OSError when it cannot connect)."""
        idle = self._idle.take(route)
        if idle is not None:
            return idle
        tls = self.getter.tls_context() if route.scheme == "https" else None
        return _Wire(open_socket(route, self.getter.limits.connect_timeout, tls), (route.scheme, route.host, route.port))

    def give_back(self, wire: _Wire) -> None:
        self._idle.give(wire)


class _Run:
    """One ``Fetcher.fetch`` call: its requests, in-flight connections and finished objects."""

    def __init__(self, fetcher: Fetcher, route: BucketRoute, objects: list[tuple[str, str]], sizes, first: int):
        self.f, self.route, self.objects = fetcher, route, objects
        self.sizes = sizes
        self.next = first          # the next object to ask for
        self.done: dict[int, bytes | BaseException | Future] = {}
        self.busy: dict[int, _Wire] = {}  # fileno -> connection with a request out
        self.idle: list[_Wire] = []       # this run's connections between requests (given back at its end)
        self.asked_bytes = 0       # planned bytes asked for and not handed out
        self.connect_failed = False
        self.selector = selectors.DefaultSelector()
        self.registered: set[int] = set()
        self.watch = fetcher.getter.watch
        self.read_timeout = fetcher.getter.limits.read_timeout

    def results(self) -> Iterator[bytes | BaseException]:
        first = self.next
        try:
            for i in range(first, len(self.objects)):
                self.fill()
                while i not in self.done:
                    self.wait()
                    self.fill()
                result = self.done.pop(i)
                if self.sizes is not None:
                    self.asked_bytes -= self.sizes[i] or 0
                yield result.result() if isinstance(result, Future) else result
        finally:
            self.finish()

    def fill(self) -> None:
        """Ask for the next objects while fewer than ``depth`` are in flight and the bytes ahead allow."""
        f = self.f
        while self.next < len(self.objects) and len(self.busy) < f.depth:
            size = (self.sizes[self.next] or 0) if self.sizes is not None else 0
            if self.asked_bytes and self.asked_bytes + size > f.ahead_bytes:
                return
            index, (bucket, key) = self.next, self.objects[self.next]
            self.next += 1
            self.asked_bytes += size
            self.send(index, bucket, key)

    def send(self, index: int, bucket: str, key: str) -> None:
        try:
            wire = self.idle.pop() if self.idle else self.f.take(self.route) if not self.connect_failed else None
        except OSError:  # refused, unreachable: the getter's attempts and messages; no new connection this call
            wire = None
            self.connect_failed = True
        if wire is None:
            self.done[index] = self.f.submit_slow(bucket, key)
            return
        wire.start(index, f"s3://{bucket}/{key}", self.f.getter.signed_request(self.route, key))
        wire.token = self.watch.start(f"GetObject {wire.url}")
        fd = wire.sock.fileno()
        self.busy[fd] = wire
        if fd not in self.registered:
            self.selector.register(wire.sock, selectors.EVENT_READ, wire)
            self.registered.add(fd)
        else:
            self.selector.modify(wire.sock, selectors.EVENT_READ, wire)
        try:
            wire.send()
        except OSError as exc:
            self.failed(wire, Transient(f"{wire.url}: {type(exc).__name__}: {exc}", before_answer=True))
            return
        if wire.out:
            self.selector.modify(wire.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, wire)

    def wait(self) -> None:
        """Read the answers that came (blocking until one does, or a connection's read timeout passes)."""
        now = time.monotonic()
        oldest = min((w.last for w in self.busy.values()), default=now)
        timeout = max(0.0, min(1.0, oldest + self.read_timeout - now))
        if not self.busy:  # only slow-path objects pending
            time.sleep(0.001)
            return
        for key, events in self.selector.select(timeout):
            wire = key.data
            if self.busy.get(wire.sock.fileno()) is not wire:  # an idle one readable: the server closed it
                if wire in self.idle:
                    self.idle.remove(wire)
                self.forget(wire)
                continue
            try:
                if events & selectors.EVENT_WRITE:
                    wire.send()
                    if not wire.out:
                        self.selector.modify(wire.sock, selectors.EVENT_READ, wire)
                if events & selectors.EVENT_READ and wire.receive():
                    self.answered(wire)
            except _Delegate:
                self.drop(wire)
                self.handoff(wire, 0, "", delegate=False)
            except Transient as exc:
                self.failed(wire, exc)
            except OSError as exc:
                self.failed(wire, Transient(f"{wire.url}: {type(exc).__name__}: {exc}"))
        now = time.monotonic()
        for wire in [w for w in self.busy.values() if now - w.last >= self.read_timeout]:
            self.failed(wire, Transient(f"{wire.url}: no answer for {self.read_timeout:g} s (timed out)"))

    def answered(self, wire: _Wire) -> None:
        """A whole answer: the object, or the getter's slow path for anything else."""
        fd = wire.sock.fileno()
        del self.busy[fd]
        self.watch.stop(wire.token)
        status, headers, body, index, url = wire.status, wire.headers, wire.body, wire.index, wire.url
        if headers.get("connection", "").lower() == "close":
            self.forget(wire)
        else:
            wire.used = True
            self.idle.append(wire)
        if status == 200 and (mismatch := checksum_mismatch(headers, body)) is None:
            self.done[index] = bytes(body)
            return
        bucket, key = self.objects[index]
        if status == 200:
            self.done[index] = self.f.submit_slow(bucket, key, 1, f"{url}: {mismatch}")
        elif status in RETRY_STATUS:
            self.done[index] = self.f.submit_slow(bucket, key, 1, f"{url}: the S3 endpoint answered {status}")
        else:  # not the object (404, 403, a redirect): boto3's answer or error
            self.done[index] = self.f.submit_slow(bucket, key, 0, "", delegate=True)

    def failed(self, wire: _Wire, exc: Transient) -> None:
        """The connection failed mid-request: asked again on a new one when a kept-alive connection was
        closed before any answer (no attempt spent), else the getter's slow path with one attempt spent."""
        self.drop(wire)
        if wire.used and exc.before_answer and not self.connect_failed:
            bucket, key = self.objects[wire.index]
            self.send(wire.index, bucket, key)
            return
        self.handoff(wire, 1, str(exc))

    def handoff(self, wire: _Wire, spent: int, why: str, delegate: bool = False) -> None:
        bucket, key = self.objects[wire.index]
        self.done[wire.index] = self.f.submit_slow(bucket, key, spent, why, delegate)

    def drop(self, wire: _Wire) -> None:
        """Take a failed connection out of this run and close it."""
        self.busy.pop(wire.sock.fileno(), None)
        self.watch.stop(wire.token)
        self.forget(wire)

    def forget(self, wire: _Wire) -> None:
        fd = wire.sock.fileno()
        if fd in self.registered:
            self.selector.unregister(wire.sock)
            self.registered.discard(fd)
        wire.close()

    def finish(self) -> None:
        """Close what is still in flight (the caller stopped early) and release the selector."""
        for wire in list(self.busy.values()):
            self.drop(wire)
        for future in self.done.values():
            if isinstance(future, Future):
                future.cancel()
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
        self.selector.close()
        for wire in self.idle:
            self.f.give_back(wire)
        self.idle.clear()
