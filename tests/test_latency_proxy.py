"""tests.tools.latency_proxy against the real moto S3 server on loopback: every request pays the
added latency (on keep-alive connections too), bodies arrive whole both ways (ranged GETs, PUTs
with 100-continue), only loopback targets are accepted, and the proxy stops by itself after its
lifetime, cutting its open connections."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.tools.latency_proxy import LatencyProxy
from tests.tools.s3server import MotoServer, client

pytest.importorskip("moto")
pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.stop()


def test_every_request_pays_the_latency_and_bodies_arrive_whole(moto):
    direct = client(moto.endpoint)
    direct.create_bucket(Bucket="lat")
    blob = bytes(range(256)) * 12_000  # 3 MB: several proxy pieces
    direct.put_object(Bucket="lat", Key="blob", Body=blob)
    with LatencyProxy(moto.port, delay_s=0.05) as proxy:
        s3 = client(proxy.endpoint)
        started = time.perf_counter()
        for _ in range(4):
            assert s3.get_object(Bucket="lat", Key="blob")["Body"].read() == blob
        ranged = s3.get_object(Bucket="lat", Key="blob", Range="bytes=1000-1999999")["Body"].read()
        elapsed = time.perf_counter() - started
        assert ranged == blob[1000:2000000]
        assert proxy.requests == 5
        assert elapsed >= 5 * 0.05


class KeepAlive(BaseHTTPRequestHandler):
    """A plain HTTP/1.1 server that keeps connections open (moto's closes them after each answer)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = b"ok %d" % self.client_address[1]  # the client port the server saw: one connection or many
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_every_request_on_one_keep_alive_connection_pays_the_latency():
    delay, n = 0.04, 6
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with LatencyProxy(server.server_address[1], delay_s=delay) as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            started = time.perf_counter()
            bodies = set()
            for _ in range(n):
                conn.request("GET", "/")
                bodies.add(conn.getresponse().read())
            elapsed = time.perf_counter() - started
            conn.close()
            assert len(bodies) == 1  # all on one connection
            assert proxy.requests == n
            assert elapsed >= n * delay
    finally:
        server.shutdown()
        server.server_close()


def test_uploads_pass_whole_and_count_once(moto):
    direct = client(moto.endpoint)
    direct.create_bucket(Bucket="upl")
    blob = bytes(range(256)) * 8_000  # 2 MB: botocore sends Expect: 100-continue, the body after the 100
    with LatencyProxy(moto.port, delay_s=0.02) as proxy:
        client(proxy.endpoint).put_object(Bucket="upl", Key="blob", Body=blob)
        assert proxy.requests == 1
    assert direct.get_object(Bucket="upl", Key="blob")["Body"].read() == blob


def test_stop_cuts_open_connections(moto):
    proxy = LatencyProxy(moto.port, delay_s=0.0)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    conn.request("GET", "/moto-api/")
    assert conn.getresponse().read()
    proxy.stop()
    with pytest.raises((OSError, http.client.HTTPException)):
        conn.request("GET", "/moto-api/")
        conn.getresponse().read()
    conn.close()


def test_only_loopback_targets_and_sane_delays():
    with pytest.raises(ValueError, match="loopback"):
        LatencyProxy(80, target_host="192.0.2.1")
    with pytest.raises(ValueError, match="delay_s"):
        LatencyProxy(80, delay_s=-1)


def test_stops_by_itself_after_its_lifetime(moto):
    proxy = LatencyProxy(moto.port, delay_s=0.0, lifetime_s=0.3)
    urllib.request.urlopen(f"{proxy.endpoint}/moto-api/", timeout=5).read()
    time.sleep(0.8)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{proxy.endpoint}/moto-api/", timeout=2).read()
    proxy.stop()  # idempotent
