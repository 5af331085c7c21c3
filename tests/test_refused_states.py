"""A state that is refused (other seed or options) leaves the reader on the version it was built on: loading
re-opens the state's older version first, and a refusal re-opens the reader's own again, so a training script
that catches the error and starts fresh never reads the older version silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.tiny_files import jpeg_bytes
from tests.conftest import run_repack


def grow(src: Path, start: int, count: int) -> None:
    for i in range(start, start + count):
        folder = src / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.jpg").write_bytes(jpeg_bytes(i))


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory) -> dict[str, Path]:
    """A webdataset of 30 then 40 samples (--append), an LMDB of 30 then 27 (remove), a token dataset of 2
    versions."""
    from tests.tools.text import documents, train_bpe, write_tokenizer

    root = tmp_path_factory.mktemp("versions")
    src = root / "src"
    grow(src, 0, 30)
    outs = {"webdataset": root / "wds", "lmdb": root / "lmdb"}
    for to, out in outs.items():
        run_repack("images", src, out, "--to", to, "--quiet")
    grow(src, 30, 10)
    run_repack("images", src, outs["webdataset"], "--append", "--quiet")
    (root / "gone.txt").write_text("c0/00000.jpg\nc1/00001.jpg\nc0/00002.jpg\n")
    run_repack("remove", outs["lmdb"], "--sources", root / "gone.txt")
    docs = documents(80, seed=7)
    tokenizer = write_tokenizer(train_bpe(docs[:40]), root / "tok")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:40]))
    run_repack("text", corpus, root / "tokens", "--tokenizer", tokenizer, "--quiet")
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[40:]))
    run_repack("text", corpus, root / "tokens", "--tokenizer", tokenizer, "--append", "--quiet")
    return {**outs, "tokens": root / "tokens"}


def test_a_refused_image_shard_state_leaves_the_reader_on_its_version(two_versions):
    from pipelines.torch_webdataset import ImageShardDataset

    root = str(two_versions["webdataset"])
    state = ImageShardDataset(root, output="dict", decode=False, shuffle=True, seed=0, version=1).state_dict()
    reader = ImageShardDataset(root, output="dict", decode=False, shuffle=True, seed=1)
    with pytest.raises(ValueError, match="seed: state 0, dataset 1"):
        reader.load_state_dict(json.loads(json.dumps(state)))
    assert reader.dataset["version"] == 2
    assert len({sample["key"] for sample in reader}) == 40


def test_a_refused_sampler_state_leaves_the_dataset_on_its_version(two_versions):
    from pipelines.sampler_resume import ResumableSampler
    from pipelines.torch_lmdb import LmdbImageDataset

    root = str(two_versions["lmdb"])
    old = LmdbImageDataset(root, decode=False, version=1)
    state = ResumableSampler(len(old), seed=0, dataset=old).state_dict()
    dataset = LmdbImageDataset(root, decode=False)
    sampler = ResumableSampler(len(dataset), seed=5, dataset=dataset)
    with pytest.raises(ValueError, match="seed 0, this one has 5"):
        sampler.load_state_dict(state)
    assert (dataset.dataset["version"], len(dataset), len(list(sampler))) == (2, 27, 27)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_packed_token_state_of_another_window_count_is_refused_and_leaves_the_reader(two_versions, shuffle):
    from pipelines.torch_text import PackedTokenDataset

    root = str(two_versions["tokens"])
    state = PackedTokenDataset(root, 16, seed=0, shuffle=shuffle, version=1).state_dict()
    reader = PackedTokenDataset(root, 16, seed=0, shuffle=shuffle)
    windows = len(reader)
    with pytest.raises(ValueError, match="taken on version 1"):
        reader.load_state_dict(state)
    assert (reader.dataset["version"], len(reader)) == (2, windows)
