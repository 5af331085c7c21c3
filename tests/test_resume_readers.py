"""Exact and elastic mid-epoch resume of the map-style readers (LMDB, packed tokens, documents with
and without LengthGroupedBatchSampler, video clips) under torchdata's real StatefulDataLoader:
k batches, the loader's state through JSON, a new process builds a new dataset + loader and loads
it; what follows equals the uninterrupted run, and the epoch holds every sample exactly once."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from pipelines.sampler_resume import ResumableSampler, elastic_state, find_state
from tests.tools.reader_data import reader_datasets
from tests.tools.resume_check import build, resume_in_new_process, run

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")]
WORKERS = (0, 2, 4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return reader_datasets(tmp_path_factory.mktemp("resume"))


CASES = {  # reader -> (roots, batch size, batches before the checkpoint)
    "lmdb": (["lmdb_a"], 4, 2),
    "packed": (["text_a"], 4, 3),
    "documents": (["text_a"], 8, 3),
    "grouped": (["text_a"], 8, 3),
    "video": (["video"], 2, 2),
}


@pytest.mark.parametrize("reader", sorted(CASES))
def test_exact_resume_in_a_new_process(data, reader):
    roots, batch, k = CASES[reader]
    if any(r not in data for r in roots):
        pytest.skip("ffmpeg with libvpx is not installed")
    jobs, expected = [], []
    for workers in WORKERS:
        spec = {"reader": reader, "roots": [data[r] for r in roots], "num_workers": workers, "batch_size": batch,
                "seed": 7, "epoch": 1}
        full, _ = run(spec)
        head, state = run(spec, batches=k)
        assert head == full[:k]
        jobs.append({"spec": spec, "state": json.loads(json.dumps(state))})
        expected.append(full)
    for workers, full, rest, job in zip(WORKERS, expected, resume_in_new_process(jobs), jobs):
        assert rest == full[CASES[reader][2]:], f"{reader} with {workers} workers"
        # every sample exactly once: the epoch's multiset is that of the dataset read in index order
        in_order = {**job["spec"], "shuffle": False, "num_workers": 0,
                    "reader": "documents" if reader == "grouped" else reader}
        flat, reference = [s for b in full for s in b], [s for b in run(in_order)[0] for s in b]
        assert sorted(flat) == sorted(reference) and flat != reference
        assert len(flat) == len(build(job["spec"])[0].dataset)
    if reader == "lmdb":  # every index exactly once
        indices = [int(s.split(":")[0]) for b in expected[0] for s in b]
        assert sorted(indices) == list(range(len(indices)))


def test_ddp_ranks_still_split_and_resume(data):
    specs = [{"reader": "lmdb", "roots": [data["lmdb_a"]], "batch_size": 3, "seed": 2, "rank": r, "world_size": 2}
             for r in range(2)]
    epochs = [run(s)[0] for s in specs]
    indices = [int(x.split(":")[0]) for e in epochs for b in e for x in b]
    assert sorted(indices) == list(range(24))
    head, state = run(specs[1], batches=1)
    (rest,) = resume_in_new_process([{"spec": specs[1], "state": state}])
    assert head + rest == epochs[1]


def consumed_and_states(spec: dict, world: int, counts: list[int], kind: str) -> tuple[list[str], list[dict]]:
    seen, states = [], []
    for rank in range(world):
        batches, state = run({**spec, "rank": rank, "world_size": world}, batches=counts[rank])
        seen += [s for b in batches for s in b]
        states.append(json.loads(json.dumps(find_state(state, kind))))
    return seen, states


@pytest.mark.parametrize("reader,kind", [("lmdb", "ResumableSampler"), ("grouped", "LengthGroupedBatchSampler"),
                                         ("documents", "ResumableSampler"), ("packed-sampler", "ResumableSampler")])
@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_elastic_resume(data, reader, kind, before, after):
    spec = {"reader": reader, "roots": [data["text_a" if reader != "lmdb" else "lmdb_a"]], "batch_size": 2,
            "seed": 5, "num_workers": 0}
    everything = sorted(s for b in run(spec)[0] for s in b)  # (packed: window hashes, a multiset)
    counts = [2, 1, 2, 1][:before]
    seen, states = consumed_and_states(spec, before, counts, kind)
    folded = json.loads(json.dumps(elastic_state(states)))
    rest = []
    for rank in range(after):
        loader, sampler, ids = build({**spec, "rank": rank, "world_size": after})
        sampler.load_state_dict(folded)
        mine = [s for batch in loader for s in ids(batch)]
        rest += mine[:len(mine) - sampler.padding]  # the repeats that even out the ranks: the share's last
        sampler.set_epoch(1)  # the next epoch is the plain after-rank epoch
        _, fresh, _ = build({**spec, "rank": rank, "world_size": after})
        fresh.set_epoch(1)
        assert list(sampler) == list(fresh)
    if reader == "grouped":  # equal batch counts per rank: at most after - 1 batches of the tail left out
        assert not set(seen) & set(rest), "a sample from before the checkpoint was repeated"
        assert len(rest) == len(set(rest)) and set(seen) | set(rest) <= set(everything)
        assert len(everything) - len(seen) - len(rest) <= (after - 1) * 2
    else:  # the multiset of the epoch: each sample once (token windows may repeat their content)
        assert Counter(seen + rest) == Counter(everything)


def test_elastic_state_refuses_an_incomplete_or_mixed_set(data):
    states = [ResumableSampler(10, rank=r, world_size=2).state_dict() for r in range(2)]
    with pytest.raises(ValueError, match="one state per rank"):
        elastic_state(states[:1])
    other = dict(states[1], epoch=3)
    with pytest.raises(ValueError, match="epoch"):
        elastic_state([states[0], other])
    with pytest.raises(ValueError, match="elastic_state"):
        ResumableSampler(10, rank=0, world_size=4).load_state_dict(states[0])


def test_chained_elastic_resume_covers_the_epoch_once():
    """4 -> 3 -> 2 ranks within one epoch, sampler level: every index once."""
    size, seen = 101, []
    samplers = [ResumableSampler(size, seed=1, rank=r, world_size=4) for r in range(4)]
    for world_next, take in ((3, [5, 7, 6, 5]), (2, [4, 9, 3]), (None, None)):
        states = []
        for r, s in enumerate(samplers):
            it = iter(s)
            seen += [next(it) for _ in range(take[r])] if take else list(it)
            states.append(s.state_dict())
        if world_next is None:
            break
        folded = elastic_state(states)
        samplers = [ResumableSampler(size, seed=1, rank=r, world_size=world_next) for r in range(world_next)]
        for s in samplers:
            s.load_state_dict(folded)
    assert sorted(seen) == list(range(size))
    assert len(np.unique(seen)) == size


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4), (3, 3)])
def test_drop_last_gives_equal_counts_and_elastic_never_repeats(before, after):
    size = 103
    samplers = [ResumableSampler(size, seed=2, rank=r, world_size=before, drop_last=True) for r in range(before)]
    assert {len(s) for s in samplers} == {size // before}
    seen, states = [], []
    for r, s in enumerate(samplers):
        it = iter(s)
        seen += [next(it) for _ in range(3 + r)]
        states.append(s.state_dict())
    folded = json.loads(json.dumps(elastic_state(states)))
    resumed = [ResumableSampler(size, seed=2, rank=r, world_size=after, drop_last=True) for r in range(after)]
    for s in resumed:
        s.load_state_dict(folded)
    assert len({len(s) for s in resumed}) == 1  # DDP: every rank the same count after the resume too
    rest = [i for s in resumed for i in s]
    assert len(set(seen + rest)) == len(seen + rest)  # none repeated
    assert size - len(seen) - len(rest) < after  # at most after - 1 left out of the epoch


def test_every_state_is_plain_json_with_kind_version_epoch(data):
    from pipelines.mixture import Mixture
    from pipelines.torch_lmdb import LmdbImageDataset
    from pipelines.torch_text import DocumentDataset, LengthGroupedBatchSampler, PackedTokenDataset

    docs = DocumentDataset(data["text_a"])
    stateful = [LmdbImageDataset(data["lmdb_a"]), PackedTokenDataset(data["text_a"], 16), docs,
                ResumableSampler(10), LengthGroupedBatchSampler(docs.lengths, 4),
                Mixture([(docs, 1), (PackedTokenDataset(data["text_b"], 16), 1)])]
    if "video" in data:
        from pipelines.torch_video import VideoClipDataset

        stateful.append(VideoClipDataset(data["video"], sequence_length=3))
    for thing in stateful:
        thing.set_epoch(3)
        state = thing.state_dict()
        assert json.loads(json.dumps(state)) == state
        assert state["kind"] == type(thing).__name__ and state["version"] == 1 and state["epoch"] == 3
        thing.load_state_dict(json.loads(json.dumps(state)))
        with pytest.raises(ValueError, match="state"):
            thing.load_state_dict({**state, "kind": "Other"})


def test_a_rank_done_before_the_checkpoint_counts_its_whole_share():
    size, seen, states = 50, [], []
    for rank in range(4):
        sampler = ResumableSampler(size, seed=4, rank=rank, world_size=4)
        it = iter(sampler)
        seen += list(it) if rank == 0 else [next(it) for _ in range(rank)]  # rank 0 finished its share
        states.append(json.loads(json.dumps(sampler.state_dict())))
    assert states[0]["yielded"] == 13
    done = ResumableSampler(size, seed=4, rank=0, world_size=4)
    done.load_state_dict(states[0])
    assert list(done) == [] and len(list(done)) == 13  # resumed at its end: nothing; the next pass is whole
    folded = elastic_state(states)
    rest = []
    for rank in range(3):
        sampler = ResumableSampler(size, seed=4, rank=rank, world_size=3)
        sampler.load_state_dict(folded)
        mine = list(sampler)
        rest += mine[:len(mine) - sampler.padding]  # less the repeat that evens out the ranks
    assert sorted(seen + rest) == list(range(size))


def test_a_state_is_refused_by_a_dataset_packed_again_into_the_same_shard_names_and_counts(tmp_path):
    """The state's dataset identity holds its shards' content: a dataset packed again into OUT with
    --overwrite --shuffle (same names, same counts, other samples at each position) refuses a state of
    the first, which it took silently (19 of 100 samples repeated, 19 never read). The same packing again
    (deterministic: the same shards) still resumes exactly."""
    from pipelines.stateful_loader import StatefulDataLoader
    from pipelines.torch_webdataset import ImageShardDataset
    from tests.benchmarks.tiny_files import tiny_jpegs
    from tests.conftest import run_repack

    src, out = tiny_jpegs(tmp_path / "src", 0, 100, workers=1), tmp_path / "out"

    def pack(*extra: str) -> None:
        run_repack("images", src, out, "--verify", "none", "--quiet", "--shard-size", "20", *extra)

    def loader() -> StatefulDataLoader:
        dataset = ImageShardDataset(out, output="dict", decode=False)
        return StatefulDataLoader(dataset, batch_size=10, num_workers=0, collate_fn=lambda b: [s["key"] for s in b])

    pack()
    first = loader()
    batches = iter(first)
    seen = [key for _ in range(3) for key in next(batches)]
    state = json.loads(json.dumps(first.state_dict()))
    pack("--overwrite")  # the same inputs and options: the same shards
    again = loader()
    again.load_state_dict(state)
    rest = [key for batch in again for key in batch]
    assert sorted(seen + rest) == sorted(set(seen + rest)) and len(seen + rest) == 100
    pack("--overwrite", "--shuffle", "--seed", "7")
    other = loader()
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="holds other shards"):
        next(iter(other))


def test_a_sampler_state_is_refused_by_a_sampler_with_other_ordering_options():
    """A sampler's state carries the options that make its order (shuffle and drop_last; batch size, mega
    and the lengths of a length-grouped one): loaded into a sampler with others it is refused by name (it
    was taken: 4 of 20 indices read twice, 52 of 200 never). A state without them (an older repack's)
    still loads."""
    from pipelines.torch_text import LengthGroupedBatchSampler

    sampler = ResumableSampler(20, seed=0, shuffle=True)
    sampler.set_epoch(0)
    taken = iter(sampler)
    [next(taken) for _ in range(8)]
    state = json.loads(json.dumps(sampler.state_dict()))
    for other in ({"shuffle": False}, {"drop_last": True}):
        with pytest.raises(ValueError, match=f"saved with {next(iter(other))}"):
            ResumableSampler(20, seed=0, **{"shuffle": True, **other}).load_state_dict(state)
    same = ResumableSampler(20, seed=0, shuffle=True)
    same.load_state_dict(state)
    same.set_epoch(0)
    assert len(list(same)) == 12
    older = {key: value for key, value in state.items() if key != "order"}
    ResumableSampler(20, seed=0, shuffle=False).load_state_dict(older)

    lengths = [(i * 37) % 101 for i in range(200)]
    grouped = LengthGroupedBatchSampler(lengths, 4, seed=0, mega=50)
    grouped.set_epoch(0)
    batches = iter(grouped)
    [next(batches) for _ in range(20)]
    state = json.loads(json.dumps(grouped.state_dict()))
    for changed in ({"mega": 5}, {"drop_last": True}, {"batch_size": 5}):
        options = {"batch_size": 4, "mega": 50, **changed}
        batch_size = options.pop("batch_size")
        with pytest.raises(ValueError, match=f"saved with {next(iter(changed))}|saved with size"):
            LengthGroupedBatchSampler(lengths, batch_size, seed=0, **options).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with lengths"):
        LengthGroupedBatchSampler(lengths[::-1], 4, seed=0, mega=50).load_state_dict(state)
    LengthGroupedBatchSampler(lengths, 4, seed=0, mega=50).load_state_dict(state)
