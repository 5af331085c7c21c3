"""The readers' ranged GETs on the wire: a SigV4-signed GET with a ``Range`` header on a kept-alive
socket, its body received straight into the batch's (or block's) buffer (``repack.manifest.s3_wire``).

Why: a botocore ``get_object`` costs 3-4 ms of client CPU, and its body comes through urllib3's and
botocore's layers; a reader that GETs each run of a batch pays that per batch, in every DataLoader
worker, and a worker's first GET also builds it a boto3 client. Here a GET is ~0.1-0.3 ms of CPU and
the socket writes the body where the batch wants it.

What stays boto3's (``pipelines.object_store``), so that the user's configuration means what it means to
boto3: a bucket's route (endpoint, addressing style, signing region) is learnt from the first ranged GET
boto3 sends for it in the process tree (``before-send``; forked DataLoader workers inherit it, and open
connections of their own); credentials are the process's boto3 Session's, read for each request; every
answer other than 200/206 with a length (a missing key, a range past the end, refused access, a
redirect, 5xx, a chunked body) is asked for again by boto3, whose answer or error is the one given; a
bucket whose GETs boto3 does not sign with SigV4, or sends through a proxy, stays boto3's.

Bounds (``repack.manifest.s3_waits``): a connection attempt waits ``REPACK_S3_CONNECT_TIMEOUT``, a silent
socket ``REPACK_S3_READ_TIMEOUT``; a request that got no answer is sent again on a new connection,
``REPACK_S3_ATTEMPTS`` attempts in all (jittered backoff), then a TimeoutError (or, when no connection
could be made, a ConnectionError) naming the object's URL, as boto3's path raises. A body cut or stalled
mid-way is the caller's to resume (``object_store``: from the byte where it stopped). Waits of
``REPACK_S3_NOTICE`` seconds are reported on stderr.
"""

from __future__ import annotations

import os
import ssl
import threading
import time

from repack.manifest.s3_waits import S3Limits, WaitWatch, retry_pause
from repack.manifest.s3_wire import (BucketRoute, Connection, Delegate, Head, IdleConnections, Signer, Transient,
                                     route_of)

_routes: dict[tuple[str, str], BucketRoute | None] = {}  # (endpoint, bucket) -> route; inherited by forks


def endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL", "")


def known_route(bucket: str) -> BucketRoute | None | bool:
    """The bucket's route; None: boto3 reads this bucket; False: not learnt yet."""
    return _routes.get((endpoint(), bucket), False)


def learn_route(bucket: str, key: str, sent: tuple[str, str] | None) -> None:
    """Keep the route of ``bucket`` from the (URL, Authorization) botocore sent for ``key`` (None: boto3's)."""
    _routes[(endpoint(), bucket)] = route_of(*sent, key) if sent else None


class RangeAnswer:
    """A 200/206 answer of a ranged GET: the object's ``size`` (Content-Range), its body read by ``receive``."""

    def __init__(self, getter: "RangeGetter", conn: Connection, head: Head, url: str, size: int) -> None:
        self._getter, self._conn, self._head, self._url = getter, conn, head, url
        self.size = size

    def receive(self, view: memoryview) -> int:
        """The body into ``view`` until it is full or the body ends or breaks; how many bytes came. A body
        read whole hands its connection back for the next GET."""
        got = self._conn.receive_into(self._head, view, self._url)
        if got == self._head.length and self._conn.sock is not None:
            self._getter.release(self._conn)
        return got


class RangeGetter:
    """One process's wire GETs (after a fork a process makes its own: connections are not shared):
    ``credentials`` (botocore's, refreshed by it), ``limits``, ``cafile`` (https endpoints' CA bundle)."""

    def __init__(self, credentials, limits: S3Limits, cafile: str | None) -> None:
        self.credentials, self.limits, self._cafile = credentials, limits, cafile
        self.watch = WaitWatch(limits)
        self._signer = Signer()
        self._sign_lock = threading.Lock()
        self._idle = IdleConnections()
        self._tls: ssl.SSLContext | None = None

    def get(self, url: str, route: BucketRoute, key: str, at: int, end: int,
            content_range) -> RangeAnswer | None:
        """Bytes [at, end) of ``url`` asked for; the answer, its head read (``content_range(text, length)``
        checks it and gives the object's size), or None when boto3 must ask instead (see the module
        docstring). TimeoutError / ConnectionError naming ``url`` when no attempt got an answer."""
        with self._sign_lock:
            request = self._signer.get(route, key, self.credentials.get_frozen_credentials(),
                                       {"range": f"bytes={at}-{end - 1}"})
        attempt, wait = 0, self.watch.start(f"GetObject {url}")
        try:
            while True:
                conn = None
                try:
                    conn = self._connection(route)
                    head = conn.ask(request, url)
                except (ssl.SSLCertVerificationError, Delegate):
                    if conn is not None:
                        conn.close()
                    return None  # boto3 says what is wrong with the certificate, or reads the chunked body
                except OSError as exc:  # refused, timed out, dropped before an answer: a new connection
                    if conn is not None:
                        conn.close()
                        if conn.used and isinstance(exc, Transient) and exc.before_answer:
                            continue  # a kept-alive connection the server had closed meanwhile: no attempt spent
                    attempt += 1
                    if attempt >= self.limits.attempts:
                        raise self._gave_up(url, route, exc, connected=conn is not None) from None
                    time.sleep(retry_pause(attempt, self.limits))
                    continue
                if head.status not in (200, 206):
                    conn.close()  # its body unread: not reusable
                    return None
                try:
                    size = content_range(head.headers.get("content-range", ""), head.length)
                except OSError:
                    conn.close()
                    raise
                return RangeAnswer(self, conn, head, url, size)
        finally:
            self.watch.stop(wait)

    def _gave_up(self, url: str, route: BucketRoute, exc: OSError, connected: bool) -> OSError:
        if connected and isinstance(exc, Transient) and not exc.timed_out:  # answered with a dropped connection
            return ConnectionError(f"{url}: the S3 endpoint dropped the connection after {self.limits.describe()} "
                                   f"(last: {exc})")
        if connected or isinstance(exc, TimeoutError):
            return TimeoutError(f"{url}: the S3 endpoint did not answer ({type(exc).__name__}) after "
                                f"{self.limits.describe()}")
        return ConnectionError(f"{url}: cannot reach the S3 endpoint ({route.scheme}://{route.netloc}; "
                               f"{type(exc).__name__}: {exc}); check AWS_ENDPOINT_URL")

    def release(self, conn: Connection) -> None:
        """Hand a connection whose answer was read whole back for the next GET."""
        self._idle.give(conn)

    def _connection(self, route: BucketRoute) -> Connection:
        idle = self._idle.take(route)
        if idle is not None:
            return idle
        if route.scheme == "https" and self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._cafile)
        return Connection(route, self.limits.connect_timeout, self.limits.read_timeout,
                          self._tls if route.scheme == "https" else None)
