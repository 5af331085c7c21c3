"""Reader states that know their dataset and their epoch (issue 27, items 1-3): a state continues on
the version it was taken on (re-opened while kept, refused naming both versions once gc'ed), a state
taken at an epoch's end resumes into the next epoch's order with set_epoch before or after the load,
and states taken between snapshots (snapshot_every_n_steps > 1) resume exactly and elastically.
Real datasets written by `repack`, the real torchdata StatefulDataLoader, stop points at the edges
and at seeded random batches, 0 and 2 workers."""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections import Counter

import numpy as np
import pytest

from pipelines.resume import elastic_states
from pipelines.sampler_resume import ResumableSampler, elastic_state, loader_sampler_state
from pipelines.stateful_loader import StatefulDataLoader
from pipelines.torch_lmdb import LmdbImageDataset
from pipelines.torch_text import DocumentDataset, PackedTokenDataset
from pipelines.torch_webdataset import ImageShardDataset
from tests.conftest import run_repack
from tests.tools.image_resume import keys_and_labels
from tests.tools.loaders import failing_loader
from tests.tools.versioned import versioned_images, versioned_tokens

BATCH = 8


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    base = tmp_path_factory.mktemp("versions")
    return {"images": versioned_images(base), "tokens": versioned_tokens(base)}


@pytest.fixture(scope="module")
def images_gc(versions, tmp_path_factory):
    """A copy of the versioned images after `repack gc --keep 1`: version 3 alone (read only)."""
    gone = tmp_path_factory.mktemp("gc") / "images"
    shutil.copytree(versions["images"], gone)
    run_repack("gc", gone, "--keep", "1")
    return gone


def image_loader(root, workers: int, batch_mode: bool, version=None, **options):
    common = dict(output="dict", decode=False, shuffle=True, seed=3, shuffle_buffer=16, version=version, **options)
    if batch_mode:
        dataset = ImageShardDataset(root, batch_size=BATCH, **common)
        return dataset, StatefulDataLoader(dataset, batch_size=None, num_workers=workers)
    dataset = ImageShardDataset(root, **common)
    return dataset, StatefulDataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=keys_and_labels)


def keys(batch) -> list[str]:
    return list(batch["key"]) if isinstance(batch, dict) else [key for key, _ in batch]


def take(loader, count: int | None) -> tuple[list[str], dict]:
    """Keys of the next ``count`` batches (None: to the end) and the loader's state then."""
    out = []
    for i, batch in enumerate(loader):
        out += keys(batch)
        if count is not None and i + 1 == count:
            break
    return out, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_mode", [False, True])
def test_image_state_continues_on_its_version_or_refuses_naming_both(versions, images_gc, workers, batch_mode):
    root = versions["images"]
    v1 = [s.key for s in ImageShardDataset(root, version=1).worker_samples()]
    assert len(v1) == 300 and len(ImageShardDataset(root)) == 300  # v3: 300 again, other samples
    assert set(v1) != {s.key for s in ImageShardDataset(root).worker_samples()}
    per_epoch = -(-300 // BATCH) if workers == 0 else sum(-(-n // BATCH) for n in (150, 150))
    for stop in (1, random.Random(workers).randrange(2, per_epoch - 1)):
        _, loader = image_loader(root, workers, batch_mode, version=1)
        before, state = take(loader, stop)
        assert state and json.dumps(state)
        _, latest = image_loader(root, workers, batch_mode)  # no version=: the latest (3)
        latest.load_state_dict(state)
        after, _ = take(latest, None)
        assert Counter(before + after) == Counter(v1), f"stop {stop}: not exactly v1's samples, each once"
    dataset, _ = image_loader(images_gc, workers, batch_mode)
    with pytest.raises(ValueError, match=r"taken on version 1 .*reads version 3.*no longer kept"):
        dataset.load_state_dict(ImageShardDataset(root, version=1).state_dict())


def test_a_loader_with_workers_counts_the_loaded_states_version(versions):
    """A loader with workers loads its readers' states in the workers: the training process's dataset stayed on
    the latest version (300 samples) while the workers read version 2's 340, so len() and the steps per epoch
    a schedule is built from were another version's."""
    root = versions["images"]
    _, saved = image_loader(root, 2, False, version=2)
    before, state = take(saved, 3)
    dataset, latest = image_loader(root, 2, False)
    assert len(dataset) == 300
    latest.load_state_dict(state)
    assert len(dataset) == 340 and dataset.dataset["version"] == 2
    after, _ = take(latest, None)
    assert len(before) + len(after) == 340 == len(set(before + after))


def token_fingerprints(rows) -> list[str]:
    return [",".join(map(str, row.tolist())) for row in rows]


@pytest.mark.parametrize("workers", [0, 2])
def test_token_states_continue_on_their_version(versions, workers):
    root = versions["tokens"]
    v1_docs = DocumentDataset(root, version=1)
    assert len(v1_docs) == 120 and len(DocumentDataset(root)) == 120
    everything = Counter(token_fingerprints(v1_docs[i] for i in range(120)))
    assert everything != Counter(token_fingerprints(DocumentDataset(root)[i] for i in range(120)))
    for stop in (1, random.Random(7 + workers).randrange(2, 13)):
        old = DocumentDataset(root, version=1)
        sampler = ResumableSampler(len(old), seed=2, dataset=old)
        loader = StatefulDataLoader(old, batch_size=BATCH, sampler=sampler, collate_fn=list, num_workers=workers)
        seen = []
        for i, batch in enumerate(loader):
            seen += token_fingerprints(batch)
            if i + 1 == stop:
                break
        state = json.loads(json.dumps(loader.state_dict()))
        new = DocumentDataset(root)  # the latest
        resumed = StatefulDataLoader(new, batch_size=BATCH, sampler=ResumableSampler(len(new), seed=2, dataset=new),
                                     collate_fn=list, num_workers=workers)
        resumed.load_state_dict(state)
        rest = [f for batch in resumed for f in token_fingerprints(batch)]
        assert Counter(seen + rest) == everything, f"stop {stop}"
    # the windows of PackedTokenDataset: the same version rule through its own state
    packed_v1 = PackedTokenDataset(root, 16, seed=1, version=1)
    windows = Counter(token_fingerprints(packed_v1[i] for i in range(len(packed_v1))))
    loader = StatefulDataLoader(packed_v1, batch_size=4, num_workers=workers)
    head = [f for _, batch in zip(range(3), loader) for f in token_fingerprints(batch)]
    state = json.loads(json.dumps(loader.state_dict()))
    pinned = PackedTokenDataset(root, 16, seed=1, version=1)
    pinned_loader = StatefulDataLoader(pinned, batch_size=4, num_workers=workers)
    pinned_loader.load_state_dict(state)
    assert Counter(head + [f for b in pinned_loader for f in token_fingerprints(b)]) == windows
    latest = PackedTokenDataset(root, 16, seed=1)
    assert latest.per_rank != packed_v1.per_rank
    latest_loader = StatefulDataLoader(latest, batch_size=4, num_workers=workers)
    latest_loader.load_state_dict(state)  # the loader's sampler counts the reader as the iteration starts: the
    rest = [f for b in latest_loader for f in token_fingerprints(b)]  # reader is moved to version 1 before it
    assert Counter(head + rest) == windows and latest.dataset["version"] == 1
    counted = PackedTokenDataset(root, 16, seed=1)  # a sampler that counted version 3's windows: refused, naming both
    counted_loader = StatefulDataLoader(counted, batch_size=4, num_workers=workers, sampler=list(range(len(counted))))
    counted_loader.load_state_dict(state)
    with pytest.raises(Exception, match=r"taken on version 1 .*built on version 3"), \
            failing_loader(counted_loader) as failing:
        list(failing)
    assert counted.dataset["version"] == 3


def test_state_of_a_gone_version_is_refused_by_samplers_and_mixtures(versions, tmp_path):
    from pipelines.mixture import Mixture

    gone = tmp_path / "tokens"
    shutil.copytree(versions["tokens"], gone)
    old = DocumentDataset(gone, version=1)
    sampler_state = ResumableSampler(len(old), dataset=old).state_dict()
    mixture_state = Mixture([(old, 1), (DocumentDataset(gone, version=1), 1)]).state_dict()
    run_repack("gc", gone, "--keep", "1")
    new = DocumentDataset(gone)
    with pytest.raises(ValueError, match=r"version 1 .*version 3"):
        ResumableSampler(len(new), dataset=new).load_state_dict(sampler_state)
    with pytest.raises(ValueError, match=r"version 1 .*version 3"):
        Mixture([(new, 1), (DocumentDataset(gone), 1)]).load_state_dict(mixture_state)
    with pytest.raises(ValueError, match=r"version 1 .*version 3"):
        new.load_state_dict(DocumentDataset(versions["tokens"], version=1).state_dict())


# -- epoch boundaries ----------------------------------------------------------------------------
def image_reader(root, workers, persistent=False):
    dataset = ImageShardDataset(root, output="dict", decode=False, shuffle=True, seed=5, shuffle_buffer=16)
    return dataset, StatefulDataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=keys_and_labels,
                                       persistent_workers=persistent and workers > 0)


def lmdb_reader(root, workers, persistent=False):
    dataset = LmdbImageDataset(root, decode=False, output="dict")
    sampler = ResumableSampler(len(dataset), seed=5, dataset=dataset)
    return sampler, StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers,
                                       collate_fn=lambda b: [[str(s["index"]), s["label"]] for s in b],
                                       persistent_workers=persistent and workers > 0)


def mixture_reader(roots, workers, persistent=False):
    from pipelines.mixture import Mixture

    parts = [LmdbImageDataset(r, decode=False, output="dict") for r in roots]
    mixture = Mixture([(parts[0], 2), (parts[1], 1)], seed=5, tag_source=True)
    return mixture, StatefulDataLoader(mixture, batch_size=4, num_workers=workers,
                                       collate_fn=lambda b: [[f"{s}/{x['index']}", 0] for s, x in b],
                                       persistent_workers=persistent and workers > 0)


def token_reader(root, workers, persistent=False):
    """PackedTokenDataset orders its own windows per epoch; the loader's default sampler holds the position."""
    dataset = PackedTokenDataset(root, 7, seed=4)
    return dataset, StatefulDataLoader(dataset, batch_size=4, num_workers=workers,
                                       collate_fn=lambda b: [[",".join(map(str, w.tolist())), 0] for w in b],
                                       persistent_workers=persistent and workers > 0)


@pytest.fixture(scope="module")
def lmdbs(tmp_path_factory):
    from tests.tools.reader_data import reader_datasets

    data = reader_datasets(tmp_path_factory.mktemp("readers"), names=("lmdb_a", "lmdb_b"))
    return [data["lmdb_a"], data["lmdb_b"]]


def uninterrupted(make, epochs: int = 3) -> tuple[list[list[list[str]]], list[str]]:
    """The keys of ``epochs`` epochs of one loader, batch by batch, and its state (JSON) after each
    batch taken across them (index k: after k batches; 0: before any), as a training job saves them."""
    target, loader = make()
    out, states = [], [json.dumps(loader.state_dict())]
    for epoch in range(epochs):
        target.set_epoch(epoch)
        out.append([])
        for batch in loader:
            out[-1].append(keys(batch))
            states.append(json.dumps(loader.state_dict()))
    return out, states


WHEN = ("before", "after", "never")  # set_epoch called before load_state_dict, after it, or not at all


@pytest.mark.parametrize("reader", ["images", "lmdb", "mixture"])
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_state_at_an_epochs_end_resumes_into_the_next_epochs_order(versions, lmdbs, reader, workers, persistent):
    """Each state is loaded three times: with set_epoch before the load, after it, and never (the
    states are taken during the uninterrupted run, once for all three)."""
    make = {"images": lambda: image_reader(versions["images"], workers, persistent),
            "lmdb": lambda: lmdb_reader(lmdbs[0], workers, persistent),
            "mixture": lambda: mixture_reader(lmdbs, workers, persistent)}[reader]
    epochs, states = uninterrupted(make)
    flat = [(0, -1), *((e, i) for e, batches in enumerate(epochs) for i in range(len(batches)))]  # after k batches
    last = len(epochs[0])  # k batches taken: 0, 1, the last of epoch 0, after it (=1 of epoch 1), mid epoch 1
    edges = {0, 1, last - 1, last, last + 1, last + len(epochs[1]) // 2}
    stops = {when: edges | {random.Random(f"{reader}{workers}{when}").randrange(1, len(epochs[0]) + len(epochs[1]))}
             for when in WHEN}  # and a seeded random stop of each set_epoch order's own
    for k in sorted(set().union(*stops.values())):
        state, (epoch, index) = states[k], flat[k]
        for when in (w for w in WHEN if k in stops[w]):
            target, loader = make()
            if when == "before":
                target.set_epoch(epoch)
            loader.load_state_dict(json.loads(state))
            if when == "after":
                target.set_epoch(epoch)
            rest = [keys(b) for b in loader]  # the rest of the state's epoch
            assert rest == epochs[epoch][index + 1:], f"{when}, k={k}: the rest of epoch {epoch}"
            target.set_epoch(epoch + 1)
            assert [keys(b) for b in loader] == epochs[epoch + 1], f"{when}, k={k}: epoch {epoch + 1} in its own order"
            if index == len(epochs[epoch]) - 1:  # at the epoch's end: set_epoch(e + 1) first goes straight on
                target, loader = make()
                if when == "before":
                    target.set_epoch(epoch + 1)
                loader.load_state_dict(json.loads(state))
                if when != "before":
                    target.set_epoch(epoch + 1)
                got = [keys(b) for b in loader]
                if not got and reader != "lmdb" and len(epochs[epoch][-1]) < len(epochs[epoch][0]):
                    # torchdata's single-process loader state records that its fetcher ended (a short last
                    # batch): that pass is empty whatever the epoch; the next pass is epoch e + 1, not e again
                    target.set_epoch(epoch + 1)
                    got = [keys(b) for b in loader]
                assert got == epochs[epoch + 1], f"{when}, k={k}: set_epoch({epoch + 1}) around the load"


@pytest.mark.parametrize("reader", ["images", "lmdb", "mixture", "tokens"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_after_the_epochs_loop_ended_reads_nothing_again(versions, lmdbs, reader, workers):
    """The usual end-of-epoch checkpoint (the ``for`` loop ran to its end, then ``state_dict()``): loaded with
    the same epoch (set_epoch of it before or after the load, or none), the pass yields nothing, saving
    again gives the same state, and set_epoch(e + 1) then gives epoch e + 1 in its own order."""
    make = {"images": lambda: image_reader(versions["images"], workers),
            "lmdb": lambda: lmdb_reader(lmdbs[0], workers),
            "mixture": lambda: mixture_reader(lmdbs, workers),
            "tokens": lambda: token_reader(versions["tokens"], workers)}[reader]
    target, loader = make()
    target.set_epoch(1)
    epoch1 = [keys(b) for b in loader]
    state = json.dumps(loader.state_dict())
    target.set_epoch(2)
    epoch2 = [keys(b) for b in loader]
    assert epoch1 and epoch2 and epoch1 != epoch2
    for when in WHEN:
        target, loader = make()
        if when == "before":
            target.set_epoch(1)
        loader.load_state_dict(json.loads(state))
        if when == "after":
            target.set_epoch(1)
        assert [keys(b) for b in loader] == [], f"{when}: epoch 1 was over"
        assert json.loads(json.dumps(loader.state_dict())) == json.loads(state), when
        target.set_epoch(2)
        assert [keys(b) for b in loader] == epoch2, f"{when}: epoch 2 in its own order"
    target, loader = make()  # set_epoch(e + 1) straight after the load: that epoch, from its start
    loader.load_state_dict(json.loads(state))
    target.set_epoch(2)
    got = [keys(b) for b in loader]  # (without workers an empty pass came first: the loader state's reader state
    assert got == epoch2, "set_epoch(2) after the load"  # was looked for under torchdata's key with a "_")


# -- snapshots ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_mode", [False, True])
def test_states_between_snapshots_resume_exactly_and_elastically(versions, batch_mode):
    root = versions["images"]
    everything = [take(image_loader(root, 2, batch_mode, rank=rank, world_size=2)[1], None)[0] for rank in range(2)]
    rng = random.Random(11)
    for stop in (6, 7, rng.randrange(11, 15)):  # snapshots every 5 steps: stops between them
        before, states = [], []
        for rank in range(2):
            dataset, loader = image_loader(root, 2, batch_mode, rank=rank, world_size=2)
            loader.snapshot_every_n_steps = 5
            got, state = take(loader, stop)
            before += got
            states.append(state)
            assert state["_steps_since_snapshot"] == stop % 5
            _, exact = image_loader(root, 2, batch_mode, rank=rank, world_size=2)
            exact.load_state_dict(state)
            assert got + take(exact, None)[0] == everything[rank], f"exact resume at {stop}"
        shares = elastic_states(states, 3, batch_size=None if batch_mode else BATCH)
        after = []
        for rank in range(3):
            dataset, loader = image_loader(root, 2, batch_mode, rank=rank, world_size=3)
            dataset.load_state_dict(shares[rank])
            after += take(loader, None)[0]
        repeats = sum(b - a for s in shares for a, b in s["runs"] if a >= 300)
        assert len(before) + len(after) == 300 + repeats and len(set(before + after)) == 300, f"elastic at {stop}"
    if not batch_mode:
        with pytest.raises(ValueError, match="batch_size="):
            elastic_states(states, 3)


def test_sampler_states_between_snapshots_fold_exactly(lmdbs):
    seen, states = [], []
    for rank in range(2):
        dataset = LmdbImageDataset(lmdbs[0], decode=False, output="dict")
        sampler = ResumableSampler(len(dataset), seed=1, rank=rank, world_size=2, dataset=dataset)
        loader = StatefulDataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2,
                                    snapshot_every_n_steps=3, collate_fn=lambda b: [s["index"] for s in b])
        for i, batch in enumerate(loader):
            seen += batch
            if i + 1 == 4 + rank:
                break
        state = json.loads(json.dumps(loader.state_dict()))
        assert state["_steps_since_snapshot"] > 0
        states.append(loader_sampler_state(state, "ResumableSampler", batch_size=2))
    folded = elastic_state(states)
    rest = []
    for rank in range(3):
        dataset = LmdbImageDataset(lmdbs[0], decode=False, output="dict")
        sampler = ResumableSampler(len(dataset), seed=1, rank=rank, world_size=3, dataset=dataset)
        sampler.load_state_dict(folded)
        mine = list(sampler)
        rest += mine[:len(mine) - sampler.padding]
    assert sorted(seen + rest) == list(range(24))


def test_a_sampler_splitting_by_rank_over_a_token_dataset_that_splits_too_is_refused(versions):
    """The elastic route builds PackedTokenDataset without rank and world size; giving both the split would read
    every rank a 1/W fraction of its share, silently."""
    split = PackedTokenDataset(versions["tokens"], 7, shuffle=False, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"splits by rank itself \(world_size=2\)"):
        ResumableSampler(len(split), seed=4, rank=1, world_size=2, dataset=split)
    whole = PackedTokenDataset(versions["tokens"], 7, shuffle=False)
    shares = [list(ResumableSampler(len(whole), seed=4, rank=r, world_size=2, dataset=whole)) for r in (0, 1)]
    assert set(shares[0]) | set(shares[1]) == set(range(len(whole))) and len(shares[0]) == len(shares[1])


@pytest.mark.parametrize("saved,now", [(2, 0), (0, 2), (2, 3)])
def test_a_loader_state_of_another_worker_count_is_refused_by_name(versions, saved, now):
    _, loader = image_reader(versions["images"], saved)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    _, other = image_reader(versions["images"], now)
    with pytest.raises(ValueError, match=rf"taken with num_workers={saved} loaded into a loader with num_workers={now}"):
        other.load_state_dict(state)


def sampled_documents(dataset, workers: int, seed: int = 2):
    return StatefulDataLoader(dataset, batch_size=BATCH, sampler=ResumableSampler(len(dataset), seed=seed,
                                                                                  dataset=dataset),
                              collate_fn=list, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_state_of_a_version_of_another_size_resumes_on_it(versions, workers):
    """A ``ResumableSampler(dataset=...)`` state of version 2 (140 documents) loaded beside a reader built on the
    latest (120): with workers, the loader re-opened version 2 before the sampler loaded its state, and the
    sampler refused it ("saved with size 140, this one has 120"); ``PackedTokenDataset(shuffle=False)`` with the
    sampler (the elastic setup) was refused in the workers, built on the latest."""
    root = versions["tokens"]
    for build in (lambda version: DocumentDataset(root, version=version),
                  lambda version: PackedTokenDataset(root, 16, shuffle=False, version=version)):
        v2 = build(2)
        everything = Counter(token_fingerprints(v2[i] for i in range(len(v2))))
        loader = sampled_documents(v2, workers)
        head = [f for _, batch in zip(range(3), loader) for f in token_fingerprints(batch)]
        state = json.loads(json.dumps(loader.state_dict()))
        latest = build(None)
        assert len(latest) != len(v2)
        resumed = sampled_documents(latest, workers)
        resumed.load_state_dict(state)
        rest = [f for batch in resumed for f in token_fingerprints(batch)]
        assert Counter(head + rest) == everything and latest.dataset["version"] == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_refused_sampler_state_leaves_the_reader_on_the_version_it_was_built_on(versions, workers):
    """A state of version 2 refused (another sampler seed): with workers the reader stayed on version 2, where the
    loader had re-opened it, so a caller starting fresh read a version it never asked for."""
    root = versions["tokens"]
    v2 = DocumentDataset(root, version=2)
    loader = sampled_documents(v2, workers)
    next(iter(loader))
    state = json.loads(json.dumps(loader.state_dict()))
    latest = DocumentDataset(root)
    refused = sampled_documents(latest, workers, seed=5)
    refused.load_state_dict(state)
    with pytest.raises(ValueError, match="seed 2, this one has 5"), failing_loader(refused) as failing:
        next(failing)
    assert latest.dataset["version"] == 3 and len(latest) == 120
    assert sum(len(batch) for batch in sampled_documents(latest, workers, seed=5)) == 120


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_shuffling_a_map_reader_resumes_on_the_state_version_and_fixed_samplers_are_refused(versions,
                                                                                                      workers):
    """``StatefulDataLoader(shuffle=True)`` (torchdata's own RandomSampler, which counts the reader as the iteration
    starts) resumes a state of version 2 on it; a sampler that counted version 3 when it was built (a list,
    ``DistributedSampler``) is refused naming both versions: it resumed silently wrong (15 documents twice, 35
    never) or failed on a bare AssertionError."""
    from torch.utils.data import DistributedSampler

    root = versions["tokens"]
    v2 = DocumentDataset(root, version=2)
    everything = Counter(token_fingerprints(v2[i] for i in range(len(v2))))
    loader = StatefulDataLoader(v2, batch_size=BATCH, shuffle=True, collate_fn=list, num_workers=workers)
    head = [f for _, batch in zip(range(3), loader) for f in token_fingerprints(batch)]
    state = copy.deepcopy(loader.state_dict())  # torchdata's RandomSampler keeps its generator as a tensor
    latest = DocumentDataset(root)
    resumed = StatefulDataLoader(latest, batch_size=BATCH, shuffle=True, collate_fn=list, num_workers=workers)
    resumed.load_state_dict(state)
    assert Counter(head + [f for batch in resumed for f in token_fingerprints(batch)]) == everything
    for fixed in (lambda ds: list(range(len(ds))), lambda ds: DistributedSampler(ds, num_replicas=1, rank=0, seed=3)):
        v2 = DocumentDataset(root, version=2)
        taken = StatefulDataLoader(v2, batch_size=BATCH, sampler=fixed(v2), collate_fn=list, num_workers=workers)
        next(iter(taken))
        fixed_state = copy.deepcopy(taken.state_dict())
        latest = DocumentDataset(root)
        refused = StatefulDataLoader(latest, batch_size=BATCH, sampler=fixed(latest), collate_fn=list,
                                     num_workers=workers)
        refused.load_state_dict(fixed_state)
        with pytest.raises(Exception, match=r"taken on version 2 \(140 samples\), the reader was built on version 3"), \
                failing_loader(refused) as failing:
            list(failing)
        assert latest.dataset["version"] == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_refused_length_grouped_state_or_a_state_loaded_twice_changes_nothing(versions, workers):
    """A refused ``LengthGroupedBatchSampler(dataset=...)`` state left the sampler with the state version's lengths
    (a fresh epoch read 120 of 140 documents, or an IndexError), and a state loaded twice before its refusal left the
    reader on the state's version."""
    from pipelines.torch_text import LengthGroupedBatchSampler

    root = versions["tokens"]
    v1 = DocumentDataset(root, version=1)
    grouped = LengthGroupedBatchSampler(v1.lengths, 4, seed=3, dataset=v1)
    loader = StatefulDataLoader(v1, batch_sampler=grouped, collate_fn=list, num_workers=workers)
    next(iter(loader))
    state = json.loads(json.dumps(loader.state_dict()))
    v2 = DocumentDataset(root, version=2)
    other = LengthGroupedBatchSampler(v2.lengths, 4, seed=5, dataset=v2)
    refused = StatefulDataLoader(v2, batch_sampler=other, collate_fn=list, num_workers=workers)
    refused.load_state_dict(state)
    with pytest.raises(ValueError, match="seed 3, this one has 5"), failing_loader(refused) as failing:
        list(failing)
    assert v2.dataset["version"] == 2 and len(other.lengths) == 140
    assert sum(len(b) for b in StatefulDataLoader(v2, batch_sampler=other, collate_fn=list)) == 140
    v2_state = json.loads(json.dumps(sampled_documents(v2, workers).state_dict()))
    latest = DocumentDataset(root)
    twice = sampled_documents(latest, workers, seed=5)
    twice.load_state_dict(v2_state)
    twice.load_state_dict(v2_state)
    with pytest.raises(ValueError, match="seed 2, this one has 5"), failing_loader(twice) as failing:
        list(failing)
    assert latest.dataset["version"] == 3 and len(latest) == 120


def test_a_wrapped_sampler_that_loads_no_state_and_a_skipped_batch_keep_the_resume_exact(versions):
    """torch's own BatchSampler around ``ResumableSampler(dataset=...)`` is only fast-forwarded (its sampler loads no
    state): the reader was moved to the state's version under a sampler counting the built one (17 documents
    twice, 37 never), and is refused by name now. A ValueError the loop skips after the resumed epoch began
    moved the reader back to the version it was built on (v2 indices read from v3, then an IndexError)."""
    from torch.utils.data import BatchSampler

    root = versions["tokens"]

    def wrapped(dataset):
        return StatefulDataLoader(dataset, batch_sampler=BatchSampler(ResumableSampler(len(dataset), seed=3,
                                                                                       dataset=dataset), BATCH, False),
                                  collate_fn=list)

    taken = wrapped(DocumentDataset(root, version=2))
    next(iter(taken))
    state = copy.deepcopy(taken.state_dict())
    latest = DocumentDataset(root)
    refused = wrapped(latest)
    refused.load_state_dict(state)
    with pytest.raises(ValueError, match=r"taken on version 2 \(140 samples\), the reader was built on version 3"):
        list(refused)
    assert latest.dataset["version"] == 3
    v2 = DocumentDataset(root, version=2)
    everything = Counter(token_fingerprints(v2[i] for i in range(len(v2))))
    loader = sampled_documents(v2, 0)
    head = [f for _, batch in zip(range(3), loader) for f in token_fingerprints(batch)]
    state = json.loads(json.dumps(loader.state_dict()))
    latest = DocumentDataset(root)
    calls = []

    def skipping(batch):  # the sixth batch fails once; the loop skips it and reads on
        calls.append(len(batch))
        if len(calls) == 3:
            raise ValueError("a bad batch")
        return batch

    resumed = StatefulDataLoader(latest, batch_size=BATCH, sampler=ResumableSampler(len(latest), seed=2,
                                                                                  dataset=latest), collate_fn=skipping)
    resumed.load_state_dict(state)
    rest, it = [], iter(resumed)
    while True:
        try:
            rest += token_fingerprints(next(it))
        except ValueError:
            continue
        except StopIteration:
            break
    assert latest.dataset["version"] == 2 and len(head) + len(rest) + BATCH == 140
    assert not Counter(head + rest) - everything


def test_a_sampler_hands_out_its_share_in_blocks_from_any_start():
    """``OrderPosition.iterate`` turns its share into Python ints a block at a time (not the whole share at
    once): the same positions from any start, across block edges, counted as handed out."""
    from pipelines.sampler_resume import ITERATE_BLOCK, ResumableSampler

    size = 2 * ITERATE_BLOCK + 17
    sampler = ResumableSampler(size, seed=3)
    whole = list(sampler)
    assert sorted(whole) == list(range(size))
    for start in (0, 1, ITERATE_BLOCK - 1, ITERATE_BLOCK, size - 1, size):
        share = np.random.default_rng(start).permutation(size)
        position = sampler.position
        got = list(position.iterate(share, start))
        assert got == share[start:].tolist()


def test_a_reader_continuing_on_an_older_version_says_so(versions):
    """A state of version 1 loaded into a reader built on the latest (3): it continues on 1 and warns that it
    keeps reading 1, samples taken down since included, until it is built again without the state."""
    from pipelines.dataset_identity import OlderVersionWarning

    root = versions["images"]
    state = ImageShardDataset(root, version=1).state_dict()
    latest = ImageShardDataset(root)
    with pytest.warns(OlderVersionWarning, match=r"continues on version 1.*not version 3.*build the reader again"):
        latest.load_state_dict(state)
    assert latest.dataset["version"] == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the state's own version: nothing to say
        ImageShardDataset(root, version=1).load_state_dict(state)
