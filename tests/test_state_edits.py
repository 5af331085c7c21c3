"""A reader state edited by hand (a count out of its range, a string for a number) is refused with a ValueError
naming the field, by every reader that resumes: before, a negative position replayed consumed samples, an
oversized one ended the epoch at once, and a string failed later with a bare TypeError."""

from __future__ import annotations

import json

import pytest

from pipelines.mixture import Mixture
from pipelines.sampler_resume import ResumableSampler
from pipelines.torch_webdataset import ImageShardDataset


def edited(state: dict, **changes) -> dict:
    return {**json.loads(json.dumps(state)), **changes}


def test_an_image_reader_state_with_counts_out_of_range_is_refused(packed_photos):
    reader = ImageShardDataset(packed_photos, output="dict", decode=False)
    it = iter(reader)
    [next(it) for _ in range(5)]
    state = reader.state_dict()
    share = state["runs"][-1][1]
    for change, said in ((dict(position=-3), "position -3 is not a count"),
                         (dict(position=10 ** 6), "position 1000000 is not a count"),
                         (dict(position="5"), "position '5' is not a count"),
                         (dict(position=True), "position True is not a count"),
                         (dict(epoch=-1), "epoch -1 is not a count"),
                         (dict(skipped=-5), "skipped -5 is not a count"),
                         (dict(runs=[[0, share + 100]]), "runs stop"),
                         (dict(runs=[[5, 3]]), "not ascending, disjoint and non-empty"),
                         (dict(worker=None), "position 5 is not a count from 0 to 0"),
                         (dict(num_workers=0), "num_workers 0 is no worker count")):
        with pytest.raises(ValueError, match=said):
            ImageShardDataset(packed_photos, output="dict", decode=False).load_state_dict(edited(state, **change))
    resumed = ImageShardDataset(packed_photos, output="dict", decode=False)
    resumed.load_state_dict(edited(state))
    assert len(list(resumed)) == share - 5


def test_a_sampler_state_with_counts_out_of_range_is_refused():
    sampler = ResumableSampler(40, seed=1)
    it = iter(sampler)
    [next(it) for _ in range(5)]
    state = sampler.state_dict()
    for change, said in ((dict(yielded=-3), "yielded -3 is not a count from 0 to 40"),
                         (dict(yielded=10 ** 6), "yielded 1000000 is not a count"),
                         (dict(yielded=5.9), "yielded 5.9 is not a count"),
                         (dict(epoch="0"), "epoch '0' is not a count"),
                         (dict(history=[{"world_size": 2, "yielded": [-1, 3]}]), "history count -1"),
                         (dict(history=[{"world_size": 2, "yielded": [3]}]), "one count per rank")):
        with pytest.raises(ValueError, match=said):
            ResumableSampler(40, seed=1).load_state_dict(edited(state, **change))


def test_a_mixture_state_with_counts_out_of_range_is_refused_and_changes_nothing(packed_photos):
    def mixture():
        return Mixture([(ImageShardDataset(packed_photos, output="dict", decode=False), 0.5),
                        (ImageShardDataset(packed_photos, output="dict", decode=False, seed=3), 0.5)], seed=0)

    first = mixture()
    it = iter(first)
    [next(it) for _ in range(6)]
    state = json.loads(json.dumps(first.state_dict()))
    with pytest.raises(ValueError, match="drawn -5 is not a count"):
        mixture().load_state_dict(edited(state, drawn=-5))
    sources = json.loads(json.dumps(state["sources"]))
    sources[1]["pass"] = -1
    with pytest.raises(ValueError, match="source 1's pass -1 is not a count"):
        mixture().load_state_dict(edited(state, sources=sources))
