"""A TCP proxy on loopback that adds a fixed latency to every HTTP request: network storage in a
box, in front of the loopback S3 server (tests.tools.s3server).

It does not speak HTTP beyond one look at each turn: when a client sends data after the server
has answered (or first on a connection), it peeks at the first bytes without reading them; if they
begin a request line (``GET /...``), the proxy waits ``delay_s`` (the round trip a remote object
store or network filesystem costs per request) and counts a request. So every request on a
keep-alive connection pays the latency, and a request body that follows ``100 Continue`` does not
pay it twice. The bytes themselves move at kernel level: ``os.splice`` from one socket into a pipe
and from the pipe into the other socket (no copy through Python; plain ``recv_into``/``sendall``
where ``os.splice`` is missing), one thread per direction per connection.

Bounded and self-stopping: it listens on 127.0.0.1 only and forwards only to a loopback address,
serves at most ``max_connections`` connections at a time (more wait in the listen queue), and
stops by itself after ``lifetime_s`` (default 30 minutes) if ``stop`` was never called.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import select
import socket
import threading
import time

PIPE_BYTES = 1 << 20  # the kernel pipe between the sockets (one splice moves at most this much)
_REQUEST_LINE = re.compile(rb"(GET|PUT|POST|HEAD|DELETE|OPTIONS|PATCH) ")
_SPLICE = hasattr(os, "splice")


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB pipe works, in more splices
    return r, w


class _Relay:
    """Moves bytes from socket ``src`` to socket ``dst``: spliced through a pipe, or copied through one
    buffer where os.splice is missing. ``move`` returns the bytes moved (0: ``src`` ended)."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        if _SPLICE:
            self.r, self.w = _pipe()
        else:
            self.buffer = bytearray(PIPE_BYTES)

    def move(self) -> int:
        if not _SPLICE:
            n = self.src.recv_into(self.buffer)
            self.dst.sendall(memoryview(self.buffer)[:n])
            return n
        n = os.splice(self.src.fileno(), self.w, PIPE_BYTES)
        left = n
        while left:
            left -= os.splice(self.r, self.dst.fileno(), left)
        return n

    def close(self) -> None:
        if _SPLICE:
            os.close(self.r)
            os.close(self.w)


class LatencyProxy:
    """Forwards TCP from ``endpoint`` to ``target_host:target_port``, ``delay_s`` before each HTTP request.

    ``requests`` counts the requests delayed. Use as a context manager or call ``stop``."""

    def __init__(self, target_port: int, delay_s: float = 0.010, target_host: str = "127.0.0.1",
                 max_connections: int = 64, lifetime_s: float = 1800.0) -> None:
        if not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError(f"LatencyProxy forwards to loopback addresses only, not {target_host!r}")
        if not 0 <= delay_s <= 10:
            raise ValueError(f"delay_s must be within 0..10 s, got {delay_s!r}")
        self.delay_s = delay_s
        self.target = (target_host, target_port)
        self.requests = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(0.2)  # the accept loop looks at _stopped this often
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept, name="latency-proxy", daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True
        self._thread.start()
        self._timer.start()

    # -- serving ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopped.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, OSError):
                self._slots.release()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._stopped.is_set():
                return False
            self._open.update(socks)
            return True

    def _serve(self, conn: socket.socket) -> None:
        upstream = None
        try:
            conn.setblocking(True)
            upstream = socket.create_connection(self.target, timeout=30)
            upstream.setblocking(True)
            for sock in (conn, upstream):
                # no Nagle: a small answer must not wait for a delayed ACK (40 ms of latency not meant)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._track(conn, upstream):
                return
            answered = threading.Event()
            answered.set()  # the first data on a connection starts a turn
            down = threading.Thread(target=self._downstream, args=(upstream, conn, answered), daemon=True)
            down.start()
            self._upstream(conn, upstream, answered)
            down.join()
        except OSError:
            pass  # a peer closed or reset: the connection ends, the proxy goes on
        finally:
            with self._lock:
                self._open.difference_update((conn, upstream))
            for sock in (conn, upstream):
                if sock is not None:
                    sock.close()
            self._slots.release()

    def _upstream(self, client: socket.socket, upstream: socket.socket, answered: threading.Event) -> None:
        """Client to server; the delay before each request that follows an answer."""
        relay = _Relay(client, upstream)
        poller = select.poll()
        poller.register(client, select.POLLIN | select.POLLPRI)
        try:
            while not self._stopped.is_set():
                poller.poll()  # until data, EOF or shutdown; nothing read yet
                if answered.is_set():
                    answered.clear()
                    head = client.recv(16, socket.MSG_PEEK)
                    if _REQUEST_LINE.match(head):
                        time.sleep(self.delay_s)
                        with self._lock:
                            self.requests += 1
                if relay.move() == 0:
                    break
        except OSError:
            pass
        finally:
            relay.close()
            _shutdown(upstream, socket.SHUT_WR)  # the server sees the client's EOF, answers, closes

    def _downstream(self, upstream: socket.socket, client: socket.socket, answered: threading.Event) -> None:
        """Server to client; marks the turn answered before the client can see the answer."""
        relay = _Relay(upstream, client)
        try:
            while True:
                if _SPLICE:
                    n = os.splice(upstream.fileno(), relay.w, PIPE_BYTES)
                    if n == 0:
                        break
                    answered.set()
                    while n:
                        n -= os.splice(relay.r, client.fileno(), n)
                else:
                    n = upstream.recv_into(relay.buffer)
                    if n == 0:
                        break
                    answered.set()
                    client.sendall(memoryview(relay.buffer)[:n])
        except OSError:
            pass
        finally:
            relay.close()
            _shutdown(client, socket.SHUT_RDWR)  # the server closed: so does the client side
            _shutdown(upstream, socket.SHUT_RDWR)

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop serving and cut the open connections (idempotent)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            socks = list(self._open)
        self._timer.cancel()
        for sock in socks:
            _shutdown(sock, socket.SHUT_RDWR)  # wakes the relays blocked in poll/splice
        self._thread.join(5)
        self._listener.close()

    def __enter__(self) -> "LatencyProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _shutdown(sock: socket.socket | None, how: int) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(how)
    except OSError:
        pass
