"""tests.tools.latency_proxy against the real moto S3 server on loopback: every request pays the
added latency, bodies arrive whole (ranged GETs included), only loopback targets are accepted,
and the proxy stops by itself after its lifetime."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

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
