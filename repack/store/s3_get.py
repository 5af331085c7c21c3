"""Whole small objects at a low client CPU per GET: the read path of an s3:// SOURCE.

Why not boto3 for each GET: a botocore ``get_object`` costs 3-4 ms of client CPU (request
building, hooks, signing, urllib3 and header parsing), so a worker packing 700-byte objects
from a fast server spends its CPU in the client (docs/benchmarks.md, "Big s3:// sources").
Here a GET is one SigV4-signed HTTP/1.1 request written to a kept-alive socket and its answer
read straight into the object's buffer: ~0.27 ms of client CPU, less than Rust's object_store
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
then ``Unreadable`` (an OSError) naming the URL. A wait longer than ``REPACK_S3_NOTICE`` is
reported on stderr.

Connections: an idle list per process (after a fork, a process opens its own), one request at a
time on each (no pipelining), shared by the threads of ``repack.sources.s3.prefetched``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass

from repack.manifest.s3_waits import WaitWatch

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
RETRY_STATUS = frozenset({500, 502, 503, 504})
HEADER_LIMIT = 64 << 10     # an answer's header block larger than this is not S3's
RECV_BYTES = 64 << 10
# the answer's headers this module reads (names case-insensitive); the others are not parsed
_HEADERS = re.compile(rb"\r\n((?i:content-length|transfer-encoding|connection|x-amz-checksum-(?:crc32|sha1|sha256)))"
                      rb"[ \t]*:([^\r\n]*)")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.~/-]*")  # a key that quoting leaves as it is


@dataclass(frozen=True)
class BucketRoute:
    """Where and how a bucket's GETs go, as botocore sent one: ``base`` + the quoted key is the path."""

    scheme: str
    host: str
    port: int
    netloc: str   # the Host header, as signed
    base: str     # the path before the key: "/bucket/" (path style) or "/" (virtual-hosted)
    region: str   # the SigV4 scope's region


class Transient(OSError):
    """A failed attempt worth another: the connection dropped or stalled, the body was cut.
    ``before_answer``: the connection closed before any byte of an answer."""

    def __init__(self, message: str, before_answer: bool = False) -> None:
        super().__init__(message)
        self.before_answer = before_answer


class Unreadable(OSError):
    """Every attempt at a GET failed (errno EIO; the message names the URL and the bounds spent)."""


class _Delegate(Exception):
    """An answer that is not the object: boto3 does this GET again and gives its answer or error."""


def route_of(url: str, authorization: str, key: str) -> BucketRoute | None:
    """The route of a GET botocore sent to ``url`` with this ``Authorization`` for ``key``; None when
    it was not signed with SigV4 for s3 or its URL does not end in the key as this module quotes it."""
    scope = authorization.partition("Credential=")[2].partition(",")[0].split("/")
    if not authorization.startswith("AWS4-HMAC-SHA256 ") or len(scope) != 5 or scope[3] != "s3":
        return None
    parts = urllib.parse.urlsplit(url)
    quoted = _quote(key)
    if parts.query or parts.scheme not in ("http", "https") or not parts.path.endswith(quoted):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return BucketRoute(parts.scheme, parts.hostname or "", port, parts.netloc, parts.path[:-len(quoted)], scope[2])


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
                return f"checksum mismatch ({name} {want}, the body's {got})"
    return None


def _quote(key: str) -> str:
    return key if _PLAIN_KEY.fullmatch(key) else urllib.parse.quote(key, safe="/~")


def _through_proxy(route: BucketRoute) -> bool:
    proxies = urllib.request.getproxies()
    return route.scheme in proxies and not urllib.request.proxy_bypass(route.host)


def open_socket(route: BucketRoute, connect_timeout: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A connected socket to the route's host (TLS handshake done when ``tls``), Nagle off."""
    sock = socket.create_connection((route.host, route.port), timeout=connect_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=route.host)
    return sock


def parse_head(block: bytes, url: str) -> tuple[int, dict[str, str], int]:
    """(status, the lower-cased headers this module reads, body length) of an answer's header block
    (up to its last CRLF). Transient when it is not HTTP; _Delegate when the length is not given
    (chunked: boto3 reads it)."""
    status_line = block[:block.find(b"\r\n")]
    try:
        status = int(status_line.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise Transient(f"{url}: not an HTTP answer: {status_line[:80]!r}") from None
    headers = {name.lower().decode(): value.strip().decode("latin-1") for name, value in _HEADERS.findall(block)}
    length = headers.get("content-length", "")
    if not length.isdigit() or "transfer-encoding" in headers:
        raise _Delegate()
    return status, headers, int(length)


class _Connection:
    """One kept-alive socket to a host, and the bytes read past the last answer (none: no pipelining)."""

    def __init__(self, route: BucketRoute, connect_timeout: float, read_timeout: float, tls: ssl.SSLContext | None):
        sock = open_socket(route, connect_timeout, tls)
        sock.settimeout(read_timeout)
        self.sock = sock
        self.key = (route.scheme, route.host, route.port)
        self.used = False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def exchange(self, request: bytes, url: str) -> tuple[int, dict[str, str], bytearray]:
        """Send ``request``; (status, lower-cased headers, body) of its answer. Transient when the
        connection drops or stalls before the whole body came; _Delegate when the answer's length is
        not given (chunked: boto3 reads it)."""
        try:
            self.sock.sendall(request)
            head = bytearray()
            while (end := head.find(b"\r\n\r\n")) < 0:
                if len(head) > HEADER_LIMIT:
                    raise Transient(f"{url}: the S3 endpoint sent a header block over {HEADER_LIMIT} bytes")
                chunk = self.sock.recv(RECV_BYTES)
                if not chunk:
                    raise Transient(f"{url}: the connection closed before an answer", before_answer=not head)
                head += chunk
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            raise Transient(f"{url}: {type(exc).__name__}: {exc}") from None
        status, headers, length = parse_head(bytes(head[:end + 2]), url)
        body = bytearray(length)
        got = min(len(head) - end - 4, len(body))
        body[:got] = head[end + 4:end + 4 + got]
        view = memoryview(body)
        try:
            while got < len(body):
                n = self.sock.recv_into(view[got:])
                if not n:
                    raise Transient(f"{url}: the body was cut at byte {got} of {len(body)}")
                got += n
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            raise Transient(f"{url}: body cut at byte {got} of {len(body)} ({type(exc).__name__})") from None
        if headers.get("connection", "").lower() == "close":
            self.close()
            self.sock = None
        return status, headers, body


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
        self._idle: list[_Connection] = []
        self._idle_lock = threading.Lock()
        self._keys: tuple = ()
        self._second: tuple[int, str] = (0, "")

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
                time.sleep(random.random() * min(20.0, 2.0 ** (attempt - 1)))

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
                self._routes[bucket] = self._route(sent[-1], key)
            raise
        finally:
            events.unregister("before-send.s3.GetObject", unique_id=hook)
        self._routes[bucket] = self._route(sent[-1], key) if sent else None
        return data

    def _route(self, sent: tuple[str, str], key: str) -> BucketRoute | None:
        route = route_of(sent[0], sent[1], key)
        return None if route is None or _through_proxy(route) else route

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
        """Sleep before attempt ``attempt`` + 1 (botocore's standard jitter), or raise OSError naming
        ``url`` when the attempts or the retry budget are spent."""
        bounds = self.limits
        if attempt >= bounds.attempts or time.monotonic() - started >= bounds.retry_budget:
            raise Unreadable(5, f"{why}; gave up after {attempt} attempt(s) (REPACK_S3_ATTEMPTS={bounds.attempts}, "
                          f"REPACK_S3_READ_TIMEOUT={bounds.read_timeout:g} s, "
                          f"REPACK_S3_RETRY_BUDGET={bounds.retry_budget:g} s)", url)
        time.sleep(random.random() * min(20.0, 2.0 ** (attempt - 1)))

    def _connection(self, route: BucketRoute) -> _Connection:
        want = (route.scheme, route.host, route.port)
        with self._idle_lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].key == want:
                    return self._idle.pop(i)
        tls = self.tls_context() if route.scheme == "https" else None
        return _Connection(route, self.limits.connect_timeout, self.limits.read_timeout, tls)

    def _release(self, conn: _Connection) -> None:
        if conn.sock is None:
            return
        conn.used = True
        with self._idle_lock:
            self._idle.append(conn)

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context of https endpoints (botocore's CA bundle)."""
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._cafile)
        return self._tls

    def signed_request(self, route: BucketRoute, key: str) -> bytes:
        """The signed GET of ``key`` (AWS Signature Version 4, an empty payload's hash)."""
        creds = self.credentials.get_frozen_credentials()
        path = route.base + _quote(key)
        stamp = self._stamp()
        date = stamp[:8]
        names = "host;x-amz-checksum-mode;x-amz-content-sha256;x-amz-date" + (
            ";x-amz-security-token" if creds.token else "")
        canonical = (f"GET\n{path}\n\nhost:{route.netloc}\nx-amz-checksum-mode:ENABLED\n"
                     f"x-amz-content-sha256:{EMPTY_SHA256}\n"
                     f"x-amz-date:{stamp}\n" + (f"x-amz-security-token:{creds.token}\n" if creds.token else "")
                     + f"\n{names}\n{EMPTY_SHA256}")
        scope = f"{date}/{route.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.digest(self._signing_key(creds.secret_key, date, route.region), to_sign.encode(),
                                "sha256").hex()
        token = f"x-amz-security-token: {creds.token}\r\n" if creds.token else ""
        return (f"GET {path} HTTP/1.1\r\nHost: {route.netloc}\r\nx-amz-checksum-mode: ENABLED\r\n"
                f"x-amz-date: {stamp}\r\n"
                f"x-amz-content-sha256: {EMPTY_SHA256}\r\n{token}"
                f"Authorization: AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                f"SignedHeaders={names}, Signature={signature}\r\n\r\n").encode()

    def _stamp(self) -> str:
        """The request time, ISO 8601 basic (made once a second)."""
        now = int(time.time())
        second, stamp = self._second
        if second != now:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
            self._second = (now, stamp)
        return stamp

    def _signing_key(self, secret: str, date: str, region: str) -> bytes:
        keys = self._keys
        if keys[:3] != (secret, date, region):
            key = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
            for part in (region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            keys = self._keys = (secret, date, region, key)
        return keys[3]
