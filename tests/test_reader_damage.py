"""Never a silent drop: the LMDB, text, video and webdataset readers refuse damage with an error naming the
dataset and the sample (a manifest counting more samples than the database holds, a missing
LMDB key, a token file shorter than its index, a missing video, a shard index with a line repeated or moved),
instead of a shorter epoch, a sample read twice or a raw library traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lmdb
import pytest

from pipelines.torch_lmdb import LmdbImageDataset
from pipelines.torch_text import DocumentDataset, PackedTokenDataset
from pipelines.torch_video import VideoClipDataset
from repack.manifest import ManifestError
from tests.tools.reader_data import reader_datasets


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return reader_datasets(tmp_path_factory.mktemp("damage"))


def copy(root: str, tmp_path: Path) -> Path:
    out = tmp_path / Path(root).name
    shutil.copytree(root, out)
    return out


def edit_manifest(root: Path, change) -> None:
    data = json.loads((root / "manifest.json").read_text())
    change(data)
    (root / "manifest.json").write_text(json.dumps(data))


def test_lmdb_manifest_counting_more_than_the_database_is_refused(data, tmp_path):
    root = copy(data["lmdb_a"], tmp_path)

    def more(m):
        m["shards"][0]["samples"] += 5
        m["totals"]["samples"] += 5

    edit_manifest(root, more)
    with pytest.raises(ManifestError, match=r"data\.lmdb: the manifest lists 29 samples, the database holds 24"):
        LmdbImageDataset(root)


def test_lmdb_missing_sample_key_names_the_sample(data, tmp_path):
    root = copy(data["lmdb_a"], tmp_path)
    env = lmdb.open(str(root / "data.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        assert txn.delete(b"s/0000000005/img")
    env.close()
    size = os.path.getsize(root / "data.lmdb")
    edit_manifest(root, lambda m: m["shards"][0].update(bytes=size))
    ds = LmdbImageDataset(root)
    assert ds[4][0].size and ds[6][0].size
    with pytest.raises(RuntimeError, match=r"data\.lmdb: sample 5 has no image \(key s/0000000005/img missing"):
        ds[5]


def test_lmdb_last_sample_missing_is_refused_at_open(data, tmp_path):
    root = copy(data["lmdb_a"], tmp_path)
    env = lmdb.open(str(root / "data.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.delete(b"s/0000000023/img")
    env.close()
    edit_manifest(root, lambda m: m["shards"][0].update(bytes=os.path.getsize(root / "data.lmdb")))
    with pytest.raises(ManifestError, match="lacks sample 23"):
        LmdbImageDataset(root)


@pytest.mark.parametrize("reader", [PackedTokenDataset, DocumentDataset])
def test_token_file_shorter_than_its_index_is_refused(data, tmp_path, reader):
    root = copy(data["text_a"], tmp_path)
    shard = json.loads((root / "manifest.json").read_text())["shards"][-1]
    with open(root / shard["path"], "r+b") as fh:
        fh.truncate(os.path.getsize(root / shard["path"]) - 100)
    args = (16,) if reader is PackedTokenDataset else ()
    with pytest.raises(ValueError, match=rf"{root}: .*{shard['path']} holds \d+ tokens, its index says "
                                         rf"{shard['tokens']}"):
        reader(root, *args)


def test_token_index_disagreeing_with_the_manifest_is_refused(data, tmp_path):
    root = copy(data["text_a"], tmp_path)
    edit_manifest(root, lambda m: m["shards"][0].update(tokens=m["shards"][0]["tokens"] + 1))
    with pytest.raises(ValueError, match="the manifest"):
        DocumentDataset(root)


def test_missing_video_names_the_dataset_and_the_clip(data, tmp_path):
    if "video" not in data:
        pytest.skip("ffmpeg with libvpx is not installed")
    root = copy(data["video"], tmp_path)
    ds = VideoClipDataset(root, sequence_length=3, stride=2, step=4)
    Path(ds.paths[1]).unlink()
    assert ds[0][0].shape[0] == 3  # clip 0 is in the first video, which is still there
    last = len(ds) - 1
    with pytest.raises(RuntimeError, match=rf"{root}: clip {last} needs .*/two\.\w+, which is missing"):
        ds[last]


def test_lmdb_reader_refuses_an_s3_root_with_what_to_do():
    with pytest.raises(ManifestError, match=r"s3://bucket/lmdb: an LMDB is read from a local file .*repack pull"):
        LmdbImageDataset("s3://bucket/lmdb")


@pytest.mark.parametrize("damage", ["repeated", "swapped"])
def test_a_shard_index_with_a_line_repeated_or_moved_names_the_shard(tmp_path, damage):
    """The index's lines still name members the tar holds, so nothing else notices: a repeated line would read
    one sample twice and another never."""
    from pipelines.torch_webdataset import ImageShardDataset
    from tests.conftest import run_repack
    from tests.test_images_job import write_jpegs

    src, out = write_jpegs(tmp_path / "src" / "c", 9, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    index = out / "shard-000001.idx"
    head, *lines = index.read_bytes().split(b"\n")[:-1]
    lines = [lines[0], lines[0], *lines[2:]] if damage == "repeated" else [lines[1], lines[0], *lines[2:]]
    index.write_bytes(b"\n".join([head, *lines]) + b"\n")
    with pytest.raises(ManifestError, match=r"shard-000001\.idx.*a line repeated, moved or dropped"):
        list(ImageShardDataset(out, output="dict", decode=False))


def test_dali_decode_failure_names_the_damaged_sample_or_says_the_bytes_are_intact(tmp_path):
    """DALI's decoder fails without naming a sample ("nvImageCodec failure"): the loader checks each sample
    against its recorded crc32 and names the shard and key whose bytes changed; over intact bytes it says so."""
    pytest.importorskip("nvidia.dali")
    from pipelines.dali_webdataset import dali_image_loader, failure_named
    from pipelines.manifest_access import open_webdataset
    from pipelines.sample_errors import ShardIntegrityError
    from tests.conftest import run_repack
    from tests.test_images_job import write_jpegs

    src, out = write_jpegs(tmp_path / "src" / "c", 8, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    manifest = open_webdataset(out, "images")
    decoder = RuntimeError("Critical error in pipeline:\nError in CPU operator `nvidia.dali.fn.decoders.image`\n"
                           "nvImageCodec failure: '#3'\nCurrent pipeline object is no longer valid.")
    intact = failure_named(manifest, decoder)
    assert type(intact) is RuntimeError and "are the bytes packed" in str(intact) and "nvImageCodec failure" in str(intact)
    assert failure_named(manifest, RuntimeError("CUDA allocation failed: out of memory")) is None  # not a decoder's
    tar = out / "shard-000001.tar"
    data = bytearray(tar.read_bytes())
    second = [i for i in range(len(data) - 1) if data[i:i + 2] == b"\xff\xd8"][1]  # the shard's second JPEG
    data[second + 2:second + 200] = bytes(198)
    tar.write_bytes(bytes(data))
    with pytest.raises(ShardIntegrityError, match=r"shard-000001\.tar: sample '[^']+': its bytes are not the ones "
                                                  r"packed .*DALI said: .*nvImageCodec"):
        for _ in dali_image_loader(out, batch_size=2, num_threads=1, device_id=None, size=None):
            pass


def test_dali_decode_failure_in_a_later_epoch_names_the_shard_of_the_part_read_then(tmp_path):
    """DALI moves a pipeline to part (shard_id + epoch) % num_shards each epoch: a damaged sample part 1 holds
    is met by shard_id 0 in epoch 1, and named (the check looked at epoch 0's part and called the bytes intact)."""
    pytest.importorskip("nvidia.dali")
    from pipelines.dali_webdataset import dali_image_loader
    from pipelines.sample_errors import ShardIntegrityError
    from tests.conftest import run_repack
    from tests.test_images_job import write_jpegs

    src, out = write_jpegs(tmp_path / "src" / "c", 8, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    tar = out / "shard-000001.tar"  # part 1 of 2
    data = bytearray(tar.read_bytes())
    first = data.index(b"\xff\xd8")
    data[first + 2:first + 200] = bytes(198)
    tar.write_bytes(bytes(data))
    loader = dali_image_loader(out, batch_size=2, num_threads=1, device_id=None, shard_id=0, num_shards=2, size=None)
    assert sum(batch[0]["images"].shape[0] for batch in loader) == 4  # epoch 0: part 0, intact
    with pytest.raises(ShardIntegrityError, match=r"shard-000001\.tar: sample '[^']+': its bytes are not the ones"):
        for _ in loader:
            pass
