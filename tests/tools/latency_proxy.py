"""An HTTP proxy on loopback that adds a fixed latency to every request: network storage in a
box, in front of the loopback S3 server (tests.tools.s3server.MotoServer).

Each request waits ``delay_s`` before it is forwarded (the round trip a remote object store
or network filesystem costs per request); the answer is streamed back in 1 MiB pieces as it
arrives, so a large ranged GET is not held whole in memory. Bounded and self-stopping: it
listens on 127.0.0.1 only and forwards only to a loopback port, serves at most
``max_connections`` connections at a time (more wait in the listen queue), and stops by
itself after ``lifetime_s`` (default 30 minutes) if ``stop`` was never called.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = 1 << 20
HOP_BY_HOP = ("transfer-encoding", "content-length", "connection", "keep-alive")


class LatencyProxy:
    """Forwards HTTP from ``endpoint`` to ``target_host:target_port`` after ``delay_s`` per request.

    ``requests`` counts the requests forwarded. Use as a context manager or call ``stop``."""

    def __init__(self, target_port: int, delay_s: float = 0.010, target_host: str = "127.0.0.1",
                 max_connections: int = 64, lifetime_s: float = 1800.0) -> None:
        if not ipaddress.ip_address(target_host).is_loopback:
            raise ValueError(f"LatencyProxy forwards to loopback addresses only, not {target_host!r}")
        if not 0 <= delay_s <= 10:
            raise ValueError(f"delay_s must be within 0..10 s, got {delay_s!r}")
        self.delay_s = delay_s
        self.requests = 0
        lock = threading.Lock()
        slots = threading.BoundedSemaphore(max_connections)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                # no Nagle: a small answer's body must not wait for the client's delayed ACK of
                # the headers (40 ms), which would add latency the proxy did not mean to add
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                time.sleep(proxy.delay_s)
                with lock:
                    proxy.requests += 1
                upstream = http.client.HTTPConnection(target_host, target_port, timeout=120)
                try:
                    upstream.connect()
                    upstream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    upstream.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    answer = upstream.getresponse()
                    self.send_response(answer.status)
                    for name, value in answer.getheaders():
                        if name.lower() not in HOP_BY_HOP:
                            self.send_header(name, value)
                    size = answer.getheader("Content-Length")
                    if size is None and self.command != "HEAD":
                        data = answer.read()
                        size = str(len(data))
                        self.send_header("Content-Length", size)
                        self.end_headers()
                        self.wfile.write(data)
                        return
                    self.send_header("Content-Length", size or "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        while piece := answer.read(CHUNK):
                            self.wfile.write(piece)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def process_request(self, request, client_address) -> None:
                slots.acquire()
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

            def handle_error(self, request, client_address) -> None:
                pass  # a client closing its keep-alive connection is not an error

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._stopped = False
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True
        self._thread.start()
        self._timer.start()

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "LatencyProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
