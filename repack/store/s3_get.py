"""Whole small objects at a low client CPU per GET: the read path of an s3:// SOURCE.

Why not boto3 for each GET: a botocore ``get_object`` costs 3-4 ms of client CPU (request
building, hooks, signing, urllib3 and header parsing), so a worker packing 700-byte objects
from a fast server spends its CPU in the client (docs/benchmarks.md, "Big s3:// sources").
Here a GET is one SigV4-signed HTTP/1.1 request written to a kept-alive socket and its answer
read straight into the object's buffer (the wire: ``repack.manifest.s3_wire``, shared with the readers): ~0.27 ms of client CPU, less than Rust's object_store
(``obstore``) measured beside it, with no dependency beyond boto3.

What stays boto3's, so that the user's configuration means what it means to boto3:
- where a bucket's GET goes and how it is signed: the first GET of a bucket in a process is a
  boto3 ``get_object`` whose sent request is observed (``before-send``): its URL (endpoint,
  virtual-hosted or path style, region redirects applied) and its signing scope (region).
  A signature other than SigV4, or a URL that does not end in the key, keeps boto3 for that bucket;
  so does an endpoint reached through a proxy (``HTTP(S)_PROXY``);
- credentials: the process's boto3 Session (environment, profiles, SSO, instance roles; refreshed
  by botocore), read for each request;
- every answer that is not the object (a missing key, refused access, a redirect, an answer
  without a length): the GET is done again by boto3, whose answer or error is the one given
  (a body cut mid-way there is asked for again too, within the attempts).

Bounds (``repack.manifest.s3_waits``): a connection attempt waits ``REPACK_S3_CONNECT_TIMEOUT``, a
silent socket ``REPACK_S3_READ_TIMEOUT``; a dropped connection, a cut body, a timeout or a
5xx/throttling answer is tried again on a new connection, ``REPACK_S3_ATTEMPTS`` attempts in all
(with botocore's jittered backoff) and none started after ``REPACK_S3_RETRY_BUDGET`` seconds;
then ``repack.errors.SourceUnavailable`` naming the URL (the endpoint's fault: the task fails, a re-run asks
again), or ``Unreadable`` (an OSError: the input is quarantined) where every answer failed its checksum. A wait longer than ``REPACK_S3_NOTICE`` is
reported on stderr.

Connections: an idle list per process (after a fork, a process opens its own), one request at a
time on each (no pipelining), shared by the threads of ``repack.sources.s3.prefetched``.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import threading
import time
import zlib

from repack.errors import SourceUnavailable
from repack.manifest.s3_waits import WaitWatch, retry_pause
from repack.manifest.s3_wire import (HEADER_LIMIT, RECV_BYTES, BucketRoute, Connection, Signer, Transient,  # noqa: F401
                                     open_socket, parse_head, route_of)
from repack.manifest.s3_wire import Delegate as _Delegate
from repack.manifest.s3_wire import IdleConnections

RETRY_STATUS = frozenset({500, 502, 503, 504})
CHECKSUM_FAULT = "checksum mismatch"  # how ``checksum_mismatch`` starts: a fault of the object, not the endpoint


class Unreadable(OSError):
    """Every attempt at a GET failed (errno EIO; the message names the URL and the bounds spent)."""


def checksum_mismatch(headers: dict[str, str], body) -> str | None:
    """Why ``body`` does not match the whole-object checksum its answer carries (``x-amz-checksum-crc32``,
    ``-sha1``, ``-sha256``; asked for with ``x-amz-checksum-mode: ENABLED``, as boto3 asks), or None.
    A multipart upload's composite checksum ("...-N") and the CRCs stdlib lacks (crc32c, crc64nvme)
    are not checked (boto3 skips them too without awscrt)."""
    for name, digest in (("x-amz-checksum-crc32", lambda b: zlib.crc32(b).to_bytes(4, "big")),
                         ("x-amz-checksum-sha256", lambda b: hashlib.sha256(b).digest()),
                         ("x-amz-checksum-sha1", lambda b: hashlib.sha1(b).digest())):
        want = headers.get(name)
        if want and "-" not in want:
            got = base64.b64encode(digest(body)).decode()
            if got != want:
                return f"{CHECKSUM_FAULT} ({name} {want}, the body's {got})"
    return None


class ObjectGetter:
    """Whole-object GETs of one process (see the module docstring). ``client``: the process's boto3
    client (the fallback and the source of each bucket's route); ``credentials``: its Session's;
    ``limits``: its ``S3Limits``; ``is_missing``: how its errors say "no such key"."""

    def __init__(self, client, credentials, limits, is_missing, tls_cafile: str | None = None) -> None:
        self.client = client
        self.is_missing = is_missing  # (exception) -> True for boto3's answer "no such key"
        self.credentials = credentials
        self.limits = limits
        self.watch = WaitWatch(limits)
        self._cafile = tls_cafile
        self._tls: ssl.SSLContext | None = None
        self._routes: dict[str, BucketRoute | None] = {}
        self._route_lock = threading.Lock()
        self._learning: set[str] = set()  # buckets whose route a thread is learning
        self._idle = IdleConnections()
        self._signer = Signer()

    # --- the public read ---------------------------------------------------------------------------
    def get(self, bucket: str, key: str) -> bytes:
        """The object's bytes. Errors as boto3 raises them (ClientError, botocore's connection errors)
        for answers that are not the object; Unreadable naming the URL when every attempt failed."""
        route = self._routes.get(bucket, False)
        if route is False:  # not known yet: one thread learns it, the others read through boto3 meanwhile
            with self._route_lock:
                mine = bucket not in self._learning
                self._learning.add(bucket)
            if not mine:
                return self._boto3_get(bucket, key)
            try:
                return self._discover(bucket, key)
            finally:
                with self._route_lock:
                    self._learning.discard(bucket)
        if route is None:
            return self._boto3_get(bucket, key)
        try:
            return self._get(route, bucket, key)
        except _Delegate:
            return self._boto3_get(bucket, key)

    def known_route(self, bucket: str) -> BucketRoute | None | bool:
        """The bucket's route; None: boto3 reads this bucket; False: not learnt yet in this process."""
        return self._routes.get(bucket, False)

    def get_after(self, bucket: str, key: str, spent: int = 0, why: str = "", delegate: bool = False) -> bytes:
        """As ``get``, for a GET that was sent elsewhere (``repack.store.s3_fetch``): ``spent`` attempts
        already failed (``why``: the last one's reason), so only the attempts left are made, after the
        backoff; ``delegate``: its answer was not the object, boto3 asks again and gives its answer."""
        route = self._routes.get(bucket, False)
        if route is False:
            return self.get(bucket, key)
        if delegate or route is None:
            return self._boto3_get(bucket, key)
        try:
            return self._get(route, bucket, key, spent, why)
        except _Delegate:
            return self._boto3_get(bucket, key)

    # --- boto3: the first GET of a bucket, and every answer that is not the object -------------------
    def _boto3_get(self, bucket: str, key: str) -> bytes:
        """boto3's GET (botocore retries the request); a body cut or stalled mid-way, which botocore
        does not retry once the answer began, is asked for again within the attempts."""
        from botocore.exceptions import BotoCoreError

        attempt = 0
        while True:
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
            attempt += 1
            try:
                return body.read()
            except (BotoCoreError, OSError):
                body.close()
                if attempt >= self.limits.attempts:
                    raise
                time.sleep(retry_pause(attempt, self.limits))

    def _discover(self, bucket: str, key: str) -> bytes:
        """A boto3 GET of ``key`` whose last sent request gives the bucket's route (kept unless the
        call failed for another reason than a missing key)."""
        me, sent = threading.get_ident(), []

        def observe(request, **_):
            if threading.get_ident() == me:
                auth = request.headers.get("Authorization", b"")
                sent.append((request.url, auth.decode("latin-1") if isinstance(auth, bytes) else str(auth)))

        events, hook = self.client.meta.events, f"repack-s3-get-route-{me}"
        events.register("before-send.s3.GetObject", observe, unique_id=hook)
        try:
            data = self._boto3_get(bucket, key)
        except Exception as exc:
            if sent and self.is_missing(exc):
                self._routes[bucket] = route_of(*sent[-1], key)
            raise
        finally:
            events.unregister("before-send.s3.GetObject", unique_id=hook)
        self._routes[bucket] = route_of(*sent[-1], key) if sent else None
        return data

    # --- the fast path -------------------------------------------------------------------------------
    def _get(self, route: BucketRoute, bucket: str, key: str, spent: int = 0, why: str = "") -> bytes:
        url = f"s3://{bucket}/{key}"
        started, attempt = time.monotonic(), spent
        wait = self.watch.start(f"GetObject {url}")
        try:
            if spent:
                self._backoff(attempt, started, why, url)
            while True:
                conn = None
                try:
                    conn = self._connection(route)
                    status, headers, body = conn.exchange(self.signed_request(route, key), url)
                except ssl.SSLCertVerificationError:
                    raise _Delegate() from None  # boto3 says what is wrong with the certificate
                except _Delegate:  # an answer without a length: its body is not read, so not kept alive
                    conn.close()
                    raise
                except OSError as exc:  # refused, timed out, dropped, cut (Transient): a new connection
                    if conn is not None:
                        conn.close()
                    if conn is not None and conn.used and isinstance(exc, Transient) and exc.before_answer:
                        continue  # a kept-alive connection the server had closed meanwhile: no attempt spent
                    attempt += 1
                    why = exc if isinstance(exc, Transient) else f"{url}: cannot connect ({type(exc).__name__}: {exc})"
                    self._backoff(attempt, started, why, url)
                    continue
                if status == 200 and (mismatch := checksum_mismatch(headers, body)):
                    self._release(conn)
                    attempt += 1
                    self._backoff(attempt, started, f"{url}: {mismatch}", url)
                    continue
                if status in RETRY_STATUS:
                    self._release(conn)
                    attempt += 1
                    self._backoff(attempt, started, f"{url}: the S3 endpoint answered {status}", url)
                    continue
                self._release(conn)
                if status != 200:
                    raise _Delegate()
                return bytes(body)
        finally:
            self.watch.stop(wait)

    def _backoff(self, attempt: int, started: float, why, url: str) -> None:
        """Sleep before attempt ``attempt`` + 1 (botocore's standard jitter), or, when the attempts or the retry
        budget are spent, raise naming ``url``: Unreadable (an OSError: the input is quarantined) where every
        answer was a body that failed its checksum, SourceUnavailable (the task fails, a re-run asks again)
        where the endpoint did not serve it (refused, cut, timed out, 5xx)."""
        bounds = self.limits
        if attempt >= bounds.attempts or time.monotonic() - started >= bounds.retry_budget:
            text = (f"{why}; gave up after {attempt} attempt(s) (REPACK_S3_ATTEMPTS={bounds.attempts}, "
                    f"REPACK_S3_READ_TIMEOUT={bounds.read_timeout:g} s, REPACK_S3_RETRY_BUDGET={bounds.retry_budget:g} s)")
            if CHECKSUM_FAULT in str(why):
                raise Unreadable(5, text, url)
            raise SourceUnavailable(f"{url}: {text}" if url not in str(why) else text)
        time.sleep(retry_pause(attempt, self.limits))

    def _connection(self, route: BucketRoute) -> Connection:
        idle = self._idle.take(route)
        if idle is not None:
            return idle
        tls = self.tls_context() if route.scheme == "https" else None
        return Connection(route, self.limits.connect_timeout, self.limits.read_timeout, tls)

    def _release(self, conn: Connection) -> None:
        if conn.sock is None:
            return
        self._idle.give(conn)

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context of https endpoints (botocore's CA bundle)."""
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._cafile)
        return self._tls

    def signed_request(self, route: BucketRoute, key: str) -> bytes:
        """The signed GET of ``key`` (AWS Signature Version 4, an empty payload's hash), asking for the
        object's stored checksum (``x-amz-checksum-mode: ENABLED``, as boto3 asks)."""
        return self._signer.get(route, key, self.credentials.get_frozen_credentials(),
                                {"x-amz-checksum-mode": "ENABLED"})
