"""s3:// SOURCE against moto's S3 server on loopback: images (class = first level under the
prefix) and text (ranged reads snap chunk cuts to lines; .gz streamed) give the same bytes as
the same files on local disk."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.conftest import run_repack
from tests.tools.s3server import MotoServer, client, s3_env
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def server():
    moto = MotoServer()
    yield moto
    moto.stop()


def upload_tree(s3, root: Path, bucket: str, prefix: str) -> None:
    s3.create_bucket(Bucket=bucket)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


def tar_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".idx", ".bin")}


def test_images_from_s3_equal_local_source(server, photo_tree, packed_photos, tmp_path):
    s3 = client(server.endpoint)
    upload_tree(s3, photo_tree, "photos", "tree")
    s3.put_object(Bucket="photos", Key="tree/cat/.DS_Store", Body=b"junk")  # skipped like on disk
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    run_repack("images", "s3://photos/tree", tmp_path / "out", "--shard-size", "25", "--quiet", env=env)
    assert tar_files(tmp_path / "out") == tar_files(packed_photos)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["totals"]["quarantined"] == 0 and len(manifest["classes"]) == 10
    missing = run_repack("images", "s3://photos/none", tmp_path / "none", env=env, check=False)
    assert missing.returncode == 2 and "holds no objects" in missing.stderr


def test_text_from_s3_equal_local_source(server, tmp_path):
    folder = tmp_path / "tok"
    write_tokenizer(gpt2_tokenizer(), folder)
    src = tmp_path / "corpus"
    (src / "b").mkdir(parents=True)
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(150, seed=1)))
    (src / "b" / "c.txt").write_text("".join(d.replace("\n", " ") + "\n" for d in documents(80, seed=2)))
    (src / "b" / "d.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps({"text": d}) + "\n" for d in documents(60, seed=3)).encode(), mtime=0))
    (src / "b" / "scan.pdf").write_bytes(b"%PDF-1.4 not text")  # skipped by its name, counted alike
    s3 = client(server.endpoint)
    upload_tree(s3, src, "corpus", "text")
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    common = ["--tokenizer", folder, "--chunk-bytes", "16KB", "--quiet"]
    run_repack("text", src, tmp_path / "local", *common)
    run_repack("text", "s3://corpus/text", tmp_path / "remote", *common, env=env)
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    remote = json.loads((tmp_path / "remote" / "manifest.json").read_text())
    assert local["totals"]["parts"] > 3 and remote["stats"]["parts"] == local["stats"]["parts"]
    assert remote["totals"] == local["totals"] and remote["quarantine"] == local["quarantine"]
    assert tar_files(tmp_path / "remote") == tar_files(tmp_path / "local")


def test_s3_objects_over_the_size_cap_are_quarantined_and_a_resized_object_stops_the_job(server, photo_tree,
                                                                                          tmp_path, monkeypatch):
    s3 = client(server.endpoint)
    upload_tree(s3, photo_tree, "capped", "tree")
    sizes = sorted(p.stat().st_size for p in photo_tree.rglob("*") if p.is_file())
    cap = sizes[len(sizes) // 2]
    env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
    run_repack("images", "s3://capped/tree", tmp_path / "out", "--max-file-size", str(cap), "--quiet", env=env)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    over = sorted(q["source"] for q in manifest["quarantine"] if "--max-file-size" in q["reason"])
    expected = sorted(p.relative_to(photo_tree).as_posix() for p in photo_tree.rglob("*")
                      if p.is_file() and p.stat().st_size > cap)
    assert over and over == expected and manifest["totals"]["samples"] == len(sizes) - len(expected)

    # an object whose size differs from the planned one: SourceChanged, from the ranged GET's answer
    from repack.sources.confine import SourceChanged
    from repack.sources.reading import open_input, read_inputs

    from repack.store import s3_client

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(s3_client, "_clients", {})  # a client for this server's endpoint
    url = "s3://capped/tree/" + expected[0]
    with pytest.raises(SourceChanged, match="source changed"):
        with open_input(url, [sizes[-1] + 1, 0, 0], expected[0]) as fh:
            fh.read(16)
    with pytest.raises(SourceChanged, match="source changed"):
        list(read_inputs([{"path": url, "rel": expected[0], "fingerprint": [sizes[-1] + 1, 0, 0]}]))
