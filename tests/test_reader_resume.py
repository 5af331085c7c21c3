"""ImageShardDataset under torchdata's StatefulDataLoader: stop after k batches, save the loader's
state as JSON, resume in a new process: the batches that follow are the uninterrupted run's, the
epoch covers every sample once, and the resumed run reads no byte of a consumed sample. Elastic:
N ranks' states finish the epoch on M ranks (4 -> 2, 2 -> 4), each remaining sample once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from pipelines.manifest_access import read_index
from pipelines.resume import elastic_states
from pipelines.tar_blocks import sample_span
from pipelines.torch_webdataset import ImageShardDataset
from tests.conftest import ROOT
from tests.tools.image_resume import BATCH, keys_and_labels, make
from tests.tools.loaders import failing_loader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def resume_elsewhere(root, cases: list[dict]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.tools.image_resume"], input=json.dumps([str(root), cases]), capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def span_bytes(root, keys: set[str]) -> int:
    """Bytes of the tar spans (headers, data, padding) of the samples ``keys``."""
    dataset = ImageShardDataset(root)
    return sum(b - a for shard in range(len(dataset.counts)) for s in read_index(dataset.manifest, shard)
               if s.key in keys for a, b in [sample_span(s)])


CASES = [(w, shuffle) for w in (0, 2, 4) for shuffle in (False, True)] + [(2, "ddp")]


def test_resume_in_a_new_process_equals_the_uninterrupted_run(packed_photos):
    cases, expected = [], []
    for workers, mode in CASES:
        options = {"shuffle": bool(mode), "seed": 11, "shuffle_buffer": 16}
        epoch = 0
        if mode == "ddp":  # DDP rank 1 of 2 with drop_last, a later epoch
            options.update(rank=1, world_size=2, drop_last=True)
            epoch = 3
        dataset, loader = make(packed_photos, workers, **options)
        dataset.set_epoch(epoch)
        full = list(loader)
        dataset, loader = make(packed_photos, workers, **options)
        dataset.set_epoch(epoch)
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))  # plain JSON, round-trips
        del it
        assert head == full[:3]
        cases.append({"workers": workers, "options": options, "epoch": epoch, "state": state})
        expected.append((full, len(dataset)))
    for (workers, mode), case, (full, length), got in zip(CASES, cases, expected,
                                                          resume_elsewhere(packed_photos, cases)):
        assert got["batches"] == full[3:], (workers, mode)
        keys = [key for batch in full for key, _ in batch]
        assert len(keys) == len(set(keys)) == length, (workers, mode)
        rest = {key for batch in full[3:] for key, _ in batch}
        assert got["bytes"] == span_bytes(packed_photos, rest), (workers, mode)  # nothing consumed re-read
    # shuffling changed the order, and DDP + drop_last gave rank 1 its equal share
    assert expected[1][0] != expected[0][0] and expected[-1][1] == 60


def test_state_is_small_json_and_refuses_another_dataset(packed_photos):
    dataset, loader = make(packed_photos, 0, shuffle=True)
    it = iter(loader)
    next(it)
    state = dataset.state_dict()
    assert state["kind"] == "ImageShardDataset" and state["version"] == 3 and state["epoch"] == 0
    assert state["position"] == BATCH and json.loads(json.dumps(state)) == state
    other = ImageShardDataset(packed_photos, shuffle=True, seed=99)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="drop_last"):  # a rank's share depends on it
        ImageShardDataset(packed_photos, shuffle=True, drop_last=not state["drop_last"]).load_state_dict(state)
    wrong_workers = ImageShardDataset(packed_photos, shuffle=True, output="dict", decode=False)
    wrong_workers.load_state_dict(state)
    with pytest.raises(ValueError, match="same num_workers"), failing_loader(
            StatefulDataLoader(wrong_workers, batch_size=BATCH, num_workers=2, collate_fn=keys_and_labels)) as failing:
        list(failing)


def run_ranks(root, world: int, batches: list[int], workers: int, states: list | None = None,
              epoch: int | None = None):
    """Each rank of ``world`` (after loading ``states[rank]``, then ``set_epoch(epoch)``) reads
    ``batches[rank]`` batches (-1: to the end); (keys read, loader states)."""
    keys, saved = [], []
    for rank in range(world):
        dataset, loader = make(root, workers, shuffle=True, seed=4, shuffle_buffer=10, rank=rank, world_size=world)
        if states is not None:
            dataset.load_state_dict(states[rank])
        if epoch is not None:
            dataset.set_epoch(epoch)
        it = iter(loader)
        for i, batch in enumerate(it):
            keys += [key for key, _ in batch]
            if i + 1 == batches[rank]:
                break
        saved.append(json.loads(json.dumps(loader.state_dict())))
    return keys, saved


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4)])
def test_elastic_resume_finishes_the_epoch_once(packed_photos, old, new):
    before, states = run_ranks(packed_photos, old, [1, 2, 3, 1][:old], workers=2)
    shares = elastic_states(states, new)
    assert [s["rank"] for s in shares] == list(range(new)) and all(json.loads(json.dumps(s)) == s for s in shares)
    after, _ = run_ranks(packed_photos, new, [-1] * new, workers=2, states=shares)
    repeats = sum(b - a for s in shares for a, b in s["runs"] if a >= 120)  # padding: one per short share
    assert len(set(before) & set(after)) <= repeats  # nothing delivered before comes again, but the repeats
    assert len(before) + len(after) == 120 + repeats
    assert len(set(before) | set(after)) == 120  # every sample of the epoch
    lengths = [sum(b - a for a, b in s["runs"]) for s in shares]
    assert max(lengths) == min(lengths)  # every new rank as many samples: as many steps
    # the next epoch is the normal M-rank epoch (the loaded share is of epoch 0: set_epoch(1) leaves it)
    nxt, _ = run_ranks(packed_photos, new, [-1] * new, workers=2, states=shares, epoch=1)
    fresh = [s.key for rank in range(new) for w in range(2)
             for s in ImageShardDataset(packed_photos, shuffle=True, seed=4, shuffle_buffer=10, rank=rank,
                                        world_size=new).worker_samples(w, 2, epoch=1)]
    assert sorted(nxt) == sorted(fresh) and len(set(nxt)) == 120


def test_a_resumed_share_checkpoints_and_resumes_again(packed_photos):
    before, states = run_ranks(packed_photos, 2, [2, 1], workers=2)
    share = elastic_states(states, 3)[1]
    dataset, loader = make(packed_photos, 2, shuffle=True, seed=4, shuffle_buffer=10, rank=1, world_size=3)
    dataset.load_state_dict(share)
    full = list(loader)
    dataset, loader = make(packed_photos, 2, shuffle=True, seed=4, shuffle_buffer=10, rank=1, world_size=3)
    dataset.load_state_dict(share)
    it = iter(loader)
    head = [next(it)]
    state = json.loads(json.dumps(loader.state_dict()))
    dataset, loader = make(packed_photos, 2, shuffle=True, seed=4, shuffle_buffer=10, rank=1, world_size=3)
    loader.load_state_dict(state)
    assert head + list(loader) == full
    assert sum(len(b) for b in full) == sum(b - a for a, b in share["runs"])


def test_elastic_refuses_an_incomplete_checkpoint(packed_photos):
    _, states = run_ranks(packed_photos, 2, [1, 1], workers=2)
    with pytest.raises(ValueError, match="every worker of all 2 ranks"):
        elastic_states(states[:1], 3)
