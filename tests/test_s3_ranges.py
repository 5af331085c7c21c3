"""The readers' ranged GETs on the wire (pipelines.s3_ranges, issue 29 item 6), against real S3 servers on
loopback (moto; rclone serve s3, which checks every SigV4 signature) behind a recording proxy: after
the first GET of a bucket (boto3's, which teaches the route) the ranges are signed and sent on one
kept-alive connection and received straight into the caller's buffer, boto3 untouched; a body cut
mid-way is resumed from the exact byte where it stopped; an answer that is not the range (a 500, a
missing key, a range past the end) is boto3's to give; a forked DataLoader-style worker reads on the
wire without making a boto3 client; a silent or closed endpoint fails within the REPACK_S3_* bounds
with an error naming the object's URL."""

from __future__ import annotations

import multiprocessing
import socket
import time

import numpy as np
import pytest

pytest.importorskip("boto3")

from pipelines import object_store, s3_ranges  # noqa: E402
from tests.tools.s3server import FaultProxy, MotoServer, RcloneServer, SilentServer, client, s3_env  # noqa: E402

BLOB = np.random.default_rng(96).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
SERVERS = ["moto"] + (["rclone"] if RcloneServer.available() else [])
URL = "s3://ranges/blob"
LOW = {"REPACK_S3_READ_TIMEOUT": "1", "REPACK_S3_CONNECT_TIMEOUT": "1", "REPACK_S3_ATTEMPTS": "2",
       "REPACK_S3_NOTICE": "0.5"}


@pytest.fixture(scope="module", params=SERVERS)
def server(request):
    started = RcloneServer() if request.param == "rclone" else MotoServer()
    s3 = client(started.endpoint)
    s3.create_bucket(Bucket="ranges")
    s3.put_object(Bucket="ranges", Key="blob", Body=BLOB)
    yield started
    started.stop()


@pytest.fixture()
def proxy(server, monkeypatch):
    """A recording proxy in front of the server, this process's S3 state fresh for its endpoint."""
    recording = FaultProxy(server.port)
    for name, value in s3_env(recording.endpoint).items():
        monkeypatch.setenv(name, value)
    _fresh()
    yield recording
    recording.stop()
    _fresh()


def _fresh() -> None:
    object_store._clients.clear()
    object_store._getters.clear()
    s3_ranges._routes.clear()


def _boto3_sends() -> list:
    """The requests boto3 sends from now on (its client's ``before-send``)."""
    sent: list = []
    object_store._client().meta.events.register("before-send.s3", lambda request, **_: sent.append(request.url))
    return sent


def _gets(proxy: FaultProxy) -> list[str | None]:
    return [rng for method, path, rng in proxy.requests if method == "GET" and path == "/ranges/blob"]


def test_ranges_after_the_first_are_signed_on_the_wire_into_the_buffer(proxy):
    sent = _boto3_sends()
    ranges = [(0, 1000), (4096, 1 << 20), (12345, 300_000), (len(BLOB) - 777, 777), (1 << 20, 1 << 20)]
    for start, size in ranges:
        shared = np.zeros(size + 64, np.uint8)  # a numpy buffer, as a batch's shared memory is
        assert object_store.read_range_into(URL, start, memoryview(shared)[32:32 + size]) == size
        assert shared[32:32 + size].tobytes() == BLOB[start:start + size]
        assert not shared[:32].any() and not shared[32 + size:].any()
    assert len(sent) == 1  # the first GET: boto3's, which taught the bucket's route
    assert s3_ranges.known_route("ranges")
    assert _gets(proxy) == [f"bytes={a}-{a + n - 1}" for a, n in ranges]
    assert len(proxy.peers) == 2  # boto3's connection, then one kept-alive wire connection for the rest
    # read_range (a manifest read "up to the cap"): a buffer of what the object holds, on the wire too
    assert object_store.read_range(URL, 100, 256 << 20) == BLOB[100:]
    assert len(sent) == 1 and _gets(proxy)[-1] == f"bytes=100-{(256 << 20) - 1}"


def test_a_body_cut_mid_way_is_resumed_from_the_byte_where_it_stopped(proxy):
    assert object_store.read_range_into(URL, 0, bytearray(10)) == 10  # the route learnt
    proxy.faults["/ranges/blob"] = ["cut", "cut"]  # half the body, then the connection dropped; twice
    buffer = bytearray(1 << 20)
    assert object_store.read_range_into(URL, 4096, buffer) == len(buffer) and buffer == BLOB[4096:4096 + (1 << 20)]
    last = 4096 + (1 << 20) - 1
    half, quarter = 1 << 19, 1 << 18  # the cut answers' halves: 512 KiB, then 256 KiB of the rest
    assert _gets(proxy)[1:] == [f"bytes=4096-{last}", f"bytes={4096 + half}-{last}",
                                f"bytes={4096 + half + quarter}-{last}"]
    assert proxy.cut == 2


def test_answers_that_are_not_the_range_are_boto3s(proxy):
    sent = _boto3_sends()
    assert object_store.read_range_into(URL, 0, bytearray(10)) == 10
    proxy.faults["/ranges/blob"] = [500]  # the wire's answer: boto3 asks again (and gets the range)
    buffer = bytearray(5000)
    assert object_store.read_range_into(URL, 777, buffer) == 5000 and buffer == BLOB[777:5777]
    assert len(sent) == 2
    tail = bytearray(100)
    assert object_store.read_range_into(URL, len(BLOB) - 10, tail) == 10 and tail[:10] == BLOB[-10:]
    assert object_store.read_range_into(URL, len(BLOB) + 5, bytearray(10)) == 0  # 416: nothing there
    with pytest.raises(FileNotFoundError):
        object_store.read_range_into("s3://ranges/none", 0, bytearray(10))
    assert tail[10:] == bytes(90)


def _worker(queue) -> None:
    import os

    buffer = bytearray(300_000)
    got = object_store.read_range_into(URL, 1 << 20, buffer)
    queue.put((got, bytes(buffer) == BLOB[1 << 20:(1 << 20) + 300_000],
               any(pid == os.getpid() for pid, _ in object_store._clients)))


def test_a_forked_worker_reads_on_the_wire_without_a_boto3_client(proxy):
    assert object_store.read_range_into(URL, 0, bytearray(10)) == 10  # the parent learns the route
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    worker = context.Process(target=_worker, args=(queue,))
    worker.start()
    result = queue.get(timeout=60)
    worker.join(30)
    assert result == (300_000, True, False)
    assert _gets(proxy)[-1] == f"bytes={1 << 20}-{(1 << 20) + 300_000 - 1}"


def _point_route_at(endpoint: str, monkeypatch) -> None:
    """The bucket's route as botocore would have sent a GET to ``endpoint`` (path style, SigV4)."""
    for name, value in {**s3_env(endpoint), **LOW}.items():
        monkeypatch.setenv(name, value)
    _fresh()
    s3_ranges.learn_route("ranges", "blob", (f"{endpoint}/ranges/blob", "AWS4-HMAC-SHA256 Credential=testing/"
                                              "20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0"))


def test_a_silent_endpoint_fails_on_the_wire_within_the_bounds_naming_the_url(monkeypatch, capfd):
    silent = SilentServer()
    try:
        _point_route_at(silent.endpoint, monkeypatch)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            object_store.read_range_into(URL, 0, bytearray(4096))
        took = time.monotonic() - started
    finally:
        silent.close()
        _fresh()
    assert took < 2 * object_store.limits().request_limit_s + 2, took
    assert str(caught.value).startswith(f"{URL}: the S3 endpoint did not answer")
    assert "REPACK_S3_READ_TIMEOUT" in str(caught.value) and silent.accepted == 2
    waits = [line for line in capfd.readouterr().err.splitlines() if line.startswith("repack: waiting")]
    assert waits and f"GetObject {URL}" in waits[0], waits


def test_a_closed_endpoint_is_a_connection_error_naming_the_url(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    _point_route_at(f"http://127.0.0.1:{port}", monkeypatch)
    try:
        with pytest.raises(ConnectionError, match=f"{URL}: cannot reach the S3 endpoint"):
            object_store.read_range_into(URL, 0, bytearray(4096))
    finally:
        _fresh()
