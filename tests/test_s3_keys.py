"""The right object for each key (issue 21, item 5), against a real S3 HTTP server on loopback: under
a bucket-root source a key with a leading '/' or a '//' is quarantined with a reason, never read as
another key nor given an empty class; hidden and '..' objects are skipped and counted as a folder
scan counts them; a failing s3:// SOURCE fails before OUT holds anything, naming the URL."""

from __future__ import annotations

import hashlib

import pytest

from repack.sources.object_etag import etag_value
from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes, png_bytes
from tests.tools.s3server import MotoServer, client, s3_env


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def tree() -> dict[str, bytes]:
    """A labeled tree with a hidden file and a hidden folder (two objects in it)."""
    return {"cat/a.jpg": jpeg_bytes(seed=1), "cat/b.jpg": jpeg_bytes(seed=2), "dog/c.jpg": jpeg_bytes(seed=3),
            "cat/.hidden.jpg": jpeg_bytes(seed=4), ".git/x.jpg": jpeg_bytes(seed=5), ".git/y.jpg": jpeg_bytes(seed=6)}


def put_all(server, bucket: str, objects: dict[str, bytes]) -> None:
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket=bucket)
    for key, data in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    listed = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert listed == set(objects)  # the server keeps every key as given, '/' and '//' included


def test_skipped_objects_are_counted_as_a_folder_scan_counts_them(server, tmp_path):
    objects = tree()
    folder = tmp_path / "src"
    for rel, data in objects.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    put_all(server, "same-tree", objects)
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    run_repack("images", folder, tmp_path / "local", "--quiet")
    run_repack("images", "s3://same-tree", tmp_path / "remote", "--quiet", env=env)
    local, remote = read_manifest_json(tmp_path / "local"), read_manifest_json(tmp_path / "remote")
    assert remote["totals"]["skipped_junk"] == local["totals"]["skipped_junk"] == 2
    assert remote["classes"] == local["classes"] == {"cat": 0, "dog": 1}
    assert remote["totals"]["samples"] == local["totals"]["samples"] == 3


def test_keys_that_name_no_file_are_quarantined_never_read_as_another_key(server, tmp_path):
    objects = {**tree(), "/cat/a.jpg": png_bytes(), "dog//d.jpg": jpeg_bytes(seed=7),
               "dog/../e.jpg": jpeg_bytes(seed=8), "cat/f/": jpeg_bytes(seed=9), "dog/": b""}
    put_all(server, "odd-keys", objects)
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    out = tmp_path / "out"
    run_repack("images", "s3://odd-keys", out, "--quiet", env=env)
    manifest = read_manifest_json(out)
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert set(reasons) == {"/cat/a.jpg", "dog//d.jpg", "cat/f/"}  # an empty folder marker ("dog/") is no input
    assert all("empty path part" in reason and "not read" in reason for rel, reason in reasons.items() if rel != "cat/f/")
    assert reasons["cat/f/"].startswith("object key 'cat/f/' ends in '/' and holds ")  # bytes under a marker
    assert manifest["classes"] == {"cat": 0, "dog": 1}  # no class "" from "dog//d.jpg"
    assert manifest["totals"]["samples"] == 3 and manifest["totals"]["skipped_junk"] == 3  # + "dog/.."
    assert manifest["fields"].get("png") is None  # the PNG under "/cat/a.jpg" was never packed as cat/a.jpg


@pytest.mark.parametrize("source,said", [("s3://no-such-bucket/photos", "the bucket does not exist"),
                                         ("s3://empty-bucket/photos", "holds no objects")])
def test_a_failing_source_leaves_no_state_in_out(server, tmp_path, source, said):
    s3 = client(server.endpoint)
    s3.create_bucket(Bucket="empty-bucket")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    out = tmp_path / "out"
    proc = run_repack("images", source, out, env=env, check=False)
    assert proc.returncode == 2 and source in proc.stderr and said in proc.stderr, proc.stderr
    assert "scratch" not in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_text_and_converted_sources_quarantine_odd_keys_and_count_hidden_ones(server, tmp_path):
    """The text job and ``--from webdataset`` list a prefix the same way the images job does: a key
    with an empty path part is a quarantine record, hidden objects count as skipped files (none of
    them dropped without a trace)."""
    import json

    from tests.test_convert_foreign import write_wds_shards
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    body = "".join(json.dumps({"text": d}) + "\n" for d in documents(20, seed=1)).encode()
    put_all(server, "text-keys", {"a.jsonl": body, "/b.jsonl": body, "c//d.jsonl": body, ".cache/e.jsonl": body})
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok").parent
    out = tmp_path / "text"
    run_repack("text", "s3://text-keys", out, "--tokenizer", tok, "--quiet", env=env)
    manifest = read_manifest_json(out)
    assert sorted(q["source"] for q in manifest["quarantine"]) == ["/b.jsonl", "c//d.jsonl"]
    assert all("empty path part" in q["reason"] for q in manifest["quarantine"])
    assert manifest["totals"]["files"] == 1 and manifest["totals"]["skipped_files"] == 1

    shards = tmp_path / "wds"
    write_wds_shards(shards)
    first = sorted(shards.iterdir())[0]
    put_all(server, "wds-keys", {first.name: first.read_bytes(), f"/{first.name}": first.read_bytes(),
                                 f".old/{first.name}": first.read_bytes()})
    converted = tmp_path / "converted"
    run_repack("images", "s3://wds-keys", converted, "--from", "webdataset", "--quiet", env=env)
    manifest = read_manifest_json(converted)
    assert [q["source"] for q in manifest["quarantine"]] == [f"/{first.name}"]


def test_listing_columns_keep_the_folder_scans_byte_order_and_refusals(server, tmp_path):
    """The columnar listing (``list_columns``) under a prefix: objects beside the class folders (sorted after
    some of them: a merge), non-ASCII keys (byte order, not code points of another encoding), a page of
    plain keys beside one with a hidden object; the job equals a local folder scan of the same tree."""
    from repack.sources.confine import Confinement
    from repack.sources.s3 import list_columns, scan_s3

    objects = {"b-c/x.jpg": jpeg_bytes(seed=11), "b.jpg": jpeg_bytes(seed=12), "b/y.jpg": jpeg_bytes(seed=13),
               "b/z.jpg": jpeg_bytes(seed=14), "a.jpg": jpeg_bytes(seed=15), "zz.jpg": jpeg_bytes(seed=16),
               "é/w.jpg": jpeg_bytes(seed=17), "e/v.jpg": jpeg_bytes(seed=18), "b/.h.jpg": jpeg_bytes(seed=19),
               **{f"m/{i:03d}.jpg": jpeg_bytes(seed=20 + i) for i in range(30)}}
    put_all(server, "order", {f"pre/{rel}": data for rel, data in objects.items()})
    folder = tmp_path / "src"
    for rel, data in objects.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        listed = list_columns("s3://order/pre")
        scan = scan_s3("s3://order/pre", Confinement(max_file_bytes=len(objects["m/000.jpg"]) - 1))
    visible = sorted((rel for rel in objects if "/." not in rel), key=lambda rel: rel.encode())
    assert listed.rels == visible and listed.root == "s3://order/pre" and listed.skipped == 1
    assert listed.sizes.tolist() == [len(objects[rel]) for rel in visible]
    refused = {q["source"]: q["reason"] for q in scan.quarantine}
    assert {rel for rel in refused if "/" not in rel} == {"a.jpg", "b.jpg", "zz.jpg"}
    assert "m/000.jpg" in refused and "over the size cap" in refused["m/000.jpg"]
    assert [item.path for item in scan.items][:2] == ["s3://order/pre/b-c/x.jpg", "s3://order/pre/b/y.jpg"]
    md5 = {rel: etag_value(hashlib.md5(data).hexdigest()) for rel, data in objects.items()}  # moto's ETags
    assert all(item.fingerprint == [len(objects[item.rel]), md5[item.rel], 0] for item in scan.items)
    run_repack("images", folder, tmp_path / "local", "--quiet")
    run_repack("images", "s3://order/pre", tmp_path / "remote", "--quiet", env=env)
    for name in ("shard-000000.tar", "shard-000000.idx"):
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    local, remote = read_manifest_json(tmp_path / "local"), read_manifest_json(tmp_path / "remote")
    assert remote["quarantine"] == local["quarantine"] and remote["classes"] == local["classes"]
