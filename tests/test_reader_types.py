"""What the readers yield is what the docs say: DALI label dtypes (CPU backend) as docs/dali.md
lists them, and in batch mode len(dataset), hence len(DataLoader), is the number of batches an
epoch yields."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from pipelines.torch_webdataset import ImageShardDataset
from tests.conftest import run_repack

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(scope="module")
def packed_lmdb(photo_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("types") / "lmdb"
    run_repack("images", photo_tree, out, "--to", "lmdb", "--quiet")
    return out


def test_dali_label_dtypes_are_the_documented_ones(packed_photos, packed_lmdb):
    pytest.importorskip("nvidia.dali")
    from pipelines.dali_lmdb import dali_lmdb_loader
    from pipelines.dali_webdataset import dali_image_loader

    options = dict(batch_size=8, num_threads=1, device_id=None, size=32)
    wds_labels = next(iter(dali_image_loader(packed_photos, **options)))[0]["labels"]
    lmdb_labels = next(iter(dali_lmdb_loader(packed_lmdb, **options)))[0]["labels"]
    assert wds_labels.dtype == torch.int64 and wds_labels.shape == (8,)
    assert lmdb_labels.dtype == torch.int32 and lmdb_labels.shape == (8,)


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("rank", [0, 1])
def test_len_in_batch_mode_is_the_batches_the_loader_yields(packed_photos, workers, rank):
    dataset = ImageShardDataset(packed_photos, decode=False, batch_size=8, num_workers=workers, rank=rank,
                                world_size=2)
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    batches = list(loader)
    assert len(loader) == len(dataset) == len(batches) == dataset.steps(workers)
    assert sum(len(labels) for _, labels in batches) == dataset.rank_range()[1] - dataset.rank_range()[0] == 60
    # 3 workers read 20 samples each: 3 batches each, 9 in all, not ceil(60 / 8) = 8
    assert len(batches) == (9 if workers == 3 else 8)


def test_len_in_batch_mode_needs_the_worker_count(packed_photos):
    unsized = ImageShardDataset(packed_photos, decode=False, batch_size=8)
    with pytest.raises(TypeError, match="num_workers"):
        len(unsized)
    assert unsized.steps(0) == 15 and len(ImageShardDataset(packed_photos)) == 120
    with pytest.raises(ValueError, match="built with num_workers=2 .* read by 1"):
        list(ImageShardDataset(packed_photos, decode=False, batch_size=8, num_workers=2))
    with pytest.raises(ValueError, match="batch mode"):
        ImageShardDataset(packed_photos, num_workers=2)
