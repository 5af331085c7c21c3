"""The readers on s3:// against endpoint faults seen in the field, through a fault proxy in front of moto: a
kept-alive connection reset while idle (a load balancer's idle timeout) costs no attempt, a ranged answer of
other bytes than asked is asked for again, an error answer that outlasts the attempts names the shard, and a
token file shorter than its index is the reader's own error. Each read runs in a fresh process (a process's S3
clients and routes are made once)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, run_repack
from tests.tools.photos import make_photo_tree
from tests.tools.s3server import FaultProxy, MotoServer, client, s3_env

READ_ALL = """
import hashlib, json, sys, time
from pipelines.torch_webdataset import ImageShardDataset
def epoch(**options):
    read = ImageShardDataset("s3://faults/ds", output="dict", decode=False, read_bytes=16384, **options)
    images = [image for batch in read for image in batch["image"]] if "batch_size" in options else \
        [sample["image"] for sample in read]
    return [hashlib.sha256(bytes(image)).hexdigest()[:12] for image in images]
first = epoch()
time.sleep(float(sys.argv[1]))
print(json.dumps([first, epoch(prefetch=0), epoch(batch_size=8)]))
"""


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer()
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="faults")
    photos = tmp_path_factory.mktemp("photos")
    make_photo_tree(photos, per_class=12, classes=2, seed=8, max_side=96)
    run_repack("images", photos, "s3://faults/ds", "--shard-size", "6", "--quiet", env=s3_env(server.endpoint))
    s3.put_object(Bucket="faults", Key="short.bin", Body=np.arange(1000, dtype="<u2").tobytes())
    yield server
    server.stop()


def python(code: str, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, **s3_env(endpoint), "REPACK_S3_ATTEMPTS": "2"})


@pytest.fixture(scope="module")
def samples(moto) -> list[str]:
    """The first epoch read straight from moto, no proxy: read once for the module (a process of its own)."""
    done = python(READ_ALL, moto.endpoint, "0")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)[0]


def test_kept_alive_connections_reset_while_idle_cost_no_attempt(moto, samples):
    """After a pause longer than the endpoint's idle timeout every kept-alive socket is reset when it is used:
    with 2 attempts the second epoch failed ("the S3 endpoint did not answer ... after 2 attempt(s)")."""
    proxy = FaultProxy(moto.port, reset_idle=0.5)
    try:
        done = python(READ_ALL, proxy.endpoint, "1.0")
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    first, again, batches = json.loads(done.stdout)
    assert first == again == sorted(batches, key=first.index) == samples and proxy.resets >= 1


@pytest.mark.parametrize("fault", ["shift 512", "ignore range"])
def test_a_shard_range_answered_with_other_bytes_once_is_asked_again(moto, samples, fault):
    """One ranged GET of a shard answered from another place (a proxy's fault): the epoch ended on an OSError at
    once, where the docs say the range is asked for again first."""
    shard = "/faults/ds/shard-000001.tar"
    proxy = FaultProxy(moto.port, faults={shard: [None, fault]})  # the first GET (boto3's) teaches the route
    try:
        done = python(READ_ALL, proxy.endpoint, "0")
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0] == samples
    assert len([r for r in proxy.requests if r[1] == shard]) >= 3


@pytest.mark.parametrize("status, named", [(503, "answered InternalError"), (403, "refused access")])
def test_an_error_answer_that_outlasts_the_attempts_names_the_shard(moto, status, named):
    """A 5xx that outlasts the attempts, or a 403: a bare botocore ClientError naming no shard came out."""
    shard = "/faults/ds/shard-000002.tar"
    proxy = FaultProxy(moto.port, faults={shard: [status] * 50})
    try:
        done = python(READ_ALL, proxy.endpoint, "0")
    finally:
        proxy.stop()
    assert done.returncode != 0 and f"s3:/{shard}: the S3 endpoint {named}" in done.stderr, done.stderr[-600:]
    assert "ClientError" not in done.stderr


def test_a_token_file_shorter_than_its_index_says_so(moto):
    """Tokens past the end of an s3:// .bin: botocore's InvalidRange came out raw, naming no object."""
    done = python("from pipelines.torch_text import RemoteTokens\nimport numpy as np\n"
                  "tokens = RemoteTokens('s3://faults/short.bin', np.dtype('<u2'), 1200)\n"
                  "for window in (slice(990, 1010), slice(1100, 1110)):\n"
                  "    try:\n        tokens[window]\n    except ValueError as exc:\n        print(exc)\n",
                  moto.endpoint)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "s3://faults/short.bin: tokens 990..1010 lie past the end of the object (20 of 40 bytes; run `repack verify`)",
        "s3://faults/short.bin: tokens 1100..1110 lie past the end of the object (0 of 20 bytes; run `repack verify`)"]
