"""The DALI loaders give every DDP rank as many batches per epoch and never an empty one (DALI's CPU
backend): a rank with one step fewer hangs DDP's all-reduce, and a 0-sample batch makes the loss NaN.
37 images over 2 and 3 ranks: every sample once per epoch plus at most one repeat per rank."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pipelines.dali_lmdb import dali_lmdb_loader
from pipelines.dali_webdataset import dali_image_loader
from tests.conftest import run_repack
from tests.test_images_job import write_jpegs

SAMPLES = 37


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("steps")
    for c in range(4):
        write_jpegs(base / f"src/c{c}", 10 if c < 3 else SAMPLES - 30, stem=f"c{c}_")
    run_repack("images", base / "src", base / "wds", "--shard-size", "8", "--quiet")
    run_repack("images", base / "src", base / "lmdb", "--to", "lmdb", "--quiet")
    return {"wds": str(base / "wds"), "lmdb": str(base / "lmdb")}


def epoch_rows(loader, field: str) -> list[list]:
    """One epoch of ``loader``: per batch, the samples' identities (``meta`` -> the source path, ``index``)."""
    rows = []
    for batch in loader:
        values = batch[0][field]
        if field == "meta":
            rows.append([json.loads(bytes(v.numpy()).rstrip(b"\0"))["path"] for v in values])
        else:
            rows.append([int(v) for v in values])
    return rows


def check_epoch(per_rank: list[list[list]], paddings: list[int], batch_size: int) -> None:
    steps = {len(rows) for rows in per_rank}
    assert len(steps) == 1, f"ranks yield {[len(rows) for rows in per_rank]} batches"
    assert all(rows and all(0 < len(b) <= batch_size for b in rows) for rows in per_rank), per_rank
    seen = Counter(s for rows in per_rank for b in rows for s in b)
    assert len(seen) == SAMPLES, "a sample is missing"
    assert sum(seen.values()) == SAMPLES + sum(paddings)
    assert all(count <= 2 for count in seen.values())


@pytest.mark.parametrize("ranks,batch_size", [(3, 4), (2, 6), (3, 13)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_webdataset_ranks_take_equal_steps_without_empty_batches(roots, ranks, batch_size, shuffle):
    loaders = [dali_image_loader(roots["wds"], batch_size=batch_size, num_threads=1, device_id=None, size=None,
                                 shard_id=rank, num_shards=ranks, random_shuffle=shuffle, initial_fill=8,
                                 with_meta=True) for rank in range(ranks)]
    for _ in range(2):  # DALI moves each rank to the next shard every epoch: the short ranks change
        paddings = [loader.padding for loader in loaders]
        per_rank = [epoch_rows(loader, "meta") for loader in loaders]
        check_epoch(per_rank, paddings, batch_size)
        for rows, padding in zip(per_rank, paddings):
            if padding:  # the repeat is the rank's last sample, alone in the last batch
                assert len(rows[-1]) == 1 and rows[-1][0] == rows[-2][-1]


@pytest.mark.parametrize("ranks,batch_size", [(3, 4), (2, 6)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_lmdb_ranks_take_equal_steps(roots, ranks, batch_size, drop_last):
    loaders = [dali_lmdb_loader(roots["lmdb"], batch_size=batch_size, num_threads=1, device_id=None, size=None,
                                shard_id=rank, num_shards=ranks, random_shuffle=True, with_index=True,
                                drop_last=drop_last) for rank in range(ranks)]
    steps = len(loaders[0])
    assert all(len(loader) == steps for loader in loaders)
    for _ in range(2):
        per_rank = [epoch_rows(loader, "index") for loader in loaders]
        assert [len(rows) for rows in per_rank] == [steps] * ranks
        samples = [s for rows in per_rank for b in rows for s in b]
        if drop_last:
            assert len(samples) == len(set(samples)) == SAMPLES // ranks * ranks
            assert all(len(b) == batch_size for rows in per_rank for b in rows)
        else:
            assert set(samples) == set(range(SAMPLES))
            assert len(samples) == -(-SAMPLES // ranks) * ranks  # a short rank repeats its epoch's first sample
            for rows, loader in zip(per_rank, loaders):
                flat = [s for b in rows for s in b]
                assert len(flat) - len(set(flat)) == loader.padding  # the repeat the loader reports
                if loader.padding:
                    assert flat[-1] == flat[0]


@pytest.mark.parametrize("ranks,batch_size", [(5, 2), (3, 4)])
def test_webdataset_drop_gives_every_epoch_full_batches_of_distinct_samples(roots, ranks, batch_size):
    """last_batch="drop" over a padding reader with several ranks: DALI's DROP left the padded batch in the
    pipeline, so from the second epoch a rank began with one image repeated batch_size times and samples were
    never delivered. Every epoch now yields every rank the full batches of the smallest share, each sample once;
    a loader resumed from a state taken at the epoch's end goes on exactly."""
    smallest = SAMPLES // ranks
    options = dict(batch_size=batch_size, num_threads=1, device_id=None, size=None, num_shards=ranks,
                   with_meta=True, last_batch="drop")
    loaders = [dali_image_loader(roots["wds"], shard_id=rank, **options) for rank in range(ranks)]
    epochs = []
    for _ in range(3):
        per_rank = [epoch_rows(loader, "meta") for loader in loaders]
        assert all(len(rows) == smallest // batch_size and all(len(b) == batch_size for b in rows)
                   for rows in per_rank), per_rank
        seen = Counter(s for rows in per_rank for b in rows for s in b)
        assert set(seen.values()) == {1}, seen
        epochs.append(per_rank[0])
    with pytest.raises(ValueError, match="every epoch would be empty"):
        dali_image_loader(roots["wds"], shard_id=0, **{**options, "batch_size": smallest + 1})
    loader = dali_image_loader(roots["wds"], shard_id=0, **options)
    for _ in range(len(loader)):  # the epoch's last batch taken, its end not seen yet
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = dali_image_loader(roots["wds"], shard_id=0, state=state, **options)
    assert epoch_rows(resumed, "meta") == [] and epoch_rows(resumed, "meta") == epochs[1]


def test_lmdb_drop_last_with_a_batch_larger_than_a_rank_share_is_refused_by_name(roots):
    """DALI's own traceback said "last_batch_policy is set to PARTIAL" for a drop_last loader whose batch exceeds a
    rank's samples; the loader names the dataset and the sizes now."""
    with pytest.raises(ValueError, match=r"batch_size 16 is more than a rank's 12 sample\(s\) \(37 over 3"):
        dali_lmdb_loader(roots["lmdb"], batch_size=16, num_threads=1, device_id=None, size=None, shard_id=0,
                         num_shards=3, drop_last=True)
