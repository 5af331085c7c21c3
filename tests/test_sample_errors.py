"""Every decode or transform error names the shard and the sample: a damaged image payload, a bad label
or a failing transform in ImageShardDataset (one at a time, in batches, through DataLoader workers),
LmdbImageDataset and VideoClipDataset raise SampleDecodeError (a ShardIntegrityError) naming the
shard and the key, chained from the original error; with on_error="skip" such a sample is skipped and
counted like other damage."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lmdb
import pytest
from torch.utils.data import DataLoader

from pipelines.manifest_access import read_index
from pipelines.sample_errors import SampleDecodeError, ShardIntegrityError
from pipelines.torch_lmdb import LmdbImageDataset
from pipelines.torch_video import VideoClipDataset
from pipelines.torch_webdataset import ImageShardDataset
from tests.tools.loaders import failing_loader
from tests.tools.reader_data import reader_datasets

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:skipped:UserWarning")
SHARD = "shard-000002.tar"


def zero_image(root: Path, number: int = 7) -> str:
    """The image payload of sample ``number`` of SHARD overwritten with zeros (headers and index intact,
    so only decoding can notice): its key."""
    sample = read_index(ImageShardDataset(root).manifest, 2)[number]
    ext, offset, size = next(m for m in sample.members if m[0] != "cls")
    with open(root / SHARD, "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes(size))
    return sample.key


@pytest.fixture
def damaged(packed_photos, tmp_path) -> tuple[Path, str]:
    root = tmp_path / "ds"
    shutil.copytree(packed_photos, root)
    return root, zero_image(root)


def test_undecodable_image_names_shard_and_key(damaged):
    root, key = damaged
    with pytest.raises(SampleDecodeError) as caught:
        list(ImageShardDataset(root))
    assert caught.value.url == str(root / SHARD) and caught.value.key == key
    assert f"{root / SHARD}: sample {key!r}: decode failed" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)  # PIL's own error, chained
    with pytest.raises(ShardIntegrityError, match=f"{SHARD}: sample '{key}': decode failed"), \
            failing_loader(DataLoader(ImageShardDataset(root), batch_size=None, num_workers=2)) as failing:
        list(failing)  # through workers


@pytest.mark.parametrize("batch_size", [None, 8])
def test_undecodable_image_is_skipped_and_counted(damaged, batch_size):
    root, key = damaged
    dataset = ImageShardDataset(root, output="dict", on_error="skip", batch_size=batch_size)
    got = list(DataLoader(dataset, batch_size=None, num_workers=2))
    keys = [k for b in got for k in b["key"]] if batch_size else [s["key"] for s in got]
    assert len(keys) == 119 and key not in keys and dataset.skipped == 1
    with pytest.raises(SampleDecodeError, match=key):
        list(ImageShardDataset(root, batch_size=batch_size))


def test_raw_batches_with_a_bad_label_name_the_sample(packed_photos, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(packed_photos, root)
    sample = read_index(ImageShardDataset(root).manifest, 1)[4]
    _, offset, size = next(m for m in sample.members if m[0] == "cls")
    with open(root / "shard-000001.tar", "r+b") as fh:
        fh.seek(offset)
        fh.write(b"x" * size)
    with pytest.raises(SampleDecodeError, match=f"sample '{sample.key}': label failed"):
        list(ImageShardDataset(root, decode=False, batch_size=8))
    skipping = ImageShardDataset(root, decode=False, on_error="skip", batch_size=8)
    assert sum(len(labels) for _, labels in skipping) == 119 and skipping.skipped == 1


class FailOn:
    """A transform that fails on images of one width (a plain class: it pickles into workers)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, image):
        if image.size[0] == self.width:
            raise ValueError(f"cannot handle width {self.width}")
        return image.size


def test_failing_transform_names_shard_and_key(packed_photos):
    dataset = ImageShardDataset(packed_photos, output="dict")
    first = next(iter(dataset))
    width = first["image"].size[0]
    with pytest.raises(SampleDecodeError, match=rf"shard-000000\.tar: sample '{first['key']}': transform failed: "
                                                rf"ValueError: cannot handle width {width}") as caught:
        next(iter(ImageShardDataset(packed_photos, transform=FailOn(width))))
    assert isinstance(caught.value.__cause__, ValueError)
    pipe = ImageShardDataset(packed_photos, transform=FailOn(width), on_error="skip").pipeline()
    sizes = list(pipe)
    assert sizes and all(size[0] != width for size, _ in sizes)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return reader_datasets(tmp_path_factory.mktemp("errors"), names=("lmdb_a", "video"))


def test_lmdb_undecodable_image_names_database_and_key(data, tmp_path):
    root = tmp_path / "lmdb"
    shutil.copytree(data["lmdb_a"], root)
    env = lmdb.open(str(root / "data.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        size = len(txn.get(b"s/0000000003/img"))
        txn.put(b"s/0000000003/img", bytes(size))
    env.close()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"][0]["bytes"] = os.path.getsize(root / "data.lmdb")
    (root / "manifest.json").write_text(json.dumps(manifest))
    dataset = LmdbImageDataset(root)
    dataset[2]
    with pytest.raises(SampleDecodeError, match=r"data\.lmdb: sample 's/0000000003': decode failed") as caught:
        dataset[3]
    assert caught.value.key == "s/0000000003" and caught.value.__cause__ is not None


def fail_always(clip):
    raise ValueError("no")


def test_video_transform_error_names_file_and_clip(data):
    if "video" not in data:
        pytest.skip("ffmpeg with libvpx is needed")
    dataset = VideoClipDataset(data["video"], sequence_length=4, transform=fail_always)
    with pytest.raises(SampleDecodeError, match=r"videos/a/one\.mp4: sample 'clip 1': transform failed: ValueError: no"):
        dataset[1]


def test_dali_lmdb_source_names_a_bad_label(data, tmp_path):
    from pipelines.dali_lmdb import LmdbBatchSource

    root = tmp_path / "lmdb"
    shutil.copytree(data["lmdb_a"], root)
    env = lmdb.open(str(root / "data.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"s/0000000002/cls", b"x")
    env.close()
    source = LmdbBatchSource(str(root / "data.lmdb"), 24, batch_size=4)
    with pytest.raises(SampleDecodeError, match=r"data\.lmdb: sample 's/0000000002': label failed: ValueError"):
        source()
