"""The readers' index as numpy columns (``repack.manifest.shard_index``): the vectorized parser gives exactly
what a line-by-line reading of the ``.idx`` text gives (or refuses what it refuses), the order's array
forms equal its list forms, and a reader's memory grows by the index columns, not by an object per
sample, while it reads an epoch of raw batches."""

from __future__ import annotations

import io
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines import sample_order
from repack.manifest import shard_index
from pipelines.manifest_access import read_index, read_index_columns, sample_at
from pipelines.sample_errors import ShardIntegrityError
from repack.manifest.shard_index import concat, parse_index
from pipelines.torch_webdataset import ImageShardDataset
from repack.lifecycle.shard_index import parse_index as remove_index
from repack.manifest import ManifestError, read_manifest
from repack.sinks.tar_check import check_against_index
from tests.conftest import run_repack
from tests.test_reader_integrity import flip_header_byte


def reference(text: str) -> list[tuple[str, tuple, tuple]]:
    """The index read line by line, as the readers' parser once did: (key, members, names) per line."""
    lines = text.splitlines()
    head = lines[0].split()
    assert head[0] == "v1.2" and int(head[1]) == len(lines) - 1
    out = []
    for line in lines[1:]:
        tokens = line.split(" ")
        assert tokens and len(tokens) % 4 == 0
        groups = [tokens[i:i + 4] for i in range(0, len(tokens), 4)]
        out.append((groups[0][3].split(".", 1)[0], tuple((e, int(o), int(s)) for e, o, s, _ in groups),
                    tuple(n for *_, n in groups)))
    return out


def as_lines(columns) -> list[tuple[str, tuple, tuple]]:
    return [(s.key, s.members, s.names) for s in (sample_at(columns, i) for i in range(columns.samples))]


ODD = ("v1.2 5\n"  # odd names, the members laid out as in a tar (a header block before each, data padded)
       "jpg 512 10 a.b.jpg cls 1536 2 a.b.cls\n"  # a key before the first dot only
       "jpg 2560 3 plain\n"  # no dot: the whole name is the key
       "png 3584 4 k2.png json 4608 5 other.json txt 5632 6 k2.txt\n"  # a name that does not start with the key
       "jpg 6656 0 k3.jpg\n"
       "webp 7168 123456789012 kk.webp\n")


@pytest.mark.parametrize("chunk", [shard_index.CHUNK_BYTES, 200])
def test_columns_match_a_line_by_line_reading(packed_photos, monkeypatch, chunk):
    monkeypatch.setattr(shard_index, "CHUNK_BYTES", chunk)  # a shard's text parsed in pieces gives the same
    manifest = read_manifest(packed_photos)
    texts = [(packed_photos / s["index"]).read_text() for s in manifest.data["shards"]]
    for text in [*texts, ODD]:
        assert as_lines(parse_index(text.encode(), "x.idx")) == reference(text)
    whole = concat([parse_index(t.encode(), "x.idx") for t in [ODD, *texts, ODD]])
    assert as_lines(whole) == [line for t in [ODD, *texts, ODD] for line in reference(t)]
    assert [s.key for s in read_index(manifest, 1)] == [key for key, _, _ in reference(texts[1])]
    columns = read_index_columns(manifest)
    assert columns.samples == manifest.data["totals"]["samples"]
    names = columns.name_fields(np.arange(columns.samples).repeat(np.diff(columns.first_member)),
                                np.arange(len(columns.ext)))
    assert [bytes(row).rstrip(b"\0").decode() for row in names] == [n for _, _, ns in as_lines(columns) for n in ns]


MALFORMED = [
    ("", "empty index file"),
    ("v1.2 2\njpg 512 3 a.jpg\n", "matching sample count"),
    ("v1.3 1\njpg 512 3 a.jpg\n", "matching sample count"),
    ("v1.2 1\njpg 512 3\n", "malformed index line 'jpg 512 3'"),
    ("v1.2 2\njpg 512 3 a.jpg\njpg x12 3 b.jpg\n", "malformed index line 'jpg x12 3 b.jpg'"),
    ("v1.2 1\njpg 512  a.jpg x\n", "malformed index line"),
    ("v1.2 1\njpg -512 3 a.jpg\n", "malformed index line"),
    ("v1.2 1\njpg 5120000000000000000 3 a.jpg\n", "malformed index line"),
    ("v1.2 1\njpg 512 3 a\u00e9.jpg\n", "not printable ASCII"),
    ("v1.2 1\njpg\t512 3 a.jpg\n", "not printable ASCII"),
    ("v1.2 1\njpg 512 3 a\tb.jpg\n", "not printable ASCII"),
    ("v1.2 1\njpg +512 3 a.jpg\n", "malformed index line"),
    ("v1.2 1\njpg 512 1_024 a.jpg\n", "malformed index line"),
]


@pytest.mark.parametrize("text, message", MALFORMED)
def test_malformed_indexes_are_refused_naming_the_file(text, message):
    with pytest.raises(ManifestError, match="bad.idx: .*" + message.replace("(", r"\(")):
        parse_index(text.encode(), "bad.idx")


@pytest.mark.parametrize("text", [text for text, _ in MALFORMED])
def test_remove_refuses_every_index_the_readers_refuse(text):
    """`repack remove` reads an index with the readers' parser: what they refuse, it rebuilds from the tar."""
    assert remove_index(text.encode()) is None


def test_remove_and_verify_read_a_shard_index_as_the_readers_do(packed_photos):
    manifest = read_manifest(packed_photos)
    for shard in manifest.data["shards"]:
        raw = (packed_photos / shard["index"]).read_bytes()
        columns = parse_index(raw, shard["index"])
        members = np.arange(len(columns.ext))
        samples = np.arange(columns.samples).repeat(np.diff(columns.first_member))
        names = [bytes(row).rstrip(b"\0").decode() for row in columns.name_fields(samples, members)]
        keys = [columns.key(i) for i in range(columns.samples)]
        removing = remove_index(raw, shard["index_sha256"])
        assert removing.keys() == keys and removing.names(members) == names
        assert removing.offset.tolist() == columns.offset.tolist() and removing.size.tolist() == columns.size.tolist()
        verifying = check_against_index((packed_photos / shard["path"]).read_bytes(), raw)
        assert verifying.offsets.tolist() == columns.offset.tolist()
        assert [bytes(row).rstrip(b"\0").decode() for row in verifying.keys] == keys


@pytest.mark.parametrize("runs", [[[0, 1000]], [[5, 17], [40, 300], [1000, 1001]], [], [[0, 63]], [[3, 9000]]])
def test_the_order_as_arrays_equals_the_order_as_lists(runs):
    for workers in (1, 2, 3, 16):
        for worker in range(workers):
            listed = sample_order.worker_positions(runs, worker, workers)
            array = sample_order.worker_position_array(runs, worker, workers)
            assert array.tolist() == listed
            lazy = sample_order.WorkerPositions(runs, worker, workers)
            assert len(lazy) == len(listed)
            for a, b in ((0, len(listed)), (0, 1), (63, 130), (len(listed) - 5, len(listed) + 9)):
                assert lazy[a:b].tolist() == listed[a:b]
            for seed in (None, "7:1:0:0"):
                order = sample_order.delivery_order(listed, 100, seed)
                for start in (0, 1, 99, 100, len(listed)):
                    for positions in (array, lazy):
                        chunks = list(sample_order.delivery_chunks(positions, 100, seed, start))
                        assert [p for c in chunks for p in c.tolist()] == order[start:]


SAMPLES = 3000


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    """3,000 tiny JPEGs in 10 classes, packed in 3 shards."""
    src = tmp_path_factory.mktemp("tiny") / "src"
    variants = []
    for i in range(16):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), (i * 16, 255 - i * 16, 7 * i)).save(buffer, "JPEG")
        variants.append(buffer.getvalue())
    for i in range(SAMPLES):
        folder = src / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.jpg").write_bytes(variants[i % 16])
    out = src.parent / "out"
    run_repack("images", src, out, "--shard-size", "1000", "--verify", "none", "--quiet")
    return out


def test_an_epoch_of_raw_batches_holds_columns_not_an_object_per_sample(tiny_dataset):
    next(iter(ImageShardDataset(tiny_dataset, batch_size=64, decode=False, shuffle=True)))  # imports at first use
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        dataset = ImageShardDataset(tiny_dataset, batch_size=64, decode=False, shuffle=True)
        opened = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        labels = [label for _, batch in zip(range(10 ** 6), dataset) for label in batch[1].tolist()]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(labels) == SAMPLES and sorted(set(labels)) == list(range(10))
    held = sum(a.nbytes for a in (dataset.index.first_member, dataset.index.key_ends, dataset.index.keys,
                                   dataset.index.ext, dataset.index.suffix, dataset.index.offset, dataset.index.size))
    assert held <= 64 * SAMPLES
    assert opened - before <= held + (256 << 10)  # the columns, the manifest and the like
    # reading: the order (8 bytes a position) and one batch's work, nothing that grows per sample of the dataset
    assert peak - opened <= 16 * SAMPLES + (768 << 10), (peak - opened) / SAMPLES


@pytest.mark.filterwarnings("ignore:skipped:UserWarning")
def test_a_damaged_header_sends_its_raw_batch_to_the_exact_path(packed_photos, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(packed_photos, root)
    key, lost = flip_header_byte(root)
    with pytest.raises(ShardIntegrityError, match=f"{key}.*checksum mismatch"):
        list(ImageShardDataset(root, decode=False, batch_size=8))
    skipping = ImageShardDataset(root, decode=False, on_error="skip", batch_size=8)
    got = [(bytes(image.numpy()), label) for images, labels in skipping for image, label in zip(images, labels.tolist())]
    intact = [(s["image"], s["label"]) for s in ImageShardDataset(packed_photos, decode=False, output="dict")
              if s["key"] != key]
    assert got == intact and skipping.skipped == lost


def test_verify_takes_the_fast_check_only_for_a_canonical_index(packed_photos):
    """verify's column check answers yes only for the exact index repack writes: the same index with a
    leading zero on a number, or an unterminated last line, sends the shard to the member walk."""
    shard = read_manifest(packed_photos).data["shards"][0]
    tar, raw = (packed_photos / shard["path"]).read_bytes(), (packed_photos / shard["index"]).read_bytes()
    assert check_against_index(tar, raw) is not None
    head, first, rest = raw.split(b"\n", 2)
    ext, offset, tail = first.split(b" ", 2)
    for variant in (b"\n".join([head, b" ".join([ext, b"0" + offset, tail]), rest]), raw[:-1]):
        parse_index(variant, "x.idx")  # the readers accept it
        assert check_against_index(tar, variant) is None
