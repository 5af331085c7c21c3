"""S3 GETs on the wire: a SigV4-signed HTTP/1.1 GET on a kept-alive socket, its answer's head parsed
and its body received straight into the caller's buffer. Stdlib only, so that both halves use it: the
producer's whole-object GETs (``repack.store.s3_get``) and the readers' ranged GETs
(``pipelines.s3_ranges``, which may import only ``repack.manifest``).

What a GET costs here: one ``sendall`` of a request signed with ``hmac`` (the signing key made once a
day per secret and region), the head read in one ``recv`` or a few, and the body ``recv_into`` the
caller's memory (no bytes object per chunk): ~0.1-0.3 ms of client CPU, where botocore spends 3-4 ms
on a GET (request building, hooks, signing, urllib3 and header parsing).

Where a bucket's GETs go (``BucketRoute``: endpoint, path or virtual-hosted style, the signing
region) is never decided here: the callers learn it from a request botocore sent (``route_of``), so
the user's configuration means what it means to boto3. Credentials are botocore's too (read for each
request: refreshed ones are used as they change).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
HEADER_LIMIT = 64 << 10     # an answer's header block larger than this is not S3's
RECV_BYTES = 64 << 10
# the answer's headers the callers read (names case-insensitive); the others are not parsed
_HEADERS = re.compile(rb"\r\n((?i:content-length|content-range|transfer-encoding|connection|"
                      rb"x-amz-checksum-(?:crc32|sha1|sha256)))[ \t]*:([^\r\n]*)")
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
    ``before_answer``: the connection closed (or was reset) before any byte of an answer."""

    def __init__(self, message: str, before_answer: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.before_answer = before_answer
        self.timed_out = timed_out  # the endpoint stalled (no answer within the read timeout)


class Delegate(Exception):
    """An answer the wire path does not read (no length given: chunked): boto3 does that GET again."""


def quote_key(key: str) -> str:
    """The key as it stands in a request's path (and in its canonical request)."""
    return key if _PLAIN_KEY.fullmatch(key) else urllib.parse.quote(key, safe="/~")


def route_of(url: str, authorization: str, key: str) -> BucketRoute | None:
    """The route of a GET botocore sent to ``url`` with this ``Authorization`` for ``key``; None when
    it was not signed with SigV4 for s3, its URL does not end in the key as this module quotes it, or
    it goes through a proxy (``HTTP(S)_PROXY``: boto3 reads that bucket)."""
    scope = authorization.partition("Credential=")[2].partition(",")[0].split("/")
    if not authorization.startswith("AWS4-HMAC-SHA256 ") or len(scope) != 5 or scope[3] != "s3":
        return None
    parts = urllib.parse.urlsplit(url)
    quoted = quote_key(key)
    if parts.query or parts.scheme not in ("http", "https") or not parts.path.endswith(quoted):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    route = BucketRoute(parts.scheme, parts.hostname or "", port, parts.netloc, parts.path[:-len(quoted)], scope[2])
    proxies = urllib.request.getproxies()
    if route.scheme in proxies and not urllib.request.proxy_bypass(route.host):
        return None
    return route


def open_socket(route: BucketRoute, connect_timeout: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A connected socket to the route's host (TLS handshake done when ``tls``), Nagle off."""
    sock = socket.create_connection((route.host, route.port), timeout=connect_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=route.host)
    return sock


def parse_head(block: bytes, url: str) -> tuple[int, dict[str, str], int]:
    """(status, the lower-cased headers this module reads, body length) of an answer's header block
    (up to its last CRLF). Transient when it is not HTTP; Delegate when the length is not given
    (chunked: boto3 reads it)."""
    status_line = block[:block.find(b"\r\n")]
    try:
        status = int(status_line.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise Transient(f"{url}: not an HTTP answer: {status_line[:80]!r}") from None
    headers = {name.lower().decode(): value.strip().decode("latin-1") for name, value in _HEADERS.findall(block)}
    length = headers.get("content-length", "")
    if not length.isdigit() or "transfer-encoding" in headers:
        raise Delegate()
    return status, headers, int(length)


class Signer:
    """SigV4 signatures of GETs (an empty payload's hash), the signing key cached per secret, day and region."""

    def __init__(self) -> None:
        self._keys: tuple = ()
        self._second: tuple[int, str] = (0, "")

    def get(self, route: BucketRoute, key: str, credentials, headers: dict[str, str]) -> bytes:
        """The signed request bytes of a GET of ``key`` with the extra ``headers`` (lower-case names,
        all signed: e.g. ``range``, ``x-amz-checksum-mode``); ``credentials``: botocore's frozen ones."""
        path = route.base + quote_key(key)
        stamp = self._stamp()
        date = stamp[:8]
        signed = {"host": route.netloc, **headers, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
        if credentials.token:
            signed["x-amz-security-token"] = credentials.token
        names = sorted(signed)
        canonical = (f"GET\n{path}\n\n" + "".join(f"{n}:{signed[n]}\n" for n in names)
                     + f"\n{';'.join(names)}\n{EMPTY_SHA256}")
        scope = f"{date}/{route.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.digest(self._signing_key(credentials.secret_key, date, route.region), to_sign.encode(),
                                "sha256").hex()
        lines = "".join(f"{n}: {signed[n]}\r\n" for n in names if n != "host")
        return (f"GET {path} HTTP/1.1\r\nHost: {route.netloc}\r\n{lines}"
                f"Authorization: AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
                f"SignedHeaders={';'.join(names)}, Signature={signature}\r\n\r\n").encode()

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


@dataclass(frozen=True)
class Head:
    """An answer's status line and headers: ``status``, the headers ``parse_head`` reads, the body's
    ``length``, and ``early``: the body's first bytes, read with the head."""

    status: int
    headers: dict
    length: int
    early: bytes


class Connection:
    """One kept-alive socket to a host, one request at a time (no pipelining). ``sock`` is None once
    the server said it closes the connection (or it was closed)."""

    def __init__(self, route: BucketRoute, connect_timeout: float, read_timeout: float, tls: ssl.SSLContext | None):
        sock = open_socket(route, connect_timeout, tls)
        sock.settimeout(read_timeout)
        self.sock: socket.socket | None = sock
        self.key = (route.scheme, route.host, route.port)
        self.used = False

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def ask(self, request: bytes, url: str) -> Head:
        """Send ``request`` and read its answer's head. Transient when the connection drops or stalls
        before the head came; Delegate when the answer's length is not given."""
        head = bytearray()
        try:
            self.sock.sendall(request)
            while (end := head.find(b"\r\n\r\n")) < 0:
                if len(head) > HEADER_LIMIT:
                    raise Transient(f"{url}: the S3 endpoint sent a header block over {HEADER_LIMIT} bytes")
                chunk = self.sock.recv(RECV_BYTES)
                if not chunk:
                    raise Transient(f"{url}: the connection closed before an answer", before_answer=not head)
                head += chunk
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            # a reset or a broken pipe before any byte of the answer: a kept-alive socket the endpoint (or a load
            # balancer's idle timeout) dropped meanwhile, as a close is; a stall is no such thing
            dropped = isinstance(exc, ConnectionError) and not head
            raise Transient(f"{url}: {type(exc).__name__}: {exc}", before_answer=dropped,
                            timed_out=isinstance(exc, TimeoutError)) from None
        status, headers, length = parse_head(bytes(head[:end + 2]), url)
        return Head(status, headers, length, bytes(head[end + 4:end + 4 + length]))

    def receive_into(self, head: Head, view: memoryview, url: str) -> int:
        """The answer's body into ``view`` (at most ``head.length`` bytes; the early bytes first, then the
        socket's straight in); how many bytes came. A body cut or stalled stops early (the
        connection is closed: what is left of the answer is unread); so does a short ``view``."""
        limit = min(len(view), head.length)  # an answer shorter than the range asked ends where it says
        got = min(len(head.early), limit)  # (reading on would wait on a kept-alive socket for the read timeout)
        view[:got] = head.early[:got]
        try:
            while got < limit:
                n = self.sock.recv_into(view[got:limit])
                if not n:
                    break
                got += n
        except (TimeoutError, ConnectionError, ssl.SSLError):
            pass
        if got < head.length or head.headers.get("connection", "").lower() == "close":
            self.close()  # cut, or the rest unread: not reusable
        return got

    def exchange(self, request: bytes, url: str) -> tuple[int, dict[str, str], bytearray]:
        """Send ``request``; (status, lower-cased headers, body) of its answer. Transient when the
        connection drops or stalls before the whole body came; Delegate when the answer's length is
        not given (chunked: boto3 reads it)."""
        head = self.ask(request, url)
        body = bytearray(head.length)
        got = self.receive_into(head, memoryview(body), url)
        if got < head.length:
            raise Transient(f"{url}: the body was cut at byte {got} of {head.length}")
        return head.status, head.headers, body


class IdleConnections:
    """Kept-alive connections waiting for their next request, found by ``(scheme, host, port)``; shared by
    the threads of one process (after a fork a process makes its own)."""

    def __init__(self) -> None:
        self._idle: list = []
        self._lock = threading.Lock()

    def take(self, route: BucketRoute):
        """The most recently given connection to the route's host, or None."""
        want = (route.scheme, route.host, route.port)
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].key == want:
                    return self._idle.pop(i)
        return None

    def give(self, conn) -> None:
        """Hand a connection whose answer was read whole back for the next request."""
        conn.used = True
        with self._lock:
            self._idle.append(conn)
