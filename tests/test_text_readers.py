"""Contract: `repack text` writes (real CLI), pipelines/torch_text.py reads back under DataLoader workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pipelines.torch_text import (DocumentDataset, LengthGroupedBatchSampler, PackedTokenDataset, collate_pad,
                                  padding_fraction, random_batches, split_inputs_targets)
from tests.conftest import run_repack
from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 documents tokenized twice: one merged prefix, and --no-merge (several prefixes)."""
    base = tmp_path_factory.mktemp("textreaders")
    tok_dir = base / "tok"
    tok = gpt2_tokenizer()
    write_tokenizer(tok, tok_dir)
    docs = documents(300, seed=11)
    src = base / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    merged, parts = base / "merged", base / "parts"
    run_repack("text", src, merged, "--tokenizer", tok_dir, "--chunk-bytes", "80KB")
    run_repack("text", src, parts, "--tokenizer", tok_dir, "--chunk-bytes", "80KB", "--no-merge")
    ids = [tok.encode(d).ids + [50256] for d in docs]
    return {"docs": docs, "ids": ids, "stream": np.array([t for x in ids for t in x], dtype=np.int64),
            "merged": merged, "parts": parts, "tok": tok}


@pytest.mark.parametrize("which", ["merged", "parts"])
def test_packed_windows_cover_the_stream_under_workers(corpus, which):
    stream = corpus["stream"]
    seen = {}
    for rank in range(2):
        ds = PackedTokenDataset(corpus[which], SEQ, seed=5, rank=rank, world_size=2)
        loader = DataLoader(ds, batch_size=8, num_workers=2, shuffle=False)
        order = ds.window_ids()
        rows = torch.cat(list(loader))
        assert rows.dtype == torch.int64 and rows.shape == (len(ds), SEQ + 1)
        for w, row in zip(order.tolist(), rows.numpy()):
            assert w not in seen
            seen[w] = True
            assert np.array_equal(row, stream[w * SEQ: w * SEQ + SEQ + 1])  # crosses documents (and prefixes)
    total = (len(stream) - 1) // SEQ
    assert len(seen) == total // 2 * 2 and max(seen) < total
    if which == "parts":
        assert len(json.loads((corpus["parts"] / "manifest.json").read_text())["prefixes"]) > 2


def test_packed_is_deterministic_per_seed_and_epoch(corpus):
    a = PackedTokenDataset(corpus["merged"], SEQ, seed=1)
    b = PackedTokenDataset(corpus["merged"], SEQ, seed=1)
    assert torch.equal(a[3], b[3]) and np.array_equal(a.window_ids(), b.window_ids())
    first = a.window_ids().copy()
    a.set_epoch(1)
    assert not np.array_equal(first, a.window_ids())
    assert sorted(first.tolist()) == sorted(a.window_ids().tolist())
    x, y = split_inputs_targets(torch.stack([a[0], a[1]]))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert PackedTokenDataset(corpus["merged"], SEQ, dtype=torch.int32)[0].dtype == torch.int32


def test_token_readers_yield_int64_by_default_and_the_storage_dtype_on_request(corpus):
    """Both token readers agree: int64 ids (what nn.Embedding and cross_entropy take) unless
    dtype=None asks for the storage dtype (uint16 here: GPT-2's ids are < 65536)."""
    manifest = json.loads((corpus["merged"] / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16"
    window, document = PackedTokenDataset(corpus["merged"], SEQ)[0], DocumentDataset(corpus["merged"])[0]
    assert window.dtype == document.dtype == torch.int64
    assert document.tolist() == corpus["ids"][0]
    hidden = torch.nn.Embedding(50257, 4)(window[:-1])  # the first step of a language model
    logits = torch.nn.Linear(4, 50257)(hidden)
    assert torch.nn.functional.cross_entropy(logits, window[1:]).isfinite()
    stored = PackedTokenDataset(corpus["merged"], SEQ, dtype=None)[0], DocumentDataset(corpus["merged"], dtype=None)[0]
    assert stored[0].dtype == stored[1].dtype == torch.uint16
    assert torch.equal(stored[0].long(), window) and torch.equal(stored[1].long(), document)


def test_storage_dtype_items_are_copies_an_in_place_edit_never_reaches_a_later_epoch(corpus):
    """dtype=None items were views of the memmap's copy-on-write pages: a loss mask applied in place
    (``w[w == eos] = -100``) changed that window, and its document, for every later epoch of the process."""
    ds = PackedTokenDataset(corpus["merged"], SEQ, shuffle=False, dtype=None)
    first = ds[0].clone()
    edited = ds[0]
    edited.fill_(0)
    ds.set_epoch(1)
    assert torch.equal(ds[0], first) and ds[0].dtype == first.dtype
    docs = DocumentDataset(corpus["merged"], dtype=None)
    doc = docs[0]
    doc.fill_(0)
    assert docs[0].ne(0).any()


def test_documents_round_trip_with_dynamic_padding(corpus):
    tok = corpus["tok"]
    ds = DocumentDataset(corpus["parts"])
    assert len(ds) == len(corpus["docs"])
    sampler = LengthGroupedBatchSampler(ds.lengths, 16, seed=2)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate_pad, num_workers=2)
    seen = []
    for batch, idx in zip(loader, sampler.batches()):
        ids, mask, lengths = batch["input_ids"], batch["attention_mask"], batch["lengths"]
        assert ids.shape[1] == int(lengths.max())  # padded to the longest of this batch only
        assert torch.equal(mask.sum(1), lengths)
        for row, i in enumerate(idx):
            n = int(lengths[row])
            assert ids[row, :n].tolist() == corpus["ids"][i] and not ids[row, n:].any()
            assert tok.decode(ids[row, :n - 1].tolist()) == corpus["docs"][i]
            seen.append(i)
    assert sorted(seen) == list(range(len(ds)))
    grouped = padding_fraction(ds.lengths, sampler.batches())
    random = padding_fraction(ds.lengths, random_batches(len(ds), 16, seed=2))
    assert grouped < random / 2, (grouped, random)


def test_truncation_and_rank_split(corpus):
    ds = DocumentDataset(corpus["merged"], max_len=32)
    assert int(ds.lengths.max()) <= 32 and len(ds[int(np.argmax(DocumentDataset(corpus["merged"]).lengths))]) == 32
    a = LengthGroupedBatchSampler(ds.lengths, 8, seed=0, rank=0, world_size=2)
    b = LengthGroupedBatchSampler(ds.lengths, 8, seed=0, rank=1, world_size=2)
    assert len(a) == len(b) and not {i for x in a for i in x} & {i for x in b for i in x}


def test_reader_refuses_other_formats(packed_photos):
    with pytest.raises(ValueError, match="not a token memmap"):
        DocumentDataset(packed_photos)


def test_set_epoch_reaches_persistent_workers(corpus):
    stream = corpus["stream"]
    ds = PackedTokenDataset(corpus["merged"], SEQ, seed=3)
    loader = DataLoader(ds, batch_size=16, num_workers=2, shuffle=False, persistent_workers=True)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        rows = torch.cat(list(loader)).long().numpy()
        order = ds.window_ids().tolist()
        for w, row in zip(order, rows):  # what the (persistent) workers served is this epoch's order
            assert np.array_equal(row, stream[w * SEQ: w * SEQ + SEQ + 1])
        orders.append(order)
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_a_packed_state_of_another_seq_len_is_refused(corpus):
    """Two window lengths can give the same window count: the state names its seq_len."""
    a = PackedTokenDataset(corpus["merged"], seq_len=100, shuffle=True, seed=1)
    b = PackedTokenDataset(corpus["merged"], seq_len=101, shuffle=True, seed=1)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["seq_len"] == 100
    state["windows"] = b.num_windows  # the count alone would pass
    with pytest.raises(ValueError, match="seq_len 100"):
        b.load_state_dict(state)


def _batches_as_lists(lengths, batch_size, seed, epoch, mega, drop_last):
    """The epoch's batches as LengthGroupedBatchSampler built them as lists of lists (the reference)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    span, out = batch_size * mega, []
    for start in range(0, len(order), span):
        chunk = order[start:start + span]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        out += [chunk[i:i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    if drop_last:
        out = [b for b in out if len(b) == batch_size]
    return [out[i] for i in rng.permutation(len(out))]


@pytest.mark.parametrize("drop_last", [False, True])
def test_grouped_batches_are_columns_with_the_same_batches(drop_last):
    """The epoch's batches are held as columns (one int64 per index, not a Python int in a list per index), the
    same batches in the same order as the lists they were, for any batch size, mega and epoch; len() counts them
    without building them."""
    from pipelines.torch_text import BatchTable

    lengths = np.random.default_rng(1).integers(1, 500, 1003)
    for batch_size, mega, epoch in [(8, 5, 0), (7, 3, 2), (32, 50, 1), (1, 1, 0), (2000, 2, 0)]:
        sampler = LengthGroupedBatchSampler(lengths, batch_size, seed=4, mega=mega, drop_last=drop_last)
        sampler.set_epoch(epoch)
        table = sampler.global_batches()
        assert isinstance(table, BatchTable) and table.flat.dtype == np.int64
        assert list(table) == _batches_as_lists(lengths, batch_size, 4, epoch, mega, drop_last)
        assert len(sampler) == len(sampler.batches()) == len(list(iter(sampler)))
