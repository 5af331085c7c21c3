"""ImageShardDataset(batch_size=B): batches made in the DataLoader workers (raw bytes packed in shared
memory, tensors stacked) hold exactly what the one-sample-at-a-time reader delivers, batch for batch,
and resume, skip and recycle their buffers without losing or changing a sample."""

from __future__ import annotations

import gc
import hashlib
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from pipelines.batches import RING, PackedBytes
from pipelines.mixture import Mixture
from pipelines.torch_webdataset import ImageShardDataset
from tests.tools.loaders import failing_loader
from tests.test_reader_integrity import flip_header_byte, s3, upload  # noqa: F401  (s3: a fixture)
from tests.tools.s3server import s3_env

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:skipped:UserWarning",
                                        "ignore:.set_vital. is deprecated")
BATCH = 8


def columns(samples: list):
    if isinstance(samples[0], dict):
        return {key: [s[key] for s in samples] for key in samples[0]}
    return [list(column) for column in zip(*samples)]


def per_sample_batches(root, workers: int, **options) -> list:
    """The reference: one sample at a time, batched by the DataLoader (same workers: same batches)."""
    loader = DataLoader(ImageShardDataset(root, **options), batch_size=BATCH, num_workers=workers,
                        collate_fn=columns)
    return list(loader)


def as_bytes(images: PackedBytes) -> list[bytes]:
    assert isinstance(images, PackedBytes)
    return [images.tobytes(i) for i in range(len(images))]


@pytest.mark.parametrize("workers", [0, 2])
def test_raw_batches_equal_the_per_sample_reader_batch_for_batch(packed_photos, workers):
    want = per_sample_batches(packed_photos, workers, decode=False, shuffle=True, seed=3)
    dataset = ImageShardDataset(packed_photos, decode=False, shuffle=True, seed=3, batch_size=BATCH)
    got = list(DataLoader(dataset, batch_size=None, num_workers=workers))
    assert [as_bytes(images) for images, _ in got] == [images for images, _ in want]
    assert [labels.tolist() for _, labels in got] == [labels for _, labels in want]
    assert sum(len(images) for images, _ in got) == dataset.total_samples == 120
    first = got[0][0]
    assert list(first)[0].dtype == torch.uint8 and first.sizes() == [len(b) for b in want[0][0]]


def test_a_raw_batch_crosses_from_its_worker_as_one_buffer(packed_photos):
    """Images and labels of a worker's batch are views of one shared-memory buffer: one transfer per
    batch (each tensor of a plain tuple is a transfer of its own: a file descriptor passed, a mapping)."""
    dataset = ImageShardDataset(packed_photos, decode=False, batch_size=BATCH)
    got = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert sum(len(labels) for _, labels in got) == 120
    for images, labels in got:
        assert type(labels) is torch.Tensor and labels.dtype == torch.int64 and labels.is_shared()
        assert labels.untyped_storage().data_ptr() == images.data.untyped_storage().data_ptr()
    want = per_sample_batches(packed_photos, 2, decode=False)
    assert [labels.tolist() for _, labels in got] == [labels for _, labels in want]
    assert [as_bytes(images) for images, _ in got] == [images for images, _ in want]


def test_held_batches_keep_their_bytes_while_buffers_are_recycled(packed_photos):
    """More batches than a worker's ring holds, all kept alive: none is overwritten; then batches
    dropped as they come are refilled in place and still read right."""
    intact = {s["key"]: hashlib.sha256(s["image"]).hexdigest()
              for s in ImageShardDataset(packed_photos, decode=False, output="dict")}
    dataset = ImageShardDataset(packed_photos, decode=False, output="dict", batch_size=4)
    held = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert len(held) == 30 > 2 * RING
    seen = {key: hashlib.sha256(batch["image"].tobytes(i)).hexdigest()
            for batch in held for i, key in enumerate(batch["key"])}
    assert seen == intact
    del held
    gc.collect()
    storages = set()
    for batch in DataLoader(dataset, batch_size=None, num_workers=2):
        storages.add(batch["image"].data.untyped_storage().data_ptr())
        for i, key in enumerate(batch["key"]):
            assert hashlib.sha256(batch["image"].tobytes(i)).hexdigest() == intact[key]
        del batch
    assert len(storages) < 30  # buffers came back and were filled again


def test_decoded_batches_stack_tensors_and_dicts_list_the_rest(packed_photos):
    def small(image):
        return torch.from_numpy(np.array(image.resize((16, 16)))).permute(2, 0, 1)

    want = per_sample_batches(packed_photos, 2, transform=small, output="dict", shuffle=True, seed=1)
    dataset = ImageShardDataset(packed_photos, transform=small, output="dict", shuffle=True, seed=1, batch_size=BATCH)
    got = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert len(got) == len(want)
    for batch, ref in zip(got, want):
        keys, images, labels, metas = ref["key"], ref["image"], ref["label"], ref["meta"]
        assert batch["image"].shape == (len(keys), 3, 16, 16) and batch["image"].dtype == torch.uint8
        assert torch.equal(batch["image"], torch.stack(images))
        assert batch["key"] == list(keys) and batch["label"].tolist() == list(labels) and batch["meta"] == list(metas)


def test_batched_state_resumes_at_the_next_batch(packed_photos):
    def loader():
        dataset = ImageShardDataset(packed_photos, decode=False, output="dict", shuffle=True, seed=5, batch_size=BATCH)
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2)

    whole = [batch["key"] for batch in loader()]
    first = loader()
    it = iter(first)
    consumed = [next(it)["key"] for _ in range(5)]
    state = first.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [batch["key"] for batch in resumed]
    assert consumed + rest == whole
    assert sorted(k for keys in consumed + rest for k in keys) == sorted(k for keys in whole for k in keys)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_damaged_sample_leaves_its_batch_or_raises_naming_it(packed_photos, tmp_path, s3, monkeypatch,  # noqa: F811
                                                             where):
    folder = tmp_path / "ds"
    shutil.copytree(packed_photos, folder)
    key, lost = flip_header_byte(folder)
    root = str(folder)
    if where == "s3":
        for name, value in s3_env(s3.endpoint).items():
            monkeypatch.setenv(name, value)
        root = upload(s3, folder, "batched-flip")
    with pytest.raises(Exception, match=key), failing_loader(
            DataLoader(ImageShardDataset(root, decode=False, batch_size=BATCH), batch_size=None, num_workers=2)) as failing:
        list(failing)
    skipping = ImageShardDataset(root, decode=False, output="dict", on_error="skip", batch_size=BATCH)
    got = list(DataLoader(skipping, batch_size=None, num_workers=2))
    keys = [k for batch in got for k in batch["key"]]
    assert len(keys) == 120 - lost and key not in keys and skipping.skipped == lost
    intact = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, decode=False, output="dict")}
    assert all(batch["image"].tobytes(i) == intact[k] for batch in got for i, k in enumerate(batch["key"]))


def test_batch_size_is_checked_and_pipeline_refuses_it(packed_photos):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            ImageShardDataset(packed_photos, batch_size=bad)
    with pytest.raises(ValueError, match="wds.batched"):
        ImageShardDataset(packed_photos, batch_size=4).pipeline()
    with pytest.raises(ValueError, match="one sample at a time"):
        Mixture([(ImageShardDataset(packed_photos, batch_size=4), 1)])


def test_a_copy_of_a_batch_does_not_release_its_buffer(packed_photos):
    """A deepcopy in the training process is a new tensor: dropping it must leave the batch's own
    buffer claimed (else the worker would refill it under the batch still held)."""
    import copy

    dataset = ImageShardDataset(packed_photos, decode=False, output="dict", batch_size=4)
    intact = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, decode=False, output="dict")}
    held = []
    for batch in DataLoader(dataset, batch_size=None, num_workers=1):
        held.append(batch)
        copy.deepcopy(batch)  # made and dropped at once
        gc.collect()
    assert len(held) == 30
    assert all(b["image"].tobytes(i) == intact[k] for b in held for i, k in enumerate(b["key"]))
