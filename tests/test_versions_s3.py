"""A dataset over time with OUT on s3:// (moto's S3 server on loopback, real boto3): append, remove
and gc under the store's lock give the same dataset files as the same steps on a local folder."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import add_inputs, make_source
from tests.tools.s3server import MotoServer, client, objects, s3_env


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def same_step_same_files(step, local, url: str, env: dict, s3, number: int) -> dict[str, bytes]:
    """Run ``step`` on the folder and on ``url``; both hold the same dataset files (manifests: the same
    shards and version; their run sections hold timings). The objects under ``url``, job state aside."""
    run_repack(*step(local))
    run_repack(*step(url), env=env)
    bucket, _, prefix = url[len("s3://"):].partition("/")
    remote = {k: v for k, v in objects(s3, bucket, prefix).items() if not k.startswith(".repack/")}
    here = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*")
            if p.is_file() and ".repack" not in p.relative_to(local).parts}
    assert remote.keys() == here.keys(), number
    for name, data in here.items():
        if name.startswith("manifest"):
            mine, theirs = json.loads(data), json.loads(remote[name])
            mine.pop("run"), theirs.pop("run")
            mine["created_by"].pop("command", None), theirs["created_by"].pop("command", None)
            assert mine.keys() == theirs.keys()
            assert mine["shards"] == theirs["shards"] and mine.get("dataset_version", {}).get("number") == \
                theirs.get("dataset_version", {}).get("number")
        else:
            assert remote[name] == data, name
    assert run_repack("verify", url, env=env).returncode == 0
    return remote


def test_append_remove_gc_on_s3_equal_local(server, tmp_path):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="nightly")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    src, local, url = make_source(tmp_path / "src"), tmp_path / "local", "s3://nightly/ds"
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\ncat/new0.jpg\n")
    steps = [lambda out: ("images", src, out, "--shard-size", "4", "--quiet"),
             lambda out: ("images", src, out, "--shard-size", "4", "--append", "--quiet"),
             lambda out: ("remove", out, "--sources", tmp_path / "takedown.txt", "--quiet"),
             lambda out: ("gc", out, "--keep", "1")]
    removed = (src / "cat" / "c1.jpg").read_bytes()
    for number, step in enumerate(steps):
        if number == 1:
            add_inputs(src)
            removed_new = (src / "cat" / "new0.jpg").read_bytes()
        remote = same_step_same_files(step, local, url, env, s3, number)
    assert json.loads(remote["manifest.json"])["dataset_version"]["number"] == 3
    every = objects(s3, "nightly", "ds")
    assert not any(removed in blob or removed_new in blob for blob in every.values())
    state = sorted(key for key in every if key.startswith(".repack/"))  # version 1's plan and task records gone too
    assert ".repack/inputs-v3.npz" in state and not any(key.startswith((".repack/plan", ".repack/tasks/"))
                                                        for key in state), state


def test_text_append_remove_gc_and_video_append_on_s3_equal_local(server, tmp_path):
    from tests.test_video_append import X264, clip
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="corpora")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    corpus, tok = tmp_path / "corpus", tmp_path / "tok"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    docs = documents(20, seed=5)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:12]))
    (tmp_path / "keys.txt").write_text("a.jsonl#2\nb.jsonl#1\n")
    steps = [lambda out: ("text", corpus, out, "--tokenizer", tok, "--quiet"),
             lambda out: ("text", corpus, out, "--tokenizer", tok, "--append", "--quiet"),
             lambda out: ("remove", out, "--keys", tmp_path / "keys.txt", "--quiet"),
             lambda out: ("gc", out, "--keep", "1")]
    for number, step in enumerate(steps):
        if number == 1:
            (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[12:]))
        remote = same_step_same_files(step, tmp_path / "text", "s3://corpora/text", env, s3, number)
    assert sorted(name for name in remote if name.endswith(".bin")) == ["text_document-v2-v3.bin",
                                                                         "text_document-v3.bin"]
    videos = tmp_path / "videos"
    clip(videos / "x/first.mp4", X264)
    steps = [lambda out: ("video", videos, out, "--probe", "--transcode", "--to", "webdataset", "--quiet"),
             lambda out: ("video", videos, out, "--probe", "--transcode", "--to", "webdataset", "--append",
                          "--quiet")]
    for number, step in enumerate(steps):
        if number == 1:
            clip(videos / "x/second.mp4", X264, seed=1)
        remote = same_step_same_files(step, tmp_path / "video", "s3://corpora/video", env, s3, number)
    assert "videos-v2/x/second.mp4" in remote and "shard-v2-000000.tar" in remote


def upload(s3, bucket: str, root, prefix: str) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root).as_posix()}", Body=path.read_bytes())


def test_an_object_rewritten_with_other_bytes_of_its_size_is_refused_by_append_and_one_uploaded_again_is_not(
        server, tmp_path):
    """An s3:// SOURCE's fingerprint holds each object's ETag (``repack.sources.object_etag``): an object
    put again with its own bytes adds nothing; one rewritten with other bytes of the same size is refused
    by name, for images and for text (its size alone let --append keep the old sample silently)."""
    from tests.tools.text import gpt2_tokenizer, write_tokenizer
    from tests.test_images_job import jpeg_bytes

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="etags")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    upload(s3, "etags", make_source(tmp_path / "src"), "img")
    texts = tmp_path / "texts"
    for i in range(4):
        (texts / f"d{i}").mkdir(parents=True)
        (texts / f"d{i}" / "doc.txt").write_text(f"document {i} says hello world.\n" * 3)
    upload(s3, "etags", texts, "txt")
    tokenizer = write_tokenizer(gpt2_tokenizer(), tmp_path / "gpt2")
    images, text = tmp_path / "images", tmp_path / "text"
    run_repack("images", "s3://etags/img", images, "--quiet", env=env)
    run_repack("text", "s3://etags/txt", text, "--tokenizer", tokenizer, "--doc-per", "file", "--quiet", env=env)

    def put(key: str, body: bytes) -> None:
        s3.put_object(Bucket="etags", Key=key, Body=body)

    put("img/cat/c0.jpg", (tmp_path / "src" / "cat" / "c0.jpg").read_bytes())  # the same bytes, put again
    put("img/cat/late.jpg", jpeg_bytes(seed=77))
    put("txt/d0/doc.txt", (texts / "d0" / "doc.txt").read_bytes())
    put("txt/d9/doc.txt", b"a later document.\n")
    run_repack("images", "s3://etags/img", images, "--append", "--quiet", env=env)
    run_repack("text", "s3://etags/txt", text, "--tokenizer", tokenizer, "--doc-per", "file", "--append", "--quiet",
               env=env)
    assert read_manifest_json(images)["totals"]["samples"] == 9 + 1
    assert read_manifest_json(text)["dataset_version"]["number"] == 2

    cat = bytearray((tmp_path / "src" / "cat" / "c1.jpg").read_bytes())
    cat[-3] ^= 0x5A  # other bytes, the same size
    put("img/cat/c1.jpg", bytes(cat))
    put("img/cat/later.jpg", jpeg_bytes(seed=78))
    put("txt/d1/doc.txt", (texts / "d1" / "doc.txt").read_bytes().replace(b"hello", b"HELLO"))
    refused = run_repack("images", "s3://etags/img", images, "--append", "--quiet", env=env, check=False)
    assert refused.returncode != 0 and "changed since the dataset packed them" in refused.stderr
    assert "cat/c1.jpg" in refused.stderr and read_manifest_json(images)["totals"]["samples"] == 10
    refused = run_repack("text", "s3://etags/txt", text, "--tokenizer", tokenizer, "--doc-per", "file", "--append",
                         "--quiet", env=env, check=False)
    assert refused.returncode != 0 and "d1/doc.txt" in refused.stderr and "changed since" in refused.stderr
    assert read_manifest_json(text)["dataset_version"]["number"] == 2


def test_a_webdataset_source_on_s3_rewritten_with_other_bytes_of_its_size_is_refused_by_append(server, tmp_path):
    """`--from webdataset` from s3://: a tar shard's fingerprint holds its ETag too (it was its size alone:
    a shard rewritten with another sample of the same size kept the old sample silently)."""
    import io
    import tarfile

    from tests.benchmarks.tiny_files import jpeg_bytes

    def shard(seeds) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, seed in enumerate(seeds):
                for ext, data in (("jpg", jpeg_bytes(seed)), ("cls", str(i % 2).encode())):
                    info = tarfile.TarInfo(f"{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    seeds = next((a, b) for a in range(40) for b in range(40) if a != b and len(jpeg_bytes(a)) == len(jpeg_bytes(b)))
    old, new = shard([seeds[0], 101, 102]), shard([seeds[1], 101, 102])
    assert len(old) == len(new) and old != new
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="wds")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    s3.put_object(Bucket="wds", Key="src/train-000.tar", Body=old)
    out = tmp_path / "out"
    run_repack("images", "s3://wds/src", out, "--from", "webdataset", "--quiet", env=env)
    s3.put_object(Bucket="wds", Key="src/train-000.tar", Body=old)  # the same bytes again: nothing new
    assert "nothing new" in run_repack("images", "s3://wds/src", out, "--from", "webdataset", "--append",
                                       env=env).stdout
    s3.put_object(Bucket="wds", Key="src/train-000.tar", Body=new)
    refused = run_repack("images", "s3://wds/src", out, "--from", "webdataset", "--append", "--quiet", env=env,
                         check=False)
    assert refused.returncode == 2 and "train-000.tar/000.jpg" in refused.stderr and "changed since" in refused.stderr


def test_an_append_after_a_killed_remove_on_s3_publishes_both_and_leaves_no_probe(server, tmp_path):
    """A remove killed between manifest.v3.json and manifest.json leaves version 3 pending: the next --append
    publishes it, then version 4 (on s3:// the check of the pending version listed the prefix first, and the
    staged shards, written by another store object, were "gone"). A command killed between its write probe's
    PUT and DELETE leaves the probe, which the next command removes."""
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="pending")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    src, url = make_source(tmp_path / "src"), "s3://pending/ds"
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\n")
    run_repack("images", src, url, "--shard-size", "4", "--quiet", env=env)
    run_repack("remove", url, "--sources", tmp_path / "takedown.txt", "--quiet", env=env)
    s3.copy_object(Bucket="pending", Key="ds/manifest.json", CopySource={"Bucket": "pending", "Key": "ds/manifest.v1.json"})
    s3.put_object(Bucket="pending", Key="ds/.repack/.write-probe-elsewhere-1", Body=b"")
    add_inputs(src)
    run_repack("images", src, url, "--shard-size", "4", "--append", "--quiet", env=env)
    manifest = json.loads(objects(s3, "pending", "ds")["manifest.json"])
    assert manifest["dataset_version"]["number"] == 3 and manifest["dataset_version"]["change"]["kind"] == "append"
    assert "cat/c1.jpg" not in json.dumps(manifest["shards"]) and run_repack("verify", url, env=env).returncode == 0
    assert not [key for key in objects(s3, "pending", "ds") if ".write-probe-" in key]


def test_a_move_above_the_single_copy_limit_goes_in_parts_with_its_digest(server, tmp_path, endpoint, monkeypatch):
    """S3 copies at most 5 GiB in one CopyObject: a larger file an --append moves into place is copied in parts
    (here the limit is lowered to 1 MiB), with its bytes and its sha256 metadata, and the source deleted."""
    import hashlib

    from repack.store import s3 as s3_store
    from repack.store import s3_client

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="moves")
    endpoint(server.endpoint)
    monkeypatch.setattr(s3_store, "SINGLE_COPY_BYTES", 1 << 20)
    monkeypatch.setattr(s3_client, "MULTIPART_BYTES", 5 << 20)  # S3's smallest part
    store = s3_store.S3Store("s3://moves/ds")
    data = bytes(range(256)) * (6 << 12)  # 6 MiB: two parts
    (tmp_path / "big").write_bytes(data)
    store.publish("staged/big.bin", tmp_path / "big")
    store.move("staged/big.bin", "big-v2.bin")
    head = s3.head_object(Bucket="moves", Key="ds/big-v2.bin")
    assert head["ETag"].strip('"').endswith("-2")  # a copy in two parts
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert objects(s3, "moves", "ds") == {"big-v2.bin": data}


def test_a_move_asks_again_through_failing_answers(server, tmp_path, endpoint):
    """The server-side copy that moves a file into place rides out 5xx answers as every other request of the store
    does (it was one bare request: a traceback, exit 1, after botocore's own attempts)."""
    from repack.lifecycle.publish import move
    from repack.store.s3 import S3Store
    from tests.tools.s3server import FaultProxy

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="flaky")
    proxy = FaultProxy(server.port, put_faults={"/flaky/ds/moved.bin": [500] * 4})
    try:
        endpoint(proxy.endpoint)
        store = S3Store("s3://flaky/ds")
        store.put_bytes("staged.bin", b"payload")
        move(store, "staged.bin", "moved.bin")
    finally:
        proxy.stop()
    assert objects(s3, "flaky", "ds") == {"moved.bin": b"payload"} and not proxy.put_faults["/flaky/ds/moved.bin"]


def test_sources_named_by_whole_paths_are_removed_from_s3_and_text_datasets(server, tmp_path):
    """`repack remove --sources` takes a source's whole path: ``s3://bucket/prefix/cat/c1.jpg`` for an s3://
    SOURCE's ``cat/c1.jpg``, and a text dataset's ``/path/to/texts/d1/doc.txt`` for ``d1/doc.txt``."""
    from tests.conftest import sample_paths
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="whole")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    upload(s3, "whole", make_source(tmp_path / "src"), "img")
    images = tmp_path / "images"
    run_repack("images", "s3://whole/img", images, "--quiet", env=env)
    before = sorted(sample_paths(images))
    (tmp_path / "takedown.txt").write_text(f"s3://whole/img/{before[0]}\ns3://other/img/{before[1]}\n")
    done = run_repack("remove", images, "--sources", tmp_path / "takedown.txt", env=env)
    assert "1 sample(s) removed, 1 name(s) not found" in done.stdout + done.stderr
    assert sorted(sample_paths(images)) == before[1:]
    texts, text = tmp_path / "texts", tmp_path / "text"
    for i in range(3):
        (texts / f"d{i}").mkdir(parents=True)
        (texts / f"d{i}" / "doc.txt").write_text(f"document {i} says hello world.\n" * 3)
    tokenizer = write_tokenizer(gpt2_tokenizer(), tmp_path / "gpt2")
    run_repack("text", texts, text, "--tokenizer", tokenizer, "--doc-per", "file", "--quiet")
    (tmp_path / "docs.txt").write_text(f"{texts}/d1/doc.txt\n")
    done = run_repack("remove", text, "--sources", tmp_path / "docs.txt")
    assert "1 sample(s) removed, 0 name(s) not found" in done.stdout + done.stderr, done.stdout + done.stderr
    assert run_repack("verify", text).returncode == 0


def test_quarantine_side_files_on_s3_equal_local(server, tmp_path, monkeypatch):
    """Quarantine records beyond the listed one (``REPACK_QUARANTINE_LISTED=1``) in each version's side file: the
    same files on s3:// as on a folder through a pack, an append and a remove; inspect reads every record there."""
    from tests.test_quarantine_records import bad_inputs

    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="crawl")
    monkeypatch.setenv("REPACK_QUARANTINE_LISTED", "1")  # both runs of each step
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    src, local, url = make_source(tmp_path / "src"), tmp_path / "local", "s3://crawl/ds"
    bad_inputs(src / "cat", 3)
    (tmp_path / "takedown.txt").write_text("cat/bad1.jpg\n")
    steps = [lambda out: ("images", src, out, "--quiet"),
             lambda out: ("images", src, out, "--append", "--quiet"),
             lambda out: ("remove", out, "--sources", tmp_path / "takedown.txt", "--quiet")]
    for number, step in enumerate(steps):
        if number == 1:
            bad_inputs(src / "emu", 2, "e")
        remote = same_step_same_files(step, local, url, env, s3, number)
    assert {name for name in remote if name.endswith(".records")} == \
        {"quarantine.records", "quarantine-v2.records", "quarantine-v3.records"}
    listed = [json.loads(line) for line in run_repack("inspect", url, "--quarantine", env=env).stdout.splitlines()]
    assert [r["source"] for r in listed] == ["cat/bad0.jpg", "cat/bad2.jpg", "emu/e0.jpg", "emu/e1.jpg"]
    pulled = tmp_path / "pulled"
    run_repack("pull", url, pulled, env=env)
    assert (pulled / "quarantine-v3.records").read_bytes() == remote["quarantine-v3.records"]
    assert run_repack("verify", pulled).returncode == 0
