"""An object store whose answers go wrong (through ``tests.tools.s3server.FaultProxy`` in front of moto): another
range than the one asked for is an error naming the object, never another place's bytes (the token reader's
stream, an s3:// SOURCE's file reads); a lock write that was applied but whose answer was lost is still this
run's lock (its create, its heartbeat); a body cut once is asked again by `repack verify`."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("boto3")

from tests.conftest import ROOT, run_repack  # noqa: E402
from tests.tools.photos import make_photo_tree  # noqa: E402
from tests.tools.s3server import FaultProxy, MotoServer, client, s3_env  # noqa: E402

TOKENS = np.arange(50000, dtype="<u2")


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="tokens")
    s3.put_object(Bucket="tokens", Key="tok.bin", Body=TOKENS.tobytes())
    yield server
    server.stop()


def python(code: str, endpoint: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh process talking to ``endpoint`` (a process's S3 clients are made once)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, **s3_env(endpoint), "REPACK_S3_ATTEMPTS": "2"})


@pytest.mark.parametrize("fault", ["shift 2000", "ignore range"])
def test_another_range_than_asked_is_an_error_not_other_bytes(moto, fault):
    proxy = FaultProxy(moto.port, faults={"/tokens/tok.bin": [fault] * 40})
    try:
        done = python(
            "import pipelines.object_store\n"  # the tokens' range asked again once, not 5 times (0.2..3.2 s apart)
            "pipelines.object_store.RESUME_ATTEMPTS = 1\n"
            "from pipelines.torch_text import RemoteTokens\n"
            "import numpy as np\n"
            "tokens = RemoteTokens('s3://tokens/tok.bin', np.dtype('<u2'), 50000)\n"
            "try:\n"
            "    print('TOKENS', tokens[10000:10010].tolist())\n"
            "except OSError as exc:\n"
            "    print('REFUSED', exc)\n"
            "from repack.sources.s3 import open_object\n"
            "f = open_object('s3://tokens/tok.bin', 100000)\n"
            "f.seek(30000)\n"
            "try:\n"
            "    print('SOURCE', f.read(20))\n"
            "except OSError as exc:\n"
            "    print('REFUSED', exc)\n", proxy.endpoint)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("REFUSED") and "s3://tokens/tok.bin" in line for line in lines), lines


@pytest.mark.parametrize("reader", ["tokens", "source"])
def test_a_range_asked_again_after_one_wrong_answer_is_right(moto, reader):
    proxy = FaultProxy(moto.port, faults={"/tokens/tok.bin": ["shift 2000"]})
    read = ("from pipelines.torch_text import RemoteTokens\n"
            "print(RemoteTokens('s3://tokens/tok.bin', np.dtype('<u2'), 50000)[10000:10010].tolist())"
            if reader == "tokens" else
            "from repack.sources.s3 import open_object\nf = open_object('s3://tokens/tok.bin', 100000)\n"
            "f.seek(20000)\nprint(np.frombuffer(f.read(20), '<u2').tolist())")
    try:
        done = python("import numpy as np\n" + read, proxy.endpoint)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(TOKENS[10000:10010].tolist())


def test_a_lock_write_applied_with_its_answer_lost_is_still_this_runs(moto, tmp_path):
    """The lock's create answered 503 after it was applied: botocore sends it again and is refused (the object
    exists): the run said "another repack process (pid <its own>) is already running" (exit 3). A heartbeat
    likewise: the run did all its work, then said its lock was taken over and published nothing."""
    photos = tmp_path / "photos"
    make_photo_tree(photos, per_class=2, classes=2, seed=4, max_side=64)
    client(moto.endpoint).create_bucket(Bucket="locks")
    proxy = FaultProxy(moto.port, put_faults={"/locks/out/.repack/lock": ["applied 503"],
                                              "/locks/beat/.repack/lock": [None, "applied 503"]})
    try:
        done = run_repack("images", photos, "s3://locks/out", "--quiet", env=s3_env(proxy.endpoint), check=False)
        assert done.returncode == 0, done.stderr
        beat = python(
            "import time\nimport repack.store.s3_lock as s3_lock\nfrom repack.store.s3 import S3Store\n"
            "s3_lock.HEARTBEAT_S = 0.2\n"
            "lock = S3Store('s3://locks/beat').lock('lock')\n"
            "with lock:\n"
            "    time.sleep(1.5)\n"
            "    lock.check_held()\n"
            "print('HELD', lock.lost)\n", proxy.endpoint)
    finally:
        proxy.stop()
    assert "manifest.json" in {o["Key"].rpartition("/")[2] for o in
                               client(moto.endpoint).list_objects_v2(Bucket="locks", Prefix="out/")["Contents"]}
    beats = [r for r in proxy.requests if r[:2] == ("PUT", "/locks/beat/.repack/lock")]
    assert len(beats) >= 3  # the create, the beat applied and answered 503, botocore's second send (refused)
    assert beat.returncode == 0 and beat.stdout.strip() == "HELD None", beat.stderr


def test_verify_asks_again_for_a_body_cut_once(moto, tmp_path):
    photos = tmp_path / "photos"
    make_photo_tree(photos, per_class=3, classes=2, seed=5, max_side=64)
    client(moto.endpoint).create_bucket(Bucket="cuts")
    run_repack("images", photos, "s3://cuts/out", "--quiet", env=s3_env(moto.endpoint))
    proxy = FaultProxy(moto.port, faults={"/cuts/out/shard-000000.tar": ["cut"]})
    try:
        done = run_repack("verify", "s3://cuts/out", env=s3_env(proxy.endpoint), check=False)
    finally:
        proxy.stop()
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    assert proxy.cut == 1  # it said "the S3 endpoint did not answer" (exit 2), after that one GET


def test_an_answer_shorter_than_the_range_is_resumed_without_waiting(moto):
    """A ranged GET answered with half the range (its Content-Length saying so) on a kept-alive connection: the
    wire reader read on past the answer and waited the read timeout (20 s) before it resumed; the rest is asked
    for at once now."""
    proxy = FaultProxy(moto.port, faults={"/tokens/tok.bin": [None, "short"]})
    try:
        done = python("import time\nfrom pipelines import object_store\n"
                      "object_store.read_range('s3://tokens/tok.bin', 0, 1000)  # boto3's GET: the route learnt\n"
                      "started = time.monotonic()\n"
                      "data = object_store.read_range('s3://tokens/tok.bin', 20000, 60000)\n"
                      "import numpy as np\n"
                      "print(data == np.arange(50000, dtype='<u2').tobytes()[20000:60000], "
                      "round(time.monotonic() - started))",
                      proxy.endpoint)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    equal, seconds = done.stdout.split()
    assert equal == "True" and int(seconds) < 10
    assert sum(1 for r in proxy.requests if r[1] == "/tokens/tok.bin") == 3  # the half, then the rest
