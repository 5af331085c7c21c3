"""Reader states that know their dataset and their epoch (issue 27, items 1-3): a state continues on
the version it was taken on (re-opened while kept, refused naming both versions once gc'ed), a state
taken at an epoch's end resumes into the next epoch's order with set_epoch before or after the load,
and states taken between snapshots (snapshot_every_n_steps > 1) resume exactly and elastically.
Real datasets written by `repack`, the real torchdata StatefulDataLoader, stop points at the edges
and at seeded random batches, 0 and 2 workers."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from pipelines.resume import elastic_states
from pipelines.sampler_resume import ResumableSampler, elastic_state, loader_sampler_state
from pipelines.torch_lmdb import LmdbImageDataset
from pipelines.torch_text import DocumentDataset, PackedTokenDataset
from pipelines.torch_webdataset import ImageShardDataset
from tests.conftest import run_repack
from tests.tools.image_resume import keys_and_labels
from tests.tools.versioned import versioned_images, versioned_tokens

BATCH = 8


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    base = tmp_path_factory.mktemp("versions")
    return {"images": versioned_images(base), "tokens": versioned_tokens(base)}


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
def test_image_state_continues_on_its_version_or_refuses_naming_both(versions, tmp_path, workers, batch_mode):
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
    gone = tmp_path / "gc"
    shutil.copytree(root, gone)
    run_repack("gc", gone, "--keep", "1")
    dataset, _ = image_loader(gone, workers, batch_mode)
    with pytest.raises(ValueError, match=r"taken on version 1 .*reads version 3.*no longer kept"):
        dataset.load_state_dict(ImageShardDataset(root, version=1).state_dict())


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
    assert latest.per_rank != packed_v1.per_rank  # its sampler counts v3's windows: refused, naming both
    latest_loader = StatefulDataLoader(latest, batch_size=4, num_workers=workers)
    latest_loader.load_state_dict(state)
    with pytest.raises(Exception, match=r"taken on version 1 .*built on version 3"):
        list(latest_loader)


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
