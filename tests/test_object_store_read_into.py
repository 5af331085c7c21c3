"""pipelines.object_store.read_range_into (issue 29, item 6): a range of an object received straight
into the caller's buffer, against real S3 servers on loopback (rclone serve s3, which answers a ranged
GET with 200 and a Content-Range, and moto): exact bytes at any offset, short only where the object
ends, resumed after a connection cut mid-body, keep-alive kept between reads (the wire GETs of
pipelines.s3_ranges after the first; tests/test_s3_ranges.py tests that path); the same for a local file.
An endpoint that answers another range than the one asked for is an error (read_range too), never
bytes taken as the range."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("boto3")

from pipelines import object_store  # noqa: E402
from tests.tools.latency_proxy import LatencyProxy  # noqa: E402
from tests.tools.s3server import FaultProxy, MotoServer, RcloneServer, client, s3_env  # noqa: E402

BLOB = np.random.default_rng(29).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
SERVERS = ["moto"] + (["rclone"] if RcloneServer.available() else [])


class CountingProxy(LatencyProxy):
    """The latency proxy, counting the connections it serves."""

    def __init__(self, *args, **kwargs) -> None:
        self.connections = 0
        self._counting = threading.Lock()
        super().__init__(*args, **kwargs)

    def _serve(self, conn) -> None:
        with self._counting:
            self.connections += 1
        super()._serve(conn)


@pytest.fixture(scope="module", params=SERVERS)
def server(request):
    started = RcloneServer() if request.param == "rclone" else MotoServer()
    s3 = client(started.endpoint)
    s3.create_bucket(Bucket="into")
    s3.put_object(Bucket="into", Key="blob", Body=BLOB)  # botocore sends a CRC32; rclone echoes it on ranges
    yield started
    started.stop()


@pytest.fixture()
def endpoint(monkeypatch):
    def use(url: str) -> None:
        for name, value in s3_env(url).items():
            monkeypatch.setenv(name, value)
    return use


def test_exact_bytes_at_any_offset_into_any_buffer(server, endpoint):
    endpoint(server.endpoint)
    object_store._clients.clear()  # this process's client: for this server's endpoint
    url = "s3://into/blob"
    for start, size in [(0, 1), (0, 4 << 10), (12345, 1 << 20), (len(BLOB) - (2 << 20), 2 << 20), (777, len(BLOB) - 777)]:
        buffer = bytearray(size)
        assert object_store.read_range_into(url, start, buffer) == size
        assert buffer == BLOB[start:start + size]
    shared = np.zeros(5000, np.uint8)  # a numpy array (as a batch's shared memory is), filled through a slice
    assert object_store.read_range_into(url, 1 << 20, memoryview(shared)[1000:4000]) == 3000
    assert shared[1000:4000].tobytes() == BLOB[1 << 20:(1 << 20) + 3000] and not shared[:1000].any()
    tail = bytearray(100)  # past the end: short, the rest of the buffer untouched
    assert object_store.read_range_into(url, len(BLOB) - 10, tail) == 10 and tail[:10] == BLOB[-10:]
    assert tail[10:] == bytes(90)
    assert object_store.read_range_into(url, len(BLOB) + 5, bytearray(10)) == 0
    with pytest.raises(FileNotFoundError):
        object_store.read_range_into("s3://into/none", 0, bytearray(10))


def test_a_connection_cut_mid_body_is_resumed_and_keep_alive_is_kept(server, endpoint):
    url = "s3://into/blob"
    proxy = FaultProxy(server.port, cut_every=2)  # every 2nd ranged answer cut after half its body
    try:
        endpoint(proxy.endpoint)
        object_store._clients.clear()  # a client for the proxy's endpoint
        for start in (0, 4096, 1 << 20):
            buffer = bytearray(1 << 20)
            assert object_store.read_range_into(url, start, buffer) == len(buffer)
            assert buffer == BLOB[start:start + len(buffer)]
        assert proxy.cut >= 2
    finally:
        proxy.stop()
    with CountingProxy(server.port, delay_s=0) as counting:
        endpoint(counting.endpoint)
        object_store._clients.clear()
        for start in range(0, 2 << 20, 256 << 10):
            buffer = bytearray(256 << 10)
            assert object_store.read_range_into(url, start, buffer) == len(buffer)
            assert buffer == BLOB[start:start + len(buffer)]
        # rclone keeps a connection alive: boto3's for the first GET (which teaches the bucket's route), then
        # one wire connection (pipelines.s3_ranges) for the other seven; moto's server closes each one
        assert counting.requests == 8 and counting.connections == (2 if server.name.startswith("rclone") else 8)
    object_store._clients.clear()


def test_a_local_file_reads_the_same(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(BLOB)
    buffer = bytearray(1 << 20)
    assert object_store.read_range_into(str(path), 4321, buffer) == len(buffer) and buffer == BLOB[4321:4321 + (1 << 20)]
    assert object_store.read_range_into(str(path), len(BLOB) - 3, bytearray(8)) == 3
    with pytest.raises(FileNotFoundError):
        object_store.read_range_into(str(tmp_path / "none"), 0, bytearray(1))
    assert os.path.getsize(path) == len(BLOB)


class IgnoresRange(BaseHTTPRequestHandler):
    """An HTTP endpoint that answers every GET with the whole object and status 200, Range ignored."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB[:4096])))
        self.end_headers()
        self.wfile.write(BLOB[:4096])

    def log_message(self, *args) -> None:
        pass


def test_an_answer_for_another_range_is_refused_not_taken_as_the_range(endpoint, monkeypatch):
    # one range asked again, not 5: each asked again after a doubling pause (0.2 s .. 3.2 s: 6.2 s a read)
    monkeypatch.setattr(object_store, "RESUME_ATTEMPTS", 1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), IgnoresRange)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint(f"http://127.0.0.1:{server.server_address[1]}")
        for read in (lambda: object_store.read_range("s3://into/blob", 100, 200),
                     lambda: object_store.read_range_into("s3://into/blob", 100, bytearray(100))):
            with pytest.raises(OSError, match="s3://into/blob: the S3 endpoint answered a ranged GET without"):
                read()
        assert object_store.read_range("s3://into/blob", 0, 4096) == BLOB[:4096]  # from byte 0 it is the range
    finally:
        server.shutdown()
        server.server_close()
