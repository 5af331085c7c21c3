"""Contract tests: `repack images` writes, both bundled readers read back every sample once,
with the right label and pixels (PIL decode of the original file as the reference)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from pipelines.dali_webdataset import build_image_pipeline, dali_image_loader, output_names
from pipelines.manifest_access import parse_label, split_range
from pipelines.torch_webdataset import ImageShardDataset
from repack.manifest import ManifestError
from tests.conftest import read_manifest_json, run_repack

SIDE = 24
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:.pin_memory. argument")


def reference(photo_tree: Path, rel: str) -> np.ndarray:
    return np.asarray(Image.open(photo_tree / rel).convert("RGB"))


def to_array(image: Image.Image) -> np.ndarray:
    return np.array(image)


def small_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image.resize((SIDE, SIDE)))).permute(2, 0, 1)


def source_files(tree: Path) -> list[str]:
    return sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())


def check_dicts(samples: list[dict], photo_tree: Path, classes: dict[str, int]) -> None:
    """Every source file exactly once, right label, identical pixels."""
    paths = [s["meta"]["path"] for s in samples]
    assert sorted(paths) == source_files(photo_tree)
    assert len(set(s["key"] for s in samples)) == len(samples)
    for s in samples:
        assert s["label"] == classes[s["meta"]["class"]] == classes[s["meta"]["path"].split("/")[0]]
        np.testing.assert_array_equal(np.asarray(s["image"]), reference(photo_tree, s["meta"]["path"]))


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_torch_reader_every_sample_once(packed_photos, photo_tree, num_workers):
    classes = read_manifest_json(packed_photos)["classes"]
    dataset = ImageShardDataset(packed_photos, transform=to_array, output="dict")
    assert len(dataset) == len(source_files(photo_tree)) == 120
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    check_dicts(list(loader), photo_tree, classes)


def test_torch_reader_ranks_and_workers_cover_once(packed_photos, photo_tree):
    classes = read_manifest_json(packed_photos)["classes"]
    seen, lengths = [], []
    for rank in range(2):
        dataset = ImageShardDataset(packed_photos, transform=to_array, output="dict", rank=rank, world_size=2)
        rank_samples = list(DataLoader(dataset, batch_size=None, num_workers=2))
        assert len(rank_samples) == len(dataset)
        lengths.append(len(dataset))
        seen += rank_samples
    assert lengths == [60, 60]
    check_dicts(seen, photo_tree, classes)
    # 7 ranks x 3 workers: uneven splits across shard boundaries, still exactly once, plus one
    # repeat on each rank one sample short (every rank ceil(120 / 7) = 18 samples: equal steps)
    keys, repeats = [], 0
    for rank in range(7):
        dataset = ImageShardDataset(packed_photos, rank=rank, world_size=7, decode=False)
        assert len(dataset) == 18
        repeats += dataset.padding
        keys += [s.key for worker in range(3) for s in dataset.worker_samples(worker, 3)]
    assert len(set(keys)) == 120 and len(keys) == 120 + repeats == 7 * 18
    # drop_last: equal shares for DDP, the remainder skipped
    shares = [len(ImageShardDataset(packed_photos, rank=r, world_size=7, drop_last=True)) for r in range(7)]
    assert shares == [120 // 7] * 7


def test_torch_reader_shuffle_epochs_persistent_pinned(packed_photos):
    dataset = ImageShardDataset(packed_photos, transform=small_tensor, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=16, num_workers=2, persistent_workers=True, pin_memory=True)
    plain = ImageShardDataset(packed_photos, output="dict", decode=False)
    expected = Counter(s["label"] for s in plain)
    orders = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        batches = list(loader)
        images = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches]).tolist()
        assert images.shape == (120, 3, SIDE, SIDE) and images.dtype == torch.uint8
        assert Counter(labels) == expected
        orders.append(labels)
    assert orders[0] != orders[1] != orders[2]
    # the order of an epoch depends on (seed, epoch) only
    again = ImageShardDataset(packed_photos, shuffle=True, seed=3, decode=False)
    again.set_epoch(1)
    replay = [label for batch in DataLoader(again, batch_size=16, num_workers=2) for label in batch[1].tolist()]
    assert replay == orders[1]
    keys = [s.key for w in range(2) for s in again.worker_samples(w, 2)]
    assert len(set(keys)) == 120 and keys != sorted(keys)


def test_dali_two_shards_cover_once_with_pixels(packed_photos, photo_tree):
    classes = read_manifest_json(packed_photos)["classes"]
    assert output_names(packed_photos, with_meta=True) == ["images", "labels", "meta"]
    seen = []
    for shard_id in range(2):
        pipe = build_image_pipeline(packed_photos, batch_size=16, num_threads=2, device_id=None, shard_id=shard_id,
                                    num_shards=2, size=None, with_meta=True)
        epoch = pipe.epoch_size("Reader")
        start, stop = split_range(120, 2, shard_id)
        assert epoch == 120
        count = 0
        while count < stop - start:
            images, labels, metas = pipe.run()
            for i in range(min(len(images), stop - start - count)):
                meta = json.loads(bytes(metas.at(i)).rstrip(b"\x00"))
                seen.append(meta["path"])
                assert int(labels.at(i)) == classes[meta["class"]]
                got = images.at(i).astype(np.int16)
                ref = reference(photo_tree, meta["path"]).astype(np.int16)
                assert got.shape == ref.shape
                diff = np.abs(got - ref)
                assert diff.max() <= 4 and diff.mean() < 0.5, (meta["path"], diff.max(), diff.mean())
            count += len(images)
    assert sorted(seen) == source_files(photo_tree)


def test_dali_loader_resized_normalized_epochs(packed_photos):
    manifest = read_manifest_json(packed_photos)
    labels_in_order = [s["label"] for s in ImageShardDataset(packed_photos, output="dict", decode=False)]
    assert len(labels_in_order) == manifest["totals"]["samples"]
    loader = dali_image_loader(packed_photos, batch_size=32, num_threads=2, size=32)
    for _ in range(2):  # auto_reset: two full epochs, the last batch partial
        images, labels = [], []
        for batch in loader:
            images.append(batch[0]["images"])
            labels += batch[0]["labels"].tolist()
        images = torch.cat(images)
        assert images.shape == (120, 3, 32, 32) and images.dtype == torch.float32
        assert labels == labels_in_order
        pixels = images * torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255 + \
            torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
        assert pixels.min() > -0.5 and pixels.max() < 255.5 and pixels.std() > 10


def test_a_shard_cut_short_is_named_before_dali_reads_it(packed_photos, tmp_path):
    """A tar shorter than its manifest entry (a copy cut off) is named by the DALI pipeline before DALI reads
    it: with with_meta its reader crashed the process (SIGSEGV), else it blamed a "malformed index"."""
    from repack.manifest import ManifestError

    broken = tmp_path / "cut"
    shutil.copytree(packed_photos, broken)
    tar = broken / "shard-000001.tar"
    os.truncate(tar, tar.stat().st_size - 700)
    with pytest.raises(ManifestError, match=r"shard-000001\.tar: \d+ bytes, the manifest says \d+: the shard changed"):
        build_image_pipeline(broken, batch_size=8, num_threads=1, size=16, with_meta=True)


def test_missing_component_is_an_error(packed_photos, tmp_path):
    """A sample without its .cls must stop both readers (DALI's default would yield an empty label)."""
    broken = tmp_path / "broken"
    shutil.copytree(packed_photos, broken)
    idx = broken / "shard-000000.idx"
    lines = idx.read_text().splitlines()
    tokens = lines[2].split(" ")
    cls_at = tokens.index("cls")
    lines[2] = " ".join(tokens[:cls_at] + tokens[cls_at + 4:])
    idx.write_text("\n".join(lines) + "\n")
    from repack.manifest import ManifestError
    with pytest.raises(ManifestError, match="shard-000000.idx: .* the index changed since packing"):
        build_image_pipeline(broken, batch_size=8, num_threads=1, size=None)  # checked against the manifest first
    manifest = json.loads((broken / "manifest.json").read_text())  # an index the manifest vouches for, then
    manifest["shards"][0].update(index_bytes=idx.stat().st_size, index_sha256=hashlib.sha256(idx.read_bytes()).hexdigest())
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"shard-000000\.idx: .*sample 1's member .* a member left out"):
        build_image_pipeline(broken, batch_size=8, num_threads=1, size=None)  # the index laid out as its tar?
    with pytest.raises(ManifestError, match=r"shard-000000\.idx: .*sample 1's member .* a member left out"):
        list(ImageShardDataset(broken, decode=False))
    # the same index through DALI's default behaviour passes silently: the option matters
    from nvidia.dali import fn
    from nvidia.dali.pipeline import Pipeline
    pipe = Pipeline(batch_size=8, num_threads=1, device_id=None)
    with pipe:
        pipe.set_outputs(*fn.readers.webdataset(paths=[str(broken / "shard-000000.tar")], index_paths=[str(idx)],
                                                ext=["jpg;png", "cls"]))
    pipe.build()
    _, cls = pipe.run()
    assert [len(cls.at(i)) for i in range(3)] == [1, 0, 1]


def test_unlabeled_flat_folder(photo_tree, tmp_path):
    # DALI pipelines that earlier tests left as garbage must be collected here, not in a forked
    # DataLoader worker: DALI's Pipeline.__del__ deadlocks in a forked child (seen: this test hung)
    gc.collect()
    flat = tmp_path / "flat"
    flat.mkdir()
    files = source_files(photo_tree)[::10]
    for rel in files:
        shutil.copy(photo_tree / rel, flat / rel.replace("/", "_"))
    out = tmp_path / "out"
    run_repack("images", flat, out, "--shard-size", "5", "--quiet")
    assert "cls" not in read_manifest_json(out)["fields"]
    samples = list(DataLoader(ImageShardDataset(out, transform=to_array, output="dict"), batch_size=None,
                              num_workers=2))
    assert sorted(s["meta"]["path"] for s in samples) == sorted(r.replace("/", "_") for r in files)
    for s in samples:
        assert s["label"] == -1
        np.testing.assert_array_equal(np.asarray(s["image"]), reference(flat, s["meta"]["path"]))
    assert output_names(out) == ["images"]
    loader = dali_image_loader(out, batch_size=4, num_threads=1, size=16, num_shards=2, shard_id=1)
    batches = [b[0] for b in loader]
    assert sum(b["images"].shape[0] for b in batches) == len(files) - len(files) // 2
    assert all(set(b) == {"images"} for b in batches)


def test_reader_refuses_bad_inputs(packed_photos, tmp_path):
    with pytest.raises(ValueError):
        parse_label(b"\x80\x04K")  # a pickle opcode stream is not a label
    assert parse_label(b"007") == 7
    moved = tmp_path / "evil"
    shutil.copytree(packed_photos, moved)
    data = json.loads((moved / "manifest.json").read_text())
    data["shards"][0]["index"] = "../../etc/passwd"
    (moved / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError):
        ImageShardDataset(moved)
    with pytest.raises(ManifestError):
        build_image_pipeline(moved, batch_size=2)


def test_every_reader_decodes_the_stored_pixels_of_an_exif_rotated_image(tmp_path):
    """A JPEG stored 64x48 with EXIF orientation 6 (shown 48x64), packed without --normalize: the PyTorch
    readers gave the stored 64x48 picture and DALI's decoder the rotated one, for the same sample. Every reader
    gives the stored pixels now (--normalize is what applies the orientation), WebDataset and LMDB alike."""
    from pipelines.dali_lmdb import dali_lmdb_loader
    from pipelines.torch_lmdb import LmdbImageDataset

    stored = np.zeros((48, 64, 3), np.uint8)
    stored[:24, :32] = (255, 0, 0)  # red in the stored top-left quarter
    exif = Image.Exif()
    exif[0x0112] = 6
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(stored).save(tmp_path / "src" / "a" / "rot6.jpg", quality=95, exif=exif.tobytes())
    pictures = []
    for to in ("webdataset", "lmdb"):
        out = tmp_path / to
        run_repack("images", tmp_path / "src", out, "--to", to, "--quiet")
        if to == "webdataset":
            pictures.append(np.asarray(next(iter(ImageShardDataset(out, output="dict")))["image"]))
            loader = dali_image_loader(out, batch_size=1, num_threads=1, device_id=None, size=None)
        else:
            pictures.append(np.asarray(LmdbImageDataset(out)[0][0]))
            loader = dali_lmdb_loader(out, batch_size=1, num_threads=1, device_id=None, size=None)
        pictures.append(next(iter(loader))[0]["images"][0].numpy())
    for picture in pictures:
        assert picture.shape == (48, 64, 3) and picture[0, 0, 0] > 200 and picture[0, -1, 0] < 60


def test_dali_refuses_a_dataset_with_a_gray_alpha_tiff_it_would_read_with_other_pixels(tmp_path):
    """DALI's decoder reads a gray+alpha TIFF without an error, with the alpha in the green channel, where the
    PyTorch readers give the gray picture: the same sample trained on other pixels. The pack counts such images
    (stats.dali_misreads, summed by --append) and DALI's loaders refuse the dataset naming them; --normalize
    makes them JPEGs both read alike."""
    from pipelines.dali_lmdb import dali_lmdb_loader

    gray = np.full((8, 8), 200, np.uint8)
    alpha = np.full((8, 8), 255, np.uint8)  # opaque: DALI gives green 255, the PyTorch readers 200
    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.fromarray(np.dstack([gray, alpha]), "LA").save(tmp_path / "src" / "a" / "ga.tiff")
    Image.fromarray(np.dstack([gray] * 3)).save(tmp_path / "src" / "a" / "rgb.tiff")
    for to, loader in (("webdataset", dali_image_loader), ("lmdb", dali_lmdb_loader)):
        out = tmp_path / to
        run_repack("images", tmp_path / "src", out, "--to", to, "--quiet")
        assert read_manifest_json(out)["stats"]["dali_misreads"] == {"gray+alpha TIFF": 1}
        with pytest.raises(ValueError, match=r"1 gray\+alpha TIFF.*--normalize"):
            loader(out, batch_size=1, num_threads=1, device_id=None, size=None)
    (tmp_path / "more" / "b").mkdir(parents=True)
    shutil.copytree(tmp_path / "src" / "a", tmp_path / "more" / "a")
    shutil.copy(tmp_path / "src" / "a" / "ga.tiff", tmp_path / "more" / "b" / "ga2.tiff")
    run_repack("images", tmp_path / "more", tmp_path / "webdataset", "--append", "--quiet")
    assert read_manifest_json(tmp_path / "webdataset")["stats"]["dali_misreads"] == {"gray+alpha TIFF": 2}
    (tmp_path / "gone.txt").write_text("a/ga.tiff\nb/ga2.tiff\n")  # taken down: the count goes with them
    for to, loader in (("webdataset", dali_image_loader), ("lmdb", dali_lmdb_loader)):
        run_repack("remove", tmp_path / to, "--sources", tmp_path / "gone.txt", "--quiet")
        assert "dali_misreads" not in read_manifest_json(tmp_path / to)["stats"]
        assert len(list(loader(tmp_path / to, batch_size=1, num_threads=1, device_id=None, size=None))) == 1
    out = tmp_path / "normalized"
    run_repack("images", tmp_path / "src", out, "--normalize", "--quiet")
    assert "dali_misreads" not in read_manifest_json(out)["stats"]
    greens = [int(batch[0]["images"][0].numpy()[0, 0, 1])
              for batch in dali_image_loader(out, batch_size=1, num_threads=1, device_id=None, size=None)]
    assert len(greens) == 2 and all(abs(green - 200) < 8 for green in greens), greens


def test_a_reader_decodes_what_a_raised_max_pixels_let_in(tmp_path, monkeypatch):
    """--max-pixels above Pillow's own bomb limit packed images the PyTorch readers then refused
    (DecompressionBombError); a reader lets its Pillow decode what the dataset's check let in. (Pillow's limit
    and the reader's idea of it are lowered here: the real one is ~179 MP.)"""
    import pipelines.manifest_access as manifest_access
    from pipelines.torch_lmdb import LmdbImageDataset

    (tmp_path / "src" / "a").mkdir(parents=True)
    Image.new("RGB", (60, 60), (10, 200, 30)).save(tmp_path / "src" / "a" / "big.png")  # 3,600 pixels
    monkeypatch.setattr(manifest_access, "PILLOW_PIXELS", 1000)
    for to in ("webdataset", "lmdb"):
        out = tmp_path / to
        run_repack("images", tmp_path / "src", out, "--to", to, "--max-pixels", "5000", "--quiet")
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # its error from 2,000 pixels
        reader = ImageShardDataset(out) if to == "webdataset" else LmdbImageDataset(out)
        image, _ = next(iter(reader)) if to == "webdataset" else reader[0]
        assert np.asarray(image).shape == (60, 60, 3) and Image.MAX_IMAGE_PIXELS == 5000


def test_a_sample_dalis_decoder_refuses_in_the_first_batches_is_named(tmp_path):
    """A lossless WebP carrying EXIF passes the check and Pillow reads it; DALI's decoder refuses it. The first
    batches run while the loader is built, where the failure came out as DALI's bare error; it is explained as
    a later batch's is."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 1
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "src" / "a" / "x.webp", lossless=True,
                                                  exif=exif.tobytes())
    out = tmp_path / "out"
    run_repack("images", tmp_path / "src", out, "--quiet")
    with pytest.raises(RuntimeError, match="ImageShardDataset names it"):
        dali_image_loader(out, batch_size=1, num_threads=1, device_id=None, size=None)


def test_dali_names_a_dataset_folder_whose_name_is_not_utf8(packed_photos, tmp_path):
    """A dataset under a folder named in another encoding packed and verified, then DALI's pipeline failed with its
    own traceback ("Unsupported argument type with name paths"); the loader names the problem now."""
    moved = tmp_path / os.fsdecode(b"out\xff")
    shutil.copytree(packed_photos, moved)
    with pytest.raises(ValueError, match="path is not UTF-8"):
        build_image_pipeline(moved, batch_size=2)
