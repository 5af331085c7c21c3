"""`repack images --from webdataset|parquet`: datasets written by other tools (the real webdataset
ShardWriter, the real Hugging Face ``datasets`` library) repacked through the one images path."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from repack.sinks.tar_format import iter_members
from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes, png_bytes


def packed_samples(out: Path) -> list[dict]:
    """Every packed sample's members (extension -> bytes), in shard order."""
    manifest = read_manifest_json(out)
    samples: dict[str, dict] = {}
    for shard in manifest["shards"]:
        with open(out / shard["path"], "rb") as fh:
            for member in list(iter_members(fh)):
                fh.seek(member.offset)
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {})[ext] = fh.read(member.size)
    return list(samples.values())


def write_wds_shards(folder: Path) -> list[tuple[str, bytes, int]]:
    """Two shards from the real ShardWriter (jpg/png + cls + txt + json), one sample without an image,
    one with a member name that would escape if it were a path; returns (key, image, label)."""
    import webdataset as wds

    folder.mkdir()
    written = []
    with wds.ShardWriter(str(folder / "part-%03d.tar"), maxcount=4) as sink:
        for i in range(7):
            image = jpeg_bytes(seed=i) if i % 3 else png_bytes((20 + i, 16))
            ext = "jpg" if i % 3 else "png"
            key = f"sample{i:04d}"
            sink.write({"__key__": key, ext: image, "cls": i % 3, "txt": f"caption {i}", "json": {"i": i}})
            written.append((key, image, i % 3))
        sink.write({"__key__": "noimage", "cls": 1, "txt": "nothing to see"})
    with tarfile.open(folder / "part-999.tar", "w") as tar:  # a hand-made shard: a hostile member name
        data = jpeg_bytes(seed=40)
        info = tarfile.TarInfo("../../escape.jpg")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        label = tarfile.TarInfo("../../escape.cls")
        label.size = 1
        tar.addfile(label, io.BytesIO(b"2"))
    written.append(("../../escape", data, 2))
    (folder / "part_stats.json").write_text("{}")  # img2dataset writes such files beside the shards
    return written


def test_webdataset_shards_repacked_with_keys_labels_and_no_escape(tmp_path):
    src = tmp_path / "wds"
    written = write_wds_shards(src)
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "webdataset", "--shard-size", "3", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == len(written)
    assert [q["source"] for q in manifest["quarantine"]] == ["part-001.tar/noimage"]
    assert "no image member" in manifest["quarantine"][0]["reason"]
    assert manifest["classes"] == {"0": 0, "1": 1, "2": 2}  # the source's own indices kept
    assert manifest["stats"]["source_not_carried"] == {"json": 7, "txt": 7}
    samples = packed_samples(out)
    for (key, image, label), sample in zip(written, samples):
        meta = json.loads(sample["json"])
        assert sample.get("jpg", sample.get("png")) == image
        assert int(sample["cls"]) == label
        assert meta["source_key"] == key and meta["source_file"].startswith("part-")
    assert not list(tmp_path.glob("**/escape*"))  # member names are data: nothing written outside OUT
    assert run_repack("verify", out).returncode == 0
    again = tmp_path / "again"  # deterministic: the same shards byte for byte
    run_repack("images", src, again, "--from", "webdataset", "--shard-size", "3", "--quiet")
    assert [(out / s["path"]).read_bytes() for s in manifest["shards"]] == \
        [(again / s["path"]).read_bytes() for s in read_manifest_json(again)["shards"]]


def test_webdataset_named_fields_and_lmdb(tmp_path):
    src = tmp_path / "wds"
    written = write_wds_shards(src)
    out = tmp_path / "lmdb"
    run_repack("images", src / "part-000.tar", out, "--from", "webdataset", "--image-field", "jpg",
               "--label-field", "cls", "--to", "lmdb", "--quiet")
    manifest = read_manifest_json(out)
    # part-000 holds samples 0..3; sample 0 and 3 are PNGs: no 'jpg' member, quarantined by name
    assert manifest["totals"]["samples"] == 2
    assert sorted(q["source"] for q in manifest["quarantine"]) == ["part-000.tar/sample0000", "part-000.tar/sample0003"]
    from pipelines.torch_lmdb import LmdbImageDataset

    dataset = LmdbImageDataset(out, decode=False, output="dict")
    by_key = {key: (image, label) for key, image, label in written}
    for i in range(len(dataset)):
        sample = dataset[i]
        assert (sample["image"], sample["label"]) == by_key[sample["meta"]["source_key"]]
    assert run_repack("verify", out).returncode == 0
    bad = run_repack("images", src, tmp_path / "x", "--image-field", "jpg", check=False)
    assert bad.returncode == 2 and "--from webdataset" in bad.stderr


def write_hf_parquet(path: Path) -> list[tuple[bytes, str]]:
    """A parquet file written by the real ``datasets`` library: Image + ClassLabel features."""
    import datasets

    images = [jpeg_bytes(seed=i) for i in range(6)]
    labels = [i % 2 for i in range(6)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["zebra", "ant"]),
                                  "caption": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": f"orig/{i}.jpg"} for i, b in enumerate(images)],
                                     "label": labels, "caption": [f"c{i}" for i in range(6)]}, features=features)
    ds.to_parquet(str(path))
    return list(zip(images, [["zebra", "ant"][label] for label in labels]))


def test_parquet_from_datasets_library(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    written = write_hf_parquet(src / "train.parquet")
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "parquet", "--shard-size", "4", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 6 and manifest["quarantine"] == []
    assert manifest["classes"] == {"zebra": 0, "ant": 1}  # ClassLabel names and indices kept
    assert manifest["stats"]["source_not_carried"] == {"caption": 6}
    for i, ((image, name), sample) in enumerate(zip(written, packed_samples(out))):
        meta = json.loads(sample["json"])
        assert sample["jpg"] == image and int(sample["cls"]) == manifest["classes"][name]
        assert (meta["source_file"], meta["source_key"], meta["source_path"]) == ("train.parquet", str(i),
                                                                                  f"orig/{i}.jpg")
    from pipelines.torch_webdataset import ImageShardDataset

    read = [(s["image"], s["label"]) for s in ImageShardDataset(out, decode=False, output="dict")]
    assert read == [(image, manifest["classes"][name]) for image, name in written]
    assert run_repack("verify", out).returncode == 0


def test_hostile_shards_and_rows_are_quarantined_by_name(tmp_path):
    """A link member, a pickle member (never unpickled: not carried), a damaged shard, a .tar.gz, a
    parquet row whose image is only a path: each set aside with its reason, the rest packed."""
    import pickle

    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "wds"
    src.mkdir()
    good = jpeg_bytes(seed=3)
    with tarfile.open(src / "a.tar", "w") as tar:
        for name, data in (("k1.jpg", good), ("k1.pyd", pickle.dumps({"boom": 1}))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("k2.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    (src / "b.tar").write_bytes(b"\x00garbage, not a tar" * 40)
    (src / "c.tar.gz").write_bytes(b"\x1f\x8b compressed")
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(out)
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert manifest["totals"]["samples"] == 1 and manifest["stats"]["source_not_carried"] == {"pyd": 1}
    assert "not a regular file" in reasons["a.tar/k2.jpg"]
    assert "b.tar" in reasons and "c.tar.gz" in reasons and "decompress" in reasons["c.tar.gz"]

    table = pa.table({"image": pa.array([{"bytes": good, "path": "x.jpg"}, {"bytes": None, "path": "y.jpg"}],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]))})
    pq.write_table(table, tmp_path / "rows.parquet")
    out2 = tmp_path / "out2"
    run_repack("images", tmp_path / "rows.parquet", out2, "--from", "parquet", "--quiet")
    manifest = read_manifest_json(out2)
    assert manifest["totals"]["samples"] == 1
    assert manifest["quarantine"] == [{"source": "rows.parquet/1", "reason": "image not embedded (only a path: y.jpg)"}]


@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_foreign_sources_in_object_storage(tmp_path, kind):
    """SOURCE on s3:// (moto's server on loopback, real boto3): tar members / parquet files read from
    the bucket give the same shards as the local copy."""
    from tests.tools.s3server import MotoServer, client, s3_env

    src = tmp_path / "src"
    written = write_wds_shards(src) if kind == "webdataset" else write_hf_parquet(src / "train.parquet")
    server = MotoServer()
    try:
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="raw")
        for path in sorted(src.iterdir()):
            s3.upload_file(str(path), "raw", f"shards/{path.name}")
        env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(tmp_path / "scratch")}
        local, remote = tmp_path / "local", tmp_path / "remote"
        run_repack("images", src, local, "--from", kind, "--quiet")
        run_repack("images", "s3://raw/shards", remote, "--from", kind, "--quiet", env=env)
    finally:
        server.stop()
    assert read_manifest_json(remote)["totals"]["samples"] == len(written)
    assert [(local / s["path"]).read_bytes() for s in read_manifest_json(local)["shards"]] == \
        [(remote / s["path"]).read_bytes() for s in read_manifest_json(remote)["shards"]]


def test_appending_new_shards_of_another_tool_keeps_their_class_indices(tmp_path):
    import webdataset as wds

    src, out = tmp_path / "wds", tmp_path / "out"
    src.mkdir()
    with wds.ShardWriter(str(src / "a-%03d.tar"), maxcount=10) as sink:
        for i in range(4):
            sink.write({"__key__": f"k{i}", "jpg": jpeg_bytes(seed=i), "cls": i % 2})
    run_repack("images", src, out, "--from", "webdataset", "--quiet")
    before = (out / "shard-000000.tar").read_bytes()
    with wds.ShardWriter(str(src / "b-%03d.tar"), maxcount=10) as sink:  # a later night: a new shard
        for i in range(4, 6):
            sink.write({"__key__": f"k{i}", "jpg": jpeg_bytes(seed=i), "cls": 5})
    run_repack("images", src, out, "--from", "webdataset", "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["classes"] == {"0": 0, "1": 1, "5": 5} and manifest["totals"]["samples"] == 6
    assert (out / "shard-000000.tar").read_bytes() == before
    assert [json.loads(s["json"])["source_file"] for s in packed_samples(out)][-2:] == ["b-000.tar"] * 2
