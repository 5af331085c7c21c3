"""Tiny samples: `repack inspect` reports shard bytes over payload bytes, and `repack images
--no-sample-json` drops the per-sample .json member; its shards are read by DALI's webdataset reader,
plain webdataset and ImageShardDataset, `repack remove --sources` finds their samples from the record
of the inputs, `repack verify` passes and `--append` keeps the dataset's choice."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.tools.photos import make_photo_tree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """2 classes of 6 tiny photos (8-16 px, a few hundred bytes each)."""
    root = tmp_path_factory.mktemp("tiny") / "src"
    make_photo_tree(root, per_class=6, classes=2, seed=3, min_side=8, max_side=16)
    return root


def tar_members(out: Path) -> dict[str, bytes]:
    """{member name: data} of every shard the manifest lists."""
    found = {}
    for shard in read_manifest_json(out)["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            found.update({m.name: tar.extractfile(m).read() for m in tar.getmembers()})
    return found


def shard_bytes(out: Path) -> int:
    return sum((out / s["path"]).stat().st_size for s in read_manifest_json(out)["shards"])


def member_bytes(out: Path) -> int:
    """Bytes of the shards' members (headers, data, padding), the end-of-archive records aside."""
    total = 0
    for shard in read_manifest_json(out)["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            last = tar.getmembers()[-1]
            total += last.offset_data + -(-last.size // 512) * 512
    return total


def test_inspect_reports_shard_bytes_over_payload_bytes_with_a_hint(tiny, tmp_path):
    out, lean = tmp_path / "out", tmp_path / "lean"
    run_repack("images", tiny, out, "--shard-size", "5", "--quiet")
    run_repack("images", tiny, lean, "--shard-size", "5", "--no-sample-json", "--quiet")
    for folder, members in ((out, 3), (lean, 2)):
        payload = sum(map(len, tar_members(folder).values()))  # read with tarfile, not the .idx files
        ratio = shard_bytes(folder) / payload
        assert ratio > 2
        text = run_repack("inspect", folder).stdout
        assert f"shard bytes / payload bytes: {ratio:.1f}x (tar headers and padding: {members} member(s) " \
               "of >= 1 KB per sample)" in text
    assert "--no-sample-json" in run_repack("inspect", out).stdout
    assert "--no-sample-json" not in run_repack("inspect", lean).stdout  # no json left to drop
    assert "hint: the samples are tiny" in run_repack("inspect", lean).stdout


def test_no_sample_json_is_read_by_every_reader_removed_by_source_verified_and_kept_on_append(tiny, tmp_path):
    import webdataset as wds

    from pipelines.dali_webdataset import build_image_pipeline
    from pipelines.torch_webdataset import ImageShardDataset

    src, out, full = tmp_path / "src", tmp_path / "out", tmp_path / "full"
    make_photo_tree(src, per_class=6, classes=2, seed=3, min_side=8, max_side=16)
    run_repack("images", src, out, "--shard-size", "5", "--no-sample-json", "--quiet")
    run_repack("images", src, full, "--shard-size", "5", "--quiet")
    manifest = read_manifest_json(out)
    assert "json" not in manifest["fields"] and "cls" in manifest["fields"]
    members = tar_members(out)
    assert not [name for name in members if name.endswith(".json")] and len(members) == 24
    assert member_bytes(full) - member_bytes(out) >= 12 * 1024  # a 512-byte header and >= 1 block per sample
    sources = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.*"))
    by_bytes = {(src / rel).read_bytes(): rel for rel in sources}
    classes = manifest["classes"]

    read = [(by_bytes[s["image"]], s["label"]) for s in ImageShardDataset(out, output="dict", decode=False)]
    assert sorted(read) == sorted((rel, classes[rel.split("/")[0]]) for rel in sources)

    urls = [str(out / s["path"]) for s in manifest["shards"]]
    plain = list(wds.WebDataset(urls, shardshuffle=False))
    assert sorted(by_bytes[s.get("jpg", s.get("png"))] for s in plain) == sources
    assert all("json" not in s for s in plain)

    pipe = build_image_pipeline(out, batch_size=12, num_threads=1, device_id=None, size=None)
    images, labels = pipe.run()
    assert sorted(int(labels.at(i)) for i in range(12)) == sorted(label for _, label in read)
    assert all(images.at(i).shape[2] == 3 for i in range(12))
    with pytest.raises(ValueError, match="no-sample-json"):
        build_image_pipeline(out, batch_size=12, num_threads=1, device_id=None, size=None, with_meta=True)

    gone = sources[1]
    (tmp_path / "takedown.txt").write_text(f"{gone}\n")
    run_repack("remove", out, "--sources", tmp_path / "takedown.txt", "--quiet")
    assert read_manifest_json(out)["totals"]["samples"] == 11
    assert (src / gone).read_bytes() not in tar_members(out).values()
    assert sorted(by_bytes[s["image"]] for s in ImageShardDataset(out, output="dict", decode=False)) == \
        [rel for rel in sources if rel != gone]
    assert run_repack("verify", out).returncode == 0

    make_photo_tree(tmp_path / "more", per_class=2, classes=1, seed=9, min_side=8, max_side=16)
    for path in (tmp_path / "more").rglob("*.*"):
        path.rename(src / path.relative_to(tmp_path / "more").parent / f"new_{path.name}")
    run_repack("images", src, out, "--shard-size", "5", "--append", "--quiet")  # no --no-sample-json given
    appended = read_manifest_json(out)
    assert appended["totals"]["samples"] == 13 and "json" not in appended["fields"]
    assert not [name for name in tar_members(out) if name.endswith(".json")]
    assert run_repack("verify", out).returncode == 0


def test_no_sample_json_applies_to_webdataset_only(tiny, tmp_path):
    done = run_repack("images", tiny, tmp_path / "db", "--to", "lmdb", "--no-sample-json", check=False)
    assert done.returncode != 0 and "--no-sample-json" in done.stderr and "--to lmdb" in done.stderr


def test_inspect_refuses_an_index_whose_lines_are_out_of_its_tars_order(tiny, tmp_path):
    # the shards' small indexes are parsed together; each is still laid out against its tar
    out = tmp_path / "out"
    run_repack("images", tiny, out, "--shard-size", "5", "--quiet")
    idx = out / "shard-000001.idx"
    head, *lines = idx.read_text().splitlines(keepends=True)
    lines[0], lines[1] = lines[1], lines[0]  # the same bytes, in another order than the tar's members
    idx.write_text(head + "".join(lines))
    proc = run_repack("inspect", out, check=False)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "shard-000001.idx: not a v1.2 index of its tar" in proc.stderr and "repack verify" in proc.stderr
