"""s3:// OUT against a real S3 HTTP server on loopback (moto's server mode) with boto3, no patching:
images, text and video outputs equal the local run's bytes; verify, pull, resume after kill -9,
5xx answers retried, a second live run refused, wrong credentials and LMDB refused (exit 2)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_manifest_json, run_repack
from tests.tools.s3server import FaultProxy, MotoServer, client, objects, s3_env
from tests.tools.text import documents as make_documents, gpt2_tokenizer, write_tokenizer

SECRET = s3_env("x")["AWS_SECRET_ACCESS_KEY"]


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


@pytest.fixture
def s3(server):
    return client(server.endpoint)


def env_for(endpoint: str, tmp_path: Path) -> dict:
    return {**s3_env(endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}


def dataset_files(objs: dict[str, bytes]) -> dict[str, bytes]:
    """The dataset's files (no job state, no manifest: its run section holds timings)."""
    return {k: v for k, v in objs.items() if not k.startswith(".repack/") and k != "manifest.json"}


def stable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in ("run", "created_by")}


def local_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and ".repack" not in p.parts and p.name != "manifest.json"}


def tokenizer_and_corpus(tmp_path: Path, documents: int, seed: int) -> tuple[Path, Path]:
    """The GPT-2 tokenizer folder and a JSON-lines corpus of generated documents."""
    folder = tmp_path / "tok"
    write_tokenizer(gpt2_tokenizer(), folder)
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_documents(documents, seed=seed)))
    return folder, src


def test_images_to_s3_equal_local_then_verify_pull_and_repair(server, s3, photo_tree, packed_photos, tmp_path):
    env = env_for(server.endpoint, tmp_path)
    s3.create_bucket(Bucket="imgs")
    proc = run_repack("images", photo_tree, "s3://imgs/run/", "--shard-size", "25", env=env)
    assert "manifest: s3://imgs/run/manifest.json" in proc.stderr + proc.stdout
    objs = objects(s3, "imgs", "run")
    assert dataset_files(objs) == local_files(packed_photos)
    manifest = json.loads(objs["manifest.json"])
    assert stable(manifest) == stable(read_manifest_json(packed_photos))
    assert not any(SECRET.encode() in data for data in objs.values())  # credentials never written
    head = s3.head_object(Bucket="imgs", Key="run/shard-000000.tar")
    assert head["Metadata"]["sha256"] == manifest["shards"][0]["sha256"]

    assert "OK" in run_repack("verify", "s3://imgs/run", env=env).stdout
    pulled = tmp_path / "pulled"
    run_repack("pull", "s3://imgs/run", pulled, env=env)
    assert local_files(pulled) == local_files(packed_photos)
    assert run_repack("verify", pulled).returncode == 0

    s3.put_object(Bucket="imgs", Key="run/shard-000001.tar", Body=b"\0" * 1024)
    bad = run_repack("verify", "s3://imgs/run", env=env, check=False)
    assert bad.returncode == 5 and "shard-000001.tar" in bad.stderr
    refused = run_repack("pull", "s3://imgs/run", tmp_path / "pulled2", env=env, check=False)
    assert refused.returncode == 5 and "shard-000001.tar" in refused.stderr
    assert not (tmp_path / "pulled2" / "manifest.json").exists()
    again = run_repack("images", photo_tree, "s3://imgs/run", "--shard-size", "25", env=env)
    assert "1 task(s) run, 4 resumed" in again.stdout  # the damaged shard is redone, the rest resumed
    assert dataset_files(objects(s3, "imgs", "run")) == local_files(packed_photos)
    assert "nothing to do" in run_repack("images", photo_tree, "s3://imgs/run", "--shard-size", "25", env=env).stdout


def test_second_live_run_refused_and_stale_lock_taken_over(server, s3, photo_tree, tmp_path):
    env = env_for(server.endpoint, tmp_path)
    s3.create_bucket(Bucket="locks")
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "heartbeat": time.time()}
    s3.put_object(Bucket="locks", Key="run/.repack/lock", Body=json.dumps(holder).encode())
    proc = run_repack("images", photo_tree, "s3://locks/run", "--quiet", env=env, check=False)
    assert proc.returncode == 3 and f"pid {os.getpid()}" in proc.stderr
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder["pid"] = int(dead.stdout)  # a killed run on this host: its lock is taken over at once
    s3.put_object(Bucket="locks", Key="run/.repack/lock", Body=json.dumps(holder).encode())
    run_repack("images", photo_tree, "s3://locks/run", "--quiet", env=env)
    assert "run/.repack/lock" not in {o["Key"] for o in s3.list_objects_v2(Bucket="locks")["Contents"]}
    elsewhere = {"pid": 1, "host": "another-host", "started": 0, "heartbeat": time.time()}
    s3.put_object(Bucket="locks", Key="run/.repack/lock", Body=json.dumps(elsewhere).encode())
    proc = run_repack("images", photo_tree, "s3://locks/run", "--quiet", env=env, check=False)
    assert proc.returncode == 3 and "another-host" in proc.stderr  # alive elsewhere: refused
    elsewhere["heartbeat"] = time.time() - 3600  # its host's clock an hour behind: the server wrote it just now
    s3.put_object(Bucket="locks", Key="run/.repack/lock", Body=json.dumps(elsewhere).encode())
    proc = run_repack("images", photo_tree, "s3://locks/run", "--quiet", env=env, check=False)
    assert proc.returncode == 3 and "another-host" in proc.stderr  # staleness is the server's clock, not the holder's
    same_name = {**holder, "pid": 1, "pidns": 1}  # this host's name, another pid namespace (a container): alive
    s3.put_object(Bucket="locks", Key="run/.repack/lock", Body=json.dumps(same_name).encode())
    proc = run_repack("images", photo_tree, "s3://locks/run", "--quiet", env=env, check=False)
    assert proc.returncode == 3
    s3.put_object(Bucket="locks", Key="run/.repack/lock", Body=json.dumps(elsewhere).encode())
    time.sleep(3)  # not refreshed for 3 s by the server's clock, past a 2 s limit: a dead run, taken over
    done = run_repack("images", photo_tree, "s3://locks/run", env={**env, "REPACK_S3_STALE_LOCK_S": "2"})
    assert "nothing to do" in done.stdout


def test_a_run_whose_lock_was_taken_over_publishes_nothing_and_leaves_the_new_lock(server, s3, monkeypatch, endpoint):
    """A holder whose heartbeat stalled past the limit loses its lock to another run: its next heartbeat is refused
    (a PUT conditional on the ETag it wrote), it publishes nothing, and its exit does not delete the new lock."""
    from repack.errors import JobLockedError
    from repack.store.s3 import S3Store
    from repack.store.s3_lock import ObjectLock

    import repack.store.s3_lock as s3_lock

    endpoint(server.endpoint)  # this process's clients for this server, forgotten after the test
    monkeypatch.setattr(s3_lock, "HEARTBEAT_S", 0.2)
    s3.create_bucket(Bucket="lost")
    store = S3Store("s3://lost/ds")
    theirs = b'{"token": "another run", "host": "elsewhere"}'
    with ObjectLock(store, ".repack/lock") as lock:
        time.sleep(0.5)
        store.check_lock()  # held, refreshed by its heartbeats
        s3.put_object(Bucket="lost", Key="ds/.repack/lock", Body=theirs)  # taken over
        deadline = time.time() + 10
        while lock.lost is None and time.time() < deadline:  # the next heartbeat's conditional PUT is refused
            time.sleep(0.05)
        assert lock.lost and s3.get_object(Bucket="lost", Key="ds/.repack/lock")["Body"].read() == theirs
        with pytest.raises(JobLockedError, match="taken over by another run"):
            store.check_lock()
    assert s3.get_object(Bucket="lost", Key="ds/.repack/lock")["Body"].read() == theirs  # not deleted at exit
    with pytest.raises(JobLockedError, match="elsewhere"):  # the other run's lock: refused while it may live
        with ObjectLock(store, ".repack/lock"):
            pass



def test_other_options_refused_unless_overwrite(server, s3, photo_tree, tmp_path):
    env = env_for(server.endpoint, tmp_path)
    s3.create_bucket(Bucket="over")
    run_repack("images", photo_tree, "s3://over/run", "--shard-size", "25", "--quiet", env=env)
    refused = run_repack("images", photo_tree, "s3://over/run", "--shard-size", "60", env=env, check=False)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    run_repack("images", photo_tree, "s3://over/run", "--shard-size", "60", "--overwrite", "--quiet", env=env)
    objs = objects(s3, "over", "run")
    assert sorted(k for k in dataset_files(objs)) == ["shard-000000.crc", "shard-000000.idx", "shard-000000.tar",
                                                      "shard-000001.crc", "shard-000001.idx", "shard-000001.tar"]
    assert sorted(k for k in objs if k.startswith(".repack/tasks/")) == [".repack/tasks/shard-000000.json",
                                                                       ".repack/tasks/shard-000001.json"]


def test_lmdb_and_wrong_credentials_are_clear_errors(server, photo_tree, tmp_path):
    env = env_for(server.endpoint, tmp_path)
    proc = run_repack("images", photo_tree, "s3://imgs/lmdb", "--to", "lmdb", env=env, check=False)
    assert proc.returncode == 2 and "--to lmdb" in proc.stderr and "Traceback" not in proc.stderr
    strict = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # checks every request's credentials
    try:
        proc = run_repack("images", photo_tree, "s3://imgs/x", env=env_for(strict.endpoint, tmp_path), check=False)
    finally:
        strict.stop()
    assert proc.returncode == 2 and "access refused" in proc.stderr and "Traceback" not in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    proc = run_repack("images", photo_tree, "s3://no-such-bucket/x", env=env, check=False)
    assert proc.returncode == 2 and "bucket does not exist" in proc.stderr


def kill_after_objects(args: list, env: dict, s3, bucket: str, prefix: str, count: int) -> None:
    """Start `repack ARGS`; SIGKILL it (and its workers) once ``count`` task records are in the store."""
    proc = subprocess.Popen([sys.executable, "-m", "repack", *map(str, args)], cwd=ROOT, env={**os.environ, **env},
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/.repack/tasks/").get("KeyCount", 0)
        if listed >= count:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kill_during_upload_then_resume_is_identical(server, s3, photo_tree, tmp_path):
    env = env_for(server.endpoint, tmp_path)
    s3.create_bucket(Bucket="kill")
    args = ["images", photo_tree, "--shard-size", "6", "--workers", "2", "--quiet"]
    run_repack(*args[:2], tmp_path / "ref", *args[2:])  # the same options' local run (its files equal an s3:// run's)
    kill_after_objects([*args[:2], "s3://kill/run", *args[2:]], env, s3, "kill", "run", 4)
    assert "manifest.json" not in objects(s3, "kill", "run")
    resumed = run_repack(*args[:2], "s3://kill/run", *args[2:], env=env).stdout
    assert int(re.search(r"(\d+) resumed", resumed).group(1)) >= 4  # only the missing tasks are redone
    ref, run = local_files(tmp_path / "ref"), objects(s3, "kill", "run")
    assert dataset_files(run) == ref and len(ref) == 60  # 20 x .tar, .idx, .crc
    assert stable(json.loads(run["manifest.json"])) == stable(read_manifest_json(tmp_path / "ref"))
    assert not s3.list_multipart_uploads(Bucket="kill").get("Uploads")


def test_chunked_shards_on_s3_then_kill_and_resume_on_another_machine(server, s3, photo_tree, packed_photos,
                                                                      tmp_path):
    """Shards assembled from chunk tasks equal the local run's; on the local pool the chunk pieces
    stay in the scratch (a shard is uploaded once), so a run killed mid-way and resumed from an
    empty scratch (another machine) redoes the chunks it cannot find and still gives the same bytes."""
    env = env_for(server.endpoint, tmp_path)
    s3.create_bucket(Bucket="chunks")
    args = ["--shard-size", "25", "--chunk-size", "4", "--workers", "2", "--quiet"]
    run_repack("images", photo_tree, "s3://chunks/ref", *args, env=env)
    ref = objects(s3, "chunks", "ref")
    assert dataset_files(ref) == local_files(packed_photos)
    assert stable(json.loads(ref["manifest.json"])) == stable(read_manifest_json(packed_photos))
    assert not [k for k in ref if k.startswith(".repack/segments/")]
    assert ".repack/tasks/shard-000000.json" in ref  # the shard's record (it replaced its chunks' records)
    assert len(json.loads(ref[".repack/tasks/shard-000000.json"])["segments"]) == 7  # 25 inputs in chunks of 4

    run = ["images", photo_tree, "s3://chunks/run", *args]
    kill_after_objects(run, {**env, "REPACK_SCRATCH": str(tmp_path / "first")}, s3, "chunks", "run", 2)  # 2 of 4 shard records
    killed = objects(s3, "chunks", "run")
    assert "manifest.json" not in killed and not [k for k in killed if k.startswith(".repack/segments/")]
    run_repack(*run, env={**env, "REPACK_SCRATCH": str(tmp_path / "second")})
    objs = objects(s3, "chunks", "run")
    assert dataset_files(objs) == local_files(packed_photos)
    assert stable(json.loads(objs["manifest.json"])) == stable(read_manifest_json(packed_photos))


def test_5xx_answers_are_retried(server, s3, photo_tree, tmp_path):
    # 2 shards, not 5: the same kinds of request (two tasks side by side), each 503 still one in 3, but ~70
    # requests instead of ~130, as each 503 costs botocore's backoff sleep (~0.5 s)
    s3.create_bucket(Bucket="flaky")
    local = tmp_path / "local"
    run_repack("images", photo_tree, local, "--shard-size", "60", "--quiet")
    proxy = FaultProxy(server.port, every=3)
    try:
        run_repack("images", photo_tree, "s3://flaky/run", "--shard-size", "60", "--quiet",
                   env=env_for(proxy.endpoint, tmp_path))
        assert run_repack("verify", "s3://flaky/run", env=env_for(proxy.endpoint, tmp_path)).returncode == 0
    finally:
        proxy.stop()
    assert proxy.failed >= 5
    assert len([k for k in dataset_files(objects(s3, "flaky", "run")) if k.endswith(".tar")]) == 2
    assert dataset_files(objects(s3, "flaky", "run")) == local_files(local)  # the same options' local run


def test_text_to_s3_equals_local_merged_and_parts(server, s3, tmp_path):
    folder, src = tokenizer_and_corpus(tmp_path, documents=200, seed=5)
    s3.create_bucket(Bucket="text")
    env = env_for(server.endpoint, tmp_path)
    for extra in ([], ["--no-merge"]):
        common = ["--tokenizer", folder, "--chunk-bytes", "20KB", "--quiet", *extra]
        local = tmp_path / f"local{len(extra)}"
        run_repack("text", src, local, *common)
        run_repack("text", src, f"s3://text/run{len(extra)}", *common, env=env)
        objs = objects(s3, "text", f"run{len(extra)}")
        assert dataset_files(objs) == local_files(local)
        assert not [k for k in objs if k.startswith(".repack/parts/")]  # merged parts are removed
        assert run_repack("verify", f"s3://text/run{len(extra)}", env=env).returncode == 0
    shutil.rmtree(tmp_path / "scratch")  # another machine: the scratch is gone, the store has it all
    again = run_repack("text", src, "s3://text/run0", "--tokenizer", folder, "--chunk-bytes", "20KB", env=env)
    assert "nothing to do" in again.stdout


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
def test_video_to_s3_equals_local(server, s3, tmp_path):
    from tests.tools.videos import CLIPS, make_clips

    src = tmp_path / "src"
    make_clips(src, [c for c in CLIPS if c.rel in ("good/h264.mp4", "good/mjpeg.avi")], workers=2)
    s3.create_bucket(Bucket="video")
    common = ["--transcode", "--to", "webdataset", "--shard-size", "1", "--preset", "ultrafast", "--quiet"]
    run_repack("video", src, tmp_path / "local", *common)
    run_repack("video", src, "s3://video/run", *common, env=env_for(server.endpoint, tmp_path))
    objs = objects(s3, "video", "run")
    assert dataset_files(objs) == local_files(tmp_path / "local")
    assert hashlib.sha256(objs["probe.jsonl"]).digest() == hashlib.sha256((tmp_path / "local" / "probe.jsonl")
                                                                          .read_bytes()).digest()


def test_static_partitions_then_merge_on_s3(server, s3, photo_tree, packed_photos, tmp_path):
    env = env_for(server.endpoint, tmp_path)
    s3.create_bucket(Bucket="parts")
    for rank in range(2):
        proc = run_repack("images", photo_tree, "s3://parts/run", "--shard-size", "25", "--num-nodes", "2",
                          "--node-rank", str(rank), env={**env, "REPACK_SCRATCH": str(tmp_path / f"node{rank}")})
        assert "repack merge s3://parts/run" in proc.stdout + proc.stderr
    assert "manifest.json" not in objects(s3, "parts", "run")
    run_repack("merge", "s3://parts/run", "--quiet", env={**env, "REPACK_SCRATCH": str(tmp_path / "merger")})
    objs = objects(s3, "parts", "run")
    assert dataset_files(objs) == local_files(packed_photos)
    assert stable(json.loads(objs["manifest.json"])) == stable(read_manifest_json(packed_photos))


def test_text_partitions_on_separate_machines_then_merge(server, s3, tmp_path):
    """Each node has its own scratch; the merging node has none: it fetches the parts from the store."""
    folder, src = tokenizer_and_corpus(tmp_path, documents=120, seed=7)
    s3.create_bucket(Bucket="textparts")
    env = env_for(server.endpoint, tmp_path)
    common = ["--tokenizer", folder, "--chunk-bytes", "10KB", "--quiet"]
    run_repack("text", src, tmp_path / "local", *common)
    for rank in range(2):
        run_repack("text", src, "s3://textparts/run", *common, "--num-nodes", "2", "--node-rank", str(rank),
                   env={**env, "REPACK_SCRATCH": str(tmp_path / f"node{rank}")})
    run_repack("merge", "s3://textparts/run", "--quiet", env={**env, "REPACK_SCRATCH": str(tmp_path / "merger")})
    objs = objects(s3, "textparts", "run")
    assert dataset_files(objs) == local_files(tmp_path / "local")
    assert not [k for k in objs if k.startswith(".repack/parts/")]


def test_ray_executor_to_s3_equals_local(server, s3, photo_tree, packed_photos, tmp_path):
    pytest.importorskip("ray")
    s3.create_bucket(Bucket="ray")
    # chunked shards: on Ray the pieces travel through the store (the driver may not share a worker's scratch)
    run_repack("images", photo_tree, "s3://ray/run", "--shard-size", "25", "--chunk-size", "4", "--executor", "ray",
               "--workers", "2", "--quiet", env=env_for(server.endpoint, tmp_path))
    objs = objects(s3, "ray", "run")
    assert dataset_files(objs) == local_files(packed_photos)
    assert len(json.loads(objs[".repack/tasks/shard-000000.json"])["segments"]) == 7  # assembled from 7 chunks
    assert not [k for k in objs if k.startswith(".repack/segments/")]
    assert json.loads(objs["manifest.json"])["run"]["executor"] == "ray"


def test_a_manifest_over_the_cap_is_named_by_its_url_and_not_published(server, s3, photo_tree, tmp_path):
    s3.create_bucket(Bucket="capped")
    env = {**env_for(server.endpoint, tmp_path), "REPACK_MAX_MANIFEST_BYTES": "1000"}
    proc = run_repack("images", photo_tree, "s3://capped/ds", "--shard-size", "60", "--quiet", env=env, check=False)
    assert proc.returncode == 5, proc.stderr
    assert proc.stderr.startswith("repack: error: s3://capped/ds/manifest.json: the manifest would be "), proc.stderr
    assert "manifest.json" not in objects(s3, "capped", "ds")
