"""pipelines.mixture.Mixture over real readers: weighted draws (within 1% over 10,000 samples),
determinism per (seed, epoch), the exhaustion rules, disjoint samples across DDP ranks and
DataLoader workers, images with images (LMDB + WebDataset shards), tokens with tokens, and exact
resume in a new process under torchdata's StatefulDataLoader."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader

from pipelines.mixture import BLOCK, Mixture, block_counts
from pipelines.torch_lmdb import LmdbImageDataset
from pipelines.torch_text import PackedTokenDataset
from pipelines.torch_webdataset import ImageShardDataset
from tests.conftest import run_repack
from tests.tools.loaders import failing_loader
from tests.tools.reader_data import reader_datasets
from tests.tools.resume_check import resume_in_new_process, run
from tests.tools.text import train_bpe, write_tokenizer

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return reader_datasets(tmp_path_factory.mktemp("mixture"), names=("lmdb_a", "lmdb_b", "text_a", "text_b"))


def lmdb(root):
    return LmdbImageDataset(root, decode=False, output="dict")


def test_block_counts_follow_the_weights_within_one_draw():
    assert block_counts([0.7, 0.3], 2).tolist() == [[70, 30], [70, 30]]
    thirds = block_counts([1, 1, 1], 3)
    assert thirds.sum(axis=1).tolist() == [100] * 3 and thirds.sum(axis=0).tolist() == [100, 100, 100]
    weights = np.array([0.123, 0.456, 0.001, 0.42])
    running = block_counts(weights, 500).cumsum(axis=0)
    ideal = np.outer(np.arange(1, 501) * 100, weights)
    assert np.abs(running - ideal).max() < 1


def test_an_epochs_draws_do_not_depend_on_the_epochs_before_in_this_process():
    """Weights whose shares tie on remainders (0.45 : 0.6 : 0.05 of 100 draws): the table grown past its first
    block gives the first block the same counts as a fresh one (it was built from the raw weights first)."""
    weights = [0.45, 0.6, 0.05]
    assert block_counts(weights, 1)[0].tolist() == block_counts([w / sum(weights) for w in weights], 3)[0].tolist()

    def mixture():
        return Mixture([(list(range(i * 1000, i * 1000 + 500)), w) for i, w in enumerate(weights)], seed=0,
                       exhausted="repeat", samples=300, tag_source=True)

    after_epoch_0 = mixture()
    list(after_epoch_0)
    after_epoch_0.set_epoch(1)
    fresh = mixture()
    fresh.set_epoch(1)
    assert list(after_epoch_0) == list(fresh)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2)])
def test_proportions_within_one_percent_over_10000_on_every_rank(data, weights):
    roots = [data["text_a"], data["text_b"], data["text_a"]][:len(weights)]
    for rank in range(2):
        mix = Mixture([(PackedTokenDataset(r, 16, shuffle=False), w) for r, w in zip(roots, weights)], seed=3,
                      exhausted="repeat", samples=20_000, tag_source=True, rank=rank, world_size=2)
        drawn = Counter(source for source, _ in mix)
        assert sum(drawn.values()) == 10_000
        for i, w in enumerate(weights):
            assert abs(drawn[i] / 10_000 - w) < 0.01, (rank, drawn)


def test_deterministic_per_seed_and_epoch(data):
    def keys(seed, epoch):
        mix = Mixture([(lmdb(data["lmdb_a"]), 2), (lmdb(data["lmdb_b"]), 1)], seed=seed, tag_source=True)
        mix.set_epoch(epoch)
        return [(s, x["index"]) for s, x in mix]

    assert keys(1, 0) == keys(1, 0)
    assert keys(1, 0) != keys(1, 1) and keys(1, 0) != keys(2, 0)


def test_stop_ends_at_the_first_exhausted_source_and_repeat_starts_it_over(data):
    a, b = lmdb(data["lmdb_a"]), lmdb(data["lmdb_b"])  # 24 and 18 samples
    stop = [(s, x["index"]) for s, x in Mixture([(a, 1), (b, 1)], seed=0, tag_source=True)]
    by = Counter(s for s, _ in stop)
    assert (by[0] == 24) != (by[1] == 18) and len(set(stop)) == len(stop)  # one ran out: the epoch ended there
    assert len(list(Mixture([(a, 1), (b, 1)], seed=0, samples=10))) == 10
    repeat = [(s, x["index"]) for s, x in Mixture([(a, 1), (b, 1)], seed=0, exhausted="repeat", samples=100,
                                                  tag_source=True)]
    assert len(repeat) == 100
    counts = Counter(repeat)
    assert set(counts) == {(0, i) for i in range(24)} | {(1, i) for i in range(18)}  # every sample, some twice
    with pytest.raises(ValueError, match="needs samples"):
        Mixture([(a, 1), (b, 1)], exhausted="repeat")
    with pytest.raises(ValueError, match="exhausted must be"):
        Mixture([(a, 1)], exhausted="cycle")
    with pytest.raises(ValueError, match="positive"):
        Mixture([(a, 0)])


def test_ranks_and_workers_get_disjoint_samples(data):
    seen = []
    for rank in range(2):
        mix = Mixture([(lmdb(data["lmdb_a"]), 1), (lmdb(data["lmdb_b"]), 1)], seed=4, tag_source=True,
                      rank=rank, world_size=2)
        for batch in DataLoader(mix, batch_size=2, num_workers=2, collate_fn=list):
            seen += [(s, x["index"]) for s, x in batch]
    assert len(seen) == len(set(seen)) and len(seen) > 20


def test_images_with_images_lmdb_and_webdataset_shards(data, packed_photos):
    shards = ImageShardDataset(packed_photos, decode=False, shuffle=True)
    mix = Mixture([(LmdbImageDataset(data["lmdb_a"], decode=False), 1), (shards, 3)], seed=0, tag_source=True,
                  per_source_labels=True)  # other class maps
    out = list(mix)
    by = Counter(s for s, _ in out)
    assert by[0] == 24 and 60 <= by[1] <= 80  # the LMDB ran out first: 24 of it, ~3x as many shard samples
    assert all(isinstance(image, bytes) and isinstance(label, int) for _, (image, label) in out)


def test_sources_that_would_mix_silently_wrong_are_refused(data, packed_photos, tmp_path):
    """Other class maps, other tokenizers, an iterable source split for another rank: refused by name."""
    lmdb_a, photos = LmdbImageDataset(data["lmdb_a"], decode=False), ImageShardDataset(packed_photos, decode=False)
    assert set(lmdb_a.classes) & set(photos.classes) or set(lmdb_a.classes.values()) & set(photos.classes.values())
    with pytest.raises(ValueError, match="Mixture sources 0 and 1 label otherwise"):
        Mixture([(lmdb_a, 1), (photos, 1)])
    with pytest.raises(ValueError, match="needs tag_source=True"):
        Mixture([(lmdb_a, 1), (photos, 1)], per_source_labels=True)
    assert Mixture([(lmdb_a, 1), (LmdbImageDataset(data["lmdb_b"], decode=False), 1)]).sources  # one class map
    with pytest.raises(ValueError, match="source 1 \\(ImageShardDataset\\) reads rank 0 of 1, the mixture rank 1 of 2"):
        Mixture([(lmdb_a, 1), (photos, 1)], rank=1, world_size=2, tag_source=True, per_source_labels=True)
    with pytest.raises(ValueError, match=r"source 0 \(PackedTokenDataset\) splits itself into 2 parts"):
        Mixture([(PackedTokenDataset(data["text_a"], 16, rank=1, world_size=2), 1)], rank=1, world_size=2)
    text_a = PackedTokenDataset(data["text_a"], 16, shuffle=False)
    assert Mixture([(text_a, 1), (PackedTokenDataset(data["text_b"], 16, shuffle=False), 1)]).sources
    texts = [f"document {i} of another corpus, its own tokenizer" for i in range(40)]
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    write_tokenizer(train_bpe(texts, vocab_size=300), tmp_path / "tok")
    run_repack("text", tmp_path / "other.jsonl", tmp_path / "other", "--tokenizer", tmp_path / "tok", "--quiet")
    with pytest.raises(ValueError, match="were tokenized with other tokenizers"):
        Mixture([(text_a, 1), (PackedTokenDataset(tmp_path / "other", 16, shuffle=False), 1)])


@pytest.mark.parametrize("reader,roots,extra", [
    ("mixture-images", ["lmdb_a", "lmdb_b"], {"weights": [2, 1]}),
    # windows of 64 tokens (329 and 167): 768 samples (a multiple of 2 and 4 workers) repeat both sources, as 3,000
    # of 16 tokens (1,318 and 668) did
    ("mixture-tokens", ["text_a", "text_b"], {"weights": [0.6, 0.4], "exhausted": "repeat", "samples": 768,
                                              "seq_len": 64}),
])
def test_mixture_resumes_exactly_in_a_new_process(data, reader, roots, extra):
    jobs, expected = [], []
    for workers in (0, 2, 4):
        spec = {"reader": reader, "roots": [data[r] for r in roots], "num_workers": workers, "batch_size": 3,
                "seed": 9, "epoch": 2, **extra}
        full, _ = run(spec)
        head, state = run(spec, batches=4)
        assert head == full[:4]
        jobs.append({"spec": spec, "state": json.loads(json.dumps(state))})
        expected.append(full)
    for workers, full, rest in zip((0, 2, 4), expected, resume_in_new_process(jobs)):
        assert rest == full[4:], f"{reader} with {workers} workers"
        flat = [s for b in full for s in b]
        if "samples" in extra:
            assert len(flat) == extra["samples"]
        else:
            assert len(flat) == len(set(flat))


def test_mixture_with_webdataset_shards_resumes_or_says_why_not(data, packed_photos):
    """An iterable source resumes through its own state_dict(); without one, loading says so."""
    def mixture():
        return Mixture([(lmdb(data["lmdb_a"]), 1), (ImageShardDataset(packed_photos, decode=False, output="dict",
                                                                       shuffle=True), 2)], seed=1, tag_source=True,
                       per_source_labels=True)

    def key(item):
        source, sample = item
        return source, sample.get("index", sample.get("key"))

    full = [key(x) for x in mixture()]
    first = mixture()
    it = iter(first)
    head = [key(next(it)) for _ in range(20)]
    state = json.loads(json.dumps(first.state_dict()))
    assert head == full[:20] and state["drawn"] == 20
    again = mixture()
    if not hasattr(ImageShardDataset, "state_dict"):
        with pytest.raises(ValueError, match=r"source 1 \(ImageShardDataset\) has no state_dict\(\)"):
            again.load_state_dict(state)
        return
    again.load_state_dict(state)
    assert [key(x) for x in again] == full[20:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_state_of_epoch_1_resumed_without_set_epoch_reads_an_undrawn_iterable_source_in_that_epoch(
        packed_photos, workers):
    """The state continues its epoch; an iterable source that no worker had drawn from yet when the state was
    taken (its state None) reads that epoch's order too, not its own epoch 0: every sample once, as uninterrupted."""
    from pipelines.stateful_loader import StatefulDataLoader

    def loader(epoch):
        mixture = Mixture([(ImageShardDataset(packed_photos, decode=False, output="dict", shuffle=True), 1)], seed=9)
        if epoch is not None:
            mixture.set_epoch(epoch)
        return StatefulDataLoader(mixture, batch_size=8, num_workers=workers,
                                  collate_fn=lambda batch: [sample["key"] for sample in batch])

    full = [key for batch in loader(1) for key in batch]
    first = loader(1)
    it = iter(first)
    head = next(it)
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = loader(None)
    resumed.load_state_dict(state)
    rest = [key for batch in resumed for key in batch]
    assert head + rest == full and len(set(full)) == len(full) == 120


def test_a_mixture_state_of_another_order_is_refused(data):
    def mixture(shuffle):
        return Mixture([(lmdb(data["lmdb_a"]), 1), (lmdb(data["lmdb_b"]), 1)], seed=3, shuffle=shuffle)

    first = mixture(True)
    it = iter(first)
    [next(it) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    with pytest.raises(ValueError, match=r"another order loaded \(shuffle: saved True, now False\)"):
        mixture(False).load_state_dict(state)
    old_reader_state = {k: v for k, v in state.items() if k not in ("shuffle", "exhausted", "samples", "weights")}
    mixture(True).load_state_dict(old_reader_state)  # a state of a reader that did not record them still loads


def test_a_mixture_state_of_a_map_source_of_another_length_is_refused(data):
    """A token source built with another seq_len has another number of windows, so the saved position indexes
    another permutation: refused, as the reader alone refuses it (it resumed and read consumed tokens again)."""
    def mixture(seq_len):
        return Mixture([(PackedTokenDataset(data["text_a"], seq_len), 1), (PackedTokenDataset(data["text_b"], 16), 1)],
                       seed=3)

    first = mixture(16)
    it = iter(first)
    [next(it) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    with pytest.raises(ValueError, match=r"Mixture source 0 \(PackedTokenDataset\) was read with \{'seq_len': 16, .*"
                                         r"is built with \{'seq_len': 32, "):
        mixture(32).load_state_dict(state)
    mixture(16).load_state_dict(state)
    untouched = json.loads(json.dumps(mixture(16).state_dict()))  # a fresh mixture's state names the options too
    with pytest.raises(ValueError, match="was read with"):
        mixture(32).load_state_dict(untouched)
    without_options = json.loads(json.dumps(state))  # a state of an older reader: its length still decides
    del without_options["sources"][0]["options"]
    with pytest.raises(ValueError, match=r"had \d+ samples when the state was saved and has \d+ now"):
        mixture(32).load_state_dict(without_options)


def test_a_mixture_state_of_a_map_source_of_another_seq_len_but_as_many_windows_is_refused(data):
    """seq_len a and a + 1 can cut a stream into as many windows: the length matched, so the state loaded and
    window i named other tokens (tokens read twice in one epoch); the reader alone refused it."""
    tokens = PackedTokenDataset(data["text_a"], 16).data.num_tokens
    a = next(a for a in range(8, tokens) if (tokens - 1) // a == (tokens - 1) // (a + 1) >= 4)

    def mixture(seq_len):
        return Mixture([(PackedTokenDataset(data["text_a"], seq_len), 1), (PackedTokenDataset(data["text_b"], 16), 1)],
                       seed=3)

    first = mixture(a)
    it = iter(first)
    [next(it) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    assert len(mixture(a + 1).sources[0]) == len(first.sources[0])
    with pytest.raises(ValueError, match=f"was read with {{'seq_len': {a}, .*is built with {{'seq_len': {a + 1}, "):
        mixture(a + 1).load_state_dict(state)


def test_a_mixture_state_of_a_shuffled_token_source_of_another_seed_or_order_is_refused(data):
    """A PackedTokenDataset shuffling its own windows: its seed and its shuffle decide what window i holds. Only
    seq_len was compared, so a state loaded beside another seed read 23 windows twice and 23 never in the pass; a
    state of an older reader (seq_len alone) is compared on what it holds. The epoch is not compared: a state taken
    at an epoch's end continues with set_epoch(e + 1) on the mixture and on its sources."""
    def mixture(**options):
        return Mixture([(PackedTokenDataset(data["text_a"], 16, **options), 1),
                        (PackedTokenDataset(data["text_b"], 16), 1)], seed=3)

    first = mixture(seed=0)
    it = iter(first)
    [next(it) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    for options, named in (({"seed": 1}, "'seed': 1"), ({"shuffle": False}, "'shuffle': False")):
        with pytest.raises(ValueError, match=f"is built with {{.*{named}"):
            mixture(**options).load_state_dict(state)
    older = json.loads(json.dumps(state))
    older["sources"][0]["options"] = {"seq_len": 16}
    resumed = mixture(seed=0)
    resumed.load_state_dict(state)
    mixture(seed=1).load_state_dict(older)  # what an older reader saved: nothing more to compare
    assert [t.tolist() for t in resumed] == [t.tolist() for t in it]
    ended = mixture(seed=0)  # the end of epoch 0, then epoch 1 set on the mixture and its source, as a loop does
    list(ended)
    final = json.loads(json.dumps(ended.state_dict()))
    fresh, next_epoch = mixture(seed=0), mixture(seed=0)
    for mix in (fresh, next_epoch):  # set before the load, as a StatefulDataLoader loads when it iterates
        mix.set_epoch(1)
        mix.sources[0].set_epoch(1)
    fresh.load_state_dict(final)
    assert [t.tolist() for t in fresh] == [t.tolist() for t in next_epoch]


def test_a_refused_mixture_state_leaves_every_source_as_it_was(packed_photos):
    """Source 1 refuses the state (another seed) after source 0 took its part: source 0 is put back, so a caller
    that starts fresh reads a fresh epoch (source 0 resumed at the state's place: 14 samples never came)."""
    def mixture(second_seed):
        return Mixture([(ImageShardDataset(packed_photos, output="dict", decode=False, seed=seed), 0.5)
                        for seed in (0, second_seed)], seed=0, tag_source=True)

    first = mixture(0)
    it = iter(first)
    tagged_draws(it, 30)
    state = json.loads(json.dumps(first.state_dict()))
    refused = mixture(1)
    with pytest.raises(ValueError, match="seed: state 0, dataset 1"):
        refused.load_state_dict(state)
    assert tagged_draws(iter(refused)) == tagged_draws(iter(mixture(1)))
    again = mixture(1)  # and no state is left pending in this process's slot: DataLoader workers start fresh
    with pytest.raises(ValueError, match="seed: state 0, dataset 1"):
        again.load_state_dict(state)
    collate = lambda batch: batch  # noqa: E731 - (source, sample) pairs as they are
    assert sorted(key for _, key in tagged_draws(DataLoader(again, batch_size=None, num_workers=2,
                                                            collate_fn=collate))) == \
        sorted(key for _, key in tagged_draws(DataLoader(mixture(1), batch_size=None, num_workers=2,
                                                         collate_fn=collate)))


def test_an_append_between_save_and_load_leaves_every_rank_on_the_saved_version_with_equal_steps(tmp_path):
    """Two ranks mix an ImageShardDataset A (0.9) with B (0.1, 40 samples); the state is taken when rank 0
    drew from B and rank 1 not yet, then B is appended to. Each rank resumes exactly as the uninterrupted
    epoch went: rank 1's untouched B state names B's version (it was None: rank 1 read the new version),
    and the stop point is computed on the saved version's lengths (it was the new one's: unequal steps)."""
    from pipelines.stateful_loader import StatefulDataLoader
    from pipelines.torch_webdataset import ImageShardDataset
    from tests.benchmarks.tiny_files import jpeg_bytes, tiny_jpegs

    def pack(src, out, *extra):
        run_repack("images", src, out, "--verify", "none", "--quiet", "--shard-size", "5", *extra)

    pack(tiny_jpegs(tmp_path / "srcA", 0, 400, workers=1), tmp_path / "A")
    pack(tiny_jpegs(tmp_path / "srcB", 0, 40, workers=1), tmp_path / "B")

    def loader(rank):
        sources = [(ImageShardDataset(tmp_path / name, output="dict", decode=False, rank=rank, world_size=2), weight)
                   for name, weight in (("A", 0.9), ("B", 0.1))]
        mixture = Mixture(sources, seed=0, tag_source=True, rank=rank, world_size=2)
        mixture.set_epoch(0)
        return mixture, StatefulDataLoader(mixture, batch_size=1, num_workers=0,
                                           collate_fn=lambda batch: [(i, s["key"]) for i, s in batch])

    first = [loader(rank)[0]._draws(rank, 0, 0).tolist() for rank in (0, 1)]
    cut = next(k for k in range(1, BLOCK) if 1 in first[0][:k] and 1 not in first[1][:k])
    whole = {rank: [x for batch in loader(rank)[1] for x in batch] for rank in (0, 1)}
    seen, states = {}, {}
    for rank in (0, 1):
        _, taken = loader(rank)
        batches = iter(taken)
        seen[rank] = [x for _ in range(cut) for x in next(batches)]
        states[rank] = json.loads(json.dumps(taken.state_dict()))
    for i in range(40):
        (tmp_path / "srcB" / f"c{i:03d}" / f"new{i}.jpg").write_bytes(jpeg_bytes(10_000 + i))
    pack(tmp_path / "srcB", tmp_path / "B", "--append")
    for rank in (0, 1):
        _, resumed = loader(rank)
        resumed.load_state_dict(states[rank])
        assert seen[rank] + [x for batch in resumed for x in batch] == whole[rank], rank


def photos_mixture(root, seed: int) -> Mixture:
    """Two readers of one dataset mixed 0.9 : 0.1, each draw tagged with its source."""
    return Mixture([(ImageShardDataset(root, output="dict", decode=False), w) for w in (0.9, 0.1)], seed=seed,
                   tag_source=True)


def tagged_draws(it, limit: int | None = None) -> list[tuple[int, str]]:
    """(source, key) of the draws of ``it``, at most ``limit``."""
    out = []
    for pick, sample in it:
        out.append((pick, sample["key"]))
        if limit is not None and len(out) == limit:
            break
    return out


def test_a_second_pass_saves_an_undrawn_source_at_its_start_not_where_the_last_pass_ended(packed_photos):
    """A second pass over the same epoch (no set_epoch), its state taken before the first draw from B: B's saved
    state was B's last iterator's place, at its end, so the resumed pass took 3 samples where it takes 120+."""
    first = photos_mixture(packed_photos, 0)
    whole = tagged_draws(iter(first))
    before_b = [pick for pick, _ in whole].index(1)
    assert before_b > 0
    it = iter(first)  # the second pass
    head = tagged_draws(it, before_b)
    state = json.loads(json.dumps(first.state_dict()))
    rest = tagged_draws(it)
    resumed = photos_mixture(packed_photos, 0)
    resumed.load_state_dict(state)
    assert head + tagged_draws(iter(resumed)) == head + rest == whole


def test_a_resumed_pass_that_never_draws_a_source_again_leaves_it_fresh_for_the_next_pass(packed_photos):
    """The state taken after a pass's last draw from B: B's loaded state stayed on B (the resumed pass never drew
    from it), so the next pass continued B from there: 0 samples (stop) where an uninterrupted second pass reads
    the epoch again."""
    first = photos_mixture(packed_photos, 5)
    whole = [tagged_draws(iter(first)), tagged_draws(iter(first))]  # two passes of one epoch
    cut = max(i for i, (pick, _) in enumerate(whole[0]) if pick == 1) + 1
    assert cut < len(whole[0])
    taken = photos_mixture(packed_photos, 5)
    head = tagged_draws(iter(taken), cut)
    state = json.loads(json.dumps(taken.state_dict()))
    resumed = photos_mixture(packed_photos, 5)
    resumed.load_state_dict(state)
    assert [head + tagged_draws(iter(resumed)), tagged_draws(iter(resumed))] == whole


def test_a_resumed_pass_closed_early_still_reports_an_undrawn_sources_loaded_place(packed_photos):
    """The loaded state of a source the resumed pass has not drawn from yet is taken off the source when the pass's
    iterator is closed, and the mixture's state still names it: a state taken then resumes exactly."""
    first = photos_mixture(packed_photos, 0)
    whole = tagged_draws(iter(first))
    b_draws = [i for i, (pick, _) in enumerate(whole) if pick == 1]
    cut = b_draws[1] + 1  # B drawn twice
    taken = photos_mixture(packed_photos, 0)
    head = tagged_draws(iter(taken), cut)
    state = json.loads(json.dumps(taken.state_dict()))
    resumed = photos_mixture(packed_photos, 0)
    resumed.load_state_dict(state)
    it = iter(resumed)
    more = tagged_draws(it, 1)  # A's next draw only (B's next is later): then the iterator is closed
    assert more[0][0] == 0
    it.close()
    again = json.loads(json.dumps(resumed.state_dict()))
    assert again["sources"][1] == state["sources"][1]
    last = photos_mixture(packed_photos, 0)
    last.load_state_dict(again)
    assert head + more + tagged_draws(iter(last)) == whole


def test_a_mixture_state_taken_before_a_remove_resumes_on_its_version(tmp_path):
    """25 of 30 LMDB samples drawn, then `repack remove` of 10: the state resumes on its own (kept) version and
    draws the last 5 (its position was checked against the new version's 20 samples and refused as edited)."""
    from tests.test_images_job import write_jpegs

    write_jpegs(tmp_path / "src" / "c0", 30, "c0_")
    out = tmp_path / "lmdb"
    run_repack("images", tmp_path / "src", out, "--to", "lmdb", "--quiet")

    def mixture():
        return Mixture([(LmdbImageDataset(out, decode=False, output="dict"), 1)], seed=0)

    first = mixture()
    it = iter(first)
    drawn = [next(it)["image"] for _ in range(25)]
    state = json.loads(json.dumps(first.state_dict()))
    rest = [sample["image"] for sample in it]
    (tmp_path / "gone.txt").write_text("".join(f"c0/c0_{i}.jpg\n" for i in range(10)))
    run_repack("remove", out, "--sources", tmp_path / "gone.txt")
    resumed = mixture()
    assert len(resumed.sources[0]) == 20
    resumed.load_state_dict(state)
    assert [sample["image"] for sample in resumed] == rest and len(set(drawn + rest)) == 30


def test_the_epoch_after_a_resume_stays_on_the_state_version_without_persistent_workers(tmp_path):
    """A Mixture resumed from a state of version 1 (an --append published version 2 since) finished that epoch on
    version 1, then read version 2 in the next one without persistent workers (their copies come from this
    process's Mixture, whose sources were the latest), and version 1 with them: the loader's options decided the
    data. Its sources follow the state's versions in this process too now (Mixture.follow_state)."""
    from pipelines.mixture import Mixture
    from pipelines.stateful_loader import StatefulDataLoader
    from pipelines.torch_lmdb import LmdbImageDataset
    from pipelines.torch_webdataset import ImageShardDataset
    from tests.conftest import run_repack
    from tests.test_images_job import write_jpegs

    src, out, lmdb = tmp_path / "src", tmp_path / "wds", tmp_path / "lmdb"
    write_jpegs(src / "cat", 24, "a")
    run_repack("images", src, out, "--shard-size", "8", "--quiet")
    run_repack("images", src, lmdb, "--to", "lmdb", "--quiet")

    def loader(persistent: bool):
        wds = ImageShardDataset(out, output="dict", decode=False, shuffle=True, seed=0)
        mixture = Mixture([(wds, 1), (LmdbImageDataset(lmdb, decode=False, output="dict"), 1)], seed=0)
        return mixture, StatefulDataLoader(mixture, batch_size=4, num_workers=2, persistent_workers=persistent,
                                           collate_fn=lambda batch: [s["meta"]["path"] for s in batch])

    mixture, run = loader(False)
    mixture.set_epoch(0)
    it = iter(run)
    for _ in range(2):
        next(it)
    state = json.loads(json.dumps(run.state_dict()))
    del it, run
    write_jpegs(src / "new", 10, "n")
    run_repack("images", src, out, "--append", "--quiet")
    for persistent in (False, True):
        mixture, run = loader(persistent)
        mixture.set_epoch(0)
        run.load_state_dict(state)
        rest = [path for batch in run for path in batch]
        mixture.set_epoch(1)
        following = [path for batch in run for path in batch]
        assert rest and following and not [p for p in rest + following if p.startswith("new/")], persistent


def test_a_map_style_reader_follows_the_version_of_a_state(tmp_path):
    """What the StatefulDataLoader calls in the training process (MapDatasetState.follow_state): the reader reads
    the state's version from then on, so the workers a later epoch forks from it read that version too."""
    from pipelines.torch_lmdb import LmdbImageDataset
    from tests.conftest import run_repack
    from tests.test_images_job import write_jpegs

    src, out = tmp_path / "src", tmp_path / "lmdb"
    write_jpegs(src / "cat", 6, "a")
    run_repack("images", src, out, "--to", "lmdb", "--quiet")
    state = LmdbImageDataset(out).state_dict()
    (tmp_path / "gone.txt").write_text("cat/a0.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    reader = LmdbImageDataset(out)
    assert len(reader) == 5
    reader.follow_state(state)
    assert len(reader) == 6 and reader.dataset["version"] == 1


def test_a_mixture_state_refused_in_the_workers_leaves_every_source_on_its_version(tmp_path):
    """A state of version 1 refused by the DataLoader's workers (other weights): the loader had re-opened version 1
    in this process before the workers checked it, and left it there, so a caller starting fresh read a sample
    `repack remove` had taken down."""
    from pipelines.stateful_loader import StatefulDataLoader
    from tests.test_images_job import write_jpegs

    write_jpegs(tmp_path / "src" / "c0", 20, "c0_")
    out = tmp_path / "lmdb"
    run_repack("images", tmp_path / "src", out, "--to", "lmdb", "--quiet")

    def loader(weight):
        mix = Mixture([(LmdbImageDataset(out, decode=False, output="dict"), 1),
                       (LmdbImageDataset(out, decode=False, output="dict"), weight)], seed=0, exhausted="repeat",
                      samples=60)
        return mix, StatefulDataLoader(mix, batch_size=4, num_workers=2, collate_fn=list)

    _, first = loader(1)
    next(iter(first))
    state = json.loads(json.dumps(first.state_dict()))
    (tmp_path / "gone.txt").write_text("c0/c0_3.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    mix, refused = loader(2)
    refused.load_state_dict(state)
    with pytest.raises(ValueError, match="Mixture state of another order"), failing_loader(refused) as failing:
        next(failing)
    assert [(s.dataset["version"], len(s)) for s in mix.sources] == [(2, 19), (2, 19)]


def test_a_map_sources_share_of_a_pass_is_a_column_of_its_own(data):
    """A map-style source's share of a pass is an int64 column of this worker's slots alone (not a Python int
    per sample, not a view that keeps the whole pass's order alive), and it reads the same samples."""
    from pipelines.mixture import _Cursor

    mix = Mixture([(lmdb(data["lmdb_a"]), 2), (lmdb(data["lmdb_b"]), 1)], seed=5, shuffle=True)
    cursor = _Cursor(mix, 0, None)
    cursor._start()
    order = np.random.default_rng([mix.seed, mix.epoch, 0, 0]).permutation(len(mix.sources[0]))
    assert isinstance(cursor._order, np.ndarray) and cursor._order.base is None
    assert cursor._order.tolist() == order.tolist()  # one slot (no workers, one rank): the whole pass
    read = [cursor.next() for _ in range(len(order) + 1)]
    assert [x["index"] for ok, x in read[:-1]] == [mix.sources[0][i]["index"] for i in order.tolist()]
    assert read[-1] == (False, None)


def test_a_token_readers_windows_are_its_ranks_share_alone(data):
    """``PackedTokenDataset.window_ids`` holds this rank's windows as a column of their own: not a view that keeps
    the whole epoch's order alive in every worker; the windows are the global order's every world_size-th."""
    from pipelines.sampler_resume import global_order

    ranks = [PackedTokenDataset(data["text_a"], 4, rank=r, world_size=2, seed=9) for r in (0, 1)]
    for rank, reader in enumerate(ranks):
        windows = reader.window_ids()
        whole = global_order(reader.num_windows, 9, reader.epoch, True)[:reader.per_rank * 2]
        assert windows.base is None and windows.tolist() == whole[rank::2].tolist()
