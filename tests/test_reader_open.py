"""Opening a reader at scale: the index text is parsed in pieces spread over threads and joined once,
into the same columns a shard-by-shard parse gives, and opening costs memory in proportion to the
columns it keeps, not to the index text it parses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import torch
import pytest

from pipelines import index_process, manifest_access, torch_webdataset
from pipelines.torch_webdataset import ImageShardDataset
from repack.manifest import ManifestError, read_manifest
from repack.manifest.shard_index import concat, parse_index
from tests.tools.loaders import failing_loader
from tests.tools.synthetic_shards import synthetic_dataset, varied_dataset

COLUMNS = ("shard_starts", "first_member", "key_ends", "keys", "ext", "suffix", "offset", "size")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """One-shard synthetic datasets of 20,000 and 40,000 samples (real tars and indexes)."""
    base = tmp_path_factory.mktemp("open")
    return {n: synthetic_dataset(base / str(n), n, n) for n in (20_000, 40_000)}


def _opened_peak(root) -> tuple[int, int]:
    """(samples, the traced peak bytes of opening ``root``)."""
    tracemalloc.start()
    try:
        dataset = ImageShardDataset(root, decode=False, batch_size=256)
        return dataset.total_samples, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_opening_peaks_at_the_columns_not_at_the_index_text(datasets, monkeypatch):
    # pieces far smaller than the shard (at 1M samples a 1 MB piece is ~1/5 of a shard): the parse's
    # transient is then threads x piece, and only the kept columns grow with the samples
    monkeypatch.setattr(manifest_access, "INDEX_PIECE_BYTES", 64 << 10)
    ImageShardDataset(datasets[20_000], decode=False, batch_size=256)  # imports and caches outside the measure
    small, big = _opened_peak(datasets[20_000]), _opened_peak(datasets[40_000])
    growth = (big[1] - small[1]) / (big[0] - small[0])
    # the columns are ~35 B a sample here; parsing a whole shard's text at once peaked at ~645 B a sample
    assert growth <= 150, f"opening peaks at {growth:.0f} B more per sample"


def test_pieces_parsed_on_threads_join_into_the_shard_by_shard_index(datasets, tmp_path, monkeypatch):
    root = synthetic_dataset(tmp_path / "three", 3 * 4_000, 4_000)
    manifest = read_manifest(root)
    wanted = concat([parse_index((root / s["index"]).read_bytes(), s["index"]) for s in manifest.data["shards"]])
    monkeypatch.setattr(manifest_access, "INDEX_PIECE_BYTES", 7_000)  # ~40 pieces over the threads
    monkeypatch.setattr(manifest_access, "usable_cpus", lambda: 4)
    got = manifest_access.read_index_columns(manifest)
    for name in COLUMNS:
        assert np.array_equal(getattr(got, name), getattr(wanted, name)), name
    assert (got.exts, got.suffixes, got.key_width) == (wanted.exts, wanted.suffixes, wanted.key_width)
    assert got.shard_starts.tolist() == [0, 4_000, 8_000, 12_000]


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """300 distinct small shards of 1-9 samples (shard i's images are i % 50 + 1 bytes)."""
    sizes = [1 + (i * 5) % 9 for i in range(300)]
    return varied_dataset(tmp_path_factory.mktemp("many") / "ds", sizes, [i % 50 + 1 for i in range(300)])


def test_small_indexes_parsed_together_join_into_the_shard_by_shard_index(many_shards, monkeypatch):
    manifest = read_manifest(many_shards)
    wanted = concat([parse_index((many_shards / s["index"]).read_bytes(), s["index"])
                     for s in manifest.data["shards"]])
    monkeypatch.setattr(manifest_access, "INDEX_PIECE_BYTES", 4_000)  # ~10 small files a piece
    monkeypatch.setattr(manifest_access, "INDEX_FILES_AT_ONCE", 37)  # groups end at batch ends too
    monkeypatch.setattr(manifest_access, "usable_cpus", lambda: 4)
    got = manifest_access.read_index_columns(manifest)
    for name in COLUMNS:
        assert np.array_equal(getattr(got, name), getattr(wanted, name)), name
    assert (got.exts, got.suffixes, got.key_width) == (wanted.exts, wanted.suffixes, wanted.key_width)
    assert got.shard_starts.tolist() == np.cumsum([0] + [s["samples"] for s in manifest.data["shards"]]).tolist()


@pytest.mark.parametrize("damage", ["malformed line", "line dropped"])
def test_a_damaged_small_index_is_named_though_parsed_with_its_neighbours(many_shards, tmp_path, monkeypatch,
                                                                           damage):
    root = tmp_path / "ds"
    root.mkdir()
    for path in many_shards.iterdir():
        os.link(path, root / path.name)
    idx = root / "shard-000151.idx"
    head, *lines = idx.read_text().splitlines(keepends=True)
    assert len(lines) > 1
    os.unlink(idx)  # a file of its own, not the fixture's
    if damage == "malformed line":
        lines[1] = lines[1].replace(" ", "  ", 1)
    else:
        del lines[1]
    idx.write_text(head + "".join(lines))
    monkeypatch.setattr(manifest_access, "INDEX_PIECE_BYTES", 4_000)
    with pytest.raises(ManifestError) as caught:
        manifest_access.read_index_columns(read_manifest(root))
    message = str(caught.value)
    assert message.startswith(f"{idx}:") and "shard-000150" not in message and "shard-000152" not in message
    assert ("malformed index line" if damage == "malformed line" else "matching sample count") in message


@pytest.mark.parametrize("size", [100, 300_000], ids=["read", "mapped"])
def test_an_index_without_a_newline_is_refused_by_name(many_shards, tmp_path, size):
    root = tmp_path / "ds"
    root.mkdir()
    for path in many_shards.iterdir():
        os.link(path, root / path.name)
    idx = root / "shard-000001.idx"
    os.unlink(idx)
    idx.write_bytes(b"v1.2 6" + b" " * size)  # a header and no line end (a mapped one crashed: no .split)
    with pytest.raises(ManifestError, match=f"^{idx}: not a v1.2 index with a matching sample count"):
        manifest_access.read_index_columns(read_manifest(root))


_EPOCH_UNDER_A_FILE_LIMIT = """
import resource, sys
from collections import Counter
from torch.utils.data import DataLoader
from pipelines.torch_webdataset import ImageShardDataset
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
sizes = Counter()
dataset = ImageShardDataset(sys.argv[1], decode=False, batch_size=16, shuffle=True, seed=5)
for images, labels in DataLoader(dataset, batch_size=None, num_workers=2):
    sizes.update(len(image) for image in images)
print(sorted(sizes.items()))
"""


def test_a_dataset_of_more_shards_than_the_process_may_open_files_reads_every_sample_once(tmp_path):
    # 1,200 shards against a limit of 200 open files: small index files are read, not mapped, a batch at a
    # time and a worker keeps at most files_allowed(OPEN_SHARDS) shards open (every index file mapped at
    # once, and every shard the epoch had read kept open, failed with "Too many open files")
    sizes = [1 + i % 3 for i in range(1_200)]
    payloads = [i % 50 + 1 for i in range(1_200)]
    root = varied_dataset(tmp_path / "ds", sizes, payloads)
    wanted = {}
    for count, payload in zip(sizes, payloads):
        wanted[payload] = wanted.get(payload, 0) + count
    done = subprocess.run([sys.executable, "-c", _EPOCH_UNDER_A_FILE_LIMIT, str(root), "200"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(sorted(wanted.items()))


def _mapping_rss(mapping) -> int:
    """This process's resident bytes of ``mapping`` (its /proc/self/smaps entry)."""
    address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.mark.parametrize("forked", [True, False], ids=["forked-helper", "python-m-helper"])
def test_a_large_index_is_parsed_by_a_helper_into_the_same_columns(datasets, monkeypatch, forked):
    root = datasets[40_000]
    manifest = read_manifest(root)
    here, mapping = manifest_access.read_shared_index(manifest)
    assert mapping is None  # 2.3 MB of index text: parsed in this process
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0)
    monkeypatch.setattr(index_process, "can_fork", lambda: forked)  # (a pytest-xdist worker runs a thread)
    helped, mapping = manifest_access.read_shared_index(manifest)
    assert mapping is not None
    for name in COLUMNS:
        got = getattr(helped, name)
        assert got.dtype == getattr(here, name).dtype and np.array_equal(got, getattr(here, name)), name
        assert not got.flags.writeable, name  # a read-only view of the shared mapping
    assert (helped.exts, helped.suffixes, helped.key_width) == (here.exts, here.suffixes, here.key_width)


@pytest.mark.parametrize("forked", [True, False], ids=["forked-helper", "python-m-helper"])
def test_the_helper_names_the_index_it_refuses(tmp_path, monkeypatch, forked):
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0)
    monkeypatch.setattr(index_process, "can_fork", lambda: forked)
    root = synthetic_dataset(tmp_path / "bad", 2 * 1_000, 1_000)
    index = root / "shard-000001.idx"
    index.unlink()  # a hard link to shard 0's index: write its own, with one line cut
    lines = (root / "shard-000000.idx").read_text().splitlines(keepends=True)
    index.write_text("".join(lines[:-1]))
    # opening does not wait for the parse: the index is refused where it is first used, in the training
    # process or in a DataLoader worker (the loader raises it here)
    with pytest.raises(ManifestError, match="shard-000001.idx"):
        ImageShardDataset(root, decode=False, batch_size=256).index
    loader = torch.utils.data.DataLoader(ImageShardDataset(root, decode=False, batch_size=256), batch_size=None,
                                         num_workers=2)
    with pytest.raises(ManifestError, match="shard-000001.idx"), failing_loader(loader) as failing:
        next(failing)
    index.unlink()
    with pytest.raises(FileNotFoundError, match="shard-000001.idx"):
        manifest_access.read_shared_index(read_manifest(root))


def test_workers_wait_for_the_helper_that_the_training_process_never_waited_for(tmp_path, monkeypatch):
    # the training process forks its workers right after opening; each worker waits for the helper's
    # columns itself (a shared lock the helper holds until it answered), and every sample comes once
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0)
    dataset = ImageShardDataset(synthetic_dataset(tmp_path / "w", 4 * 10_000, 10_000), decode=False, batch_size=256)
    assert dataset._shared_index.in_helper and dataset._shared_index._done is None  # not waited for here
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    labels = np.concatenate([batch_labels.numpy() for _, batch_labels in loader])
    assert dataset._shared_index._done is None  # the workers waited, the training process did not
    assert np.array_equal(np.sort(labels), np.sort(np.tile(np.arange(10_000) % 10, 4)))
    assert dataset.index.samples == 40_000


@pytest.mark.parametrize("forked", [True, False], ids=["forked-helper", "python-m-helper"])
def test_a_helper_that_dies_before_answering_is_reported_not_waited_for_forever(tmp_path, monkeypatch, forked):
    monkeypatch.setattr(index_process, "can_fork", lambda: forked)
    fifo = tmp_path / "index.fifo"
    os.mkfifo(fifo)  # opening it blocks the helper until a writer comes: it is killed there, deterministically
    pending = index_process.PendingIndex([str(fifo)], [1])
    helper = pending._pid if forked else pending._run.pid
    os.kill(helper, signal.SIGKILL)
    with pytest.raises(index_process.HelperUnavailable, match="ended without a reply .exit -9"):
        pending.result()


def test_a_reader_parses_itself_when_its_helper_died(datasets, monkeypatch):
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0)
    monkeypatch.setattr(index_process, "can_fork", lambda: True)
    manifest = read_manifest(datasets[20_000])
    shared = manifest_access.SharedIndex(manifest)
    os.kill(shared._pending._pid, signal.SIGKILL)  # killed mid-parse, or after it answered: the same columns
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        columns, _ = shared.get()
    wanted = manifest_access.parse_index_files([manifest.path(s.index) for s in manifest.shards], [20_000])
    for name in COLUMNS:
        assert np.array_equal(getattr(columns, name), getattr(wanted, name)), name


@pytest.mark.parametrize("helper", [True, False], ids=["helper", "parsed-here"])
def test_a_reader_unmaps_the_shared_index_as_it_goes(tmp_path, monkeypatch, helper):
    # bytes, not time: after an epoch the reader maps about the index pages of its last stretch of
    # samples (plus the kernel's fault-around, 64 KB a column), not all of them (~6.2 MB here; without
    # the unmapping 5.5 MB stay mapped); the same for an index parsed in this process (its columns in
    # shared anonymous maps of their own), as where the helper cannot run
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0 if helper else 1 << 62)
    monkeypatch.setattr(torch_webdataset, "INDEX_DROP_SAMPLES", 2_048)
    dataset = ImageShardDataset(synthetic_dataset(tmp_path / "big", 200_000, 40_000), decode=False, batch_size=256)
    maps = index_process.shared_maps(dataset.index, dataset._index_mapping)
    assert len(maps) == (1 if helper else 7)  # in this process: one map per joined column
    columns = sum(getattr(dataset.index, name).nbytes for name in COLUMNS)
    assert columns > 6_000_000
    delivered = sum(len(labels) for _, labels in dataset)
    assert delivered == 200_000
    mapped = sum(_mapping_rss(mapping) for mapping in maps)
    assert mapped <= 1_500_000, f"{mapped} of {columns} bytes still mapped"


def test_a_helper_parsed_reader_reads_through_spawned_workers(tmp_path, monkeypatch):
    # spawn pickles the dataset: its columns travel by value, the shared mapping stays behind
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0)
    dataset = ImageShardDataset(synthetic_dataset(tmp_path / "s", 2 * 1_000, 1_000), decode=False, batch_size=100)
    assert dataset._index_mapping is not None
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    labels = np.concatenate([batch_labels.numpy() for _, batch_labels in loader])
    assert sorted(labels.tolist()) == sorted([i % 10 for i in range(1_000)] * 2)


def test_a_reader_parses_in_its_own_process_when_the_helper_cannot_run(datasets, monkeypatch):
    monkeypatch.setattr(manifest_access, "HELPER_MIN_INDEX_BYTES", 0)
    manifest = read_manifest(datasets[20_000])
    monkeypatch.setattr(index_process, "can_fork", lambda: False)  # a thread runs here: python -m, which fails
    monkeypatch.setattr(sys, "executable", str(datasets[20_000] / "no-python-here"))
    with pytest.warns(UserWarning, match="did not start"):
        columns, mapping = manifest_access.read_shared_index(manifest)
    assert mapping is None and columns.samples == 20_000


def test_the_helper_is_forked_only_while_no_other_thread_runs():
    import threading

    assert index_process.can_fork() == (threading.active_count() == 1)  # (a pytest-xdist worker runs a thread)
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert not index_process.can_fork()  # a lock that thread holds could be copied held into a fork
    finally:
        release.set()
        thread.join()


@pytest.mark.parametrize("batch_size", [None, 256])
def test_the_first_item_holds_no_list_of_the_workers_share(datasets, batch_size):
    """One sample at a time too (the mixture's and pipeline()'s path): a window of the order at a time, not a
    Python int per position of the share (~42 B a sample: 420 MB a worker at 10M samples)."""
    peaks = []
    for n in (20_000, 20_000, 40_000):  # the first: imports and caches outside the measure
        dataset = ImageShardDataset(datasets[n], decode=False, shuffle=True, batch_size=batch_size)
        dataset.index  # the columns, measured above
        tracemalloc.start()
        try:
            next(iter(dataset))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    growth = (peaks[2] - peaks[1]) / 20_000
    assert growth <= 8, f"the first item peaks at {growth:.1f} B more per sample of the share"
